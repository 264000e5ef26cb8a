"""The Prefect flow over a vLLM server that dies mid-training and is started again: the train stage fails with
the transient exit code, the flow retries it, the retry resumes from the last checkpoint, and every step
reaches metrics/train_log.csv and MLflow once.

The pipeline is tests/test_pipeline.py's tiny embedded default with a head size vLLM's CPU attention takes
(64 / 2), sampling in train through `python -m flows.serve` (generation.vllm_mode: server).
"""

from __future__ import annotations

import csv
import shutil
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.test_pipeline import built_pipeline, copy_repo, dvc, mlflow_client
from tests.test_vllm_server import Server, free_port
from tests.tiny import require_vllm

pytestmark = pytest.mark.slow
MAX_STEPS = 6
KILL_AFTER = 2
# generation.vllm_server_timeout: it also bounds each /generate, whose first call on a busy 2-core CPU can
# take over 10 s
SERVER_TIMEOUT_S = 30
OUTAGE_S = 40  # > SERVER_TIMEOUT_S, so the stage fails rather than reconnecting to the restarted server


def steps(repo: Path) -> list[int]:
    path = repo / "metrics/train_log.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as fh:
        return [int(row["step"]) for row in csv.DictReader(fh)]


def edit_params(repo: Path, **sections: dict) -> None:
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    for section, values in sections.items():
        raw[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


class KillAndRestart(threading.Thread):
    """Stops the server once train has logged KILL_AFTER steps, waits for the stage to fail on it, and starts
    a server on the same port again (the flow's retry delay is longer than both). A server back within the
    stage's own wait (generation.vllm_server_timeout) is found again without a retry: the outage here is
    longer."""

    def __init__(self, repo: Path, server: Server, model_dir: Path, log_dir: Path):
        super().__init__(daemon=True)
        self.repo, self.server, self.model_dir, self.log_dir = repo, server, model_dir, log_dir
        self.again: Server | None = None
        self.killed_at: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + 600
            while len(steps(self.repo)) < KILL_AFTER:
                assert time.monotonic() < deadline, "train logged no steps"
                time.sleep(0.05)
            self.server.stop()
            self.killed_at = steps(self.repo)
            time.sleep(OUTAGE_S)  # longer than the stage waits for its server: it has exited 1 by now
            self.again = Server(self.model_dir, self.log_dir / "again.log", max_model_length=128,
                                port=self.server.port)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_a_server_killed_mid_train_is_retried_by_the_flow_and_every_step_lands_once(
        prefect_harness, clean_env, tmp_path, tmp_path_factory):
    from flows.pipeline import grpo_pipeline

    require_vllm()
    repo = copy_repo(built_pipeline(tmp_path_factory)[0], tmp_path / "repo")
    shutil.rmtree(repo / "artifacts/checkpoints", ignore_errors=True)
    edit_params(repo, embedded={"hidden_size": 64, "num_attention_heads": 2},
                train={"max_steps": MAX_STEPS, "save_steps": 1})
    dvc(repo, "repro", "calibrate")  # the base model with a head size of 32, validated data, weights
    model_dir = tmp_path / "served-model"
    shutil.copytree(repo / "artifacts/base_model", model_dir)
    server = Server(model_dir, tmp_path / "server.log", max_model_length=128)
    edit_params(repo, generation={"backend": "vllm", "vllm_mode": "server", "vllm_server_port": server.port,
                                  "vllm_group_port": free_port(), "vllm_server_timeout": SERVER_TIMEOUT_S})
    killer = KillAndRestart(repo, server, model_dir, tmp_path)
    killer.start()
    try:
        result = grpo_pipeline(stages=["train"], repo=str(repo), retries=1, retry_delay_seconds=45)
    finally:
        killer.join(timeout=120)
        server.stop()
        if killer.again is not None:
            killer.again.stop()
    assert killer.error is None, killer.error
    assert KILL_AFTER <= len(killer.killed_at) < MAX_STEPS  # killed mid-run
    assert result["stages"][0]["ran"]
    assert steps(repo) == list(range(1, MAX_STEPS + 1))

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        (task,) = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[result["flow_run_id"]])))
    assert task.run_count == 2 and task.state.is_completed()  # failed once (exit 1), retried, resumed

    client = mlflow_client(repo)
    exp = client.get_experiment_by_name("grpo-pipeline")
    runs = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{result['parent_run_id']}' "
                                                   "and tags.stage = 'train'")
    logged = [m.step for run in runs for m in client.get_metric_history(run.info.run_id, "loss")]
    # each step once, however many runs the tries opened
    assert sorted(logged) == list(range(1, MAX_STEPS + 1))
