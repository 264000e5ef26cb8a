"""Two machines on one box: the train stage run as `train.num_machines: 2` by two `python -m flows.stages
train` processes on loopback (MACHINE_RANK 0 and 1, one gloo process each), each in a work root of its own
that shares only `<output_dir>/checkpoints` with the other (docs/scaling.md, "Several machines"). It trains,
machine 0 alone writes; a SIGKILL of either machine is a retryable failure and the retry resumes to the
uninterrupted run's weights; each machine holds its stage lock; a permanent failure on machine 1 (its copy of
the training data damaged) is every machine's exit code and reaches the flow as such; a machine that fails
before it launches stops machine 0's wait for it. The launcher's parts on their own: at the end."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from flows.stages.common import stage_lock_path
from flows.stages.launch import (
    EXIT_RECORD_PREFIX,
    LAUNCH_MARKER,
    Peers,
    announce_launch,
    first_rank_failure,
    launch_attempt,
    run_launcher,
)
from grpo_core.common.errors import EXIT_DATA, EXIT_ERROR
from tests.tiny import make_prompts, make_tiny_model, read_log

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
WAIT_S = 300  # one two-machine run on two busy cores takes about 40 s
LOGGED = ("loss", "reward", "kl", "entropy", "grad_norm", "completions/mean_length", "num_tokens")
TRAIN = {"num_generations": 4, "per_device_train_batch_size": 8, "max_steps": 4, "save_steps": 1,
         "learning_rate": 3e-3, "num_processes": 2, "num_machines": 2, "reward_weights": [1.0]}

# Every file a process creates, writes, renames or removes, as Python's audit hooks see it (sitecustomize runs
# in each process the machine starts: its stage, its launcher, its rank): "pid<TAB>event<TAB>path[<TAB>path]".
WRITES_AUDIT = """
import os, sys
_log = os.environ.get("GRPO_TEST_WRITES")
if _log:
    _fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    _ARGS = {"os.rename": 2, "os.mkdir": 1, "os.remove": 1, "os.rmdir": 1, "shutil.rmtree": 1,
             "os.truncate": 1}

    def _path(p):
        return os.path.abspath(os.fsdecode(p)) if isinstance(p, (str, bytes, os.PathLike)) else None

    def _hook(event, args):
        if event == "open" and isinstance(args[2], int) and args[2] & _WRITE:
            paths = args[:1]
        elif event in _ARGS:
            paths = args[:_ARGS[event]]
        else:
            return
        names = [q for q in map(_path, paths) if q]
        if names:
            os.write(_fd, ("\\t".join([str(os.getpid()), event, *names]) + "\\n").encode())

    sys.addaudithook(_hook)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, read from /proc (torchrun's ranks run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped by whoever adopted it, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------
# two machines: each its own work root, sharing the checkpoints folder


@dataclass
class Writes:
    pid: int
    event: str
    paths: list[str]


@dataclass
class Machines:
    """Machine k's work root is ``roots[k]``; machine 1's ``artifacts/checkpoints`` is machine 0's (a symlink
    standing in for a mount of shared storage)."""

    folder: Path
    roots: tuple[Path, Path]
    store: str  # the MLflow store (one per module: its tables are made once)
    procs: list[subprocess.Popen] = field(default_factory=list)
    port: int = field(default_factory=free_port)

    @property
    def shared(self) -> Path:
        return self.roots[0] / "artifacts" / "checkpoints"

    def env(self, machine: int, audited: bool = True, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("GRPO_PARENT_RUN_ID", "GRPO_FLOW_RUN_ID", "DVC_ROOT", "LAUNCH_ID", "LOCAL_RANK",
                            "WORLD_SIZE", "RANK", "GRPO_RANK_EXITS")}
        path = f"{self.folder / 'audit'}{os.pathsep}{REPO}" if audited else str(REPO)
        env.update({"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                    "PYTHONUNBUFFERED": "1", "MACHINE_RANK": str(machine), "MAIN_PROCESS_IP": "127.0.0.1",
                    "MAIN_PROCESS_PORT": str(self.port), "MLFLOW_TRACKING_URI": self.store,
                    "GRPO_RUN_GROUP": "test-two-machines",
                    "GRPO_TEST_WRITES": str(self.folder / f"writes-{machine}.tsv"), **extra})
        return env

    def start(self, machine: int, run: str, **extra: str) -> subprocess.Popen:
        """Machine ``machine``'s train stage, in a session of its own (its log: ``<run>-<machine>.log``)."""
        log = open(self.folder / f"{run}-{machine}.log", "w")  # noqa: SIM115 - the process writes it
        proc = subprocess.Popen([PYTHON, "-m", "flows.stages", "train"], cwd=self.roots[machine],
                                env=self.env(machine, **extra), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def run_both(self, run: str, **extra: str) -> tuple[subprocess.Popen, subprocess.Popen]:
        self.port = free_port()
        return self.start(0, run, **extra), self.start(1, run, **extra)

    def wait(self, proc: subprocess.Popen, run: str, timeout_s: float = WAIT_S) -> int:
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{run}: a machine still runs after {timeout_s} s\n"
                                 f"{self.logs(run)}") from None

    def logs(self, run: str) -> str:
        return "\n".join(f"--- machine {k}:\n" + (self.folder / f"{run}-{k}.log").read_text()[-6000:]
                         for k in (0, 1) if (self.folder / f"{run}-{k}.log").exists())

    def writes(self, machine: int) -> list[Writes]:
        path = self.folder / f"writes-{machine}.tsv"
        lines = path.read_text().splitlines() if path.exists() else []
        return [Writes(int(pid), event, paths) for pid, event, *paths in (line.split("\t") for line in lines)]

    def stop(self) -> None:
        """Whatever still runs of either machine (a failed test's), ranks included."""
        for proc in self.procs:
            for pid in descendants(proc.pid) if proc.poll() is None else []:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()


def write_template(root: Path) -> Path:
    """What the train stage reads in a work root: params.yaml (the project's, scaled down), validate's data
    (the first 24 of 32 prompts to train on), the base model; a stub dvc.yaml and .dvc/ (the stage lock's
    folder)."""
    (root / ".dvc").mkdir(parents=True)
    (root / "dvc.yaml").write_text("stages: {}\n")
    make_tiny_model(root / "artifacts" / "base_model")
    rows = [json.loads(line) for line in make_prompts(root / "prompts.jsonl", n=32).read_text().splitlines()]
    import pandas as pd

    (root / "data" / "validated").mkdir(parents=True)
    pd.DataFrame(rows[:24]).to_parquet(root / "data/validated/train.parquet")
    pd.DataFrame(rows[24:]).to_parquet(root / "data/validated/eval.parquet")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["embedded"] = None
    raw["rewards"] = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]
    raw["guards"]["reward_hacking"] = {"format_reward": None, "correctness_reward": None}
    raw["generation"]["max_completion_length"] = 8
    raw["data"]["max_prompt_length"] = 48
    raw["train"].update(TRAIN)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("two-machines")
    (folder / "audit").mkdir()
    (folder / "audit" / "sitecustomize.py").write_text(WRITES_AUDIT)
    return write_template(folder / "template")


