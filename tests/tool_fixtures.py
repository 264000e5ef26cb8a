"""Stand-ins for tool-using chat models, built locally: tokenizers with the real Qwen2.5 / Qwen3 / Llama
3.1 chat templates (the bytes TRL 1.16 ships and recognises, trl/chat_templates/), tiny Qwen2 models, tools
and environments, and a scripted backend whose completions are a function of the context - so two samplers
(ours and TRL's tool loop) given the same script produce the same tokens."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import torch

from grpo_core.embedded.tokenizer import _to_symbols, byte_symbols, learn_merges
from grpo_core.rollout.types import assemble_batch, left_pad, pad_and_eos_ids

WORDS = ["what", "is", "times", "multiply", "The", "answer", "<tool_call>", "</tool_call>", "<tool_response>",
         "</tool_response>", '{"name":', '"arguments":', '"a":', '"b":', "user", "assistant", "system",
         "ipython", '"parameters":', "add", "increment", "count", "<think>", "</think>"]


def chat_template(name: str) -> str:
    """A hub chat template as TRL 1.16 ships it (qwen2_5, qwen3, llama3_1, ...)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def _bpe_tokenizer(texts: list[str], specials: list[str], **roles):
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    words = sorted({w for t in texts for w in re.split(r"\s+", t) if w})
    merges = learn_merges([_to_symbols(p) for w in words for p in (w, " " + w)])
    vocab: dict[str, int] = {}
    for token in (*byte_symbols(), *(a + b for a, b in merges)):
        vocab.setdefault(token, len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, model_max_length=32768,
                         clean_up_tokenization_spaces=False, **roles)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                          for t in specials]})
    return tok


def tiny_model(tokenizer, seed: int = 0, hidden_size: int = 32, layers: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
                         use_sliding_window=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(config).eval()


# -- tools and environments ---------------------------------------------------------------------------------


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)


class Counter:
    """A stateful environment: a counter that starts at the row's ``start`` and owns its reward."""

    closed: list[int] = []  # ids of closed instances (tests check every environment is closed)

    def reset(self, start: int = 0, **row) -> str:
        self.count = int(start)
        return f" The counter starts at {self.count}."

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count)

    def close(self) -> None:
        Counter.closed.append(id(self))


QWEN = dict(specials=["<|im_start|>", "<|im_end|>", "<|endoftext|>"], bos_token=None, eos_token="<|im_end|>",
            pad_token="<|endoftext|>")
LLAMA = dict(specials=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                       "<|finetune_right_pad_id|>"], bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
             pad_token="<|finetune_right_pad_id|>")


def _chat_tokenizer(template: str, shape: dict, texts, tools):
    """A byte-level BPE whose merges cover ``texts`` and the template's own tool preamble for ``tools`` (so a
    prompt with tool schemas is a few hundred tokens, not a thousand bytes)."""
    shape = dict(shape)
    specials = shape.pop("specials")
    tok = _bpe_tokenizer([*WORDS, *texts], specials, **shape)
    tok.chat_template = chat_template(template)
    preamble = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=list(tools) or None,
                                       tokenize=False, add_generation_prompt=True)
    tok = _bpe_tokenizer([*WORDS, *texts, preamble], specials, **shape)
    tok.chat_template = chat_template(template)
    return tok


def qwen_tokenizer(template: str = "qwen2_5", texts: list[str] = (), tools=(multiply, add)):
    """Qwen2.5-/Qwen3-shaped: ChatML specials, ``<|im_end|>`` EOS, ``<|endoftext|>`` pad, no BOS."""
    return _chat_tokenizer(template, QWEN, texts, tools)


def llama_tokenizer(template: str = "llama3_1", texts: list[str] = (), tools=(multiply, add)):
    """Llama-3.1-Instruct-shaped: ``<|begin_of_text|>`` BOS, ``<|eot_id|>`` EOS (end of turn),
    header specials."""
    return _chat_tokenizer(template, LLAMA, texts, tools)



