"""The calculator task's base rates: how a prepared model uses the calculator before GRPO (configs/embedded-tools.yaml).

A plain multi-turn loop over HF generate, independent of the pipeline's rollouts (grpo_core/rollout), as TRL 1.16's
``_tool_call_loop`` does it: generate a turn until EOS; parse it with the tokenizer's response template
(``parse_response``); run its calls (a raising call is answered ``{'error': '...'}`` and counts as failed); append the
template's tokens for the results and the next generation prompt (``suffix_ids``: the text a chat template writes
between the assistant's EOS and the next turn); generate again; up to ``max_tool_calls`` tool turns; the whole
completion within ``max_completion_length`` tokens. Scored with the pipeline's correctness reward on the assistant
messages.

    .venv/bin/python -m benchmarks.embedded_tools --model artifacts/base_model --data data/prepared/eval.jsonl

prints, per temperature, accuracy, the share of completions that call the tool, accuracy when they do and when they
do not, and the share of calls that failed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpo_core.embedded.tools import calculator
from grpo_core.rewards import correctness

TOOLS = {"calculator": calculator}


@dataclass
class Conversation:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # assistant and tool messages (TRL's completion)
    calls: int = 0
    failures: int = 0
    malformed: int = 0  # turns whose tool call did not parse


def suffix_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """TRL's ``_get_tool_suffix_ids``: the template's tokens after an assistant turn's EOS, for these results."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prefix = tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    prefix = prefix[: max(i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id) + 1]
    assert full[: len(prefix)] == prefix, "chat template is not prefix-preserving"
    return full[len(prefix):]


def run_calls(message: dict) -> list[dict]:
    """The tool messages answering an assistant message's calls (TRL: a raising call is answered with its error)."""
    out = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        name = function.get("name", "unknown")
        try:
            if name not in TOOLS:
                raise ValueError(f"Tool {name} not found.")
            content, failed = str(TOOLS[name](**(function.get("arguments") or {}))), False
        except Exception as exc:  # noqa: BLE001 - the model is answered with any tool error, as in TRL
            content, failed = str({"error": str(exc)}), True
        out.append({"role": "tool", "name": name, "content": content, "failed": failed})
    return out


def generate(model, tokenizer, contexts: list[list[int]], room: list[int], temperature: float) -> list[list[int]]:
    """One turn after each context (HF generate, left-padded): ids up to and including EOS, at most room[i]."""
    pad = tokenizer.pad_token_id
    width = max(len(c) for c in contexts)
    ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts])
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
        "do_sample": False}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(room), pad_token_id=pad,
                             eos_token_id=tokenizer.eos_token_id, **sampling)[:, width:].tolist()
    turns = []
    for row, limit in zip(out, room):
        row = row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row
        turns.append(row[:limit])
    return turns


def rollouts(model, tokenizer, prompts: list[list[dict]], *, temperature: float, max_completion_length: int,
             max_tool_calls: int, seed: int) -> list[Conversation]:
    tools = list(TOOLS.values())
    torch.manual_seed(seed)  # HF generate samples from the global generator
    rows = [Conversation(tokenizer.apply_chat_template(p, tools=tools, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)) for p in prompts]
    active = list(rows)
    for turn in range(max_tool_calls + 1):
        contexts = [r.prompt_ids + r.completion_ids for r in active]
        new = generate(model, tokenizer, contexts, [max_completion_length - len(r.completion_ids) for r in active],
                       temperature)
        calling = []
        for row, context, ids in zip(active, contexts, new):
            row.completion_ids += ids
            try:
                message = tokenizer.parse_response(ids, prefix=context, tools=tools) or {}
            except ValueError:  # a malformed call (broken JSON): plain text that ends the conversation (TRL)
                message = {"content": tokenizer.decode(ids, skip_special_tokens=True)}
                row.malformed += 1
            message = {"role": "assistant", "content": message.get("content") or "",
                       **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {})}
            row.messages.append(message)
            if message.get("tool_calls") and turn < max_tool_calls:
                calling.append(row)
        active = []
        for row in calling:
            results = run_calls(row.messages[-1])
            row.calls += len(results)
            row.failures += sum(r.pop("failed") for r in results)
            suffix = suffix_ids(tokenizer, results)
            if len(row.completion_ids) + len(suffix) >= max_completion_length:
                continue  # no room for the results: the row ends as it is (TRL)
            row.messages += results
            row.completion_ids += suffix
            active.append(row)
        if not active:
            break
    return rows


def base_rates(model_dir: str, data: str, *, temperatures=(0.0, 1.0), max_completion_length: int = 64,
               max_tool_calls: int = 1, limit: int | None = None, seed: int = 0) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = [json.loads(line) for line in Path(data).read_text().splitlines()][:limit]
    reward = correctness()
    report = {}
    for temperature in temperatures:
        convs = rollouts(model, tokenizer, [r["prompt"] for r in rows], temperature=temperature,
                         max_completion_length=max_completion_length, max_tool_calls=max_tool_calls, seed=seed)
        completions = [[m for m in c.messages if m["role"] == "assistant"] for c in convs]
        scores = reward([r["prompt"] for r in rows], completions, answer=[r["answer"] for r in rows])
        called = [c.calls > 0 for c in convs]
        ok = [s == 1.0 for s in scores]

        def mean(xs):
            xs = list(xs)
            return round(sum(xs) / len(xs), 4) if xs else None

        calls = sum(c.calls for c in convs)
        report[f"T={temperature:g}"] = {
            "accuracy": mean(ok),
            "tool_call_share": mean(called),
            "accuracy_when_calling": mean(o for o, c in zip(ok, called) if c),
            "accuracy_when_not_calling": mean(o for o, c in zip(ok, called) if not c),
            "call_failure_rate": round(sum(c.failures for c in convs) / calls, 4) if calls else None,
            "tool_success_share": mean(c.calls > c.failures for c in convs),
            "malformed_call_share": mean(c.malformed > 0 for c in convs),
            "mean_completion_tokens": mean(len(c.completion_ids) for c in convs),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="artifacts/base_model")
    parser.add_argument("--data", default="data/prepared/eval.jsonl")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--max-tool-calls", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = base_rates(args.model, args.data, max_completion_length=args.max_completion_length,
                        max_tool_calls=args.max_tool_calls, limit=args.limit, seed=args.seed)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
