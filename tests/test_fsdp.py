"""FSDP2 (infra/accelerate/fsdp2.yaml): two CPU processes (gloo, the train stage's CPU launcher) shard the
policy and the reference with torch's fully_shard and train exactly as one unsharded process does on the same
global batch; their checkpoints resume exactly on two processes and on one; the export loads with
from_pretrained; a guard's rollback triggered on one process only acts on both, as on one process.

Tolerances: one process and two sum the same numbers in another order (float32), so losses agree to 1e-4
relative and weights to 1e-3 of how far training moved them; a resume on the same world size is bit-for-bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed_worker import launch
from tests.tiny import make_prompts, make_tiny_model, read_log

REPO = Path(__file__).resolve().parents[1]
FSDP2 = str(REPO / "infra/accelerate/fsdp2.yaml")
RUN = {"max_steps": 4, "save_steps": 2, "beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 2,
       "ref_model_mixup_alpha": 0.5}
SHARDED = {"per_device_train_batch_size": 8, "num_processes": 2, "accelerate_config": FSDP2}
LOGGED = ("loss", "reward", "reward_std", "kl", "entropy", "grad_norm", "completions/mean_length",
          "num_tokens", "learning_rate", "guard/skipped")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 4 steps on one unsharded process (batch 16) and on two sharded ones (8 each);
    checkpoints at 2, 4."""
    d = tmp_path_factory.mktemp("fsdp")
    model, data = make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")
    launch(d / "one", model, data, 1, {"train": RUN})
    launch(d / "two", model, data, 2, {"train": {**RUN, **SHARDED}})
    return d


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def assert_logs_agree(one: Path, two: Path, steps: list[str]) -> None:
    log1, log2 = read_log(one / "metrics/train_log.csv"), read_log(two / "metrics/train_log.csv")
    assert [r["step"] for r in log1] == [r["step"] for r in log2] == steps
    for r1, r2 in zip(log1, log2):
        for key in LOGGED:
            assert float(r2[key]) == pytest.approx(float(r1[key]), rel=1e-4, abs=1e-7), (r1["step"], key)


def assert_weights_agree(file1: Path, file2: Path, base: Path) -> None:
    w1, w2, w0 = load_file(file1), load_file(file2), load_file(base)
    assert w1.keys() == w2.keys()
    for k in w1:
        moved = (w1[k] - w0[k]).abs().max().item()
        assert moved > 0, k  # training moved every weight: the comparison is not of no-ops
        assert (w2[k] - w1[k]).abs().max().item() <= 1e-5 + 1e-3 * moved, k


def test_two_sharded_processes_train_as_one_process(runs):
    assert_logs_agree(runs / "one", runs / "two", ["1", "2", "3", "4"])
    ckpt1, ckpt2 = runs / "one/out/checkpoints/checkpoint-4", runs / "two/out/checkpoints/checkpoint-4"
    base = runs / "model/model.safetensors"
    assert_weights_agree(ckpt1 / "model.safetensors", ckpt2 / "model.safetensors", base)
    # the reference, synced at steps 2 and 4 (TR-DPO), was sharded too and is gathered into the checkpoint
    r1, r2 = load_file(ckpt1 / "reference.safetensors"), load_file(ckpt2 / "reference.safetensors")
    assert r1.keys() == r2.keys() and all(torch.allclose(r1[k], r2[k], atol=1e-5) for k in r1)
    # AdamW's state, gathered from the shards, in the one-process format: same indices, groups and values
    o1, o2 = (torch.load(c / "optimizer.pt", weights_only=True) for c in (ckpt1, ckpt2))
    assert o1["param_groups"] == o2["param_groups"] and o1["state"].keys() == o2["state"].keys()
    for i, s in o1["state"].items():
        assert torch.equal(s["step"], o2["state"][i]["step"])
        assert torch.allclose(s["exp_avg"], o2["state"][i]["exp_avg"], rtol=1e-3, atol=1e-9)
        assert torch.allclose(s["exp_avg_sq"], o2["state"][i]["exp_avg_sq"], rtol=1e-3, atol=1e-12)
    assert json.loads((ckpt2 / "trainer_state.json").read_text())["world_size"] == 2


