"""The deployment path users follow, against a real `prefect server start` on 127.0.0.1:

    prefect work-pool create --type process grpo-process
    GRPO_REPO_DIR=$PWD prefect --no-prompt deploy --all          # prefect.yaml, as shipped
    prefect deployment run grpo-pipeline/adhoc -p params_overrides='{"evaluate.seed": 1}'
    prefect worker start --pool grpo-process                     # picks the run up and completes it

on a copy of the session's built pipeline (tests/test_pipeline.py), so DVC re-runs just `evaluate`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from flows.stages.common import load_params
from tests.test_pipeline import BIN, built_pipeline, copy_repo, dvc, mlflow_client, pipeline_env, stage_runs

pytestmark = pytest.mark.slow
PREFECT = str(BIN / "prefect")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """`prefect server start` with its own PREFECT_HOME (database); yields the environment that points at it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = pipeline_env(PREFECT_HOME=str(home), PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
                       PREFECT_SERVER_API_HOST="127.0.0.1", PREFECT_SERVER_API_PORT=str(port))
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=5) as resp:
                    if json.loads(resp.read()) is True:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def prefect(repo: Path, env: dict, *args: str, timeout: int = 300) -> str:
    proc = subprocess.run([PREFECT, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"prefect {' '.join(args)} exited {proc.returncode}\n{out[-4000:]}"
    return out


def read_from_api(env: dict, coro_fn):
    """Run ``coro_fn(client)`` against the test's server (a fresh event loop, the server's URL)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def main():
        async with get_client() as client:
            return await coro_fn(client)

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        return asyncio.run(main())


def test_deploy_schedule_run_and_worker_complete_the_flow(prefect_server, tmp_path_factory):
    repo = copy_repo(built_pipeline(tmp_path_factory)[0], tmp_path_factory.mktemp("worker") / "repo")
    env = {**prefect_server, "GRPO_REPO_DIR": str(repo)}
    before = {r.info.run_id for r in stage_runs(repo)}

    prefect(repo, env, "work-pool", "create", "--type", "process", "grpo-process")
    prefect(repo, env, "--no-prompt", "deploy", "--all")

    # the nightly schedule, as the UI and CLI show it
    inspected = prefect(repo, env, "deployment", "inspect", "grpo-pipeline/nightly-retrain")
    assert "0 2 * * *" in inspected
    nightly = read_from_api(env, lambda c: c.read_deployment_by_name("grpo-pipeline/nightly-retrain"))
    (schedule,) = nightly.schedules
    assert schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone == "UTC" and schedule.active
    assert nightly.work_pool_name == "grpo-process"

    started = prefect(repo, env, "deployment", "run", "grpo-pipeline/adhoc", "-p", 'params_overrides={"evaluate.seed": 1}')
    flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", started).group(1)
    prefect(repo, env, "worker", "start", "--pool", "grpo-process", "--run-once", timeout=900)

    flow_run = read_from_api(env, lambda c: c.read_flow_run(flow_run_id))
    assert flow_run.state.is_completed(), flow_run.state
    assert flow_run.parameters == {"params_overrides": {"evaluate.seed": 1}}
    # the run changed only evaluate's key: DVC re-ran evaluate alone, in the worker's checkout
    assert load_params(repo / "params.yaml").evaluate.seed == 1
    assert "Data and pipelines are up to date." in dvc(repo, "status").stdout

    # the flow run and the MLflow parent run name each other
    new = [r for r in stage_runs(repo) if r.info.run_id not in before]
    parent = next(r for r in new if r.data.tags.get("grpo.role") == "pipeline")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_id"] == flow_run_id
    assert parent.data.tags["prefect.flow_run_url"] == (
        f"{env['PREFECT_API_URL'].removesuffix('/api')}/runs/flow-run/{flow_run_id}")
    children = [r for r in new if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert [r.data.tags["stage"] for r in children] == ["evaluate"]
    assert children[0].data.tags["prefect.flow_run_id"] == flow_run_id
    assert "pipeline_summary.md" in {a.path for a in mlflow_client(repo).list_artifacts(parent.info.run_id)}

    artifacts = read_from_api(env, lambda c: artifacts_of(c, flow_run_id))
    link = artifacts["mlflow-parent-run"]
    # Prefect stores a link artifact as its markdown: [text](url)
    assert link.data == (f"[MLflow parent run {parent.info.run_id}](http://127.0.0.1:5000/#/experiments/"
                         f"{parent.info.experiment_id}/runs/{parent.info.run_id})")
    summary = artifacts["grpo-pipeline-summary"].data
    assert "## Calibration" in summary and "## Evaluation" in summary and "## Registry" in summary
    assert "| evaluate | ran |" in summary and "| train | up to date |" in summary


async def artifacts_of(client, flow_run_id: str) -> dict:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    found = await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in found}
