"""model.cpu_kernels: every stage caps torch's CPU kernels (ATen, oneDNN, MKL) at one instruction set before
its first tensor op, so one run gives the same bytes on every CPU that has that set. Each check runs in a
process of its own: ATen fixes its level at its first dispatch."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
PIN = """
import json, os, sys
from grpo_core.model.cpu_kernels import pin_cpu_kernels
if sys.argv[2] == "op first":
    import torch
    torch.ones(64).sum()
running = pin_cpu_kernels(sys.argv[1])
print(json.dumps({"running": running, **{k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", \
"ONEDNN_MAX_CPU_ISA",
                                                                        "MKL_CBWR")}}))
"""
PIN_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")
needs_avx2 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="an x86-64 CPU with AVX2 (the level the checks compare against)")


def unpinned_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PIN_VARS}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def pinned(level: str, order: str = "pin first") -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", PIN, level, order], capture_output=True, text=True,
                          env=unpinned_env(), check=True)
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@needs_avx2
def test_a_level_sets_all_three_libraries_and_aten_runs_at_it():
    assert pinned("scalar")[0] == {"running": "default", "ATEN_CPU_CAPABILITY": "default",
                                   "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE"}
    assert pinned("avx2")[0] == {"running": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                                 "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}
    assert pinned("native")[0] == {"running": None, "ATEN_CPU_CAPABILITY": None, "ONEDNN_MAX_CPU_ISA": None,
                                   "MKL_CBWR": None}


@needs_avx2
def test_a_pin_after_the_first_tensor_op_is_named_not_silent():
    result, err = pinned("scalar", "op first")
    assert result["running"] in ("avx2", "avx512")  # ATen had already chosen the CPU's own level
    assert "model.cpu_kernels: scalar asked, torch's CPU kernels run at avx" in err


def test_an_unknown_level_names_the_key_and_the_choices():
    from grpo_core.config import ConfigError, config_from_dict
    from grpo_core.model.cpu_kernels import pin_cpu_kernels

    with pytest.raises(ValueError,
                       match="model.cpu_kernels: 'avx3' is not one of native, avx2, avx512, scalar"):
        pin_cpu_kernels("avx3")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    with pytest.raises(ConfigError, match="model.cpu_kernels"):
        config_from_dict(raw, {"model.cpu_kernels": "avx3"})


def prepare_bytes(tmp_path: Path, name: str, level: str, **env: str) -> str:
    """The sha256 of the base model a tiny `prepare` stage writes with model.cpu_kernels = ``level``."""
    repo = tmp_path / name
    (repo / ".dvc").mkdir(parents=True)
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["embedded"].update(num_train=40, num_eval=8, hidden_size=32, num_hidden_layers=1,
                           intermediate_size=64, warm_start_steps=20, warm_start_batch_size=8)
    raw["model"]["cpu_kernels"] = level
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    subprocess.run([sys.executable, "-m", "flows.stages", "prepare"], cwd=repo, check=True,
                   capture_output=True,
                   env=unpinned_env(MLFLOW_TRACKING_URI=f"sqlite:///{repo / 'mlflow.db'}", **env))
    return hashlib.sha256((repo / "artifacts/base_model/model.safetensors").read_bytes()).hexdigest()


@needs_avx2
def test_the_stage_pins_before_its_first_op_and_the_pin_decides_the_bytes(tmp_path):
    """`scalar` through params.yaml gives the bytes of a native run whose environment a user capped by hand
    (so the stage pinned before any kernel ran), and other bytes than the CPU's own level (so the pin took
    effect)."""
    by_param = prepare_bytes(tmp_path, "param", "scalar")
    by_hand = prepare_bytes(tmp_path, "hand", "native", ATEN_CPU_CAPABILITY="default",
                            ONEDNN_MAX_CPU_ISA="SSE41", MKL_CBWR="COMPATIBLE")
    native = prepare_bytes(tmp_path, "native", "native")
    assert by_param == by_hand
    assert native != by_param
    assert prepare_bytes(tmp_path, "avx2",
                         "avx2") == (native if torch.backends.cpu.get_cpu_capability() == "AVX2"
                                     else prepare_bytes(tmp_path, "hand2", "native",
                                                        ATEN_CPU_CAPABILITY="avx2",
                                                        ONEDNN_MAX_CPU_ISA="AVX2", MKL_CBWR="AVX2"))
