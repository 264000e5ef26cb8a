"""Faults of issue 52 (part 5): an abandoned code reward, a judge server that is down, the stage lock under a
scheduler's rank variables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import requests
import yaml

from flows.stages.common import RANK_EXITS_ENV, is_launched_child, stage_lock, stage_lock_path
from grpo_core.common.errors import EXIT_ERROR, EXIT_TRAINING, exit_code_for
from grpo_core.rewards import code as code_reward
from grpo_core.rewards.sandbox import RunResult
from grpo_core.rewards.scoring import score_completions
from tests.reward_helpers import judged_by_url
from tests.test_stage_lock import HOLD, stage_repo

PROGRAM = "```python\nprint(input())\n```"


def test_a_timed_out_code_reward_starts_no_more_jails(monkeypatch):
    # 20 tests of 0.2 s on 2 workers take 2 s; the call is abandoned at 0.3 s, while the 3rd-4th run
    starts: list[float] = []
    lock = threading.Lock()

    def slow_run(program, stdin, limits, jail):
        with lock:
            starts.append(time.monotonic())
        time.sleep(0.2)
        return RunResult("ok", 0, stdin, "", 0.2)

    monkeypatch.setattr(code_reward, "run_python", slow_run)
    reward = code_reward.code_execution(sandbox="none", max_workers=2)
    tests = [{"input": f"{k}\n", "output": f"{k}\n"} for k in range(20)]
    scores = score_completions([reward], ["p"], [PROGRAM], {"tests": [tests]}, timeout_s=0.3)
    gave_up = time.monotonic()
    assert scores.timeout_counts == {"code_execution": 1}
    time.sleep(1.0)  # the old pool would have started ~10 more by now
    late = [t for t in starts if t > gave_up + 0.05]
    assert late == [], f"{len(late)} jails started after the timeout"
    assert 2 <= len(starts) <= 4  # the first two rounds ran (the second may be starting as it timed out)


def test_without_a_timeout_the_code_reward_runs_every_test(monkeypatch):
    runs: list[str] = []

    def echo(program, stdin, limits, jail):
        runs.append(stdin)
        return RunResult("ok", 0, stdin, "", 0.0)

    monkeypatch.setattr(code_reward, "run_python", echo)
    reward = code_reward.code_execution(sandbox="none", max_workers=2)
    tests = [{"input": "1\n", "output": "1\n"}, {"input": "2\n", "output": "3\n"}]
    scores = score_completions([reward], ["p"], [PROGRAM], {"tests": [tests]}, timeout_s=5)
    assert sorted(runs) == ["1\n", "2\n"] and scores.rewards[0, 0] == pytest.approx(0.5)


class _Judge(BaseHTTPRequestHandler):
    """A judge server: /down answers 503, /busy 429, /bad 400, /garbage 200 with a body that is not a score,
    anything else 200 with a score of 1."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status = {"/down": 503, "/busy": 429, "/bad": 400}.get(self.path, 200)
        body = b"<html>not a score</html>" if self.path == "/garbage" else b'{"score": 1}'
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _urllib_judge(url: str):
    def judge(prompts, completions, **columns):
        return judged_by_url(prompts, completions, url)
    return judge


def _requests_judge(url: str):
    def judge(prompts, completions, **columns):
        answers = [requests.post(url, json={"text": t}, timeout=2) for t in completions]
        for answer in answers:
            answer.raise_for_status()
        return [float(a.json()["score"]) for a in answers]
    return judge


def _httpx_judge(url: str):
    async def judge(prompts, completions, **columns):
        async with httpx.AsyncClient(timeout=2) as client:
            answers = [await client.post(url, json={"text": t}) for t in completions]
        for answer in answers:
            answer.raise_for_status()
        return [float(a.json()["score"]) for a in answers]
    return judge


def _exit_code(judge) -> tuple[int, str]:
    with pytest.raises(Exception) as caught:
        score_completions([judge], ["p", "p"], ["a", "b"], timeout_s=10)
    return exit_code_for(caught.value), str(caught.value)


@pytest.mark.parametrize("client", [_urllib_judge, _requests_judge, _httpx_judge])
def test_each_judge_client_scores_through_a_server_that_answers(judge_url, client):
    scores = score_completions([client(judge_url + "/score")], ["p", "p"], ["a", "b"])
    assert scores.rewards.tolist() == [[1.0], [1.0]]


@pytest.mark.parametrize("client", [_urllib_judge, _requests_judge, _httpx_judge])
@pytest.mark.parametrize("path,expected", [("/down", EXIT_ERROR), ("/busy", EXIT_ERROR),
                                           ("/bad", EXIT_TRAINING), ("/garbage", EXIT_TRAINING)])
def test_a_judge_server_that_is_down_is_transient_a_bad_answer_is_not(judge_url, client, path, expected):
    code, message = _exit_code(client(judge_url + path))
    assert code == expected, message
    assert "'judge'" in message


@pytest.mark.parametrize("client", [_urllib_judge, _requests_judge, _httpx_judge])
def test_a_judge_server_not_listening_is_transient(client):
    code, message = _exit_code(client(f"http://127.0.0.1:{_closed_port()}/score"))
    assert code == EXIT_ERROR, message
    assert "its server did not answer" in message and "'judge'" in message


