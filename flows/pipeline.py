"""Prefect flow around the DVC pipeline: one task per stage, each ``dvc repro --single-item <stage>``.

    grpo_pipeline(experiment_name=None, params_overrides=None, stages=None, force=False)

What the flow adds to ``dvc repro``:
- **process isolation**: every stage runs in its own ``dvc`` subprocess (and DVC runs the stage's command
  in another), so training's GPU memory is released before evaluation starts;
- **retries** on transient failures (a dead or silent vLLM server or sampler worker, a full disk, a crash, an
  OOM kill, a busy DVC lock: exit code 1 or a signal), never
  on permanent ones - failed data validation, bad params, unreadable data, a non-finite loss (stage exit
  codes 2-5, see ``flows/stages/__init__.py``). Training resumes from its newest checkpoint on a retry;
- **timeouts** per stage (``timeouts`` parameter, seconds; the stage's whole process group is killed);
  ``retries`` / ``retry_delay_seconds`` set the retry policy (default 2 retries, 30 s apart);
- **one MLflow parent run** per flow run: created here, passed to the stages as ``GRPO_PARENT_RUN_ID``
  with ``GRPO_FLOW_RUN_ID`` (tagged ``prefect.flow_run_id`` on every run) and ``GRPO_EXPERIMENT_NAME``,
  ended here with the pipeline's status;
- a **markdown artifact** (key ``grpo-pipeline-summary``) with the calibrated weights, the evaluation
  table and the registry decision (or the validation report when validation failed), built from the stages'
  JSON results (``STAGE_RESULTS``), never parsed out of their markdown; a result that is missing after its
  stage ran, or malformed, is named under "Stage results not shown" (and in the log) instead.

Params overrides (``{"train.learning_rate": 1e-4}``, dotted keys) are validated against the config
schema, then written into params.yaml the way ``dvc exp run -S`` writes them (ruamel, comments kept):
DVC sees an ordinary param change, re-runs exactly the stages that read those keys and records the
values in dvc.lock. Like ``dvc exp run -S`` without ``--temp``, the working copy's params.yaml keeps them.

Stages: ``None`` runs every stage (flows.stages.STAGES) in order; a subset runs just those (each
``--single-item``: their upstream outputs must be current). ``force=True`` re-runs the selected stages even
when DVC sees no change.

Run locally: ``make pipeline`` or ``python -m flows.pipeline --set train.max_steps=50``.
Deploy (nightly schedule, process work pool): see prefect.yaml and infra/README.md.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import httpx
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.prefect_records import settle_previous_run, write_outcome
from flows.stages import PERMANENT_EXIT_CODES, STAGES
from flows.stages.common import (
    CALIBRATION_WEIGHTS,
    FlowBusy,
    exclusive,
    find_repo_root,
    flow_lock_path,
    load_params,
    stage_lock,
    store_root,
)
from flows.stages.evaluate import METRICS as EVAL_METRICS
from flows.stages.evaluate import REGISTERED_KEYS, REGISTRY, REGISTRY_KEYS, registry_markdown
from flows.stages.runs import (
    EXPERIMENT_ENV,
    FLOW_RUN_ENV,
    PARENT_RUN_ENV,
    RUN_GROUP_ENV,
    common_tags,
    create_parent_run,
    process_owner,
    run_name_and_diff,
    tracking_uri_for,
)
from flows.stages.validate import REPORT_JSON as VALIDATION_JSON
from flows.stages.validate import REPORT_TXT as VALIDATION_TXT

#: seconds per stage before its process group is killed (override with the flow's ``timeouts``)
DEFAULT_TIMEOUTS = {"prepare": 2 * 3600, "convert": 3600, "validate": 3600, "calibrate": 4 * 3600,
                    "train": 48 * 3600, "evaluate": 6 * 3600, "export": 3600}
SUMMARY_ARTIFACT_KEY = "grpo-pipeline-summary"
MLFLOW_LINK_ARTIFACT_KEY = "mlflow-parent-run"
TAIL_LINES = 60


class StageFailed(RuntimeError):
    """``dvc repro <stage>`` failed; retried (transient unless a subclass says otherwise)."""

    def __init__(self, stage: str, returncode: int, stage_exit_code: int | None, tail: str,
                 what: str = "failed"):
        self.stage, self.returncode, self.stage_exit_code, self.tail = (stage, returncode, stage_exit_code,
                                                                        tail)
        code = (f"stage exit code {stage_exit_code}" if stage_exit_code is not None
                else f"dvc exit code {returncode}")
        super().__init__(f"stage '{stage}' {what} ({code}); last output:\n{tail}")


class PermanentStageFailure(StageFailed):
    """A failure retrying cannot fix (validation, params, data, deterministic training error)."""


class StageTimeout(StageFailed):
    """The stage ran past its timeout and was killed (retried: training resumes from a checkpoint)."""


# --------------------------------------------------------------------------------------------------
# running one stage


MAX_LINE_CHARS = 1 << 16  # a longer line is read in pieces: one line never holds more than this in memory


class StageOutput:
    """What the flow keeps of a stage's streamed output: the last ``TAIL_LINES`` lines for its messages, and
    what each line is scanned for as it passes: DVC's line with the stage's exit code, its "didn't change"."""

    def __init__(self, stage: str):
        self.stage = stage
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.exit_code: int | None = None
        self.unchanged = False
        self._failure = re.compile(rf"failed to reproduce '{re.escape(stage)}': failed to run: .*?, "
                                   r"exited with (-?\d+)")
        self._carry = ""  # the end of an unfinished piece: DVC's line may straddle two pieces

    def feed(self, piece: str) -> None:
        self.tail.append(piece)
        text = self._carry + piece
        # the last match wins: DVC's own line comes after anything the stage printed
        for match in self._failure.finditer(text):
            self.exit_code = int(match.group(1))
        self.unchanged = self.unchanged or f"Stage '{self.stage}' didn't change" in text
        self._carry = "" if piece.endswith("\n") else text[-1024:]

    def read(self, stream: TextIO, echo: Callable[[str], Any] | None = None) -> StageOutput:
        """Feed every line of ``stream`` (in pieces of at most MAX_LINE_CHARS) until it ends."""
        for piece in iter(lambda: stream.readline(MAX_LINE_CHARS), ""):
            self.feed(piece)
            if echo is not None:
                echo(piece)
        return self

    def tail_text(self) -> str:
        return "".join(self.tail)


def stage_exit_code(output: str, stage: str) -> int | None:
    """The stage command's exit code from DVC's error line, None when DVC failed for another reason."""
    return StageOutput(stage).read(io.StringIO(output)).exit_code


def retry_transient(task, task_run, state) -> bool:  # noqa: ARG001 - Prefect's retry_condition_fn signature
    """Prefect ``retry_condition_fn``: retry unless the stage failed permanently."""
    exc = state.data if isinstance(getattr(state, "data", None), BaseException) else None
    if exc is None:
        try:
            state.result(raise_on_failure=True)
        except BaseException as err:  # noqa: BLE001
            exc = err
    return not isinstance(exc, PermanentStageFailure)


def dvc_command() -> str:
    here = Path(sys.executable).parent / "dvc"
    return str(here) if here.exists() else "dvc"


def stage_env(base: Mapping[str, str], **extra: str | None) -> dict[str, str]:
    """The stages' environment: this interpreter's bin first on PATH (dvc.yaml runs ``python``)."""
    env = dict(base)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    for key, value in {"DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1",
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1"}.items():
        env.setdefault(key, value)
    env.pop(RUN_GROUP_ENV, None)
    for key, value in extra.items():
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    return env


def run_dvc_stage(stage: str, root: str | Path, env: Mapping[str, str], *, force: bool = False,
                  timeout_s: float | None = None, echo=None) -> dict[str, Any]:
    """``dvc repro --single-item <stage>`` in ``root``; raises
    StageFailed / PermanentStageFailure / StageTimeout.

    Returns {"stage", "ran" (False when DVC skipped it as unchanged), "seconds"}.
    """
    cmd = [dvc_command(), "repro", "--single-item", stage, *(["--force"] if force else [])]
    output = StageOutput(stage)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(root), env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                            start_new_session=True)
    assert proc.stdout is not None
    reader = threading.Thread(target=output.read, args=(proc.stdout, echo or sys.stdout.write), daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        reader.join(timeout=10)
        raise StageTimeout(stage, -9, None, output.tail_text(),
                           what=f"timed out after {timeout_s:.0f}s") from None
    except BaseException:  # cancelled / interrupted: take the stage down with us
        _kill_group(proc)
        raise
    reader.join(timeout=30)
    if rc != 0:
        code = output.exit_code
        cls = PermanentStageFailure if code in PERMANENT_EXIT_CODES else StageFailed
        raise cls(stage, rc, code, output.tail_text())
    return {"stage": stage, "ran": not output.unchanged, "seconds": round(time.monotonic() - start, 2)}


def _kill_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@task(name="dvc-stage", task_run_name="{stage}", retries=2, retry_delay_seconds=30,
      retry_condition_fn=retry_transient, cache_policy=NO_CACHE)
def stage_task(stage: str, root: str, run_env: dict[str, str | None], force: bool = False,
               timeout_s: float | None = None) -> dict[str, Any]:
    """One stage. ``run_env``: only the pipeline's own variables (parent run id, flow-run id, experiment,
    tracking URI); the rest of the environment is the worker's, read here, never passed as a parameter."""
    logger = get_run_logger()
    logger.info("dvc repro --single-item %s%s (timeout %ss)", stage, " --force" if force else "", timeout_s)
    result = run_dvc_stage(stage, root, stage_env(os.environ, **run_env), force=force, timeout_s=timeout_s)
    logger.info("%s: %s in %.1fs", stage, "ran" if result["ran"] else "up to date, skipped",
                result["seconds"])
    return result


