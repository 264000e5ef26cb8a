"""The padding-free forward on and off, side by side: the log-prob pass the trainer runs, on the embedded
default's model and prompts (run `make repro` first, or pass --model/--data).

    python -m benchmarks.padding [--batches 41] [--completion 14:21] [--prompts 8] [--group 8]

Each batch: ``--prompts`` prompts from the training data, ``--group`` completions each of a random length in
``--completion`` (the default task's range; 32:32 gives the cpu-tiny benchmark's equal lengths), padded as the
trainer pads them. Both settings run on the same batch, alternating which goes first; process CPU seconds of a
no-grad pass (reference/old log-probs) and of forward + backward (the policy), median and best over the
batches after the first. One torch thread. The two settings' log-probs are checked equal (1e-5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artifacts/base_model")
    p.add_argument("--data", default="data/prepared/train.jsonl")
    p.add_argument("--batches", type=int, default=41)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--completion", default="14:21", help="min:max completion tokens")
    args = p.parse_args(argv)
    lo, hi = (int(x) for x in args.completion.split(":"))
    if not 1 <= lo <= hi or args.batches < 2:
        p.error("--completion must be min:max with 1 <= min <= max, and --batches >= 2")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.model.logprobs import ScoringPath, token_logprobs_and_entropy
    from grpo_core.train.batching import trim_padding

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model).train()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in Path(args.data).open()]
    rng = np.random.default_rng(0)

    def batch():
        chosen = [prompts[i] for i in rng.choice(len(prompts), args.prompts, replace=False)]
        P = max(map(len, chosen))
        rows = [(p, int(rng.integers(lo, hi + 1))) for p in chosen for _ in range(args.group)]
        pad = tokenizer.pad_token_id
        return {
            "prompt_ids": torch.tensor([[pad] * (P - len(p)) + p for p, _ in rows]),
            "prompt_mask": torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p, _ in rows]),
            "completion_ids": torch.tensor([list(rng.integers(5, len(tokenizer), c)) + [pad] * (hi - c)
                                            for _, c in rows]),
            "completion_mask": torch.tensor([[1] * c + [0] * (hi - c) for _, c in rows]),
        }

    def logps(ids, att, K, pos, grad, padding_free):
        return token_logprobs_and_entropy(model, ids, att, K, position_ids=pos, compute_entropy=grad,
                                          path=ScoringPath(forward="manual", padding_free=padding_free))[0]

    times = {flag: {"no-grad": [], "fwd+bwd": []} for flag in (True, False)}
    rows_through = {}
    for i in range(args.batches):
        ids, att, mask = trim_padding(**batch())
        K = mask.shape[1]
        pos = (att.cumsum(1) - 1).clamp(min=0)
        results = {}
        for flag in (True, False) if i % 2 else (False, True):
            t0 = time.process_time()
            with torch.no_grad():
                results[flag] = logps(ids, att, K, pos, False, flag)
            t1 = time.process_time()
            (logps(ids, att, K, pos, True, flag) * mask).sum().backward()
            model.zero_grad(set_to_none=True)
            t2 = time.process_time()
            if i:  # the first batch warms up
                times[flag]["no-grad"].append(t1 - t0)
                times[flag]["fwd+bwd"].append(t2 - t1)
        diff = float(((results[True] - results[False]) * mask).abs().max())
        if diff > 1e-5:
            raise SystemExit(f"padding-free log-probs differ from the padded ones by {diff:.2e}")
        P = ids.shape[1] - K  # rows through the dense layers: per distinct prompt, then per row
        U = args.prompts
        rows_through.setdefault(False, []).append(U * P + ids.shape[0] * (K - 1))
        first = torch.arange(0, ids.shape[0], args.group)
        rows_through.setdefault(True, []).append(int(att[first, :P].sum() + att[:, P:-1].sum()))

    print(f"{args.batches - 1} batches of {args.prompts} prompts x {args.group}, completions {lo}-{hi} "
          "tokens; CPU s, median (best); 1 thread")
    for flag, label in ((False, "padded"), (True, "padding-free")):
        cells = " | ".join(f"{k} {statistics.median(v):.4f} ({min(v):.4f})" for k, v in times[flag].items())
        print(f"{label:13s} {cells} | rows through the matmuls {statistics.mean(rows_through[flag]):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