# -- a scripted policy ---------------------------------------------------------------------------------------


def hermes_call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class Script:
    """What the "model" writes after a context: a function of the context's text and a per-row seed, so any
    sampler that hands it the same contexts gets the same tokens. ``policy(text, key) -> str`` writes the turn
    (an EOS is appended unless it returns with ``truncate`` in the text: then the turn is cut at
    ``max_new``)."""

    def __init__(self, tokenizer, policy, max_new: int):
        self.tokenizer, self.policy, self.max_new = tokenizer, policy, max_new
        self.calls = 0

    def completion(self, context_ids: list[int], sample: int) -> list[int]:
        text = self.tokenizer.decode(context_ids)
        key = zlib.crc32(json.dumps([context_ids[:8], len(context_ids), sample]).encode())
        turn = self.policy(text, key)
        ids = self.tokenizer(turn, add_special_tokens=False)["input_ids"]
        if turn.endswith("<truncate>"):
            ids = self.tokenizer(turn.removesuffix("<truncate>"), add_special_tokens=False)["input_ids"]
            return (ids * self.max_new)[:self.max_new]
        return (ids + [self.tokenizer.eos_token_id])[:self.max_new]


class ScriptedBackend:
    """A RolloutBackend answering from a Script (sample g of a repeated prompt is the script's sample g)."""

    def __init__(self, script: Script, sampling_logp: float | None = None):
        """sampling_logp: report it as the sampler's log-prob of every token (as vLLM reports its own)."""
        self.script = script
        self.sampling_logp = sampling_logp
        self.pad_id, self.eos_ids = pad_and_eos_ids(script.tokenizer)
        self.requests: list[tuple[int, int]] = []  # (prompts, max_new_tokens) per generate call

    def generate(self, prompt_ids, num_generations, sampling):
        self.requests.append((len(prompt_ids), sampling.max_new_tokens))
        rows = [self.script.completion(list(p), g)[:sampling.max_new_tokens]
                for p in prompt_ids for g in range(num_generations)]
        ids, mask = left_pad([list(p) for p in prompt_ids for _ in range(num_generations)], self.pad_id)
        out = torch.full((len(rows), max(len(r) for r in rows)), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.tensor(r)
        batch = assemble_batch(ids, mask, [out], self.pad_id, self.eos_ids)
        if self.sampling_logp is not None:
            batch.sampling_logps = batch.completion_mask * self.sampling_logp
        return batch

    def sync_weights(self, model) -> None:
        pass


def calculator_policy(text: str, key: int) -> str:
    """Multiply the question's numbers with the tool, then answer with its result; every third row answers in
    its head (no tool), every fifth calls an unknown tool first."""
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
    question = re.findall(r"what is (\d+) times (\d+)", text)
    a, b = question[-1] if question else ("2", "3")
    if results and not results[-1].startswith("{'error'"):
        return f"The answer is {results[-1]}"
    if key % 3 == 0:
        return f"The answer is {int(a) + int(b)}"
    if key % 5 == 1 and "divide" not in text:
        return hermes_call("divide", a=int(a), b=int(b))
    return hermes_call("multiply", a=int(a), b=int(b))


class ScriptedFactory:
    """``backend_factory`` for train(): a ScriptedBackend over ``policy`` (picklable: the async sampler worker
    builds its backend with it in its own process)."""

    def __init__(self, policy, budget: int):
        self.policy, self.budget = policy, budget

    def __call__(self, model, tokenizer):
        return ScriptedBackend(Script(tokenizer, self.policy, self.budget))


def counter_policy(text: str, key: int) -> str:
    """Increment the counter by the row's key-chosen step until two results came back,
    then report the count."""
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
    if len(results) >= 2 or key % 4 == 0:
        return f"The count is {results[-1] if results else 'unknown'}"
    return hermes_call("increment", by=1 + key % 3)
