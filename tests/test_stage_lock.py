"""One writer at a time: a second stage process in the same repo is refused naming the holder; a killed
holder's lock is free at once; launched ranks and other machines run under their launcher's lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.stages.common import RANK_EXITS_ENV, StageBusy, is_launched_child, stage_lock, stage_lock_path
from grpo_core.common.errors import EXIT_ERROR

REPO = Path(__file__).resolve().parents[1]
HOLD = """
import sys, time
from pathlib import Path
from flows.stages.common import stage_lock
with stage_lock(Path(sys.argv[1]), "train"):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture()
def repo(tmp_path, monkeypatch):
    return stage_repo(tmp_path, monkeypatch)


def stage_repo(tmp_path: Path, monkeypatch) -> Path:
    """A repo the convert stage runs in (a model folder: nothing to convert, a second's work), with no rank
    variables set."""
    (tmp_path / ".dvc").mkdir()
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    for key in ("WORLD_SIZE", "LOCAL_RANK", "MACHINE_RANK", RANK_EXITS_ENV):
        monkeypatch.delenv(key, raising=False)
    return tmp_path


def hold_lock(root: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_stage_is_refused_naming_the_holder_and_a_killed_holder_frees_the_lock(repo, capsys):
    from flows.stages.__main__ import main

    holder = hold_lock(repo)
    try:
        assert main(["convert"]) == EXIT_ERROR
        err = capsys.readouterr().err
        assert f"convert failed: StageBusy: convert: `train` (PID {holder.pid}, since " in err
        # a known condition, said plainly
        assert "Wait for it to end, or stop it." in err and "Traceback" not in err
        assert not (repo / "artifacts/converted_model").exists()  # refused before it wrote anything
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert stage_lock_path(repo).exists()  # the dead holder's file is still there ...
    assert main(["convert"]) == 0         # ... and its lock was the kernel's: free once the process died
    assert (repo / "artifacts/converted_model").is_dir()
    assert json.loads(stage_lock_path(repo).with_suffix(".holder").read_text())["stage"] == "convert"


def test_the_lock_is_released_when_the_stage_ends_or_fails(repo):
    with pytest.raises(RuntimeError, match="boom"), stage_lock(repo, "train"):
        raise RuntimeError("boom")
    with stage_lock(repo, "evaluate"), pytest.raises(StageBusy, match="`evaluate` \\(PID"):
        with stage_lock(repo, "train"):
            pass
    start = time.monotonic()
    with stage_lock(repo, "train"):
        pass
    assert time.monotonic() - start < 1


def test_launched_ranks_and_other_machines_do_not_take_the_lock():
    assert not is_launched_child({})
    # rank variables alone do not skip it; machine 1 locks its own (tests/test_fault_items.py)
    assert not is_launched_child({"WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert not is_launched_child({"WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert not is_launched_child({"MACHINE_RANK": "1"})
    assert not is_launched_child({"MACHINE_RANK": "0"})
