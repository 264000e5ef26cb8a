"""The Prefect flow: retry policy, params overrides, the summary artifact, and a run of the real pipeline.

One session-scoped ``prefect_test_harness`` (a temporary Prefect server, tests/conftest.py) serves every flow
run here.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.pipeline import (
    SUMMARY_ARTIFACT_KEY,
    PermanentStageFailure,
    StageFailed,
    apply_params_overrides,
    retry_transient,
    stage_exit_code,
    summary_markdown,
)
from flows.stages.common import load_params

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------
# pieces


def test_stage_exit_code_is_read_from_dvc_output():
    out = ("...\nERROR: failed to reproduce 'validate': failed to run: python -m flows.stages validate, "
           "exited with 3\n")
    assert stage_exit_code(out, "validate") == 3
    assert stage_exit_code(out, "train") is None
    assert stage_exit_code("ERROR: Unable to acquire lock", "validate") is None


class _State:
    def __init__(self, exc):
        self.data = exc


def test_only_transient_failures_are_retried():
    assert retry_transient(None, None, _State(StageFailed("train", 255, 1, "oom")))
    assert retry_transient(None, None, _State(RuntimeError("lock")))
    assert not retry_transient(None, None, _State(PermanentStageFailure("validate", 255, 3, "bad rows")))


def test_overrides_are_validated_and_written_like_dvc_exp_run(tmp_path):
    from grpo_core.config import ConfigError

    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    with pytest.raises(ConfigError, match="train.learning_rat: unknown key; did you mean 'learning_rate'"):
        apply_params_overrides(params, {"train.learning_rat": 1e-4})
    with pytest.raises(ConfigError, match="train.max_steps"):
        apply_params_overrides(params, {"train.max_steps": 0})
    assert params.read_text() == (REPO / "params.yaml").read_text()  # nothing written on error
    apply_params_overrides(params, {"train.learning_rate": 1e-4, "evaluate.pass_k": [1, 2]})
    text = params.read_text()
    assert "# grpo-pipeline parameters" in text  # comments kept
    cfg = load_params(params)
    assert cfg.train.optim.learning_rate == 1e-4 and cfg.evaluate.pass_k == [1, 2]
    assert cfg.train.forward.mixed_precision == "no"  # survives the ruamel rewrite


HOLD = """
import sys, time
from pathlib import Path
from flows.stages.common import exclusive
with exclusive(Path(sys.argv[1]), sys.argv[2], RuntimeError):
    print("held", flush=True)
    time.sleep(120)
"""


@contextlib.contextmanager
def held(path: Path, holder: str):
    """``path``'s lock held by another process as ``holder``; yields that process."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), holder], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_overrides_are_refused_while_a_stage_runs_and_nothing_is_written(tmp_path):
    from flows.stages.common import StageBusy, stage_lock_path

    (tmp_path / ".dvc").mkdir()
    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    with held(stage_lock_path(tmp_path), "train") as stage:
        with pytest.raises(StageBusy, match=f"params.yaml overrides: `train` \\(PID {stage.pid}, since "):
            apply_params_overrides(params, {"train.learning_rate": 1e-4})
    assert params.read_text() == (REPO / "params.yaml").read_text()
    apply_params_overrides(params, {"train.learning_rate": 1e-4})  # the stage ended: its lock with it
    assert load_params(params).train.optim.learning_rate == 1e-4


def test_summary_lists_stages_weights_evaluation_and_registry(tmp_path):
    (tmp_path / "artifacts/calibration").mkdir(parents=True)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "reports").mkdir()
    (tmp_path / "artifacts/calibration/reward_weights.json").write_text(json.dumps(
        {"weights": {"correctness": 0.7, "format": 0.3}, "rule": "w = ...", "flags": {"format": ["dominant"]},
         "warnings": ["format dominates"]}))
    (tmp_path / "metrics/eval.json").write_text(json.dumps(
        {"base": {"accuracy": 0.25, "pass@4": 0.5}, "trained": {"accuracy": 0.5, "pass@4": 0.75},
         "delta": {"accuracy": 0.25, "pass@4": 0.25}}))
    (tmp_path / "reports/registry.json").write_text(json.dumps(PROMOTED))
    md = summary_markdown(tmp_path, status="FINISHED",
                          results=[{"stage": "train", "ran": True, "seconds": 3.0}],
                          selected=["train", "evaluate"], flow_run_id="f1", parent_run_id="p1",
                          experiment="e", tracking_uri="sqlite:///x")
    assert "| train | ran | 3.0 |" in md and "| evaluate | not run | - |" in md
    assert "| `format` | 0.3000 | dominant |" in md
    assert "| accuracy | 0.2500 | 0.5000 | 0.2500 |" in md
    assert f"## Registry\n\n{PROMOTED_TEXT}\n" in md
    assert "Stage results not shown" not in md


