"""Part (e) of the GPU kit (benchmarks/gpu_kit.py): the real-model recipe trained end to end on this machine.

    python -m benchmarks.kit_real_model --spec spec.json --out result.json

configs/smollm2-135m-word-problems.yaml as shipped - SmolLM2-135M-Instruct converted from its GGUF
(grpo_core/model/gguf.py), data/word-problems, correctness alone, its batch, lengths, sampler and steps - with
what a machine without DVC needs instead: the raw jsonl splits in place of validate's parquet files and the
reward weight pinned to 1 (one reward: calibration has nothing to weigh). The same evaluator as the evaluate
stage (greedy decoding of every held-out prompt, benchmarks/learning.py: greedy_evaluation) scores the base
and the trained policy. Reported: both accuracies, the train stage's wall time and completion tokens/s, the
allocator's peak, and the reward per step. The smoke run (``spec["smoke"]``) swaps in the tiny embedded model
and a step of 4-token completions on 4 prompts: a check of the code, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "smollm2-135m-word-problems.yaml"
GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# the smoke run's sizes (the tiny model has no chat template: its prompts stay text)
SMOKE = {"train.max_steps": 1, "train.per_device_train_batch_size": 4, "train.num_generations": 2,
         "generation.max_completion_length": 4, "evaluate.max_samples": 4, "data.prompt_format": "auto",
         "data.system_prompt": None}


def recipe(model_dir: Path, workdir: Path, smoke: bool):
    from grpo_core.config import load_config

    data = REPO / "data" / "word-problems"
    overrides = {"model.name_or_path": str(model_dir), "data.train_files": [str(data / "train.jsonl")],
                 "data.eval_files": [str(data / "eval.jsonl")], "data.train_dir": None, "data.eval_dir": None,
                 "calibrate.enabled": False, "train.reward_weights": [1.0],
                 "train.output_dir": str(workdir / "out"), "train.resume": "never",
                 "train.save_steps": 10_000}
    return load_config(RECIPE, {**overrides, **(SMOKE if smoke else {})})


def run(spec: dict) -> dict:
    import torch

    from benchmarks.learning import completion_tokens, greedy_evaluation
    from grpo_core.model.gguf import convert_gguf
    from grpo_core.train.loop import train

    workdir = Path(spec["workdir"])
    started = time.perf_counter()
    if spec.get("model_dir"):
        model_dir = Path(spec["model_dir"])
    else:
        model_dir = workdir / "model"
        convert_gguf(Path(spec.get("gguf") or GGUF), model_dir)
    convert_s = time.perf_counter() - started
    cfg = recipe(model_dir, workdir, spec.get("smoke", False))
    base = greedy_evaluation(REPO, cfg, model_dir)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = train(cfg, reward_weights=[1.0], root=REPO, progress=False, log_path=workdir / "train_log.csv")
    train_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    import csv

    with open(workdir / "train_log.csv", newline="") as fh:
        log = list(csv.DictReader(fh))
    lengths = [float(r["completions/mean_length"]) for r in log]
    trained = greedy_evaluation(REPO, cfg, result.model_dir)
    t = cfg.train
    return {"recipe": str(RECIPE.relative_to(REPO)), "smoke": bool(spec.get("smoke")),
            "shape": {"prompts_per_step": t.batch.per_device_train_batch_size // t.batch.num_generations,
                      "num_generations": t.batch.num_generations,
                      "max_completion_length": cfg.generation.max_completion_length,
                      "steps": t.max_steps, "learning_rate": t.optim.learning_rate,
                      "held_out_prompts": base["num_prompts"]},
            "convert_s": round(convert_s, 1), "train_s": round(train_s, 1),
            "completion_tokens_per_s": round(completion_tokens(cfg, lengths) / train_s, 1),
            "cuda_peak_allocated_mib": peak, "base": base, "trained": trained,
            "delta": trained["accuracy"] - base["accuracy"],
            "reward_per_step": [float(r["reward"]) for r in log]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    result = run(json.loads(a.spec.read_text()))
    a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