# --------------------------------------------------------------------------------------------------
# params overrides


def apply_params_overrides(params_path: Path, overrides: Mapping[str, Any]) -> None:
    """Validate dotted-key overrides against the schema, then write them into params.yaml like
    ``dvc exp run -S`` (DVC's ruamel round-trip writer: comments and layout kept)."""
    from dvc.utils.serialize import modify_yaml

    from grpo_core.common.params_file import read_params, set_dotted
    from grpo_core.config import ConfigError, config_from_dict

    bad = [k for k in overrides if not isinstance(k, str) or not k or k.startswith(".") or k.endswith(".")]
    if bad:
        raise ConfigError("params_overrides: keys must be dotted params.yaml keys like "
                          f"'train.learning_rate', got {bad}")
    cfg_raw = read_params(params_path)
    # raises naming the key
    config_from_dict(cfg_raw, dict(overrides), source=f"{params_path} + params_overrides")
    # a stage running now (started by hand or by `dvc repro`) read the old values: refused,
    # not rewritten under it
    with stage_lock(params_path.parent, "params.yaml overrides"), modify_yaml(str(params_path)) as data:
        for dotted, value in overrides.items():
            set_dotted(data, dotted, value)


# --------------------------------------------------------------------------------------------------
# the summary artifact


#: the stages' JSON results the summary and the return value are built from (never their markdown):
#: name -> (the stage that writes it, its path, the keys it must hold)
STAGE_RESULTS = {
    "validation": ("validate", VALIDATION_JSON, ("ok",)),
    "calibration": ("calibrate", CALIBRATION_WEIGHTS, ("weights",)),
    "eval": ("evaluate", EVAL_METRICS, ("base", "trained")),
    "registry": ("evaluate", REGISTRY, REGISTRY_KEYS),
}