#: a registry decision as evaluate writes it (reports/registry.json), and its rendering worked out by hand
PROMOTED = {"registered": True, "model_name": "grpo-policy", "version": 3, "alias": "champion",
            "previous_champion": 2, "metric": "accuracy", "trained": 0.5, "reference": 0.25,
            "against": "champion", "margin": 0.1, "promote": True, "delta": 0.25,
            "reason": "accuracy 0.5000 beats the champion's 0.2500 by more than 0.1 (delta +0.2500)"}
PROMOTED_TEXT = ("Registered `grpo-policy` version 3. Promoted to `@champion`: accuracy 0.5000 beats the "
                 "champion's 0.2500 by more than 0.1 (delta +0.2500).")
EVALUATED = [{"stage": "evaluate", "ran": True, "seconds": 1.0}]


def summary_of(root: Path, results: list[dict] = EVALUATED) -> str:
    return summary_markdown(root, status="FINISHED", results=results, selected=["evaluate"], flow_run_id="f1",
                            parent_run_id="p1", experiment="e", tracking_uri="sqlite:///x")


def test_summary_takes_the_registry_decision_from_the_json_never_the_markdown(tmp_path):
    (tmp_path / "reports").mkdir()
    # the report says otherwise: the summary must not read it
    (tmp_path / "reports/evaluation.md").write_text("# Evaluation\n\n## Registry\n\nRegistered v9. "
                                                    "Promoted.\n")
    md = summary_of(tmp_path)
    assert "v9" not in md and "## Registry" not in md
    assert "- `reports/registry.json` is missing (written by `evaluate`)" in md
    (tmp_path / "reports/registry.json").write_text(json.dumps(PROMOTED))
    md = summary_of(tmp_path)
    assert f"## Registry\n\n{PROMOTED_TEXT}\n" in md and "v9" not in md
    not_promoted = {**PROMOTED, "promote": False, "alias": None, "note": "champion v2 has no accuracy"}
    (tmp_path / "reports/registry.json").write_text(json.dumps(not_promoted))
    assert "version 3. Not promoted to `@champion`: accuracy" in summary_of(tmp_path)
    assert "\n(champion v2 has no accuracy)\n" in summary_of(tmp_path)
    (tmp_path / "reports/registry.json").write_text(json.dumps(
        {"registered": False, "promote": False, "alias": None, "reason": "MLflow tracking is unavailable"}))
    assert "## Registry\n\nNot registered: MLflow tracking is unavailable.\n" in summary_of(tmp_path)


def test_summary_names_a_malformed_result_and_a_missing_one_of_a_stage_that_ran(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "reports").mkdir()
    # evaluate did not run: no files expected
    assert "Stage results not shown" not in summary_of(tmp_path, results=[])
    (tmp_path / "metrics/eval.json").write_text('{"base": {"accuracy": 0.5}, "trained": ')
    (tmp_path / "reports/registry.json").write_text(
        json.dumps({"registered": True, "promote": True, "alias": None, "reason": "r"}))
    md = summary_of(tmp_path, results=[])  # malformed: named even when its stage did not run here
    problems = md.split("## Stage results not shown\n\n", 1)[1].splitlines()
    assert problems[0].startswith("- `metrics/eval.json` is not readable JSON (")
    assert problems[1] == ("- `reports/registry.json` is malformed: no model_name, "
                           "version (written by `evaluate`)")
    assert "## Evaluation" not in md and "## Registry" not in md


# ---------------------------------------------------------------------------------------------------
# flow runs


STAGE_SCRIPT = """
import pathlib, sys
counter = pathlib.Path("attempts")
n = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(n))
mode = pathlib.Path("mode").read_text().strip()
if mode == "permanent":
    sys.exit(3)  # like a failed data validation
if mode == "transient" and n == 1:
    sys.exit(1)  # like a crash
pathlib.Path("out.txt").write_text("ok")
"""


def fake_repo(root: Path, mode: str) -> Path:
    """A one-stage DVC repo (no git) whose `validate` fails the way ``mode`` says."""
    root.mkdir()
    (root / ".dvc").mkdir()
    (root / ".dvc/config").write_text("[core]\n    no_scm = true\n    analytics = false\n")
    (root / "params.yaml").write_text((REPO / "params.yaml").read_text())
    (root / "stage.py").write_text(STAGE_SCRIPT)
    (root / "mode").write_text(mode)
    (root / "dvc.yaml").write_text("stages:\n  validate:\n    cmd: python stage.py\n    deps: [stage.py]\n"
                                   "    outs: [out.txt]\n")
    return root


