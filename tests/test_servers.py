"""Against real servers, as a team runs it: `mlflow server` and `prefect server start` on 127.0.0.1.

- the Prefect flow runs the DVC pipeline with both servers: flow and task runs on the Prefect server,
  the parent and stage runs (with the per-step curve) on the MLflow server;
- a guard that stops training fails the Prefect task (once, not retried) with the guard's reason, and
  tags the MLflow run;
- the MLflow server dies mid-training and comes back: training goes on, and every step's metrics reach
  MLflow in the end (replayed from the tracker's backlog), equal to the local train log.

Both servers are the pip-installed ones (`mlflow`, `prefect` in the project's dependencies), started
once per session in temporary directories; nothing here talks to anything but 127.0.0.1.
"""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_pipeline import BIN, built_pipeline, copy_repo, pipeline_env
from tests.tiny import make_prompts, make_tiny_model, tiny_config

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process in its own session (so stop() takes its workers too), polled until healthy."""

    def __init__(self, name: str, cmd: list[str], health_url: str, env: dict[str, str], log_path: Path):
        self.name, self.cmd, self.health_url, self.env, self.log_path = name, cmd, health_url, env, log_path
        self.proc: subprocess.Popen | None = None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def start(self, timeout: float = 300) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text()[-3000:]}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {timeout}s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM to the whole process group (the CLI may have handed over to a worker and exited)."""
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + 30
            while self.healthy() and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.healthy():
                break
        self.proc.wait(timeout=30)
        assert not self.healthy(), f"{self.name} still answers after SIGKILL"


def _env(**extra: str) -> dict[str, str]:
    env = pipeline_env(**extra)
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    return env


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    server = Server("mlflow server",
                    [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers",
                     "1", "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}", "--artifacts-destination",
                     str(d / "artifacts")],
                    f"http://127.0.0.1:{port}/health", _env(), d / "server.log")
    server.uri = f"http://127.0.0.1:{port}"
    server.start()
    yield server
    server.stop()


def started_prefect_server(d: Path) -> Server:
    """`prefect server start` on a free port, its database and log in ``d``; ``.api`` is its API URL."""
    d.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = _env(PREFECT_HOME=str(d), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false")
    server = Server("prefect server",
                    [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
                     "--no-ui", "--analytics-off", "--no-scheduler", "--no-late-runs"],
                    f"http://127.0.0.1:{port}/api/health", env, d / "server.log")
    server.api = f"http://127.0.0.1:{port}/api"
    server.start()
    return server


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    server = started_prefect_server(tmp_path_factory.mktemp("prefect-server"))
    yield server
    server.stop()


def prefect_post(api: str, path: str, body: dict) -> list[dict]:
    import json

    req = urllib.request.Request(f"{api}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def run_flow(repo: Path, mlflow_uri: str, prefect_api: str, *overrides: str) -> subprocess.CompletedProcess:
    args = [a for o in overrides for a in ("-S", o)]
    env = _env(MLFLOW_TRACKING_URI=mlflow_uri, PREFECT_API_URL=prefect_api,
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    return subprocess.run([sys.executable, "-m", "flows.pipeline", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=900)


def runs_by_stage(client, parent_run_id: str) -> dict:
    exp = client.get_experiment_by_name("grpo-pipeline")
    runs = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    return {r.data.tags["stage"]: r for r in runs}


# The flow on these servers as users run it (deployment, worker): tests/test_prefect_deploy.py.


def test_a_guard_stop_fails_the_prefect_task_with_its_reason(mlflow_server, prefect_server, tmp_path,
                                                            tmp_path_factory):
    from mlflow import MlflowClient

    repo = copy_repo(built_pipeline(tmp_path_factory)[0], tmp_path / "repo")
    # kl is 0 at the first step of a run from the base model, and > 0 after three steps of training; window 1:
    # each step judged alone (params.yaml's median of 5 would not see three steps of it)
    proc = run_flow(repo, mlflow_server.uri, prefect_server.api, "train.max_steps=6",
                    "guards.kl_max.threshold=0.0", "guards.kl_max.action=stop", "guards.kl_max.window=1")
    assert proc.returncode != 0
    assert "guard kl_max stopped training: step 4: kl=" in proc.stderr

    flows = prefect_post(prefect_server.api, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
    assert flows[0]["state_type"] == "FAILED"
    tasks = prefect_post(prefect_server.api, "/task_runs/filter",
                         {"flow_runs": {"id": {"any_": [flows[0]["id"]]}}})
    train_task = next(t for t in tasks if t["name"].startswith("train"))
    assert train_task["state_type"] == "FAILED"
    assert train_task["run_count"] == 1  # a guard stop is permanent: not retried
    assert "stage 'train' failed (stage exit code 4)" in train_task["state"]["message"]

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = client.get_experiment_by_name("grpo-pipeline")
    parent = client.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{flows[0]['id']}' "
                                                     "and tags.`grpo.role` = 'pipeline'")[0]
    train = runs_by_stage(client, parent.info.run_id)["train"]
    assert train.info.status == "FAILED"
    assert train.data.tags["guard.kl_max"].startswith("stop: step 4: kl=")
    assert (repo / "artifacts/checkpoints/checkpoint-3").is_dir()  # the last good checkpoint is kept


class OutageTracker:
    """Wraps the MLflow tracker; the server goes down after step ``down_after`` and is back after
    ``up_after``."""

    def __init__(self, tracker, server: Server, down_after: int, up_after: int):
        self.tracker, self.server, self.down_after, self.up_after = tracker, server, down_after, up_after

    def log_metrics(self, metrics, step):
        self.tracker.log_metrics(metrics, step)
        if step == self.down_after:
            self.server.stop()
        elif step == self.up_after:
            self.server.start()

    def set_tags(self, tags):
        self.tracker.set_tags(tags)


def test_mlflow_outage_mid_training_is_replayed_when_the_server_is_back(mlflow_server, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from flows.tracking import MLflowTracker
    from grpo_core.train.loop import TrainHooks, train

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    model_dir, data = make_tiny_model(tmp_path / "model"), make_prompts(tmp_path / "train.jsonl")
    cfg = tiny_config(model_dir, data,
                      [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}], max_steps=6)
    tracker = MLflowTracker(mlflow_server.uri, "outage", "train", retry_interval_s=0.0)
    outage = OutageTracker(tracker, mlflow_server, down_after=2, up_after=4)
    with pytest.warns(RuntimeWarning, match="failed, values kept for a retry"):
        result = train(cfg, root=tmp_path, progress=False, hooks=TrainHooks(tracker=outage))
    assert result.final_step == 6  # training went on through the outage
    assert tracker.pending["metrics"] == 0  # the backlog of steps 3 and 4 went out with step 5
    assert tracker.close() == 0

    with open(tmp_path / "metrics/train_log.csv", newline="") as fh:
        local = {int(r["step"]): float(r["reward"]) for r in csv.DictReader(fh)}
    history = MlflowClient(tracking_uri=mlflow_server.uri).get_metric_history(tracker.run_id, "reward")
    remote = {m.step: m.value for m in history}
    assert sorted(remote) == [1, 2, 3, 4, 5, 6] == sorted(local)
    assert remote == pytest.approx(local, rel=1e-5)
