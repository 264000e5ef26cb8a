"""One side of the benchmark in its own process (so peak memory is that side's alone).

    python -m benchmarks.side --spec spec.json --out result.json

spec.json: {"side": "ours" | "trl", "config": BenchConfig fields, "assets": prepare()'s dict,
            "workdir": str, "variant": {lever: value} (benchmarks/levers.py), "profile": bool}

Writes per-step timings (seconds per optimizer step, generation included; generation alone), completion
tokens per step, peak memory and a few facts about the run. Both sides run the same number of optimizer
steps on the same model files, prompts, reward function and hyper-parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import torch  # noqa: E402

from benchmarks.configs import BenchConfig  # noqa: E402
from benchmarks.rss import peak_rss_bytes  # noqa: E402

REWARD = "benchmarks.rewards:length_parity"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rss_mib() -> float:
    return peak_rss_bytes() / 2**20  # this process's own peak (benchmarks/rss.py: not ru_maxrss)


def _cuda_peak_mib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


# ---------------------------------------------------------------------------------------------------
# Ours


class _Collector:
    """A tracker for grpo_core.train.loop.train: keeps every step's metrics, and the process CPU time at each
    step's end (the difference between two is one step's CPU seconds: robust on a shared, busy machine)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.cpu_mark = time.process_time()

    def log_metrics(self, metrics: dict, step: int) -> None:
        now = time.process_time()
        self.steps.append({"step": step, **metrics, "cpu_step_time": now - self.cpu_mark})
        self.cpu_mark = now


class _TimedBackend:
    """Wraps the rollout backend: CPU seconds spent generating, per call."""

    def __init__(self, inner):
        self.inner, self.cpu_times = inner, []

    def generate(self, *a, **k):
        t0 = time.process_time()
        out = self.inner.generate(*a, **k)
        self.cpu_times.append(time.process_time() - t0)
        return out

    def sync_weights(self, model) -> None:
        self.inner.sync_weights(model)


def run_ours(cfg: BenchConfig, assets: dict, workdir: Path, variant: dict) -> dict:
    from benchmarks import levers
    from grpo_core.config import config_from_dict
    from grpo_core.train.loop import TrainHooks, train

    raw = {
        "data": {"train_files": [assets["data"]], "eval_files": [assets["data"]],
                 "max_prompt_length": cfg.max_prompt_length},
        "model": {"name_or_path": assets["model_dir"], "dtype": cfg.dtype},
        "generation": {"max_completion_length": cfg.max_completion_length, "temperature": cfg.temperature},
        "rewards": [{"name": "bench", "function": REWARD}],
        "calibrate": {"enabled": False},
        "train": {
            "output_dir": "out", "learning_rate": cfg.learning_rate, "num_generations": cfg.num_generations,
            "per_device_train_batch_size": cfg.batch_size, "gradient_accumulation_steps": 1,
            "beta": cfg.beta, "loss_type": cfg.loss_type,
            "num_iterations": cfg.num_iterations, "max_steps": cfg.steps, "save_total_limit": 1,
            "logging_steps": 1, "seed": cfg.seed, "lr_scheduler_type": "constant",
            "mixed_precision": cfg.mixed_precision, "gradient_checkpointing": False, "resume": "never",
            "reward_weights": [1.0],
        },
    }
    raw["train"].update(levers.train_overrides(variant))  # lever settings (benchmarks/levers.py)
    # Checkpoints and the final export are not part of the work compared (TRL saves nothing here either).
    raw["train"]["save_strategy"] = "no"
    pcfg = config_from_dict(raw)
    collector = _Collector()
    from grpo_core.rollout import default_backend
    make_backend = levers.backend_factory(variant) or default_backend  # the trainer's own choice
    backends: list[_TimedBackend] = []

    def timed_backend(policy, tokenizer):
        backends.append(_TimedBackend(make_backend(policy, tokenizer)))
        return backends[-1]

    # async_rollouts: the worker process builds its own backend (a closure does not reach a spawned process),
    # and the generation time is the worker's, from the round's metrics
    asynchronous = pcfg.train.rollouts.async_rollouts
    t0 = time.perf_counter()
    collector.cpu_mark = time.process_time()
    hooks = TrainHooks(tracker=collector, backend_factory=None if asynchronous else timed_backend)
    train(pcfg, reward_weights=[1.0], root=workdir, progress=False, log_path="train_log.csv", export=False,
          hooks=hooks)
    wall = time.perf_counter() - t0
    gen_cpu = backends[0].cpu_times if backends else []
    steps = [{
        "step_time": m["step_time"],
        "generation_time": m["generation_time"],
        # this process's CPU seconds; under async_rollouts the worker's are elsewhere, so none is reported
        "cpu_step_time": None if asynchronous else m["cpu_step_time"],
        "wait_time": m.get("async/wait_time"),
        "cpu_generation_time": gen_cpu[i] if i < len(gen_cpu) else None,
        "completion_tokens": m["completions/mean_length"] * cfg.batch_size,
        "mean_completion_length": m["completions/mean_length"],
    } for i, m in enumerate(collector.steps)]
    return {"steps": steps, "wall_time": wall}


