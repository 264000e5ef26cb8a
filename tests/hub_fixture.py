"""Stand-ins for what a user downloads from the hub, built locally (no network in tests).

``make_chat_model``: a model folder shaped like Qwen2.5-*-Instruct as `hf download` leaves it: a Qwen2
architecture with tied embeddings, saved in bfloat16; a byte-level BPE Qwen2Tokenizer with ``<|endoftext|>``
as the pad token, ``<|im_end|>`` as EOS (and a generation config stopping on both, as Qwen's does), no BOS;
and a ChatML chat template with ``<|im_start|>role ... <|im_end|>`` turns, Qwen's default system message, and
one template keyword (``enable_thinking``, as Qwen3's) so ``data.chat_template_kwargs`` can be seen to arrive.
The weights are briefly warm-started on the chat-rendered data so completions end with ``<|im_end|>``. With
``tools`` (the hub tools recipe, configs/gsm8k-qwen2.5-0.5b-tools.yaml): Qwen2.5-Instruct's own chat template
(the bytes TRL 1.16 ships as qwen2_5.jinja, tools listed in the system turn, calls as
``<tool_call>{json}</tool_call>``), ``<tool_call>``/``</tool_call>`` as Qwen's non-special added tokens, and
half the warm-start transcripts call the first tool on the question's first two numbers before answering, so
sampled completions call it sometimes.

``make_gsm8k``: parquet files laid out as ``hf download openai/gsm8k --repo-type dataset`` leaves them
(``main/train-00000-of-00001.parquet``, ``main/test-...``), with GSM8K's columns: ``question`` and ``answer``
= reasoning lines with ``<<48/2=24>>`` calculator annotations and a final ``#### 72`` (some golds with a
thousands separator, ``#### 1,200``).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pandas as pd

from grpo_core.embedded.tokenizer import _to_symbols, byte_symbols, learn_merges

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] != 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' "
    "}}{%- endif %}{%- endif %}"
)

TOOL_TAGS = ("<tool_call>", "</tool_call>")

NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark"]
ITEMS = ["clips", "apples", "books", "pages", "dollars", "marbles", "cookies", "stickers"]


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    """GSM8K-shaped rows: two-step word problems whose answers carry ``<<a*b=c>>`` annotations and
    ``#### N``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        if i % 5 == 4:  # a large total, written with a thousands separator as GSM8K sometimes does
            a, b = rng.randint(11, 40), rng.randint(100, 300)
            total = a * b
            question = (f"{name} buys {a} boxes of {item} with {b} {item} in each box. How many {item} is "
                        "that?")
            answer = f"{name} buys {a} * {b} = <<{a}*{b}={total}>>{total} {item}.\n#### {total:,}"
        else:
            a, b = rng.randint(2, 60), rng.randint(2, 9)
            half, total = a * b, a * b + a
            question = (f"{name} had {a} {item} in April and {b} times as many in May. "
                        f"How many {item} did {name} have in April and May?")
            answer = (f"In May {name} had {a}*{b} = <<{a}*{b}={half}>>{half} {item}.\n"
                      f"In total {name} had {a}+{half} = <<{a}+{half}={total}>>{total} {item}.\n#### {total}")
        rows.append({"question": f"[{i}] {question}", "answer": answer})
    return rows


def make_gsm8k(root: Path, num_train: int = 64, num_test: int = 24, seed: int = 0) -> dict[str, Path]:
    """``<root>/main/{train,test}-00000-of-00001.parquet``, as the hub's openai/gsm8k ``main`` config."""
    out = {}
    for split, n, s in (("train", num_train, seed), ("test", num_test, seed + 1)):
        path = root / "main" / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = gsm8k_rows(n, s)
        if split == "test":  # no prompt shared with train (validate checks the overlap)
            rows = [{**r, "question": r["question"].replace("[", "[t", 1)} for r in rows]
        pd.DataFrame(rows).to_parquet(path, index=False)
        out[split] = path
    return out


