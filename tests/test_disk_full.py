"""A full disk is a transient fault: the error names the path and its free space, the stage exits 1 (the flow
retries it), what was written before stays valid, and the run resumes once there is room again.

The real case mounts a tmpfs a little larger than one checkpoint (root only: CI runs as root), so the second
checkpoint's write fills it.
"""

from __future__ import annotations

import errno
import gc
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from grpo_core.common.errors import EXIT_ERROR, TransientFailure, disk_full, exit_code_for
from grpo_core.train.checkpoint import checkpoint_problem, list_checkpoints
from grpo_core.train.loop import train
from tests.tiny import make_prompts, make_tiny_model, read_log, tiny_config

DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]


def test_enospc_anywhere_in_the_chain_names_the_path_and_the_free_space(tmp_path):
    # never created: the free space is its nearest existing folder's
    target = tmp_path / "out" / "optimizer.pt"
    cause = OSError(errno.ENOSPC, "No space left on device", str(target))
    try:
        try:
            raise cause
        except OSError as err:
            raise RuntimeError("basic_ios::clear: iostream error") from err
    except RuntimeError as wrapped:
        full = disk_full(wrapped)
    assert isinstance(full, TransientFailure) and exit_code_for(full) == EXIT_ERROR
    free = shutil.disk_usage(tmp_path).free / 2**20
    assert f"disk full writing {target} ({free:.1f} MiB free on its filesystem)" in str(full)
    assert "run the stage again: training resumes from its last complete checkpoint" in str(full)


def test_other_errors_on_a_roomy_disk_are_not_disk_full(tmp_path):
    assert disk_full(RuntimeError("a bug"), tmp_path) is None
    assert disk_full(OSError(errno.EACCES, "Permission denied", str(tmp_path))) is None
    assert disk_full(ValueError("no path")) is None


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) a tmpfs at tmp_path/small, remount(size) resizes it; unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    where = tmp_path / "small"
    where.mkdir()
    mounted = []

    def mount(size_kib: int, remount: bool = False) -> Path:
        options = f"{'remount,' if remount else ''}size={size_kib}k"
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
        mounted.append(True)
        return where

    yield mount
    # the failed torch.save's file handle lives in the exception's frames until they are collected
    gc.collect()
    if mounted:
        subprocess.run(["umount", str(where)], check=False)


def test_a_checkpoint_that_fills_the_disk_keeps_the_last_one_and_resumes_once_there_is_room(tmp_path,
                                                                                            small_disk):
    model_dir = make_tiny_model(tmp_path / "model")
    data = make_prompts(tmp_path / "train.jsonl")
    cfg = tiny_config(model_dir, data, DIGITS, max_steps=3, save_steps=1)
    sized = train(tiny_config(model_dir, data, DIGITS, max_steps=1, save_steps=1), root=tmp_path / "sizing",
                  progress=False)
    one = sum(p.stat().st_size for p in (sized.checkpoint_dir / "checkpoint-1").rglob("*") if p.is_file())
    root = small_disk(int(one * 1.5) // 1024)  # room for checkpoint-1, not for checkpoint-2 beside it

    with pytest.raises(TransientFailure, match=r"disk full writing \S+/checkpoints/checkpoint-2 \(\d+\.\d "
                                               r"MiB free on its filesystem\)") as info:
        train(cfg, root=root, progress=False)
    assert exit_code_for(info.value) == EXIT_ERROR
    checkpoints = root / cfg.train.checkpoints.output_dir / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["checkpoint-1"]
    assert checkpoint_problem(checkpoints / "checkpoint-1") is None  # the previous checkpoint stays valid
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-1"]  # the partial write is gone

    small_disk(int(one * 4) // 1024, remount=True)  # room again
    result = train(cfg, root=root, progress=False)
    assert [row["step"] for row in read_log(result.log_path)] == ["1", "2", "3"]
    assert checkpoint_problem(checkpoints / "checkpoint-3") is None
