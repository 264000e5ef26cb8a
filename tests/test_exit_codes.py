"""Every exit code reaches the flow: the stage's own code, however long its output (the flow reads DVC's
line for it as the output streams), however many processes it ran (the launcher exits with the failing
rank's code); and a params.yaml that cannot be read or is not UTF-8 is a params error (exit 2) naming the
file."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flows.pipeline import MAX_LINE_CHARS, TAIL_LINES, PermanentStageFailure, StageFailed, StageOutput
from flows.stages.launch import RANK_EXITS_ENV, first_rank_failure, launch_command, run_launcher

REPO = Path(__file__).resolve().parents[1]
UNPRIVILEGED = 65534  # nobody


def dvc_failure(stage: str, code: int) -> str:
    """DVC's line when a stage's command fails (dvc/repo/reproduce.py, dvc/stage/run.py)."""
    return (f"ERROR: failed to reproduce '{stage}': failed to run: python -m flows.stages {stage}, "
            f"exited with {code}\n")


# ---------------------------------------------------------------------------------------------------
# the flow reads the stage's code however long its output


def test_the_code_after_20001_lines_is_read_and_only_a_tail_is_kept():
    lines = (f"step {i}: loss 0.5\n" for i in range(20_001))
    stream = io.StringIO("".join(lines) + dvc_failure("train", 4) + "some trailing dvc hint\n")
    output = StageOutput("train").read(stream)
    assert output.exit_code == 4
    assert len(output.tail) == TAIL_LINES  # bounded: 60 lines, not 20,003
    assert output.tail[-2] == dvc_failure("train", 4)
    assert output.tail[0] == f"step {20_001 - TAIL_LINES + 2}: loss 0.5\n"


def test_dvc_line_straddling_two_pieces_of_an_endless_line_is_read():
    """A stage that printed a line with no end: DVC's line is appended to it and read in two pieces."""
    garbage = "x" * (MAX_LINE_CHARS - 20)  # the first piece ends 20 characters into DVC's line
    output = StageOutput("train").read(io.StringIO(garbage + dvc_failure("train", 5)))
    assert output.exit_code == 5
    assert max(len(piece) for piece in output.tail) == MAX_LINE_CHARS


def test_another_stage_or_no_dvc_line_gives_no_code():
    assert StageOutput("train").read(io.StringIO(dvc_failure("validate", 3))).exit_code is None
    assert StageOutput("train").read(io.StringIO("ERROR: Unable to acquire lock\n" * 3)).exit_code is None


FAKE_DVC = """\
#!{python}
import os, sys
assert sys.argv[1:4] == ["repro", "--single-item", "train"], sys.argv
for i in range(int(os.environ["FAKE_LINES"])):
    print(f"step {{i}}: loss 0.5")
print(os.environ["FAKE_LAST"], end="")
sys.exit(int(os.environ["FAKE_RC"]))
"""


@pytest.fixture()
def fake_dvc(tmp_path, monkeypatch):
    """``dvc`` replaced by a script printing FAKE_LINES lines, then FAKE_LAST, exiting FAKE_RC."""
    import flows.pipeline

    script = tmp_path / "dvc"
    script.write_text(FAKE_DVC.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setattr(flows.pipeline, "dvc_command", lambda: str(script))
    return lambda lines, last, rc: {**os.environ, "FAKE_LINES": str(lines), "FAKE_LAST": last,
                                    "FAKE_RC": str(rc)}


@pytest.mark.parametrize("lines", [100, 20_001, 50_000])
def test_the_flow_raises_a_permanent_failure_with_the_stage_code_however_long_the_output(fake_dvc, tmp_path,
                                                                                          lines):
    from flows.pipeline import run_dvc_stage

    with pytest.raises(PermanentStageFailure) as failure:
        run_dvc_stage("train", tmp_path, fake_dvc(lines, dvc_failure("train", 4), 255), echo=lambda _: None)
    assert (failure.value.stage_exit_code, failure.value.returncode) == (4, 255)
    assert "stage exit code 4" in str(failure.value)


def test_a_transient_code_after_long_output_is_retried_and_an_unchanged_stage_is_seen(fake_dvc, tmp_path):
    from flows.pipeline import retry_transient, run_dvc_stage

    with pytest.raises(StageFailed) as failure:
        run_dvc_stage("train", tmp_path, fake_dvc(20_001, dvc_failure("train", 1), 255), echo=lambda _: None)
    assert type(failure.value) is StageFailed and failure.value.stage_exit_code == 1
    assert retry_transient(None, None, type("State", (), {"data": failure.value})())
    skipped = run_dvc_stage("train", tmp_path, fake_dvc(20_001, "Stage 'train' didn't change, skipping\n", 0),
                            echo=lambda _: None)
    assert skipped["ran"] is False


# ---------------------------------------------------------------------------------------------------
# several processes: the launcher exits with the code of the rank that failed first

RANK = """\
import os, sys, time
from pathlib import Path
from flows.stages.launch import RANK_EXITS_ENV, rank_exit_recorded
from grpo_core.common.errors import exit_code_for, TrainingFailure, TransientFailure

first, first_code, then_code = (int(a) for a in sys.argv[1:])
rank = int(os.environ["RANK"])
errors = {1: TransientFailure("a peer is gone"), 4: TrainingFailure("guard stop")}
try:
    with rank_exit_recorded():
        if rank != first:  # fails after the first, as a collective does once its peer has died
            record = Path(os.environ[RANK_EXITS_ENV]) / f"rank-{first}.json"
            while not record.exists():
                time.sleep(0.01)
        raise errors[first_code if rank == first else then_code]
except Exception as exc:
    sys.exit(exit_code_for(exc))  # what python -m flows.stages exits with
"""


@pytest.mark.parametrize("first,first_code,then_code,expected", [
    (1, 4, 1, 4),  # rank 1 stops on a guard; rank 0 then loses its peer
    (0, 4, 1, 4),  # rank 0 stops on a guard; rank 1 then loses its peer
    (0, 1, 4, 1),  # the first failure is the cause, even when a later one is permanent
])
def test_two_processes_exit_with_the_code_of_the_rank_that_failed_first(tmp_path, monkeypatch, first,
                                                                         first_code, then_code, expected):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = [*launch_command(2), str(script), str(first), str(first_code), str(then_code)]
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run_launcher(cmd, cwd=tmp_path) == expected
    # torchrun alone exits 1 whatever its ranks exited with: what the flow saw before
    (tmp_path / "raw").mkdir()
    raw = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, RANK_EXITS_ENV: str(tmp_path / "raw")})
    assert raw.returncode == 1 and first_rank_failure(tmp_path / "raw") == expected, raw.stderr[-3000:]