def test_the_sharded_export_loads_with_from_pretrained(runs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(runs / "two/out/model")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (json.loads((runs / "two/out/model/config.json").read_text())["architectures"]
            == ["Qwen2ForCausalLM"])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert_weights_agree(runs / "one/out/model/model.safetensors", runs / "two/out/model/model.safetensors",
                         runs / "model/model.safetensors")
    final = load_file(runs / "two/out/checkpoints/checkpoint-4/model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in final.items())  # the last step's weights


def resumed_from(runs: Path, name: str, step: int) -> Path:
    root = runs / name
    shutil.copytree(runs / f"two/out/checkpoints/checkpoint-{step}",
                    root / f"out/checkpoints/checkpoint-{step}")
    return root


def test_a_sharded_checkpoint_resumes_exactly_on_two_processes(runs):
    root = resumed_from(runs, "resume-two", 2)
    launch(root, runs / "model", runs / "train.jsonl", 2, {"train": {**RUN, **SHARDED}})
    for name in ("model.safetensors", "reference.safetensors"):
        a, b = (r / "out/checkpoints/checkpoint-4" / name for r in (runs / "two", root))
        assert digest(a) == digest(b), name  # bit for bit: the uninterrupted run's step-4 checkpoint
    uninterrupted = read_log(runs / "two/metrics/train_log.csv")[2:]
    resumed = read_log(root / "metrics/train_log.csv")
    assert [r["step"] for r in resumed] == ["3", "4"]
    assert [[r[k] for k in LOGGED] for r in resumed] == [[r[k] for k in LOGGED] for r in uninterrupted]


def test_a_sharded_checkpoint_resumes_on_one_process(runs):
    """Another world size: the checkpoint holds whole weights and AdamW state in the one-process format."""
    root = resumed_from(runs, "resume-one", 2)
    launch(root, runs / "model", runs / "train.jsonl", 1, {"train": RUN})
    assert_weights_agree(runs / "two/out/checkpoints/checkpoint-4/model.safetensors",
                         root / "out/checkpoints/checkpoint-4/model.safetensors",
                         runs / "model/model.safetensors")
    resumed = read_log(root / "metrics/train_log.csv")
    assert [r["step"] for r in resumed] == ["3", "4"]
    for r1, r2 in zip(read_log(runs / "two/metrics/train_log.csv")[2:], resumed):
        for key in LOGGED:
            assert float(r2[key]) == pytest.approx(float(r1[key]), rel=1e-4, abs=1e-7), (r1["step"], key)


def test_a_nan_on_one_process_rolls_both_back_as_one_process_would(runs):
    """Rank 0's loss of step 3 is NaN, rank 1's is not: both skip the micro-batch, the nonfinite guard rolls
    both back to checkpoint-2 with the learning rate halved, and the log and weights match one process's
    run."""
    spec = {"guards": {"nonfinite": {"action": "rollback"}, "rollback_lr_factor": 0.5, "max_rollbacks": 1},
            "nan_loss_at": [3]}
    launch(runs / "guard-one", runs / "model", runs / "train.jsonl", 1, {**spec, "train": RUN})
    launch(runs / "guard-two", runs / "model", runs / "train.jsonl", 2, {**spec, "train": {**RUN, **SHARDED}})
    assert_logs_agree(runs / "guard-one", runs / "guard-two", ["1", "2", "3", "4"])
    lrs = [float(r["learning_rate"]) for r in read_log(runs / "guard-two/metrics/train_log.csv")]
    assert lrs == [1e-2, 1e-2, 5e-3, 5e-3]
    state = json.loads((runs / "guard-two/out/checkpoints/checkpoint-4/trainer_state.json").read_text())
    assert state["rollbacks"] == 1
    assert_weights_agree(runs / "guard-one/out/model/model.safetensors",
                         runs / "guard-two/out/model/model.safetensors", runs / "model/model.safetensors")


SHARDED_FORWARD = """
import os, sys, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from grpo_core.model.fastforward import use_manual_forward
from grpo_core.model.logprobs import token_logprobs_and_entropy
from grpo_core.model.sharding import FSDPSettings, is_sharded, shard_model
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
plain = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
sharded = shard_model(AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32), FSDPSettings())
assert is_sharded(sharded) and not is_sharded(plain)
assert use_manual_forward(plain, "auto") and not use_manual_forward(sharded, "auto")
ids = torch.randint(5, 400, (3, 12)); mask = torch.ones_like(ids); mask[0, :4] = 0
want, _ = token_logprobs_and_entropy(plain, ids, mask, logits_to_keep=5)
got, _ = token_logprobs_and_entropy(sharded, ids, mask, logits_to_keep=5)  # auto forward: HF's, \
fused head inside it
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_a_sharded_model_is_scored_through_its_own_forward(runs):
    """The hand-written forward reaches into submodules and would skip the root's weight gathering: a sharded
    model is refused by it and scored through its own forward (the fused LM head scoring inside it), to the
    same log-probs."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", SHARDED_FORWARD, str(runs / "model"), str(port)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


def test_a_sharded_policy_feeds_each_process_engine_one_parameter_at_a_time(tmp_path):
    """generation.backend vllm under FSDP2: no whole copy of the policy besides each process's engine; after
    every optimizer step the shards are gathered (one parameter at a time) into both engines, so after the
    last step each engine scores fixed completions exactly as the exported policy does (float32 engine, 1e-4:
    see tests/test_vllm_engine.py), and unlike the base."""
    from tests.distributed_worker import FIXED
    from tests.tiny import require_vllm

    require_vllm()
    from transformers import AutoModelForCausalLM

    # head size 32: one vLLM's CPU attention runs
    model = make_tiny_model(tmp_path / "model", hidden_size=64, heads=2)
    data = make_prompts(tmp_path / "train.jsonl")
    steps = 2
    launch(tmp_path / "run", model, data, 2, {"engine": True, "train": {**SHARDED, "max_steps": steps}})

    @torch.no_grad()
    def logps(folder: Path) -> torch.Tensor:
        policy = AutoModelForCausalLM.from_pretrained(folder).eval()
        rows = []
        for prompt, completion in FIXED:
            logits = policy(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
            rows.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0])
        return torch.stack(rows)

    trained, base = logps(tmp_path / "run/out/model"), logps(model)
    for rank in (0, 1):
        engine = json.loads((tmp_path / f"run/engine-rank{rank}.json").read_text())
        assert engine["loads"] == 1 + steps  # set-up, then after each optimizer step
        got = torch.tensor(engine["logps"])
        assert (got - trained).abs().max().item() < 1e-4
        assert (got - base).abs().max().item() > 1e-2  # training moved the policy: the check can fail