@pytest.mark.parametrize("path,expected", [("/down", EXIT_ERROR), ("/closed", EXIT_ERROR),
                                           ("/bad", EXIT_TRAINING)])
def test_an_isolated_judge_is_classed_as_the_same_judge_in_process(judge_url, path, expected):
    """In its worker process (``isolated: true``) the judge's error crosses as text; whether its server did
    not answer crosses with it."""
    from grpo_core.rewards import build_reward_functions

    url = f"http://127.0.0.1:{_closed_port()}/score" if path == "/closed" else judge_url + path
    (judge,) = build_reward_functions([{"name": "judge", "function": "tests.reward_helpers:judged_by_url",
                                        "isolated": True, "kwargs": {"url": url}}])
    try:
        code, message = _exit_code(judge)
    finally:
        judge.stop()
    assert code == expected, message
    assert "reward 'judge' (isolated) raised" in message


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def repo(tmp_path, monkeypatch):
    return stage_repo(tmp_path, monkeypatch)


def _hold_lock(root: Path, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


# what SLURM / Kubernetes / torchrun put around a single stage that no launcher of ours started
SCHEDULER_ENVS = [{"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MACHINE_RANK": "0"},
                  {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "1"}]


@pytest.mark.parametrize("env", SCHEDULER_ENVS)
def test_a_scheduler_s_rank_variables_do_not_skip_the_stage_lock(repo, monkeypatch, capsys, env):
    from flows.stages.__main__ import main

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    holder = _hold_lock(repo, env)
    try:
        assert main(["convert"]) == EXIT_ERROR
        assert f"StageBusy: convert: `train` (PID {holder.pid}, since " in capsys.readouterr().err
        assert not (repo / "artifacts/converted_model").exists()
    finally:
        holder.kill()
        holder.wait()


def test_only_a_rank_our_launcher_started_skips_the_lock(tmp_path):
    exits = tmp_path / "rank-exits"
    exits.mkdir()
    ours = {"WORLD_SIZE": "2", "LOCAL_RANK": "1", RANK_EXITS_ENV: str(exits)}
    assert is_launched_child(ours)
    assert not is_launched_child({**ours, RANK_EXITS_ENV: str(tmp_path / "gone")})  # a launch that ended
    assert not is_launched_child({k: v for k, v in ours.items() if k != "LOCAL_RANK"})  # the launcher's stage
    assert not is_launched_child({"WORLD_SIZE": "2", "LOCAL_RANK": "1", "MACHINE_RANK": "1"})


def test_machine_1_s_stage_takes_its_own_machine_s_lock(repo, monkeypatch, capsys):
    from flows.stages.__main__ import main

    holder = _hold_lock(repo, {"MACHINE_RANK": "1"})  # machine 1's train stage
    try:
        monkeypatch.setenv("MACHINE_RANK", "1")
        assert main(["convert"]) == EXIT_ERROR  # a second stage on machine 1 is refused ...
        assert f"`train` (PID {holder.pid}, since " in capsys.readouterr().err
        assert stage_lock_path(repo, 1).exists()
        with stage_lock(repo, "train", {}):  # ... while machine 0's lock is not machine 1's to hold
            pass
    finally:
        holder.kill()
        holder.wait()


STAGE = """
import sys, time
from pathlib import Path
from flows.stages.common import stage_lock
with stage_lock(Path.cwd(), "train"):
    for out in ("artifacts/model/model.safetensors", "artifacts/checkpoints/state", "metrics/train_log.csv",
                "plots/training.png"):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out + ".tmp").write_text(sys.argv[1])
        Path(out + ".tmp").replace(out)
    if sys.argv[1] == "by hand":
        print("held", flush=True)
        time.sleep(120)
"""


def test_dvc_repro_while_train_runs_by_hand_is_refused_and_keeps_its_model(tmp_path):
    """The project's train outs, under a stage that takes the project's lock: DVC removes a non-persist out
    before the stage's lock can refuse it."""
    outs = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]["outs"]
    (tmp_path / "stage.py").write_text(STAGE)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"train": {"output_dir": "artifacts"}}))
    stage = {"cmd": f"{sys.executable} stage.py repro", "deps": ["stage.py"], "outs": outs}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": stage}}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "DVC_NO_ANALYTICS": "1"}
    dvc = str(Path(sys.executable).with_name("dvc"))
    subprocess.run([dvc, "init", "--no-scm", "-q"], cwd=tmp_path, env=env, check=True)
    holder = subprocess.Popen([sys.executable, "stage.py", "by hand"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        repro = subprocess.run([dvc, "repro", "train"], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=120)
        assert repro.returncode != 0
        assert f"StageBusy: train: `train` (PID {holder.pid}, since " in repro.stdout + repro.stderr
        assert (tmp_path / "artifacts/model/model.safetensors").read_text() == "by hand"
        assert (tmp_path / "artifacts/checkpoints/state").read_text() == "by hand"
    finally:
        holder.kill()
        holder.wait()