def artifact_markdown(flow_run_id: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[SUMMARY_ARTIFACT_KEY]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    assert found, f"no {SUMMARY_ARTIFACT_KEY} artifact for flow run {flow_run_id}"
    return found[0].data


@pytest.mark.slow
def test_transient_failures_are_retried_and_validation_failures_are_not(prefect_harness, clean_env, tmp_path):
    from flows.pipeline import grpo_pipeline
    from tests.test_pipeline import mlflow_client

    flaky = fake_repo(tmp_path / "flaky", "transient")
    result = grpo_pipeline(stages=["validate"], repo=str(flaky), retries=2, retry_delay_seconds=0)
    assert (flaky / "attempts").read_text() == "2" and result["stages"][0]["ran"]

    bad = fake_repo(tmp_path / "bad", "permanent")
    with pytest.raises(PermanentStageFailure, match="stage 'validate' failed \\(stage exit code 3\\)"):
        grpo_pipeline(stages=["validate"], repo=str(bad), retries=2, retry_delay_seconds=0)
    assert (bad / "attempts").read_text() == "1"  # not retried
    client = mlflow_client(bad)
    (parent,) = client.search_runs([client.get_experiment_by_name("grpo-pipeline").experiment_id])
    assert parent.info.status == "FAILED"
    md = artifact_markdown(parent.data.tags["prefect.flow_run_id"])
    assert "Status **FAILED**" in md and "| validate | failed | - |" in md


@pytest.mark.slow
def test_a_second_flow_run_on_a_repo_is_refused_before_it_touches_params_yaml(prefect_harness, clean_env,
                                                                              tmp_path):
    from flows.pipeline import grpo_pipeline
    from flows.stages.common import FlowBusy, flow_lock_path

    repo = fake_repo(tmp_path / "repo", "ok")
    before = (repo / "params.yaml").read_text()
    with held(flow_lock_path(repo), "flow run brave-otter") as other:
        with pytest.raises(FlowBusy, match=f"`flow run brave-otter` \\(PID {other.pid}, since .*would "
                                           "rewrite params.yaml under its stages"):
            grpo_pipeline(stages=["validate"], repo=str(repo), params_overrides={"train.max_steps": 7},
                          retries=0)
    assert (repo / "params.yaml").read_text() == before and not (repo / "attempts").exists()
    result = grpo_pipeline(stages=["validate"], repo=str(repo), params_overrides={"train.max_steps": 7},
                           retries=0)
    assert result["stages"][0]["ran"] and load_params(repo / "params.yaml").train.max_steps == 7


EVALUATE_SCRIPT = """
import json, pathlib
for path, doc in json.loads(pathlib.Path("results.json").read_text()).items():
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(json.dumps(doc))
"""


@pytest.mark.slow
def test_the_flow_returns_and_shows_the_registry_decision_evaluate_wrote_as_json(prefect_harness, clean_env,
                                                                                 tmp_path):
    """An `evaluate` that writes its JSON results and no markdown: the flow's return value and summary
    artifact carry the decision all the same."""
    from flows.pipeline import grpo_pipeline

    repo = fake_repo(tmp_path / "repo", "ok")
    metrics = {"base": {"accuracy": 0.25}, "trained": {"accuracy": 0.5}, "delta": {"accuracy": 0.25}}
    (repo / "results.json").write_text(
        json.dumps({"metrics/eval.json": metrics, "reports/registry.json": PROMOTED}))
    (repo / "evaluate.py").write_text(EVALUATE_SCRIPT)
    (repo / "dvc.yaml").write_text("stages:\n  evaluate:\n    cmd: python evaluate.py\n    deps: "
                                   "[evaluate.py]\n    outs: [metrics/eval.json, reports/registry.json]\n")
    result = grpo_pipeline(stages=["evaluate"], repo=str(repo), retries=0)
    assert result["registry"] == PROMOTED and result["eval"] == metrics
    md = artifact_markdown(result["flow_run_id"])
    assert f"## Registry\n\n{PROMOTED_TEXT}\n" in md and "| accuracy | 0.2500 | 0.5000 | 0.2500 |" in md
    assert not (repo / "reports/evaluation.md").exists()


# The flow run by a worker from the deployment, end to end: tests/test_prefect_deploy.py.


def test_prefect_yaml_deploys_the_flow_on_a_nightly_schedule():
    import inspect

    import yaml
    from prefect.client.schemas.schedules import CronSchedule

    from flows.pipeline import grpo_pipeline

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    names = set(inspect.signature(grpo_pipeline.fn).parameters)
    by_name = {d["name"]: d for d in spec["deployments"]}
    assert {"nightly-retrain", "adhoc"} <= set(by_name)
    for dep in spec["deployments"]:
        path, func = dep["entrypoint"].split(":")
        assert (REPO / path).is_file() and func == "grpo_pipeline"
        assert set(dep.get("parameters") or {}) <= names
        assert dep["work_pool"]["name"] == "grpo-process"
    (schedule,) = by_name["nightly-retrain"]["schedules"]
    CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])  # valid cron
    assert (spec["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"]
            == "{{ $GRPO_REPO_DIR }}")
