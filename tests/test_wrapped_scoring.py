"""The fused LM head (``train.fused_lm_head``) under every wrapper the trainer scores through: the model's own
forward runs (accelerate's autocast wrapper, DDP's reducer, FSDP2's unsharding, the LoRA reference's adapters
off) and its LM head scores chunk by chunk inside it, so the (B, K, V) logits never exist; the numbers are the
full-logits path's.

Tolerances: float32, log-probs, entropies and gradients (of a loss on both) within 1e-5 of the full-logits
path (measured: log-probs and entropies equal, gradients within 4.8e-7, the chunks summing the head's gradient
in another order). bf16 (accelerate's autocast; FSDP2's MixedPrecisionPolicy) against the full-logits path
under the same bf16: log-probs and entropies within 1e-2 (measured: equal, each chunk's bf16 logits are the
full matmul's rows), gradients within 1.5% of the largest gradient (measured: 0.39% to 0.54%, one bf16
rounding of 2^-8: the full path rounds the head's weight gradient once over all rows, the fused one once per
chunk).

tests/scoring_parity.py runs the cases and prints these numbers (its docstring has the commands).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scoring_parity import VOCAB

REPO = Path(__file__).resolve().parents[1]
BF16 = "bf16"


def run_cases(out: Path, processes: int) -> dict[str, dict]:
    from flows.stages.launch import launch_command

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    launcher = launch_command(processes) if processes > 1 else [sys.executable]
    cmd = [*launcher, "-m", "tests.scoring_parity", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = [json.loads((out / f"scoring-rank{r}.json").read_text()) for r in range(processes)]
    assert all(len(r) == len(ranks[0]) for r in ranks)
    return {f"{case['case']}@rank{rank}": case for rank, cases in enumerate(ranks) for case in cases}


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, dict]:
    d = tmp_path_factory.mktemp("scoring")
    return {**run_cases(d / "one", 1), **run_cases(d / "two", 2)}


EXPECTED = ["plain", "plain-tied", "autocast-bf16", "lora-policy", "lora-reference",
            "lora-reference-autocast-bf16", "ddp", "ddp-tied", "ddp-autocast-bf16", "fsdp2", "fsdp2-tied",
            "fsdp2-tied-bf16", "fsdp2-tied-keep-gathered"]


def test_every_wrapper_is_run(cases):
    names = {key.split("@")[0] for key in cases}
    assert names == set(EXPECTED)
    assert {key.split("@")[1] for key in cases if key.startswith(("ddp", "fsdp2"))} == {"rank0", "rank1"}


@pytest.mark.parametrize("name", EXPECTED)
def test_the_lm_head_scores_inside_the_wrapped_forward(cases, name):
    """The spy: on the fused path the head returned (B, K, 1 or 2) scores, never the vocabulary; on the logits
    path it returned the (B, K + 1, V) logits (so the comparison below is of two different computations)."""
    for key, case in cases.items():
        if key.split("@")[0] == name:
            assert case["head_output_last_dim"] == {"fused": [1, 2], "full": [VOCAB]}, key


@pytest.mark.parametrize("name", EXPECTED)
def test_log_probs_entropies_and_gradients_match_the_full_logits(cases, name):
    for key, case in cases.items():
        if key.split("@")[0] != name:
            continue
        half = BF16 in name
        assert case["logps_dtype"] == "torch.float32"
        for field in ("logps", "entropy", "frozen_logps"):
            assert case[field] <= (1e-2 if half else 1e-5), (key, field, case[field])
        if "reference" in name:  # the LoRA reference: frozen base, adapters off, nothing to differentiate
            assert case["grads"] is None
            continue
        assert case["grad_scale"] > 0.1  # the loss moves the parameters: the comparison is not of zeros
        assert case["grads"] <= (1.5e-2 * case["grad_scale"] if half else 1e-5), (key, case["grads"])


def test_the_recipes_log_prob_passes_never_hold_the_logits(tmp_path):
    """Peak RSS of one step's log-prob passes as the GSM8K recipe runs them (the policy under accelerate's
    bf16 autocast wrapper, forward and backward; the bf16 reference without gradient) on a tiny body with a
    65,536-token vocabulary, 4 completions x 1,024 tokens: one float32 copy of the logits would be 1.0 GiB and
    the full-logits path holds several (measured: 2.3 GiB above the process before the passes); the fused head
    holds one chunk of 256 rows (measured: 0.38 GiB). Vocabulary 65,536 rather than 32,000: a 256-row chunk of
    float32 logits is then over glibc's 32 MiB mmap ceiling and goes back to the system when freed; at
    32,000 it lands in the heap and how much of it the heap keeps varies from run to run.
    benchmarks/logits_memory.py measures the full shape."""
    from benchmarks.logits_memory import measure

    spec = {"mode": "passes", "vocab": 65_536, "rows": 4, "tokens": 1024, "hidden": 64, "layers": 1,
            "mixed_precision": "bf16", "threads": 2, "fused": True}
    result = measure(spec)
    assert "error" not in result, result.get("error")
    one_float32_logits = 4 * 1025 * 65_536 * 4 / 2**30
    assert result["peak_rss_gib"] - result["rss_before_passes_gib"] < 0.75 * one_float32_logits, result
