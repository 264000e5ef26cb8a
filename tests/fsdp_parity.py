"""The numbers behind tests/test_fsdp.py, printed: how far two sharded CPU processes (FSDP2, gloo) land from
one unsharded process on the same global batch, and the digests of resumed runs.

    .venv/bin/python -m tests.fsdp_parity [WORK_DIR]

Runs the 4-step tiny recipe of tests/test_fsdp.py as: one process; two sharded processes; two processes
resumed from the sharded checkpoint-2; one process resumed from it. Prints the largest differences of the
logged metrics, weights and AdamW state, and the sha256 (first 16 hex) of each run's step-4 weights.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.distributed_worker import launch
from tests.test_fsdp import LOGGED, RUN, SHARDED
from tests.tiny import make_prompts, make_tiny_model, read_log


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def main(work: Path) -> None:
    model, data = make_tiny_model(work / "model"), make_prompts(work / "train.jsonl")
    launch(work / "one", model, data, 1, {"train": RUN})
    launch(work / "two", model, data, 2, {"train": {**RUN, **SHARDED}})
    for name, processes, extra in (("resume-two", 2, SHARDED), ("resume-one", 1, {})):
        shutil.copytree(work / "two/out/checkpoints/checkpoint-2",
                        work / name / "out/checkpoints/checkpoint-2")
        launch(work / name, model, data, processes, {"train": {**RUN, **extra}})

    log1, log2 = read_log(work / "one/metrics/train_log.csv"), read_log(work / "two/metrics/train_log.csv")
    print("1 vs 2 processes, largest relative difference over 4 steps:")
    for key in LOGGED:
        diffs = [abs(float(a[key]) - float(b[key])) / max(abs(float(a[key])), 1e-12)
                 for a, b in zip(log1, log2)]
        print(f"  {key:24s} {max(diffs):.2e}")
    base = load_file(model / "model.safetensors")
    c1, c2 = (work / r / "out/checkpoints/checkpoint-4" for r in ("one", "two"))
    w1, w2 = load_file(c1 / "model.safetensors"), load_file(c2 / "model.safetensors")
    print(f"  weights after 4 steps: max |diff| {max_diff(w1, w2):.2e} (training moved them by up to "
          f"{max_diff(w1, base):.2e})")
    o1, o2 = (torch.load(c / "optimizer.pt", weights_only=True)["state"] for c in (c1, c2))
    for field in ("exp_avg", "exp_avg_sq"):
        print(f"  AdamW {field:10s}: max |diff| "
              f"{max(max_diff({0: o1[i][field]}, {0: o2[i][field]}) for i in o1):.2e}")
    print("step-4 weights, sha256:")
    for run in ("one", "two", "resume-two", "resume-one"):
        print(f"  {run:10s} {sha(work / run / 'out/checkpoints/checkpoint-4/model.safetensors')}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="fsdp-parity-")))
