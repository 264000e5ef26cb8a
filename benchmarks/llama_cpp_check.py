"""llama.cpp itself on the exported GGUF: does it answer the held-out prompts as evaluate's trained model did?

    cd benchmarks/llama_cpp && NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install && cd ../..
    python -m benchmarks.llama_cpp_check --root <a checkout after dvc repro> --types F16 Q8_0 Q4_1

Each type is written from ``<root>/<train.output_dir>/model`` by ``export_gguf`` (the export stage's writer,
with the source GGUF's metadata when model.name_or_path is one), then node-llama-cpp's prebuilt llama.cpp
build (``benchmarks/llama_cpp/replies.mjs``, one thread) answers every held-out prompt greedily, rendered by
the model's chat template with data.system_prompt as the evaluate stage renders it, up to
evaluate's max_completion_length tokens. The replies are scored by the first correctness reward as evaluate
scores them, and compared with evaluate's own trained greedy replies (``artifacts/eval/completions.parquet``).
Results (per type: accuracy, replies identical to evaluate's, completion tokens/s with prompt processing
included, file bytes) go to ``--out``.

Beside llama.cpp, in the same run and on the same thread count: our own decode loop (the backend evaluate
samples with, ``generation.backend``) on the trained safetensors in ``model.dtype``, greedy on the same
rendered prompts, one prompt at a time as llama.cpp answers them (``ours``) and in evaluate's batches of
``evaluate.batch_size`` (``ours-batched``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NODE_APP = REPO / "benchmarks" / "llama_cpp"


def chat_prompts(cfg, model_dir: Path, rows: list[dict]) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
    return [tokenizer.apply_chat_template([*system, {"role": "user", "content": r["prompt"]}], tokenize=False,
                                          add_generation_prompt=True) for r in rows]


def max_new_tokens(cfg) -> int:
    return cfg.evaluate.max_completion_length or cfg.generation.max_completion_length


def our_replies(cfg, model_dir: Path, prompts: list[str], batch_size: int, threads: int) -> dict:
    """Our decode loop's greedy replies to the rendered ``prompts`` and its completion tokens/s (prompt
    processing included), ``batch_size`` prompts per call on ``threads`` torch threads."""
    import dataclasses
    import time

    import torch

    from grpo_core.model.loading import load_for_inference
    from grpo_core.rollout import backend_for
    from grpo_core.rollout.types import SamplingParams

    torch.set_num_threads(threads)
    model, tokenizer = load_for_inference(dataclasses.replace(cfg.model, name_or_path=str(model_dir)))
    backend = backend_for(model, tokenizer, cfg.generation, seed=0, max_prompt_length=None)
    greedy = SamplingParams(max_new_tokens=max_new_tokens(cfg), do_sample=False)  # evaluate's greedy mode
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    replies, generated, start = [], 0, time.perf_counter()
    with torch.no_grad():
        for s in range(0, len(ids), batch_size):
            batch = backend.generate(ids[s:s + batch_size], 1, greedy)
            generated += int(batch.completion_mask.sum())
            replies += tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
    seconds = time.perf_counter() - start
    return {"replies": replies, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "seconds": seconds, "backend": type(backend).__name__}


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    from grpo_core.config import load_config
    from grpo_core.model.gguf import is_gguf
    from grpo_core.model.gguf_export import Sampling, export_gguf
    from grpo_core.rewards import build_reward_functions
    from grpo_core.rewards.judges import CORRECTNESS_FUNCTIONS, reward_index

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--types", nargs="+", default=["F16", "Q8_0"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/grpo-llama-cpp"))
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp's threads and ours")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "llama-cpp-check.json")
    a = parser.parse_args(argv)
    cfg = load_config(a.root / "params.yaml")
    model_dir = a.root / cfg.train.checkpoints.output_dir / "model"
    source = a.root / cfg.model.name_or_path
    # the held-out split as the stages after validate read it
    rows = pd.read_parquet(a.root / "data" / "validated" / "eval.parquet").to_dict("records")
    rows = rows[:cfg.evaluate.max_samples] if cfg.evaluate.max_samples else rows
    a.workdir.mkdir(parents=True, exist_ok=True)
    prompts = a.workdir / "prompts.json"
    rendered = chat_prompts(cfg, model_dir, rows)
    prompts.write_text(json.dumps({"prompts": rendered}))
    spec = cfg.rewards[reward_index(cfg.rewards, CORRECTNESS_FUNCTIONS)]
    score = build_reward_functions([spec])[0]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    done = pd.read_parquet(a.root / "artifacts" / "eval" / "completions.parquet")
    ours = list(done[(done.policy == "trained") & (done["mode"] == "greedy")]
                .sort_values("prompt_index").completion)
    results = {}

    def record(name: str, got: dict, **extra) -> None:
        scores = score([r["prompt"] for r in rows], got["replies"], **columns)
        same = sum(x.strip() == y.strip() for x, y in zip(got["replies"], ours))
        results[name] = {**extra, "accuracy": sum(s == 1.0 for s in scores) / len(rows),
                         "identical_to_evaluate": same,
                         "tokens_per_s": round(got["tokens_per_s"], 1), "seconds": round(got["seconds"], 1)}
        print(name, results[name], flush=True)

    for gguf_type in a.types:
        path = a.workdir / f"model.{gguf_type}.gguf"
        export_gguf(model_dir, path, gguf_type, source_gguf=source if is_gguf(source) else None,
                    sampling=Sampling(temperature=cfg.generation.temperature))
        out = a.workdir / f"replies.{gguf_type}.json"
        subprocess.run(["node", "replies.mjs", str(path), str(prompts), str(out),
                        str(max_new_tokens(cfg)), str(a.threads)], cwd=NODE_APP, check=True)
        record(gguf_type, json.loads(out.read_text()), engine="llama.cpp", bytes=path.stat().st_size)
    for name, batch_size in (("ours", 1), ("ours-batched", cfg.evaluate.batch_size)):
        got = our_replies(cfg, model_dir, rendered, batch_size, a.threads)
        record(name, got, engine=got["backend"], dtype=cfg.model.dtype, batch_size=batch_size)
    evaluated = json.loads((a.root / "metrics" / "eval.json").read_text())["trained"]["accuracy"]
    args = sys.argv[1:] if argv is None else argv
    summary = {"command": "python -m benchmarks.llama_cpp_check " + " ".join(args), "prompts": len(rows),
               "threads": a.threads, "evaluate_trained_accuracy": evaluated, "types": results}
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