def two_machines(template: Path, folder: Path) -> Machines:
    folder.mkdir(parents=True)
    folder = folder.resolve()  # as the stages see their roots
    shutil.copytree(template.parent / "audit", folder / "audit")
    roots = (folder / "m0", folder / "m1")
    for root in roots:
        shutil.copytree(template, root)
    (roots[0] / "artifacts" / "checkpoints").mkdir()
    (roots[1] / "artifacts" / "checkpoints").symlink_to(roots[0] / "artifacts" / "checkpoints")
    return Machines(folder, roots, store=f"sqlite:///{template.parent / 'mlflow.db'}")


@pytest.fixture()
def machines(template, tmp_path):
    pair = two_machines(template, tmp_path / "pair")
    yield pair
    pair.stop()


def stage_holding(root: Path, machine: int) -> int | None:
    """The PID machine ``machine``'s stage lock's holder file names, None before a stage took it."""
    try:
        return json.loads(stage_lock_path(root, machine).with_suffix(".holder").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def third_stage(pair: Machines, machine: int) -> subprocess.CompletedProcess:
    """Another `python -m flows.stages train` in machine ``machine``'s root, as that machine."""
    return subprocess.run([PYTHON, "-m", "flows.stages", "train"], cwd=pair.roots[machine],
                          env=pair.env(machine, audited=False), capture_output=True, text=True, timeout=60)


@dataclass
class Reference:
    pair: Machines
    codes: tuple[int, int]
    pids: tuple[int, int]
    third: dict[int, subprocess.CompletedProcess]


@pytest.fixture(scope="module")
def reference(template) -> Reference:
    """The uninterrupted two-machine run (4 steps, a checkpoint after each); while both stages train, a third
    train stage is started in each machine's root."""
    pair = two_machines(template, template.parent / "reference")
    try:
        procs = pair.run_both("reference")
        wait_until(lambda: all(stage_holding(pair.roots[k], k) == procs[k].pid for k in (0, 1)), 60,
                   "both stages hold their locks")
        third = {k: third_stage(pair, k) for k in (0, 1)}
        assert all(p.poll() is None for p in procs), "the stages ended before the third one tried"
        codes = tuple(pair.wait(p, "reference") for p in procs)
    finally:
        pair.stop()
    return Reference(pair, codes, (procs[0].pid, procs[1].pid), third)


def is_under(path: str, folder: Path) -> bool:
    return Path(path) == folder or folder in Path(path).parents


@pytest.mark.slow
def test_two_machines_train_to_max_steps_and_only_machine_0_writes(reference):
    pair = reference.pair
    assert reference.codes == (0, 0), pair.logs("reference")
    log = read_log(pair.roots[0] / "metrics" / "train_log.csv")
    assert [r["step"] for r in log] == ["1", "2", "3", "4"]

    # every checkpoint renamed into place once, by one process of machine 0 (its rank 0)
    writes0 = pair.writes(0)
    renamed = [w for w in writes0 if w.event == "os.rename" and Path(w.paths[1]).parent == pair.shared
               and re.fullmatch(r"checkpoint-\d+", Path(w.paths[1]).name)]
    assert Counter(Path(w.paths[1]).name for w in renamed) == {f"checkpoint-{s}": 1 for s in (1, 2, 3, 4)}
    assert len({w.pid for w in renamed}) == 1
    train_log = str(pair.roots[0] / "metrics" / "train_log.csv")
    log_writers = {w.pid for w in writes0 if train_log in w.paths}
    assert log_writers == {renamed[0].pid}
    assert sorted(p.name for p in pair.shared.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]

    # machine 1 wrote nothing but its own stage lock: no output in its root, nothing in the shared folder
    writes1 = pair.writes(1)
    assert writes1, "machine 1's processes were not audited"
    root1, lock_dir = pair.roots[1], pair.roots[1] / ".dvc" / "tmp"
    in_root1 = {p for w in writes1 for p in w.paths if is_under(p, root1)}
    assert in_root1 and all(Path(p) == lock_dir or (Path(p).parent == lock_dir
                                                    and Path(p).name.startswith("grpo-stage.machine-1."))
                            for p in in_root1), in_root1
    assert not [p for w in writes1 for p in w.paths if is_under(p, pair.roots[0])]
    assert not (root1 / "metrics").exists() and not (root1 / "artifacts" / "model").exists()

    # the weights moved: the comparisons below are not of no-ops
    from safetensors.torch import load_file

    final = load_file(pair.shared / "checkpoint-4" / "model.safetensors")
    base = load_file(pair.roots[0] / "artifacts" / "base_model" / "model.safetensors")
    assert max((final[k] - base[k]).abs().max().item() for k in base) > 1e-3


@pytest.mark.slow
def test_each_machine_holds_its_stage_lock_while_it_trains(reference):
    for machine, lock in ((0, "grpo-stage.lock"), (1, "grpo-stage.machine-1.lock")):
        third = reference.third[machine]
        assert third.returncode == EXIT_ERROR, third.stderr[-3000:]
        assert f"StageBusy: train: `train` (PID {reference.pids[machine]}, since " in third.stderr
        assert str(reference.pair.roots[machine] / ".dvc" / "tmp" / lock) in third.stderr


def sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def kill_machine(pair: Machines, proc: subprocess.Popen) -> list[int]:
    """SIGKILL a machine's stage and its launcher (its session, as a scheduler's kill does); its ranks, in
    sessions of their own, must die with them. Returns the machine's processes before the kill."""
    tree = descendants(proc.pid)
    assert len(tree) >= 3, tree  # the stage, its launcher, its rank
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return tree


def newest_step(folder: Path) -> int:
    return max((int(p.name.split("-")[1]) for p in folder.glob("checkpoint-*") if p.name[11:].isdigit()),
               default=0)


def killed_after_a_checkpoint(pair: Machines, run: str, victim: int) -> int:
    """Run both machines, SIGKILL ``victim`` once they wrote a checkpoint; the survivor's exit code."""
    after = newest_step(pair.shared) + 1
    procs = pair.run_both(run)
    wait_until(lambda: (pair.shared / f"checkpoint-{after}" / "manifest.json").exists()
               or any(p.poll() is not None for p in procs), WAIT_S, f"{run}: checkpoint-{after}")
    assert all(p.poll() is None for p in procs), pair.logs(run)
    tree = kill_machine(pair, procs[victim])
    wait_until(lambda: not any(alive(pid) for pid in tree), 3, f"{run}: machine {victim}'s processes gone")
    start = time.monotonic()
    code = pair.wait(procs[1 - victim], run, timeout_s=120)
    assert time.monotonic() - start < 60, f"{run}: the survivor took {time.monotonic() - start:.0f} s"
    return code


@pytest.mark.slow
def test_a_sigkill_of_either_machine_is_retried_and_resumes_to_the_uninterrupted_weights(reference, machines):
    ref = reference.pair.shared
    for run, victim in (("kill-1", 1), ("kill-0", 0)):
        code = killed_after_a_checkpoint(machines, run, victim)
        assert code == EXIT_ERROR, (code, machines.logs(run))  # retried; PERMANENT_EXIT_CODES would not be
        # the survivor's rank failed on its own (its peer gone), and recorded so for the other machines
        survivor = list(machines.shared.glob(f"{EXIT_RECORD_PREFIX}*-machine-{1 - victim}-rank-*.json"))
        assert [json.loads(p.read_text())["exit_code"] for p in survivor] == [EXIT_ERROR], machines.logs(run)
    resume_point = newest_step(machines.shared)
    assert 2 <= resume_point < 4  # each kill came after a checkpoint, before the last step
    procs = machines.run_both("retry")
    assert [machines.wait(p, "retry") for p in procs] == [0, 0], machines.logs("retry")
    assert (f"train: resuming from {machines.shared / f'checkpoint-{resume_point}'}\n"
            in (machines.folder / "retry-0.log").read_text())

    for name in ("checkpoint-4/model.safetensors", "checkpoint-4/optimizer.pt"):
        assert sha256(machines.shared / name) == sha256(ref / name), name
    model = Path("artifacts") / "model" / "model.safetensors"
    assert sha256(machines.roots[0] / model) == sha256(reference.pair.roots[0] / model)
    resumed = read_log(machines.roots[0] / "metrics" / "train_log.csv")
    uninterrupted = read_log(reference.pair.roots[0] / "metrics" / "train_log.csv")
    assert [r["step"] for r in resumed] == ["1", "2", "3", "4"]
    assert [[r[k] for k in LOGGED] for r in resumed] == [[r[k] for k in LOGGED] for r in uninterrupted]


@pytest.mark.slow
def test_a_machine_that_stops_answering_fails_machine_0_after_the_collective_timeout(machines):
    """Machine 1 frozen mid-run (SIGSTOP of its stage, launcher and rank: its connections stay open, nothing
    answers, as when a machine loses power or its network): machine 0's rank fails its next collective after
    train.collective_timeout_s, and its stage exits 1 (retried) - where torch's default waits 30 minutes."""
    timeout_s = 10
    for root in machines.roots:
        raw = yaml.safe_load((root / "params.yaml").read_text())
        raw["train"].update(collective_timeout_s=timeout_s, max_steps=40)
        (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    procs = machines.run_both("frozen")
    wait_until(lambda: (machines.shared / "checkpoint-1" / "manifest.json").exists()
               or any(p.poll() is not None for p in procs), WAIT_S, "frozen: checkpoint-1")
    assert all(p.poll() is None for p in procs), machines.logs("frozen")
    tree = descendants(procs[1].pid)
    assert len(tree) >= 3, tree  # the stage, its launcher, its rank
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    code = machines.wait(procs[0], "frozen", timeout_s=180)
    waited = time.monotonic() - start
    assert code == EXIT_ERROR, machines.logs("frozen")
    assert waited < timeout_s + 60, f"machine 0 took {waited:.0f} s"
    assert newest_step(machines.shared) < 40  # it ended on the timeout, not at max_steps


FAKE_DVC = """#!{python}
# `dvc repro --single-item train` as the flow sees it: the stage's output, then DVC's line with its code
import subprocess, sys
assert sys.argv[1:4] == ["repro", "--single-item", "train"], sys.argv
code = subprocess.call([{python!r}, "-m", "flows.stages", "train"])
if code:
    print("ERROR: failed to reproduce 'train': failed to run: python -m flows.stages train, "
          f"exited with {{code}}")
    sys.exit(255)
"""


@pytest.mark.slow
def test_a_permanent_failure_on_machine_1_is_every_machines_code_and_reaches_the_flow(machines, monkeypatch):
    """Machine 1's copy of the training data is damaged (a copy cut short): its rank fails reading it (exit
    5), while machine 0's rank only sees its peer vanish (exit 1: alone, a retry that fails again forever)."""
    import flows.pipeline
    from flows.pipeline import PermanentStageFailure, retry_transient, run_dvc_stage

    data = machines.roots[1] / "data" / "validated" / "train.parquet"
    data.write_bytes(data.read_bytes()[:300])
    dvc = machines.folder / "dvc"
    dvc.write_text(FAKE_DVC.format(python=PYTHON))
    dvc.chmod(0o755)
    monkeypatch.setattr(flows.pipeline, "dvc_command", lambda: str(dvc))

    machines.port = free_port()
    machine_1 = machines.start(1, "permanent")
    output: list[str] = []
    with pytest.raises(PermanentStageFailure) as failure:
        run_dvc_stage("train", machines.roots[0], machines.env(0), timeout_s=WAIT_S, echo=output.append)
    assert machines.wait(machine_1, "permanent") == EXIT_DATA, machines.logs("permanent")
    assert failure.value.stage_exit_code == EXIT_DATA, "".join(output)[-6000:]
    assert not retry_transient(None, None, type("State", (), {"data": failure.value})())
    assert "DataFileError" in (machines.folder / "permanent-1.log").read_text()

    records = {p.name.split("-machine-")[1]: json.loads(p.read_text())
               for p in machines.shared.glob(f"{EXIT_RECORD_PREFIX}*.json")}
    assert records["1-rank-1.json"]["exit_code"] == EXIT_DATA
    assert records["0-rank-0.json"]["exit_code"] == EXIT_ERROR  # machine 0's rank alone: a retryable code
    assert records["1-rank-1.json"]["time_ns"] < records["0-rank-0.json"]["time_ns"]


@pytest.mark.slow
def test_a_machine_that_fails_before_it_launches_ends_machine_0s_wait_with_its_code(machines):
    """Machine 1 (one Job's pod: LAUNCH_ID) lacks the validated data: its stage fails before it launches, so
    machine 0's launcher would wait out the rendezvous (15 min) for it, then exit 1."""
    (machines.roots[1] / "data" / "validated" / "train.parquet").unlink()
    machines.port = free_port()
    machine_0 = machines.start(0, "unlaunched", LAUNCH_ID="job-1")
    machine_1 = machines.start(1, "unlaunched", LAUNCH_ID="job-1")
    assert machines.wait(machine_1, "unlaunched", timeout_s=120) == EXIT_DATA, machines.logs("unlaunched")
    start = time.monotonic()
    assert machines.wait(machine_0, "unlaunched", timeout_s=75) == EXIT_DATA, machines.logs("unlaunched")
    assert time.monotonic() - start < 60
    assert "train: machine 1 failed (exit 5)" in (machines.folder / "unlaunched-0.log").read_text()
    assert not list(machines.shared.glob("checkpoint-*"))


# ---------------------------------------------------------------------------------------------------
# the launcher's parts: shared records, machine 0's watch, a launch that ends with its stage


def record(folder: Path, name: str, **fields) -> None:
    (folder / name).write_text(json.dumps(fields))


A, B = "a" * 32, "b" * 32  # two launch attempts


def test_first_rank_failure_reads_every_machines_records_of_this_attempt_only(tmp_path):
    local, shared = tmp_path / "local", tmp_path / "shared"
    local.mkdir()
    shared.mkdir()
    record(local, "rank-0.json", time_ns=300, machine=0, rank=0, exit_code=1, attempt=A)  # its peer vanished
    assert first_rank_failure(local) == 1
    assert first_rank_failure(local, shared) == 1  # nothing shared yet
    record(shared, f".exit-{A}-machine-1-rank-1.json", time_ns=200, machine=1, rank=1, exit_code=5, attempt=A)
    assert first_rank_failure(local, shared) == 5  # the attempt its own rank recorded
    assert first_rank_failure(local) == 1  # this machine's ranks alone: what the flow saw before

    # earlier, but not this attempt's: another attempt's file, a file whose record names another attempt,
    # a half-written temp file, a file that is no record
    record(shared, f".exit-{B}-machine-1-rank-1.json", time_ns=100, machine=1, rank=1, exit_code=2, attempt=B)
    record(shared, f".exit-{A}-machine-1-rank-3.json", time_ns=100, machine=1, rank=3, exit_code=3, attempt=B)
    record(shared, f"..exit-{A}-machine-1-rank-2.json.tmp-7", time_ns=100, machine=1, rank=2, exit_code=2,
           attempt=A)
    (shared / f".exit-{A}-machine-1-rank-4.json").write_text("{not json")
    assert first_rank_failure(local, shared) == 5
    assert first_rank_failure(local, shared, attempt=B) == 2  # machine 0 names the attempt it announced

    # a machine's stage that failed before launching (rank -1), earliest of all
    record(shared, f".exit-{A}-machine-1.json", time_ns=150, machine=1, rank=-1, exit_code=4, attempt=A)
    assert first_rank_failure(local, shared) == 4
    assert first_rank_failure(tmp_path / "empty", shared) is None  # no rank of its own: no attempt to read
    assert first_rank_failure(tmp_path / "empty", shared, attempt=A) == 4
    record(shared, f".exit-{A}-machine-0-rank-0.json", time_ns=50, machine=0, rank=0, exit_code=0, attempt=A)
    assert first_rank_failure(tmp_path / "empty", shared, attempt=A) == 4  # exit 0 is no failure


def test_each_announce_is_a_new_attempt_and_clears_the_earlier_records(tmp_path):
    from tests.test_distributed import stage_context

    ctx = stage_context(tmp_path, num_processes=2, num_machines=2, output_dir=str(tmp_path / "out"))
    folder = tmp_path / "out" / "checkpoints"
    first = announce_launch(ctx, ctx.cfg, environ={"LAUNCH_ID": "job-1"})
    assert launch_attempt(folder) == first
    record(folder, f".exit-{first}-machine-1-rank-1.json", time_ns=1, machine=1, rank=1, exit_code=5,
           attempt=first)
    (folder / "checkpoint-2").mkdir()
    second = announce_launch(ctx, ctx.cfg, environ={"LAUNCH_ID": "job-1"})
    assert second != first and launch_attempt(folder) == second
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-2", LAUNCH_MARKER]
    assert json.loads((folder / LAUNCH_MARKER).read_text())["launch_id"] == "job-1"
    (folder / LAUNCH_MARKER).write_text('{"attempt": "../../x"}')
    assert launch_attempt(folder) is None


def test_machine_0_stops_its_launch_once_another_machine_recorded_a_failure(tmp_path):
    """Its launcher would wait 30 s (a rendezvous for a machine that never comes); it is stopped after the
    grace period instead and the stage exits with the other machine's code."""
    later = threading.Timer(0.5, record, args=(tmp_path, f".exit-{A}-machine-1.json"),
                            kwargs={"time_ns": 1, "machine": 1, "rank": -1, "exit_code": 2, "attempt": A})
    later.start()
    start = time.monotonic()
    code = run_launcher([PYTHON, "-c", "import time; time.sleep(30)"], cwd=tmp_path,
                        peers=Peers(tmp_path, 0, A), grace_s=1.0)
    later.join()
    assert code == 2 and time.monotonic() - start < 10
    # its own machine's records, and other attempts', do not stop it: it ends by itself, with its own code
    C = "c" * 32
    record(tmp_path, f".exit-{B}-machine-1.json", time_ns=1, machine=1, rank=-1, exit_code=2, attempt=B)
    record(tmp_path, f".exit-{C}-machine-0-rank-0.json", time_ns=1, machine=0, rank=0, exit_code=1, attempt=C)
    assert run_launcher([PYTHON, "-c", "import time; time.sleep(2)"], cwd=tmp_path,
                        peers=Peers(tmp_path, 0, C), grace_s=0.1) == 0


STAGE_WITH_A_LAUNCHER = """
import sys
from flows.stages.launch import run_launcher
run_launcher([sys.executable, "-c", sys.argv[1]], cwd=".")
"""
RANK = ("from flows.stages.launch import die_with_launcher; import time; die_with_launcher(); "
        "print('armed', flush=True); time.sleep(60)")
LAUNCHER = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
            "start_new_session=True); time.sleep(60)")


def test_a_launch_dies_with_its_stage_and_a_rank_with_its_launcher(tmp_path):
    """A stage SIGKILLed alone: its launcher gets SIGTERM; a launcher SIGKILLed: its rank (in a session of its
    own, as torchrun starts them) gets SIGKILL. Neither trains on, unlocked, beside the stage's retry."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    stage = subprocess.Popen([PYTHON, "-c", STAGE_WITH_A_LAUNCHER, "import time; time.sleep(60)"],
                             cwd=tmp_path, env=env)
    started: list[int] = []
    try:
        wait_until(lambda: len(descendants(stage.pid)) == 2, 30, "the launcher started")
        started = descendants(stage.pid)
        stage.kill()
        stage.wait()
        wait_until(lambda: not alive(started[1]), 10, "the launcher ended with its stage")

        launcher = subprocess.Popen([PYTHON, "-c", LAUNCHER, RANK], env=env, stdout=subprocess.PIPE,
                                    text=True)
        assert launcher.stdout.readline() == "armed\n"  # the rank's line: it armed itself
        started = descendants(launcher.pid)
        assert len(started) == 2
        launcher.kill()
        launcher.wait()
        wait_until(lambda: not alive(started[1]), 10, "the rank ended with its launcher")
    finally:
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