def read_result(root: Path, rel: str, keys: tuple[str, ...]) -> tuple[dict | None, str | None]:
    """One stage's JSON result, or None and why it cannot be used (naming the file)."""
    try:
        data = json.loads((root / rel).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"`{rel}` is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"`{rel}` is not readable JSON ({exc})"
    if not isinstance(data, dict):
        return None, f"`{rel}` is malformed: a JSON {type(data).__name__}, not an object"
    if rel == REGISTRY and data.get("registered"):
        keys = (*keys, *REGISTERED_KEYS)
    missing = [k for k in keys if k not in data]
    return (None, f"`{rel}` is malformed: no {', '.join(missing)}") if missing else (data, None)


def stage_results(root: Path, completed: set[str]) -> tuple[dict[str, dict | None], list[str]]:
    """Every STAGE_RESULTS entry (None when unusable) and the problems to report: a malformed file, or a
    missing one whose stage completed in this flow run (a stage that did not run leaving no file is
    expected)."""
    data, problems = {}, []
    for name, (stage, rel, keys) in STAGE_RESULTS.items():
        data[name], problem = read_result(root, rel, keys)
        if problem and (stage in completed or (root / rel).exists()):
            problems.append(f"{problem} (written by `{stage}`)")
    return data, problems


def _num(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, float) else ("-" if x is None else str(x))


def _stage_lines(results: list[dict], selected: list[str], error: str | None) -> list[str]:
    """One row per selected stage; the first one without a result is the one that failed."""
    done = {r["stage"]: r for r in results}
    failed = next((s for s in selected if s not in done), None) if error else None
    lines = ["| stage | result | seconds |", "| --- | --- | ---: |"]
    for st in selected:
        r = done.get(st)
        res = ("ran" if r["ran"] else "up to date") if r else ("failed" if st == failed else "not run")
        lines.append(f"| {st} | {res} | {r['seconds'] if r else '-'} |")
    return lines


def _validation_lines(root: Path, validation: dict | None, error: str | None) -> list[str]:
    """The failed validation's own text report, shown as it is (read for display, nothing parsed from it)."""
    if not (error and validation and not validation["ok"]):
        return []
    try:
        text = (root / VALIDATION_TXT).read_text()
    except OSError:
        text = f"({VALIDATION_TXT} is missing; {VALIDATION_JSON} holds the failures)"
    return ["", "## Validation report", "", "```", text[:6000], "```"]


def _calibration_lines(weights: dict | None) -> list[str]:
    if not weights:
        return []
    lines = ["", "## Calibration", "", f"Rule: {weights.get('rule', '-')[:200]}", "",
             "| reward | weight | flags |", "| --- | ---: | --- |"]
    for name, w in weights["weights"].items():
        flags = ", ".join((weights.get("flags") or {}).get(name, [])) or "-"
        lines.append(f"| `{name}` | {w:.4f} | {flags} |")
    return lines + [f"- {w}" for w in weights.get("warnings", [])]


def _evaluation_lines(metrics: dict | None) -> list[str]:
    if not metrics:
        return []
    keys = [k for k in metrics["trained"] if k == "accuracy" or k.startswith(("pass@", "format_compliance",
                                                                              "mean_completion_length"))]
    lines = ["", "## Evaluation", "", "| metric | base | trained | delta |", "| --- | ---: | ---: | ---: |"]
    for k in keys:
        lines.append(f"| {k} | {_num(metrics['base'].get(k))} | {_num(metrics['trained'].get(k))} | "
                     f"{_num(metrics.get('delta', {}).get(k))} |")
    return lines


def summary_markdown(root: Path, *, status: str, results: list[dict], selected: list[str],
                     flow_run_id: str | None, parent_run_id: str | None, experiment: str, tracking_uri: str,
                     error: str | None = None, outputs: tuple[dict, list[str]] | None = None) -> str:
    """The flow's summary artifact, from the stages' JSON results (``outputs``: ``stage_results``' answer,
    read here when not given)."""
    data, problems = outputs or stage_results(root, {r["stage"] for r in results})
    lines = ["# GRPO pipeline run", "",
             f"Status **{status}**. Prefect flow run `{flow_run_id or '-'}`; MLflow parent run "
             f"`{parent_run_id or '-'}` in experiment `{experiment}` ({tracking_uri}).", "",
             *_stage_lines(results, selected, error)]
    if error:
        lines += ["", "**Error**", "", "```", error[-3000:], "```"]
    lines += _validation_lines(root, data["validation"], error)
    lines += _calibration_lines(data["calibration"]) + _evaluation_lines(data["eval"])
    if data["registry"]:
        lines += ["", "## Registry", "", registry_markdown(data["registry"])]
    if problems:
        lines += ["", "## Stage results not shown", "", *(f"- {p}" for p in problems)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# the flow


@flow(name="grpo-pipeline", description="GRPO fine-tuning: the DVC stages prepare -> convert -> validate -> "
                                        "calibrate -> train -> evaluate, tracked in MLflow")
def grpo_pipeline(experiment_name: str | None = None, params_overrides: dict[str, Any] | None = None,
                  stages: list[str] | None = None, force: bool = False, repo: str | None = None,
                  timeouts: dict[str, float] | None = None, retries: int = 2,
                  retry_delay_seconds: float = 30.0) -> dict[str, Any]:
    """Run the DVC pipeline stage by stage (see the module docstring). Returns the parent run id, what each
    stage did, the evaluation metrics (``metrics/eval.json``) and the registry decision
    (``reports/registry.json``: registered, version, promote, alias, the compared values, margin, reason);
    both None when evaluate was not selected or its file is missing or malformed (the summary and the log then
    name the file)."""
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_API_URL

    logger = get_run_logger()
    root = find_repo_root(repo)
    selected = list(STAGES) if not stages else list(stages)
    unknown = [s for s in selected if s not in STAGES]
    if unknown:
        raise ValueError(f"stages: unknown {unknown}; the stages are {list(STAGES)}")
    selected = [s for s in STAGES if s in selected]  # always in pipeline order

    # one flow run per repo: its params.yaml overrides stay what its stages read,
    # and two runs' stages never interleave
    path = flow_lock_path(root)
    record = {"flow_run_id": str(flow_run.id) if flow_run.id else None,
              "prefect_api": PREFECT_API_URL.value()}
    with exclusive(path, f"flow run {flow_run.name or flow_run.id or os.getpid()}", lambda named: FlowBusy(
            f"{named} is running the pipeline in {root} and holds {path}; a second flow run would rewrite "
            "params.yaml under its stages. Wait for it to end, or stop it."), record) as previous:
        settle_previous_run(previous, logger)
        return run_pipeline(root, selected, experiment_name=experiment_name,
                            params_overrides=params_overrides, force=force,
                            limits={**DEFAULT_TIMEOUTS, **(timeouts or {})},
                            retry_policy={"retries": retries, "retry_delay_seconds": retry_delay_seconds},
                            outcome=lambda **done: write_outcome(path.with_suffix(".holder"), record, **done))


def run_pipeline(root: Path, selected: list[str], *, experiment_name: str | None,
                 params_overrides: dict[str, Any] | None, force: bool, limits: dict[str, float],
                 retry_policy: dict[str, float], outcome) -> dict[str, Any]:
    """The flow's body, under its repo lock: overrides, the MLflow parent, the stages, the summary.
    ``outcome`` is told the end (status, the stages' results) before Prefect is, for the next flow run to
    settle a record Prefect could not take (flows/prefect_records.py)."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.runtime import flow_run

    from flows.tracking import end_run, flatten_params

    logger = get_run_logger()
    params_path = root / "params.yaml"
    if params_overrides:
        apply_params_overrides(params_path, params_overrides)
        logger.info("params.yaml overrides applied: %s", params_overrides)
    cfg = load_params(params_path)
    experiment = experiment_name or cfg.tracking.experiment_name
    uri = tracking_uri_for(cfg, store_root(root))
    flow_run_id = str(flow_run.id) if flow_run.id else None
    tags = {**common_tags(root), "prefect.flow_run_name": flow_run.name or "",
            "grpo.stages": ",".join(selected)}
    if flow_run_id:
        tags["prefect.flow_run_id"] = flow_run_id
    if params_overrides:
        tags["grpo.params_overrides"] = json.dumps(params_overrides, default=str)[:5000]
    parent_run_id = None
    try:
        name, diff = run_name_and_diff(root, params_path)
        parent_run_id = create_parent_run(uri, experiment, run_name=name, tags=tags,
                                          params=flatten_params(cfg.to_dict()),
                                          diff=diff, owner=process_owner())
        logger.info("MLflow parent run %s in experiment '%s' (%s)", parent_run_id, experiment, uri)
        link_flow_run_and_parent(uri, parent_run_id, flow_run_id, logger)
    except Exception as exc:  # noqa: BLE001 - tracking must not stop the pipeline
        logger.warning("MLflow unavailable (%s): stages will log runs without the flow's parent", exc)

    run_env = {PARENT_RUN_ENV: parent_run_id, FLOW_RUN_ENV: flow_run_id, EXPERIMENT_ENV: experiment,
               "MLFLOW_TRACKING_URI": uri}
    results: list[dict] = []
    status, error = "FINISHED", None
    try:
        for stage in selected:
            run_stage = stage_task.with_options(**retry_policy)
            results.append(run_stage(stage, str(root), run_env, force=force, timeout_s=limits.get(stage)))
    except BaseException as exc:
        status, error = "FAILED", str(exc)
        raise
    finally:
        outputs = stage_results(root, {r["stage"] for r in results})
        for problem in outputs[1]:
            logger.warning("stage result not shown: %s", problem.replace("`", ""))
        markdown = summary_markdown(root, status=status, results=results, selected=selected,
                                    flow_run_id=flow_run_id, parent_run_id=parent_run_id,
                                    experiment=experiment, tracking_uri=uri, error=error, outputs=outputs)
        try:
            create_markdown_artifact(key=SUMMARY_ARTIFACT_KEY, markdown=markdown,
                                     description="GRPO pipeline: calibration, evaluation and registry")
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not create the summary artifact: %s", exc)
        if parent_run_id:
            _log_parent_summary(uri, parent_run_id, markdown, root)
            end_run(uri, parent_run_id, status)
        outcome(status=status, stages=results, mlflow_parent=parent_run_id)
    evaluated = "evaluate" in selected
    return {"parent_run_id": parent_run_id, "flow_run_id": flow_run_id, "experiment": experiment,
            "stages": results, "eval": outputs[0]["eval"] if evaluated else None,
            "registry": outputs[0]["registry"] if evaluated else None}


def link_flow_run_and_parent(uri: str, parent_run_id: str, flow_run_id: str | None, logger) -> None:
    """Each side names the other: a Prefect link artifact (key ``mlflow-parent-run``) opens the MLflow parent
    run; the parent's tag ``prefect.flow_run_url`` opens the flow run in the Prefect UI."""
    from prefect.artifacts import create_link_artifact
    from prefect.settings import get_current_settings

    from flows.tracking import run_url

    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        url = run_url(uri, client.get_run(parent_run_id).info.experiment_id, parent_run_id)
        create_link_artifact(link=url, link_text=f"MLflow parent run {parent_run_id}",
                             key=MLFLOW_LINK_ARTIFACT_KEY,
                             description="The pipeline's MLflow parent run: the stage runs, "
                                         "metrics and model")
        prefect_ui = get_current_settings().ui_url
        if flow_run_id and prefect_ui:
            client.set_tag(parent_run_id, "prefect.flow_run_url",
                           f"{prefect_ui.rstrip('/')}/runs/flow-run/{flow_run_id}")
    except Exception as exc:  # noqa: BLE001 - links are a convenience; the pipeline goes on
        logger.warning("could not link the flow run and MLflow run %s: %s", parent_run_id, exc)


def _log_parent_summary(uri: str, run_id: str, markdown: str, root: Path) -> None:
    """The summary markdown and metrics (``flows.comparison.pipeline_summary``) on the parent, also when DVC
    found every stage up to date and no stage logged them."""
    try:
        from mlflow import MlflowClient

        from flows.comparison import log_summary, pipeline_summary

        client = MlflowClient(tracking_uri=uri)
        client.log_text(run_id, markdown, "pipeline_summary.md")
        log_summary(client, run_id, pipeline_summary(root))
    except Exception as exc:  # noqa: BLE001
        print(f"grpo_pipeline: could not log the summary to MLflow run {run_id}: {exc}", file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# command line: python -m flows.pipeline [--set key=value ...] [--stages a,b] [--force]


def _parse_value(text: str) -> Any:
    from ruamel.yaml import YAML

    value = YAML(typ="safe", pure=True).load(text)
    return text if value is None and text not in ("null", "~", "") else value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment-name", default=None)
    parser.add_argument("--set", "-S", action="append", default=[], metavar="KEY=VALUE",
                        help="params.yaml override (YAML value), repeatable, e.g. -S "
                             "train.learning_rate=1e-4")
    parser.add_argument("--stages", default=None, help="comma-separated subset, e.g. train,evaluate")
    parser.add_argument("--force", action="store_true", help="re-run the selected stages even if unchanged")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = _parse_value(value)
    try:
        result = grpo_pipeline(experiment_name=args.experiment_name, params_overrides=overrides or None,
                               stages=args.stages.split(",") if args.stages else None, force=args.force)
    except httpx.TransportError as exc:  # the Prefect server, down past the client's retries
        from prefect.settings import PREFECT_API_URL

        print(f"flows.pipeline: the Prefect server at {PREFECT_API_URL.value()} could not be reached "
              f"({type(exc).__name__}: {exc}). The stages that ran are recorded by DVC (dvc.lock) and "
              "MLflow; the next flow run in this repo gives this run's Prefect record the end it could not "
              "report.", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in result.items() if k != "eval"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
