"""Scale-out: two CPU processes (gloo, the train stage's CPU launcher) train with DDP exactly as one process does on
the same global batch — the same loss, metrics and weights after each update. FSDP2: tests/test_fsdp.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flows.stages.train import launch_command
from tests.tiny import make_prompts, make_tiny_model, read_log

REPO = Path(__file__).resolve().parents[1]


def run_worker(launcher: list[str], out: Path, model: Path, data: Path, batch: int, loss_type: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    spec = {"train": {"per_device_train_batch_size": batch, "loss_type": loss_type}}
    cmd = [*launcher, "-m", "tests.distributed_worker", str(out), str(model), str(data), json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_gloo_processes_match_one_process_on_the_same_global_batch(assets, tmp_path, loss_type):
    model, data = assets
    one, two = tmp_path / "one", tmp_path / "two"
    run_worker([sys.executable], one, model, data, 16, loss_type)
    # the launcher the train stage uses without GPUs (accelerate's own multi-CPU launch needs mpirun)
    run_worker(launch_command(2, cuda=False), two, model, data, 8, loss_type)

    log1, log2 = read_log(one / "metrics/train_log.csv"), read_log(two / "metrics/train_log.csv")
    assert [r["step"] for r in log1] == [r["step"] for r in log2] == ["1", "2"]
    for r1, r2 in zip(log1, log2):
        for key in ("loss", "reward", "reward_std", "kl", "entropy", "grad_norm", "completions/mean_length",
                    "num_tokens"):
            assert float(r2[key]) == pytest.approx(float(r1[key]), rel=1e-4, abs=1e-7), (r1["step"], key)
    assert float(log1[-1]["kl"]) > 0  # the updates moved the policy: the comparison is not of no-ops

    w1, w2 = load_file(one / "out/model/model.safetensors"), load_file(two / "out/model/model.safetensors")
    base = load_file(model / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        moved = (w1[k] - base[k]).abs().max().item()
        assert (w2[k] - w1[k]).abs().max().item() <= 1e-5 + 1e-3 * moved, k


def test_launch_command_per_device_kind(tmp_path):
    cpu = launch_command(4, cuda=False)
    assert cpu[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]
    gpu = launch_command(8, cuda=True, accelerate_config=REPO / "infra/accelerate/fsdp2.yaml")
    assert gpu[1:] == ["-m", "accelerate.commands.launch", "--num_processes", "8", "--config_file",
                       str(REPO / "infra/accelerate/fsdp2.yaml")]
    assert launch_command(2, cuda=True)[-1] == "--multi_gpu"


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "deepspeed-zero3"])
def test_infra_accelerate_configs_load_as_accelerate_configs(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(REPO / f"infra/accelerate/{name}.yaml"))
    assert cfg.distributed_type.value == {"ddp": "MULTI_GPU", "fsdp2": "FSDP", "deepspeed-zero3": "DEEPSPEED"}[name]
    if name == "fsdp2":
        assert cfg.fsdp_config["fsdp_version"] == 2
    if name == "deepspeed-zero3":
        assert cfg.deepspeed_config["zero_stage"] == 3