def test_a_launch_that_succeeds_or_dies_unrecorded_keeps_the_launchers_code(tmp_path):
    assert run_launcher([sys.executable, "-c", "pass"], cwd=tmp_path) == 0
    assert run_launcher([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"], cwd=tmp_path) == -9
    assert run_launcher([sys.executable, "-c", "import sys; sys.exit(3)"], cwd=tmp_path) == 3


def test_first_rank_failure_orders_by_time_and_skips_what_is_not_a_record(tmp_path):
    for rank, code, time_ns in [(0, 1, 300), (1, 4, 200), (2, 0, 100)]:
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "exit_code": code,
                                                                "time_ns": time_ns}))
    (tmp_path / "rank-9.json").write_text("{not json")
    assert first_rank_failure(tmp_path) == 4
    assert first_rank_failure(tmp_path / "empty") is None


def test_the_train_stage_records_a_ranks_failure_for_the_launcher(tmp_path, monkeypatch):
    """A launched rank of the real stage whose input is missing records exit 5 (StageInputError)."""
    from flows.stages import train
    from flows.stages.common import StageContext, StageInputError
    from grpo_core.config import config_from_dict

    exits = tmp_path / "exits"
    exits.mkdir()
    for key, value in {"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", RANK_EXITS_ENV: str(exits)}.items():
        monkeypatch.setenv(key, value)
    cfg = config_from_dict({"data": {"train_files": ["train.jsonl"]},
                            "rewards": [{"name": "r", "function": "tests.reward_helpers:digit_fraction"}],
                            "train": {"num_generations": 4, "per_device_train_batch_size": 8}})
    ctx = StageContext(stage="train", root=tmp_path, store_root=tmp_path,
                       params_path=tmp_path / "params.yaml", cfg=cfg)
    with pytest.raises(StageInputError, match="validated"):
        train.run(ctx)
    assert json.loads((exits / "rank-1.json").read_text())["exit_code"] == 5
    assert first_rank_failure(exits) == 5


# ---------------------------------------------------------------------------------------------------
# params.yaml that is not UTF-8 or cannot be read: exit 2, naming the file

LATIN1 = b"train:\n  learning_rate: 1e-4\n# caf\xe9\n"  # the \xe9 is byte 7 + 22 + 5 = 34, on line 3


def test_params_not_utf8_exit_2_naming_the_file_and_the_byte(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_bytes(LATIN1)
    proc = subprocess.run([sys.executable, "-m", "flows.stages", "validate", "--params", str(params)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{params}: not UTF-8 text: byte 0xe9 at byte offset 34 (line 3)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_flows_overrides_name_a_params_file_that_is_not_utf8(tmp_path):
    from flows.pipeline import apply_params_overrides
    from grpo_core.config import ConfigError

    params = tmp_path / "params.yaml"
    params.write_bytes(LATIN1)
    with pytest.raises(ConfigError, match="byte offset 34"):
        apply_params_overrides(params, {"train.learning_rate": 1e-3})
    assert params.read_bytes() == LATIN1


def stage_cli_as(uid: int | None, argv: list[str]) -> tuple[int, str]:
    """``python -m flows.stages`` (its main, in a forked child that first becomes ``uid``): exit code, stderr.
    A fork, not a new interpreter: an unprivileged user cannot reach the virtual environment under /root."""
    import flows.stages.__main__ as cli
    import flows.stages.common  # noqa: F401 - imported before the fork: the child may not read site-packages
    import grpo_core.config  # noqa: F401

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            os.close(read_end)
            sys.stderr = open(write_end, "w")  # pytest's capture object stands in for it in this process
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            code = cli.main(argv)
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        err = pipe.read().decode(errors="replace")
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err


@pytest.mark.parametrize("what", ["file mode 000", "folder not searchable"])
def test_params_that_cannot_be_read_exit_2_naming_the_file(what):
    """As an unprivileged user (root reads any file): a fork of this process drops to nobody when root."""
    uid = UNPRIVILEGED if os.geteuid() == 0 else None
    with tempfile.TemporaryDirectory(prefix="grpo-params-") as folder:
        params = Path(folder) / "params.yaml"
        params.write_text("train:\n  learnig_rate: 1\n")  # read, an error of another kind: no stage runs
        if what == "file mode 000":
            os.chmod(folder, 0o755)
            params.chmod(0o000)
        else:
            os.chmod(folder, 0o700)
            if uid is None:
                os.chmod(folder, 0o000)  # not root: the folder must refuse its own owner
        try:
            code, err = stage_cli_as(uid, ["validate", "--params", str(params)])
        finally:
            os.chmod(folder, 0o755)
    assert code == 2, err[-3000:]
    assert f"{params}: the parameters file cannot be read: Permission denied" in err
