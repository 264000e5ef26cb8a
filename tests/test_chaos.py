"""Chaos: one training run under `dvc repro` is SIGKILLed (its whole process group) at 5 points - while a
checkpoint is being written, and at seeded random moments after a step's log row (sampling, the update, the
held-out evaluation the run does every 3 steps) - and `dvc repro` is run again after each kill. The run that
ends has the weights of an uninterrupted run, byte for byte, and the same train log (every column but the
wall-clock ones, `*_time` and `eval/runtime`), each step once.

The recipe is the embedded default as params.yaml ships it (async rollouts on), scaled down
(tests/test_pipeline.py TINY), with a checkpoint every step and evaluation during training.
"""

from __future__ import annotations

import csv
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.test_pipeline import DVC, built_pipeline, copy_repo, dvc, pipeline_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    return built_pipeline(tmp_path_factory)

MAX_STEPS = 24
CHANGES = {"max_steps": MAX_STEPS, "save_steps": 1, "eval_strategy": "steps", "eval_steps": 3}
# A model big enough that a checkpoint write (with its fsync) lasts long enough to be killed in, and a step
# long enough to be killed in a chosen phase: ~7 MB a checkpoint.
EMBEDDED = {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256}
KILLS = ["checkpoint write", "after a step", "after a step", "checkpoint write", "before an evaluation"]


def training_copy(built, dest: Path) -> Path:
    """The built pipeline's repo with CHANGES and no checkpoints: the train stage trains from the base
    model."""
    repo = copy_repo(built[0], dest)
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    raw["train"].update(CHANGES)
    raw["embedded"].update(EMBEDDED)
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    shutil.rmtree(repo / "artifacts/checkpoints", ignore_errors=True)
    return repo


WALL_CLOCK = ("_time", "/runtime")  # step_time, generation_time, async/wait_time, eval/runtime


def log_rows(repo: Path) -> list[dict]:
    """The train log without its wall-clock columns."""
    with open(repo / "metrics/train_log.csv", newline="") as fh:
        return [{k: v for k, v in row.items() if not k.endswith(WALL_CLOCK)} for row in csv.DictReader(fh)]


def logged_steps(repo: Path) -> int:
    path = repo / "metrics/train_log.csv"
    return max(0, len(path.read_text().splitlines()) - 1) if path.is_file() else 0


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 600,
             every: float = 0.0005) -> None:
    """Until ``condition()``, polled ``every`` seconds; fails if ``proc`` ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the process watched ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(every)


def partial_writes(checkpoints: Path) -> set[str]:
    """Checkpoint folders being written (``checkpoint-N.tmp-PID``); other atomic writes in the folder (the
    stage's ``.mlflow_run.json.tmp-PID``) are not checkpoint writes."""
    if not checkpoints.is_dir():
        return set()
    return {e.name for e in os.scandir(checkpoints)
            if e.is_dir() and e.name.startswith("checkpoint-") and ".tmp-" in e.name}


def freeze_inside_a_checkpoint_write(checkpoints: Path, proc: subprocess.Popen, attempts: int = 20) -> None:
    """SIGSTOP the process group while a new checkpoint write is under way. A write can end between seeing its
    temp folder and the signal; the folder, looked at once the group is stopped, says whether the stop landed
    inside it, and a miss lets the run go on to the next write."""
    stale = partial_writes(checkpoints)  # an earlier kill's leftover, removed by the next save
    for _ in range(attempts):
        wait_for(lambda: bool(partial_writes(checkpoints) - stale), proc, "a checkpoint write")
        os.killpg(proc.pid, signal.SIGSTOP)
        if partial_writes(checkpoints) - stale:
            return
        os.killpg(proc.pid, signal.SIGCONT)
    raise AssertionError(f"every one of {attempts} checkpoint writes ended before the process group stopped")


def run_and_kill(repo: Path, kill: str, rng: random.Random) -> str:
    """`dvc repro train`, SIGKILLed at ``kill``; returns where it was (for the failure message)."""
    checkpoints = repo / "artifacts/checkpoints"
    start_rows = logged_steps(repo)
    log = open(repo / f"chaos-{kill.replace(' ', '-')}.log", "a")  # noqa: SIM115 - the child's, closed below
    proc = subprocess.Popen([DVC, "repro", "train"], cwd=repo, env=pipeline_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if kill == "checkpoint write":
            freeze_inside_a_checkpoint_write(checkpoints, proc)
        else:
            wait_for(lambda: logged_steps(repo) > start_rows, proc, "a new step")
            # the step before an eval step: its sampling, update and the eval
            if kill == "before an evaluation":
                wait_for(lambda: (logged_steps(repo) + 1) % CHANGES["eval_steps"] == 0, proc, "an eval step")
            time.sleep(rng.uniform(0.0, 0.5))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    if kill == "checkpoint write":  # the kill landed inside the write: its partial folder is left behind
        assert partial_writes(checkpoints), "the checkpoint write ended before the kill"
    return f"{kill}, {logged_steps(repo)} steps logged"


def test_five_kills_and_resumes_end_with_the_uninterrupted_runs_weights_and_log(built, tmp_path):
    reference = training_copy(built, tmp_path / "reference")
    dvc(reference, "repro", "calibrate")  # the larger model's prepare, validate and calibrate, once for both
    chaos = copy_repo(reference, tmp_path / "chaos")
    dvc(reference, "repro", "train")
    rng = random.Random(0)
    where = [run_and_kill(chaos, kill, rng) for kill in KILLS]
    assert logged_steps(chaos) < MAX_STEPS, f"the run finished before the last kill: {where}"
    out = dvc(chaos, "repro", "train")
    assert "train: resuming from" in out.stdout + out.stderr

    rows = log_rows(chaos)
    assert [int(r["step"]) for r in rows] == list(range(1, MAX_STEPS + 1)), where
    assert rows == log_rows(reference), where
    assert any(r.get("eval/accuracy") not in (None, "") for r in rows)  # the held-out evaluation ran
    trained = (chaos / "artifacts/model/model.safetensors").read_bytes()
    assert trained == (reference / "artifacts/model/model.safetensors").read_bytes(), where
