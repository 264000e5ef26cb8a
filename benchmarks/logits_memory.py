"""Peak memory of the log-prob passes with the fused LM head (``train.fused_lm_head``) and with the full
logits, on a model whose vocabulary dominates: a tiny Qwen2 body (hidden 64, one layer, tied head) under a
real-size vocabulary.

    python -m benchmarks.logits_memory                      # the defaults: vocab 151,936, 8 x 1,024 tokens
    python -m benchmarks.logits_memory --vocab 32000 --paths fused,full --train none
    python -m benchmarks.logits_memory --write              # + benchmarks/results/logits-memory-<device>.json

Each measurement is a fresh subprocess (peak RSS = VmHWM, benchmarks/rss.py, imports and the
model included; ``rss_before_passes`` is VmRSS just before the first pass):

  passes   what one training step of the GSM8K recipe (configs/gsm8k-qwen2.5-0.5b.yaml) scores: the policy in
           float32 master weights under accelerate's bf16 autocast wrapper (mixed_precision bf16;
           ``--mixed-precision no`` for float32), the reference in bf16 (model.dtype) scored without gradient,
           then the policy's log-probs and entropies with a loss's backward; ``--rows`` completions of
           ``--tokens`` tokens after a 64-token prompt, one micro-batch.
  train    ``grpo_core.train.loop.train`` for one optimizer step with the GSM8K recipe's train section (bf16
           compute copy, gradient checkpointing, beta 0.04, dapo) on that model: batch ``--rows`` x
           ``--tokens``-token completions (a deterministic rollout backend: every completion exactly
           ``--tokens`` tokens, the last one EOS), one micro-batch: the peak memory a whole training step
           needs at this shape.

``--paths`` fused,full: ``fused_lm_head`` true / false. The full path at vocab 151,936 needs more than 10 GiB;
it is left out unless asked for.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.rss import current_rss_bytes, peak_rss_bytes

REPO = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 64


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--paths", default="fused", help="fused, full or fused,full")
    p.add_argument("--mixed-precision", default="bf16", choices=["bf16", "no"])
    p.add_argument("--train", default="fused",
                   help="paths to also run train() on: fused, full, fused,full or none")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write", action="store_true", help="add the results to benchmarks/results/")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return 0
    shape = {"vocab": args.vocab, "rows": args.rows, "tokens": args.tokens, "hidden": args.hidden,
             "layers": args.layers, "mixed_precision": args.mixed_precision, "threads": args.threads}
    runs = [{**shape, "mode": "passes", "fused": path == "fused"} for path in args.paths.split(",")]
    if args.train != "none":
        runs += [{**shape, "mode": "train", "fused": path == "fused"} for path in args.train.split(",")]
    results = []
    for spec in runs:
        result = measure(spec)
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.write:
        write(results)
    return 0


def measure(spec: dict) -> dict:
    """One measurement in a fresh process: its peak RSS is this run's alone."""
    import os

    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.logits_memory", "--child", json.dumps(spec)],
                          cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {**spec, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write(results: list[dict]) -> None:
    out = REPO / "benchmarks/results" / f"logits-memory-{platform.machine()}-cpu.json"
    old = json.loads(out.read_text())["runs"] if out.exists() else []
    keys = ("mode", "vocab", "rows", "tokens", "hidden", "layers", "mixed_precision", "fused")
    new = {tuple(r[k] for k in keys) for r in results}
    kept = [r for r in old if tuple(r.get(k) for k in keys) not in new]
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "runs": kept + results},
                              indent=1) + "\n")


# --- the child ----------------------------------------------------------------------------------------------


def peak_rss_gib() -> float:
    return peak_rss_bytes() / 2**30  # this process's own peak (benchmarks/rss.py: not ru_maxrss)


def rss_gib() -> float:
    return current_rss_bytes() / 2**30


def tiny_config(spec: dict):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=spec["vocab"], hidden_size=spec["hidden"],
                       intermediate_size=2 * spec["hidden"], num_hidden_layers=spec["layers"],
                       num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=PROMPT_TOKENS + spec["tokens"] + 8, tie_word_embeddings=True)


def run_child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    started = time.perf_counter()
    result = run_passes(spec) if spec["mode"] == "passes" else run_train(spec)
    import grpo_core.model.logprobs as logprobs

    return {**spec, **result, "peak_rss_gib": round(peak_rss_gib(), 3),
            "wall_s": round(time.perf_counter() - started, 1),
            "chunk_size": logprobs.DEFAULT_CHUNK_SIZE, "torch": torch.__version__}


