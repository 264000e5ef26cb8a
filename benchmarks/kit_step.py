"""Parts (a) and (c) of the GPU kit (benchmarks/gpu_kit.py): steps of the GSM8K recipe with each phase timed
and its peak memory read, and one step under torch.profiler - in a process of its own, so the peaks are this
run's alone.

    python -m benchmarks.kit_step --spec spec.json --out result.json

The recipe is configs/gsm8k-qwen2.5-0.5b.yaml as shipped: its batch (32 rows x 4 micro-batches, G = 8),
lengths (prompts up to 256 tokens, completions up to 512), precision (model.dtype bfloat16,
train.mixed_precision bf16; TF32 on CUDA), gradient checkpointing, beta, loss and the rollout backend it
picks. What a machine without the hub or the data needs instead (``spec["overrides"]``, written by
gpu_kit.py): Qwen2.5-0.5B's architecture with random weights (benchmarks/prepare.py), the embedded tasks'
questions under the recipe's system prompt and chat template (the embedded tokenizer's),
benchmarks.rewards:length_parity as the reward, no checkpoints, and ``mask_truncated_completions: false``: EOS
is masked until max_completion_length (every completion is as long as the recipe allows, the same tokens every
step), so every row is "truncated" and the mask would zero the loss.

Steps: the first is the warm-up (compilation, the allocator's first growth); then ``metered_steps`` with the
PhaseMeter alone (benchmarks/phase_meter.py: seconds and peak memory per trainer label; their medians are the
phase table); then, with ``profile``, one step under torch.profiler (CPU and CUDA activity: each label's
kernel time and the top operators).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks import profiling  # noqa: E402
from benchmarks.phase_meter import PhaseMeter, gauges_for_this_machine  # noqa: E402


@contextlib.contextmanager
def observing_trainer_phases(meter: PhaseMeter):
    """For the length of the block, every ``record_function`` span the trainer opens (grpo_core/train/loop.py
    names its phases with them) is also a meter span. The loop looks the name up when it runs, so the meter
    wraps it there; torch's profiler still sees the labels."""
    from grpo_core.train import loop

    original = loop.record_function

    @contextlib.contextmanager
    def metered(name: str, args: str | None = None):
        with meter.phase(name), original(name, args):
            yield

    loop.record_function = metered
    try:
        yield
    finally:
        loop.record_function = original


class StepMarks:
    """The trainer's tracker: closes the meter's step at each step's end,
    and runs the profiler over the last."""

    def __init__(self, meter: PhaseMeter, profiler, profile_step: int | None):
        self.meter, self.profiler, self.profile_step = meter, profiler, profile_step

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.meter.end_step(metrics)
        if self.profile_step is not None and step == self.profile_step - 1:
            self.profiler.start()
        if self.profile_step is not None and step == self.profile_step:
            self.profiler.stop()


def prompt_lengths(cfg, model_dir: str) -> list[int]:
    """Every training prompt's tokens as the trainer encodes them (system prompt, chat template,
    truncation)."""
    from transformers import AutoTokenizer

    from grpo_core.data.loading import PromptEncoder, load_split

    encoder = PromptEncoder.from_config(AutoTokenizer.from_pretrained(model_dir), cfg.data)
    dataset = load_split(cfg.data, "train", Path("."))
    return [len(encoder.encode(row[cfg.data.prompt_column])) for row in dataset]


def memory_on_paper(cfg, model_dir: str) -> dict:
    """benchmarks/memory_plan.py's terms for this model and recipe on one GPU (GiB): what the peaks check."""
    from transformers import AutoConfig

    from benchmarks.memory_plan import ModelShape, Recipe, Strategy, memory_row

    row = memory_row(ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir)),
                     Recipe.from_config(cfg), Strategy("1 GPU", "single", 1))
    terms = ("training_state", "reference", "replica", "transient_weights", "activations", "logits",
             "kv_cache")
    return {**{k: getattr(row, k) / 2**30 for k in terms}, "total": row.total / 2**30}


def run(spec: dict) -> dict:
    from grpo_core.config import load_config
    from grpo_core.train.loop import TrainHooks, train

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    steps = 1 + spec["metered_steps"] + int(spec["profile"])
    cfg = load_config(spec["recipe"], {**spec["overrides"], "train.max_steps": steps})
    workdir = Path(spec["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    meter = PhaseMeter(gauges_for_this_machine())
    profiler = torch.profiler.profile(activities=profiling.activities()) if spec["profile"] else None
    marks = StepMarks(meter, profiler, steps if profiler is not None else None)
    started = time.perf_counter()
    with observing_trainer_phases(meter):
        train(cfg, reward_weights=[1.0], root=workdir, progress=False, log_path="train_log.csv", export=False,
              hooks=TrainHooks(tracker=marks))
    wall = time.perf_counter() - started
    for gauge in meter.gauges:
        getattr(gauge, "close", lambda: None)()
    metered = list(range(2, 2 + spec["metered_steps"]))
    lengths = prompt_lengths(cfg, spec["assets"]["model_dir"])
    t, g = cfg.train, cfg.generation
    return {
        "recipe": spec["recipe"], "overrides": spec["overrides"],
        "shape": {"per_device_train_batch_size": t.batch.per_device_train_batch_size,
                  "gradient_accumulation_steps": t.batch.gradient_accumulation_steps,
                  "num_generations": t.batch.num_generations,
                  "rows_per_step": t.batch.per_device_train_batch_size
                  * t.batch.gradient_accumulation_steps, "max_prompt_length": cfg.data.max_prompt_length,
                  "max_completion_length": g.max_completion_length, "model_dtype": cfg.model.dtype,
                  "mixed_precision": t.forward.mixed_precision,
                  "gradient_checkpointing": t.forward.gradient_checkpointing,
                  "beta": t.loss.beta, "loss_type": t.loss.loss_type, "generation_backend": g.backend,
                  "cache_implementation": g.cache_implementation},
        "num_parameters": spec["assets"]["num_parameters"],
        "mean_prompt_tokens": sum(lengths) / len(lengths), "max_prompt_tokens": max(lengths),
        "gauges": [gauge.kind for gauge in meter.gauges],
        "steps": meter.steps, "metered_steps": metered, "phases": meter.summary(metered),
        "phase_records": meter.records,
        "profile": None if profiler is None else {"step": steps, "labels": profiling.label_times(profiler),
                                                  "top_operators": profiling.top_operators(profiler,
                                                                                           rows=30)},
        "memory_on_paper_gib": memory_on_paper(cfg, spec["assets"]["model_dir"]),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args(argv)
    result = run(json.loads(Path(a.spec).read_text()))
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
