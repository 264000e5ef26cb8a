"""Checkpoints are complete or absent; RNG state round-trips;
a SIGKILL mid-write leaves the last one valid."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_core.common.rng import restore_rngs, rng_state, set_rng_state
from grpo_core.train.checkpoint import (
    MANIFEST_FILE,
    CheckpointContents,
    CheckpointError,
    checkpoint_problem,
    latest_checkpoint,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_stale_temp_dirs,
    save_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)

    def save_pretrained(self, path, safe_serialization=True):
        from safetensors.torch import save_file
        save_file(self.state_dict(), Path(path) / "model.safetensors")


class _Tok:
    def save_pretrained(self, path):
        (Path(path) / "tokenizer.json").write_text("{}")


def _save(directory: Path, step: int, keep_last: int | None = None, **contents) -> Path:
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    state = {"params_hash": "abc", "sampler": {"epoch": 0, "position": 3}}
    contents = CheckpointContents(model=model, tokenizer=_Tok(), optimizer_state=opt.state_dict(),
                                  scheduler=sched, state=state, **contents)
    return save_checkpoint(directory, step, contents, keep_last=keep_last)


def test_rng_state_round_trips_every_generator():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def states_of_two_processes() -> tuple[list[dict], list[tuple]]:
    """Two processes' RNG states (seeds 10 and 11) and what each draws next."""
    states, expected = [], []
    for seed in (10, 11):
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        states.append(rng_state())
        expected.append(draws())
    return states, expected


def test_each_process_restores_its_own_rng_states():
    states, expected = states_of_two_processes()
    for rank in (1, 0):  # 2 processes -> 2, and -> 1 (rank 0 only)
        torch.manual_seed(99)
        assert restore_rngs(states, rank, seed=0, step=2) is True
        assert draws() == expected[rank]
    assert expected[0] != expected[1]


def test_a_process_the_checkpoint_has_no_state_for_is_seeded_from_seed_step_and_rank():
    states, expected = states_of_two_processes()
    got = {}
    # resuming on more processes than saved the checkpoint
    for rank, step in ((2, 4), (3, 4), (2, 6), (2, 4)):
        torch.manual_seed(99)
        assert restore_rngs(states, rank, seed=0, step=step) is False
        got.setdefault((rank, step), []).append(draws())
    assert got[(2, 4)][0] == got[(2, 4)][1]  # the same resume twice samples the same
    streams = [got[(2, 4)][0], got[(3, 4)][0], got[(2, 6)][0], *expected]
    assert len(set(streams)) == len(streams)  # no two ranks (or steps) share a stream
    restore_rngs(states[0], 1, seed=0, step=2)  # a checkpoint of one dict (before per-process states): rank
                                                # 0's
    a = draws()
    restore_rngs(states[0], 0, seed=0, step=2)
    assert draws() == expected[0] != a


