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

`build_tool_tokenizer` is the calculator task's (configs/embedded-tools.yaml): the same tokenizer plus a chat
template for tool calling in Qwen2.5's Hermes layout with compact role markers (one token each),

    <|system|>tools: calculator(expression: string)<|user|>What is 123 times 45?<|assistant|>
    <tool_call>\n{"name": "calculator", "arguments": {"expression": "123*45"}}\n</tool_call><|eos|>
    <|user|><tool_response>\n5535\n</tool_response><|assistant|><answer>\n5535\n</answer><|eos|>

(line breaks between turns added here for reading), merges learnt from that scaffolding too (`"name":` is a
few tokens, not one per byte), and a `response_template` (transformers' response parsing, which TRL 1.16's
tool loop and grpo_core's use) that reads the assistant turn back into `{"content", "tool_calls"}`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
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

# The tool-calling chat (build_tool_tokenizer). Role markers are special tokens, as Qwen's <|im_start|> is;
# the tool tags are not (decode(..., skip_special_tokens=True) keeps them, as Qwen2.5's tokenizer does).
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen2.5's template with <|im_start|>role\n ... <|im_end|>\n as one marker token per turn; an assistant turn
# ends with EOS (the model's stop token), the user and system turns at the next marker. `tools` is one line of
# signatures, not the JSON schemas: the model is ours, trained on this line. {% generation %} marks what the
# assistant writes (the warm start's loss mask: return_assistant_tokens_mask). Prefix-preserving: a
# conversation renders as the concatenation of its turns, so a rollout that appends tokens sees what the
# template would render.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>"
    "{%- if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif -%}"
    "tools:"
    "{%- for tool in tools %}{% set f = tool['function'] if tool['function'] is defined else tool %}"
    "{{ ' ' if loop.first else '; ' }}{{ f['name'] }}("
    "{%- for name, spec in f['parameters']['properties'].items() %}"
    "{{ ', ' if not loop.first }}{{ name }}: {{ spec['type'] }}{% endfor %})"
    "{%- endfor %}"
    "{%- elif messages and messages[0]['role'] == 'system' %}<|system|>{{ messages[0]['content'] }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'system' %}{% if not loop.first %}<|system|>{{ message['content'] }}{% "
    "endif %}{%- elif message['role'] == 'assistant' %}<|assistant|>{% generation %}{{ message['content'] or "
    "'' }}{%- for call in message['tool_calls'] or [] %}{% set call = call['function'] if call['function'] "
    "is defined else call %}<tool_call>\n{\"name\": \"{{ call['name'] }}\", \"arguments\": "
    "{{ call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}}\n</tool_call>"
    "{%- endfor %}<|eos|>{% endgeneration %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|user|>{% endif -%}"
    "<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{%- else %}{{ raise_exception('unknown chat role: ' ~ message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
# transformers' response parsing of one assistant turn (TRL 1.16's qwen3_template with these markers): the
# calls between <tool_call> tags as JSON, the rest content up to EOS.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": re.escape(EOS) + r"\s*", "content": "text"},
    },
}


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
    return _build(words, (), TAGS, (), CHAT_TEMPLATE)


def build_tool_tokenizer(
    words: Sequence[str], conversations: Sequence[list[dict]], tools: Sequence[Callable]
) -> PreTrainedTokenizerBase:
    """`build_tokenizer` for tool calling: TAGS + TOOL_TAGS added, ROLES as special tokens (ids in that order
    after the merges), TOOL_CHAT_TEMPLATE and RESPONSE_TEMPLATE (saved with the tokenizer's files). The merges
    are also learnt from `conversations` as the template renders them with `tools`, so the scaffolding they
    share with every transcript (`{"name":`, `(expression`, an error's `{'error':`) is a few tokens, not one
    per byte."""
    tags, specials = TAGS + TOOL_TAGS, ROLES
    bare = _build([], [], tags, specials, TOOL_CHAT_TEMPLATE)  # bytes only: renders the texts
    texts = [bare.apply_chat_template(c, tools=list(tools), tokenize=False) for c in conversations]
    tokenizer = _build(words, texts, tags, specials, TOOL_CHAT_TEMPLATE)
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def _base_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Qwen2Tokenizer:
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,  # byte-level: nothing is unknown
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def _byte_vocab() -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *byte_symbols()):
        vocab.setdefault(token, len(vocab))
    return vocab


def text_pieces(texts: Sequence[str], markers: Sequence[str]) -> list[str]:
    """Qwen2's pre-tokens (in byte symbols) of `texts`, split at `markers` first as added tokens are."""
    pre_tokenizer = _base_tokenizer(_byte_vocab(), []).backend_tokenizer.pre_tokenizer
    split = re.compile("|".join(re.escape(m) for m in markers)) if markers else None
    chunks = [c for t in texts for c in (split.split(t) if split else [t]) if c]
    return [piece for c in chunks for piece, _ in pre_tokenizer.pre_tokenize_str(c)]


def _build(
    words: Sequence[str],
    texts: Sequence[str],
    tags: Sequence[str],
    specials: Sequence[str],
    chat_template: str,
) -> PreTrainedTokenizerBase:
    pieces = [_to_symbols(p) for w in words for p in (w, " " + w)] + text_pieces(texts,
                                                                                 (*SPECIAL_TOKENS, *tags,
                                                                                  *specials))
    merges = learn_merges(pieces)
    vocab = _byte_vocab()
    for token in (a + b for a, b in merges):
        vocab.setdefault(token, len(vocab))
    tokenizer = _base_tokenizer(vocab, merges)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    if specials:  # registered as the tokenizer's extra special tokens: all_special_tokens, skipped by decode
        tokenizer.add_special_tokens(
            {"extra_special_tokens": [AddedToken(t, special=True, normalized=False) for t in specials]}
        )
    tokenizer.chat_template = chat_template
    for w in words:
        for text in (w, " " + w):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise RuntimeError(f"tokenizer: {text!r} is {len(ids)} tokens, expected 1")
    return tokenizer
