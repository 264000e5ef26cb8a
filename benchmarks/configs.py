"""The benchmark configurations: the same GRPO work, described once, run by both trainers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Qwen2.5-0.5B's architecture (its config.json), written out so no hub access is needed.
QWEN25_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}


@dataclass(frozen=True)
class BenchConfig:
    name: str
    model: str                  # "embedded" (params.yaml `embedded:` sizes) | "qwen2.5-0.5b" (random weights)
    num_prompts: int            # prompts per optimizer step
    num_generations: int        # G
    max_completion_length: int
    beta: float = 0.04
    num_iterations: int = 1
    loss_type: str = "dapo"
    dtype: str = "float32"          # weights' dtype, both sides
    mixed_precision: str = "no"     # ours: accelerate mixed precision; TRL: bf16=True when "bf16"
    steps: int = 6                  # optimizer steps per run; the first is the warm-up, not measured
    repeats: int = 2                # runs per side, alternating ours/TRL
    seed: int = 0
    learning_rate: float = 1e-6
    temperature: float = 1.0
    max_prompt_length: int = 64
    device: str = "cpu"             # where the config is meant to run ("cpu" | "cuda")
    embedded_overrides: dict[str, Any] = field(default_factory=dict)  # sizes for tests (--tiny)
    threads: int | None = None      # torch threads in each side (None = torch's default)

    @property
    def batch_size(self) -> int:
        """Completions per optimizer step (= per_device_train_batch_size, one micro-batch)."""
        return self.num_prompts * self.num_generations

    def replace(self, **changes) -> BenchConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CONFIGS = {
    "cpu-tiny": BenchConfig(name="cpu-tiny", model="embedded", num_prompts=4, num_generations=8,
                            max_completion_length=32, beta=0.04, dtype="float32", steps=6, repeats=3,
                            # a 0.4M-parameter model gains nothing from a 2nd thread on a busy box
                            threads=1),
    # The GSM8K recipe's precision (float32 masters, bf16 compute, TF32; TRL: float32 weights, bf16=True,
    # tf32): 10 measured steps x 3 runs a side, as the GPU kit runs it (benchmarks/gpu_kit.py, part d).
    "gpu-0.5b": BenchConfig(name="gpu-0.5b", model="qwen2.5-0.5b", num_prompts=8, num_generations=8,
                            max_completion_length=256, beta=0.04, dtype="bfloat16", mixed_precision="bf16",
                            steps=11, repeats=3, device="cuda"),
}

# Sizes for the test that keeps the harness from rotting (tests/test_benchmarks.py).
TINY_SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