def test_optimizer_and_scheduler_load_onto_the_device_asked_for(tmp_path):
    """Not where they were saved: every rank of an 8-GPU resume would otherwise load onto GPU 0 (meta stands
    in for a GPU here: torch.load maps onto it without one)."""
    _save(tmp_path, 1, rollout_buffer={"advantages": torch.tensor([0.5, -0.5])})
    ck = load_checkpoint(tmp_path / "checkpoint-1", device="meta")
    moments = [t for s in ck.optimizer["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert moments and all(t.device.type == "meta" for t in moments)
    assert ck.rollout_buffer["advantages"].device.type == "cpu"  # samples stay on the CPU
    assert load_checkpoint(tmp_path / "checkpoint-1").optimizer["state"][0]["exp_avg"].device.type == "cpu"


def test_save_load_prune_and_hash_check(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]
    ck = load_checkpoint(latest_checkpoint(tmp_path), expected_hash="abc")
    assert ck.state["step"] == 3 and ck.state["sampler"]["position"] == 3
    assert ck.optimizer["state"]  # Adam moments came back through torch.load(weights_only=True)
    assert ck.rollout_buffer is None
    with pytest.raises(CheckpointError, match="different training params"):
        load_checkpoint(latest_checkpoint(tmp_path), expected_hash="xyz")


def test_partial_directories_never_count(tmp_path):
    _save(tmp_path, 5)
    (tmp_path / "checkpoint-9.tmp-1234").mkdir()  # an interrupted write
    (tmp_path / "checkpoint-7").mkdir()           # a directory without its state file
    assert latest_checkpoint(tmp_path).name == "checkpoint-5"
    assert remove_stale_temp_dirs(tmp_path) == 1
    assert not (tmp_path / "checkpoint-9.tmp-1234").exists()


def test_rollout_buffer_round_trips(tmp_path):
    buffer = {"advantages": torch.tensor([0.5, -0.5]), "completion_ids": torch.tensor([[1, 2], [3, 4]])}
    _save(tmp_path, 1, rollout_buffer=buffer)
    ck = load_checkpoint(tmp_path / "checkpoint-1")
    assert torch.equal(ck.rollout_buffer["completion_ids"], buffer["completion_ids"])


KILL_DURING_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, sys.argv[2])
from tests.test_checkpoint import _save
real_save = torch.save
def dying_save(obj, f, *a, **k):
    real_save(obj, f, *a, **k)
    if str(f).endswith("optimizer.pt"):
        os.kill(os.getpid(), signal.SIGKILL)   # half-way through checkpoint-2
torch.save = dying_save
_save(__import__("pathlib").Path(sys.argv[1]), 2)
"""


def test_sigkill_during_a_checkpoint_write_leaves_the_previous_one_valid(tmp_path):
    _save(tmp_path, 1)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, str(tmp_path), str(REPO)], env=env)
    assert proc.returncode == -9
    assert any(".tmp-" in p.name for p in tmp_path.iterdir())  # the write really was cut off
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "checkpoint-1"
    assert load_checkpoint(latest, expected_hash="abc").state["step"] == 1


# ---------------------------------------------------------------------------------------------------
# manifests: what resume verifies


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    import hashlib
    import json

    path = _save(tmp_path, 1)
    files = json.loads((path / MANIFEST_FILE).read_text())["files"]
    on_disk = sorted(p.name for p in path.iterdir() if p.name != MANIFEST_FILE)
    assert (sorted(files) == on_disk
            and {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(files))
    for name, entry in files.items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoint_problem(path) is None


def _halve(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _flip_tensor_bytes(file: Path) -> None:
    """Flip bytes inside the tensor data (past safetensors' JSON header): the file still loads,
    with other values."""
    data = bytearray(file.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, file, message", [
    (_halve, "optimizer.pt", r"optimizer.pt has \d+ bytes, the manifest says \d+ \(truncated"),
    (_flip_tensor_bytes, "model.safetensors", r"model.safetensors: its sha256 differs from the manifest's"),
    (Path.unlink, "scheduler.pt", r"scheduler.pt is missing \(the manifest lists it\)"),
])
def test_resume_skips_a_corrupt_newest_checkpoint_naming_the_file(tmp_path, damage, file, message):
    """The newest checkpoint damaged, two intact ones beside it - resume takes the newest intact
    one and the warning names the damaged file. Byte flips in tensor data load silently without the
    manifest."""
    from safetensors.torch import load_file

    for step in (4, 8, 12):
        _save(tmp_path, step)
    damage(tmp_path / "checkpoint-12" / file)
    if file == "model.safetensors":
        load_file(tmp_path / "checkpoint-12" / file)  # still loads: only the manifest tells
    warnings = []
    assert latest_valid_checkpoint(tmp_path, warn=warnings.append).name == "checkpoint-8"
    assert len(warnings) == 1 and "checkpoint-12 is corrupt, skipped" in warnings[0]
    assert re.search(message, warnings[0])


def test_no_valid_checkpoint_is_an_error_naming_each(tmp_path):
    for step in (4, 8):
        _save(tmp_path, step)
    _halve(tmp_path / "checkpoint-4" / "optimizer.pt")
    (tmp_path / "checkpoint-8" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no valid checkpoint to resume from: "
                                              r".*checkpoint-8/model.safetensors is "
                                              r"missing.*checkpoint-4/optimizer.pt has") as err:
        latest_valid_checkpoint(tmp_path, warn=lambda msg: None)
    assert err.value.exit_code == 4
    assert latest_valid_checkpoint(tmp_path / "empty") is None


def test_a_checkpoint_without_a_manifest_is_not_trusted(tmp_path):
    """The manifest is written last: without it the folder may be a cut-off write or a half-deleted one."""
    _save(tmp_path, 3)
    (tmp_path / "checkpoint-3" / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError,
                       match=r"checkpoint-3/manifest.json is missing, so its files cannot be verified"):
        latest_valid_checkpoint(tmp_path, warn=lambda msg: None)
