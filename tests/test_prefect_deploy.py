"""The deployment path users follow, against a real `prefect server start` on 127.0.0.1:

    prefect work-pool create --type process grpo-process
    GRPO_REPO_DIR=$PWD prefect --no-prompt deploy --all          # prefect.yaml, as shipped
    prefect deployment run grpo-pipeline/adhoc -p params_overrides='{"train.max_steps": 4}'
    prefect worker start --pool grpo-process                     # picks the run up and completes it

on a copy of the session's built pipeline (tests/test_pipeline.py), logging to the session's `mlflow server`.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from flows.stages.common import load_params
from tests.test_pipeline import BIN, TINY, built_pipeline, copy_repo, dvc, pipeline_env
from tests.test_servers import mlflow_server, prefect_server  # noqa: F401 - the session's servers

pytestmark = pytest.mark.slow
PREFECT = str(BIN / "prefect")


@pytest.fixture(scope="module")
def servers(prefect_server, mlflow_server):  # noqa: F811 - the fixtures imported above
    """The session's `prefect server start` and `mlflow server` (tests/test_servers.py); the environment a
    user's shell has when pointed at them."""
    return pipeline_env(PREFECT_API_URL=prefect_server.api,
                        MLFLOW_TRACKING_URI=mlflow_server.uri), mlflow_server.uri


def prefect(repo: Path, env: dict, *args: str, timeout: int = 300) -> str:
    proc = subprocess.run([PREFECT, *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)
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


def test_deploy_schedule_run_and_worker_complete_the_flow(servers, tmp_path_factory):
    from mlflow import MlflowClient

    repo = copy_repo(built_pipeline(tmp_path_factory)[0], tmp_path_factory.mktemp("worker") / "repo")
    env, mlflow_uri = servers
    env = {**env, "GRPO_REPO_DIR": str(repo)}
    client = MlflowClient(tracking_uri=mlflow_uri)

    prefect(repo, env, "work-pool", "create", "--type", "process", "grpo-process")
    prefect(repo, env, "--no-prompt", "deploy", "--all")

    # the nightly schedule, as the UI and CLI show it
    inspected = prefect(repo, env, "deployment", "inspect", "grpo-pipeline/nightly-retrain")
    assert "0 2 * * *" in inspected
    nightly = read_from_api(env, lambda c: c.read_deployment_by_name("grpo-pipeline/nightly-retrain"))
    (schedule,) = nightly.schedules
    assert schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone == "UTC" and schedule.active
    assert nightly.work_pool_name == "grpo-process"

    started = prefect(repo, env, "deployment", "run", "grpo-pipeline/adhoc", "-p",
                      'params_overrides={"train.max_steps": 4}')
    flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", started).group(1)
    prefect(repo, env, "worker", "start", "--pool", "grpo-process", "--run-once", timeout=900)

    flow_run = read_from_api(env, lambda c: c.read_flow_run(flow_run_id))
    assert flow_run.state.is_completed(), flow_run.state
    assert flow_run.parameters == {"params_overrides": {"train.max_steps": 4}}
    assert load_params(repo / "params.yaml").train.max_steps == 4
    assert "Data and pipelines are up to date." in dvc(repo, "status").stdout

    # the flow run and the MLflow parent run (on the tracking server) name each other
    exp = client.get_experiment_by_name("grpo-pipeline")
    (parent,) = client.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}' "
                                                        "and tags.`grpo.role` = 'pipeline'")
    assert parent.info.status == "FINISHED" and parent.info.run_name == "max_steps=4"
    assert parent.data.tags["prefect.flow_run_url"] == (
        f"{env['PREFECT_API_URL'].removesuffix('/api')}/runs/flow-run/{flow_run_id}")
    children = {r.data.tags["stage"]: r for r in client.search_runs(
        [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
    assert set(children) == {"train", "evaluate", "export"}  # what max_steps feeds: DVC skipped the rest
    train = children["train"]
    assert (train.data.tags["prefect.flow_run_id"] == flow_run_id
            and train.data.params["train.max_steps"] == "4")
    # resumed from the built run's last checkpoint: this run trained (and logged) the one new step
    assert train.data.tags["train.checkpoints"] == f"resume:checkpoint-{TINY['train']['max_steps']}"
    assert [m.step for m in client.get_metric_history(train.info.run_id, "reward")] == [4]
    assert parent.data.metrics["steps"] == 4 and "accuracy" in parent.data.metrics
    # the parent's curve is the whole train log's, the resumed run's first steps included
    assert sorted(m.step for m in client.get_metric_history(parent.info.run_id, "reward")) == [1, 2, 3, 4]
    assert "pipeline_summary.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}

    artifacts = read_from_api(env, lambda c: artifacts_of(c, flow_run_id))
    link = artifacts["mlflow-parent-run"]
    # Prefect stores a link artifact as its markdown: [text](url)
    assert link.data == (f"[MLflow parent run {parent.info.run_id}]({mlflow_uri}/#/experiments/"
                         f"{parent.info.experiment_id}/runs/{parent.info.run_id})")
    summary = artifacts["grpo-pipeline-summary"].data
    assert "## Calibration" in summary and "## Evaluation" in summary and "## Registry" in summary
    assert "| train | ran |" in summary and "| calibrate | up to date |" in summary


async def artifacts_of(client, flow_run_id: str) -> dict:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    found = await client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in found}