# ---------------------------------------------------------------------------------------------------
# TRL


def trl_weights_dtype(cfg: BenchConfig) -> str:
    """The dtype TRL's trained weights are loaded in: under mixed precision float32, as ours, so both sides
    keep float32 masters and compute in bf16 (ours on a bf16 compute copy, TRL under accelerate's autocast:
    docs/precision.md); else ``cfg.dtype`` (both sides' weights in that dtype)."""
    return "float32" if cfg.mixed_precision in ("bf16", "fp16") else cfg.dtype


def run_trl(cfg: BenchConfig, assets: dict, workdir: Path, variant: dict) -> dict:
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.rewards import length_parity

    rows = [json.loads(line) for line in open(assets["data"])]
    dataset = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(assets["model_dir"])
    tokenizer.padding_side = "left"
    on_cuda = torch.cuda.is_available()
    args = GRPOConfig(
        output_dir=str(workdir / "trl-out"),
        per_device_train_batch_size=cfg.batch_size, gradient_accumulation_steps=1,
        num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature, beta=cfg.beta, loss_type=cfg.loss_type,
        num_iterations=cfg.num_iterations, learning_rate=cfg.learning_rate, lr_scheduler_type="constant",
        max_steps=cfg.steps, seed=cfg.seed, bf16=cfg.dtype == "bfloat16" or cfg.mixed_precision == "bf16",
        fp16=False, gradient_checkpointing=False, use_vllm=False,
        # as our trainer sets up on CUDA (grpo_core/train/loop.py: allow_tf32)
        tf32=True if on_cuda else None,
        model_init_kwargs={"dtype": trl_weights_dtype(cfg)},
        # EOS masked until max_completion_length tokens: equal token counts on both sides (see prepare.py).
        generation_kwargs={"min_new_tokens": cfg.max_completion_length},
        report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
        use_cpu=not on_cuda, dataloader_num_workers=0, **variant.get("trl_args", {}),
    )

    timings: dict[str, list] = {"step": [], "generation": [], "tokens": [], "cpu_step": [],
                                "cpu_generation": []}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _sync()
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            timings["step"].append(time.perf_counter() - self.t0)
            timings["cpu_step"].append(time.process_time() - self.c0)

    trainer = GRPOTrainer(model=assets["model_dir"], reward_funcs=[length_parity], args=args,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimer()])
    real_generate = trainer._generate_single_turn

    def timed_generate(*a, **k):
        _sync()
        t0, c0 = time.perf_counter(), time.process_time()
        completion_ids, logprobs = real_generate(*a, **k)
        _sync()
        timings["generation"].append(time.perf_counter() - t0)
        timings["cpu_generation"].append(time.process_time() - c0)
        timings["tokens"].append(sum(len(c) for c in completion_ids))
        return completion_ids, logprobs

    trainer._generate_single_turn = timed_generate
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    steps = [{"step_time": s, "generation_time": g, "cpu_step_time": cs, "cpu_generation_time": cg,
              "completion_tokens": n, "mean_completion_length": n / cfg.batch_size}
             for s, g, cs, cg, n in zip(timings["step"], timings["generation"], timings["cpu_step"],
                                        timings["cpu_generation"], timings["tokens"])]
    return {"steps": steps, "wall_time": wall, "optim": args.optim,
            "weights_dtype": str(next(trainer.model.parameters()).dtype).removeprefix("torch.")}


# ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args(argv)
    spec = json.loads(Path(a.spec).read_text())
    cfg = BenchConfig(**spec["config"])
    workdir = Path(spec["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    threads = spec.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    rss_start = _rss_mib()
    profile = spec.get("profile")
    run = {"ours": run_ours, "trl": run_trl}[spec["side"]]
    t_start = time.perf_counter()
    if profile:
        from benchmarks.profiling import profiled
        with profiled(Path(spec["profile_out"]), spec["side"]):
            result = run(cfg, spec["assets"], workdir, spec.get("variant", {}))
    else:
        result = run(cfg, spec["assets"], workdir, spec.get("variant", {}))
    result.update({
        "side": spec["side"], "variant": spec.get("variant", {}),
        "process_time": time.perf_counter() - t_start,
        "peak_rss_mib": _rss_mib(), "rss_at_start_mib": rss_start,
        "cuda_peak_allocated_mib": _cuda_peak_mib(),
        "cuda_peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20 if torch.cuda.is_available()
                                  else None,
        "torch_threads": torch.get_num_threads(),
    })
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