def build_chat_tokenizer(texts: list[str], chat_template: str = CHATML_TEMPLATE, tool_tags: bool = False):
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    words = sorted({w for t in texts for w in t.replace("\n", " ").split(" ") if w})
    merges = learn_merges([_to_symbols(p) for w in words for p in (w, " " + w)])
    vocab: dict[str, int] = {}
    for token in (*byte_symbols(), *(a + b for a, b in merges)):
        vocab.setdefault(token, len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token=IM_END,
                         pad_token=PAD, model_max_length=32768, clean_up_tokenization_spaces=False)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                          for t in (IM_START, IM_END, PAD)]})
    if tool_tags:  # as Qwen2.5's tokenizer: added, not special (decode keeps them)
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    tok.chat_template = chat_template
    return tok


def make_chat_model(path: Path, texts: list[str], system_prompt: str | None = None, hidden_size: int = 32,
                    layers: int = 2, warm_start_steps: int = 60, seed: int = 0,
                    tools: list | None = None) -> Path:
    """A Qwen2.5-Instruct-shaped folder at ``path`` (see the module docstring), warm-started on ``texts``
    (user questions) answered in the seed format and closed with ``<|im_end|>``; ``tools``: the chat template
    is Qwen2.5's own and half the answers call ``tools[0]`` first."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    words = texts + ["<reasoning>", "</reasoning>", "<answer>", "</answer>"]
    if tools:
        from tests.tool_fixtures import chat_template

        template = chat_template("qwen2_5")
        # the template's own words (tool block, schema) join the merges
        probe = build_chat_tokenizer([], template)
        words += [probe.apply_chat_template([{"role": "system", "content": system_prompt or ""}], tools=tools,
                                            tokenize=False), "<tool_response>", "</tool_response>",
                  '{"expression":']
        tok = build_chat_tokenizer(words, template, tool_tags=True)
    else:
        tok = build_chat_tokenizer(words)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True, use_sliding_window=False,
                         bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids(IM_END),
                         pad_token_id=tok.pad_token_id)
    model = Qwen2ForCausalLM(config)
    _warm_start(model, tok, texts, system_prompt, warm_start_steps, tools)
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.convert_tokens_to_ids(IM_END), tok.pad_token_id], pad_token_id=tok.pad_token_id,
        do_sample=True, temperature=0.7, top_p=0.8, top_k=20)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def _warm_start(model, tok, questions: list[str], system_prompt: str | None, steps: int,
                tools: list | None = None) -> None:
    """A few supervised steps on chat-rendered question -> short seed-format answer + <|im_end|>; with
    ``tools``, every other answer first calls ``tools[0]`` (transcript rendered by the chat template, loss on
    all of it)."""
    import torch

    rng = random.Random(0)
    examples = []
    for i, q in enumerate(questions):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": q}]
        prompt = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        answer = (f"<reasoning>\n{q.split()[1]}\n</reasoning>\n<answer>\n{rng.randint(1, 99)}\n"
                  f"</answer>{IM_END}")
        if tools and i % 2 == 0:
            answer = _tool_transcript(tok, messages, tools, q)[len(prompt):] + answer
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(answer, add_special_tokens=False)["input_ids"]
        examples.append((p_ids if tools else p_ids[-48:], a_ids))  # a call is learnt in its whole context
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        batch = rng.sample(examples, min(8 if tools else 16, len(examples)))
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for i, (p, a) in enumerate(batch):
            seq = p + a
            ids[i, :len(seq)] = torch.tensor(seq)
            labels[i, len(p):len(seq)] = torch.tensor(a)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def _tool_transcript(tok, messages: list[dict], tools: list, question: str) -> str:
    """The conversation to the next generation prompt after a call of ``tools[0]`` on the question's first two
    numbers, and its result."""
    a, b = re.findall(r"\d+", question.split("]", 1)[-1])[:2]
    expression = f"{a}*{b}"
    call = {"type": "function",
            "function": {"name": tools[0].__name__, "arguments": {"expression": expression}}}
    return tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "name": tools[0].__name__, "content": tools[0](expression)}],
        tools=tools, tokenize=False, add_generation_prompt=True)