def run_passes(spec: dict) -> dict:
    import copy

    import torch
    from accelerate import Accelerator
    from transformers import Qwen2ForCausalLM

    from grpo_core.model.logprobs import ScoringPath, token_logprobs_and_entropy

    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(tiny_config(spec)).train()  # float32 master weights
    reference = copy.deepcopy(policy).to(torch.bfloat16).eval().requires_grad_(False)  # model.dtype bfloat16
    policy = Accelerator(mixed_precision=spec["mixed_precision"], cpu=True).prepare(policy)
    n = PROMPT_TOKENS + spec["tokens"]
    ids = torch.randint(0, spec["vocab"], (spec["rows"], n))
    mask = torch.ones_like(ids)
    positions = torch.arange(n).expand_as(ids)
    kwargs = {"logits_to_keep": spec["tokens"], "position_ids": positions,
              "path": ScoringPath(fused_head=spec["fused"])}
    before = rss_gib()
    t0 = time.perf_counter()
    with torch.no_grad():
        ref_logps, _ = token_logprobs_and_entropy(reference, ids, mask, compute_entropy=False, **kwargs)
    t1 = time.perf_counter()
    logps, entropy = token_logprobs_and_entropy(policy, ids, mask, **kwargs)
    loss = -logps.mean() + 0.04 * (logps - ref_logps).mean() - 0.01 * entropy.mean()
    loss.backward()
    t2 = time.perf_counter()
    return {"rss_before_passes_gib": round(before, 3), "reference_pass_s": round(t1 - t0, 1),
            "policy_forward_backward_s": round(t2 - t1, 1), "loss": loss.item()}


def run_train(spec: dict) -> dict:
    import tempfile

    import torch
    import yaml
    from transformers import Qwen2ForCausalLM

    import grpo_core.train.loop as loop
    from grpo_core.config import config_from_dict
    from grpo_core.embedded.tasks import vocabulary_words
    from grpo_core.embedded.tokenizer import build_tokenizer
    from grpo_core.rollout import RolloutBatch, left_pad

    work = Path(tempfile.mkdtemp(prefix="logits-memory-"))
    tokenizer = build_tokenizer(vocabulary_words())
    torch.manual_seed(0)
    # ids past the tokenizer's pieces are never sampled: memory only
    model = Qwen2ForCausalLM(tiny_config(spec))
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    del model
    with open(work / "train.jsonl", "w") as fh:
        for i in range(16):
            fh.write(json.dumps({"prompt": f"Q{i}: what is {i} + {2 * i}?", "answer": str(3 * i)}) + "\n")
    recipe = yaml.safe_load((REPO / "configs/gsm8k-qwen2.5-0.5b.yaml").read_text())
    g = spec["rows"]
    train = {**recipe["train"], "per_device_train_batch_size": g, "num_generations": g,
             "gradient_accumulation_steps": 1, "max_steps": 1, "save_steps": 100,
             "fused_lm_head": spec["fused"], "mixed_precision": spec["mixed_precision"], "output_dir": "out",
             "resume": "never"}
    cfg = config_from_dict({
        "embedded": None,
        "data": {"train_files": [str(work / "train.jsonl")], "eval_files": [str(work / "train.jsonl")],
                 "max_prompt_length": PROMPT_TOKENS},
        "model": {**recipe["model"], "name_or_path": str(work / "model"), "attn_implementation": None},
        "generation": {"max_completion_length": spec["tokens"]},
        "rewards": [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}],
        "train": train})
    tokens = spec["tokens"]

    class FullLengthBackend:
        """Every completion exactly ``tokens`` tokens, the last one EOS (so none is truncated)."""

        def __init__(self, model, tok):
            self.eos, self.pad, self.span = tok.eos_token_id, tok.pad_token_id, len(tok)

        def sync_weights(self, model) -> None:
            pass

        def generate(self, prompt_ids, num_generations, sampling) -> RolloutBatch:
            rows = [p for p in prompt_ids for _ in range(num_generations)]
            ids, mask = left_pad(rows, self.pad)
            completion = ((torch.arange(tokens)[None, :] * 7 + torch.arange(len(rows))[:, None] * 13)
                          % (self.span - 8) + 8)
            completion[:, -1] = self.eos
            return RolloutBatch(ids, mask, completion, torch.ones_like(completion),
                                torch.zeros(len(rows), dtype=torch.bool))

    before = rss_gib()
    t0 = time.perf_counter()
    result = loop.train(cfg, root=work, progress=False, export=False,
                        hooks=loop.TrainHooks(backend_factory=FullLengthBackend))
    m = result.last_metrics
    return {"rss_before_train_gib": round(before, 3), "train_s": round(time.perf_counter() - t0, 1),
            "step_time_s": m.get("step_time"), "generation_time_s": m.get("generation_time"),
            "mean_completion_length": m.get("completions/mean_length"), "loss": m.get("loss")}


if __name__ == "__main__":
    sys.exit(main())
