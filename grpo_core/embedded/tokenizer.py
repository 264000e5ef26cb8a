"""A small Qwen2-style tokenizer built locally from the task alphabet (no hub, no corpus).

It is a byte-level BPE with Qwen2's own pre-tokenizer (digits split one by one, words keep their leading
space), so `AutoTokenizer.from_pretrained` — which in transformers 5 rebuilds any `qwen2` model's
tokenizer as `Qwen2Tokenizer` from the saved vocabulary and merges — loads exactly this tokenizer:

  * base vocabulary: the 256 byte symbols, so every string encodes and decode(encode(text)) == text;
  * merges: learnt here, deterministically, from the task's words only, so every word the tasks write
    (" apples", "Mia", " How") is one token and the vocabulary stays small (a few hundred ids);
  * the tags `<reasoning>`, `</reasoning>`, `<answer>`, `</answer>` and `\\boxed{` are added, non-special
    tokens: one sampling step each, and kept by `decode(..., skip_special_tokens=True)`.

No BOS is prepended (TRL tokenizes prompts with add_special_tokens=False; both conventions give the same
ids). EOS ends every completion; PAD is its own token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerBase, Qwen2Tokenizer

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>", "\\boxed{")
MAX_LENGTH = 128
# Chat-format prompts render as their messages' contents, so a user who wraps the embedded prompts as chat
# messages gives the warm-started model the text it was trained on.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@lru_cache(maxsize=1)
def byte_symbols() -> tuple[str, ...]:
    """GPT-2's byte → printable-symbol table (the ByteLevel alphabet): byte b ↦ byte_symbols()[b]."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return tuple(table[b] for b in range(256))


def _to_symbols(text: str) -> str:
    table = byte_symbols()
    return "".join(table[b] for b in text.encode("utf-8"))


def learn_merges(pieces: Iterable[str]) -> list[tuple[str, str]]:
    """BPE merges that turn each piece (a pre-token, in byte symbols) into one token.

    Plain BPE training on the set of pieces, each counted once: repeatedly merge the most frequent
    adjacent pair (ties: the lexicographically smallest), until every piece is a single symbol.
    Deterministic; replaying these merges on a piece reproduces the training segmentation.
    """
    words = [list(p) for p in sorted(set(pieces)) if p]
    merges: list[tuple[str, str]] = []
    while True:
        counts = Counter(pair for w in words for pair in zip(w, w[1:]))
        if not counts:
            return merges
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges.append(pair)
        for i, w in enumerate(words):
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == pair:
                    out.append(w[j] + w[j + 1])
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out


def build_tokenizer(words: Sequence[str]) -> PreTrainedTokenizerBase:
    """A Qwen2Tokenizer whose merges make each of `words` (with and without a leading space) one token.

    Ids: SPECIAL_TOKENS, the 256 byte symbols, the merged symbols in merge order, then TAGS; they depend
    only on `words`. Raises if a word does not come out as one token (a broken invariant, not user error).
    """
    pieces = [_to_symbols(p) for w in words for p in (w, " " + w)]
    merges = learn_merges(pieces)
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *byte_symbols(), *(a + b for a, b in merges)):
        vocab.setdefault(token, len(vocab))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,  # byte-level: nothing is unknown
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tokenizer.chat_template = CHAT_TEMPLATE
    for w in words:
        for text in (w, " " + w):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise RuntimeError(f"tokenizer: {text!r} is {len(ids)} tokens, expected 1")
    return tokenizer
