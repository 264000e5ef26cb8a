"""The Prefect server restarted under a running flow (`python -m flows.pipeline` against
`prefect server start`).

- killed (SIGKILL) while train runs and started again seconds later: the client's retries carry the flow over;
  it completes, and Prefect, MLflow and the train log all say so, each step once;
- down past the client's retries (``PREFECT_CLIENT_MAX_RETRIES=1`` here: one retry, 2 s): every stage still
  runs, the MLflow parent is FINISHED as the stages were, the flow exits 1 naming the Prefect server, and its
  Prefect record is left RUNNING; the next flow run completes and settles that record as COMPLETED, saying
  why.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_chaos import wait_for
from tests.test_pipeline import built_pipeline, copy_repo, mlflow_client
from tests.test_servers import Server, _env, prefect_post, started_prefect_server

pytestmark = pytest.mark.slow
# the tiny pipeline's steps take ~0.1 s: enough of them that the server dies inside the train stage
STEPS = 40


@pytest.fixture()
def server(tmp_path):
    served = started_prefect_server(tmp_path / "prefect")
    yield served
    served.stop()


def start_flow(repo: Path, api: str, log: Path, *overrides: str, **env: str) -> subprocess.Popen:
    args = [a for o in overrides for a in ("-S", o)]
    return subprocess.Popen([sys.executable, "-m", "flows.pipeline", *args], cwd=repo, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True,
                            env=_env(PREFECT_API_URL=api,
                                     MLFLOW_TRACKING_URI=f"sqlite:///{repo / 'mlflow.db'}", **env))


def train_log_text(repo: Path) -> str:
    path = repo / "metrics/train_log.csv"
    return path.read_text() if path.is_file() else ""


def wait_for_a_train_step(repo: Path, log: Path, flow: subprocess.Popen) -> None:
    """Until this flow's train stage has written a step (the repo's train log holds an earlier run's
    steps)."""
    wait_for(lambda: "Running stage 'train'" in log.read_text(), flow, "the train stage", every=0.2)
    before = train_log_text(repo)
    wait_for(lambda: train_log_text(repo) not in (before, "") and train_log_text(repo).endswith("\n"), flow,
             "a train step", every=0.2)


def steps(repo: Path) -> list[int]:
    path = repo / "metrics/train_log.csv"
    with open(path, newline="") as fh:
        return [int(row["step"]) for row in csv.DictReader(fh)] if path.is_file() else []


def latest_flow_run(api: str) -> tuple[dict, list[dict]]:
    (run,) = prefect_post(api, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
    return run, prefect_post(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})


def crash(server: Server) -> None:
    """SIGKILL the server's process group: down at once, as a crashed or restarted machine's would be."""
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)


def mlflow_parent(repo: Path, flow_run_id: str):
    client = mlflow_client(repo)
    exp = client.get_experiment_by_name("grpo-pipeline")
    (parent,) = client.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}' "
                                                        "and tags.`grpo.role` = 'pipeline'")
    return parent


def test_a_restart_under_a_running_flow_completes_and_a_long_outage_is_settled_by_the_next_run(
        server, tmp_path, tmp_path_factory):
    repo = copy_repo(built_pipeline(tmp_path_factory)[0], tmp_path / "repo")

    # killed while train runs, started again seconds later: the flow completes
    flow = start_flow(repo, server.api, tmp_path / "flow1.log", f"train.max_steps={STEPS}")
    wait_for_a_train_step(repo, tmp_path / "flow1.log", flow)
    crash(server)
    assert flow.poll() is None and len(steps(repo)) < STEPS  # the server died inside the train stage
    time.sleep(10)
    server.start()
    assert flow.wait(timeout=600) == 0, (tmp_path / "flow1.log").read_text()[-3000:]
    run, tasks = latest_flow_run(server.api)
    assert run["state_type"] == "COMPLETED"
    assert sorted(t["name"].split("-")[0] for t in tasks if t["state_type"] == "COMPLETED") == sorted(
        ["prepare", "convert", "validate", "calibrate", "train", "evaluate", "export"])
    assert mlflow_parent(repo, run["id"]).info.status == "FINISHED"
    assert steps(repo) == list(range(1, STEPS + 1))

    # down past the client's retries from the train stage on: the stages finish, the flow says it lost Prefect
    log2 = tmp_path / "flow2.log"
    flow = start_flow(repo, server.api, log2, f"train.max_steps={STEPS + 1}", PREFECT_CLIENT_MAX_RETRIES="1")
    wait_for(lambda: "Running stage 'train'" in log2.read_text(), flow, "the train stage", every=0.2)
    crash(server)
    assert flow.wait(timeout=600) == 1
    out = log2.read_text()
    assert f"flows.pipeline: the Prefect server at {server.api} could not be reached (ConnectError" in out
    assert steps(repo) == list(range(1, STEPS + 2))
    server.start()
    stale, _ = latest_flow_run(server.api)
    assert stale["state_type"] == "RUNNING"  # what Prefect knows; MLflow knows the stages' end
    assert mlflow_parent(repo, stale["id"]).info.status == "FINISHED"

    # the next flow run completes, and settles the record the lost one could not
    flow = start_flow(repo, server.api, tmp_path / "flow3.log")
    assert flow.wait(timeout=600) == 0, (tmp_path / "flow3.log").read_text()[-3000:]
    (settled,) = prefect_post(server.api, "/flow_runs/filter", {"flow_runs": {"id": {"any_": [stale["id"]]}}})
    assert settled["state_type"] == "COMPLETED"
    assert settled["state"]["message"].startswith(
        f"ended FINISHED (MLflow parent run {mlflow_parent(repo, stale['id']).info.run_id}) while the "
        "Prefect server could not be reached; settled by the next flow run in this repo. Stages: prepare up "
        "to date, ")
    assert "train ran, evaluate ran" in settled["state"]["message"]
    stale_tasks = prefect_post(server.api, "/task_runs/filter",
                               {"flow_runs": {"id": {"any_": [stale["id"]]}}})
    assert stale_tasks and all(t["state_type"] == "COMPLETED" for t in stale_tasks)
    assert latest_flow_run(server.api)[0]["state_type"] == "COMPLETED"
