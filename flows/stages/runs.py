"""MLflow runs of the pipeline: one parent run per pipeline run, one child run per stage.

Which parent a stage's child run goes under, first match wins:

1. ``GRPO_PARENT_RUN_ID`` - set by an orchestrator (the Prefect flow ``flows/pipeline.py``, or you),
   which owns the parent: creates it, and ends it when the pipeline ends.
2. A *run group*: ``GRPO_RUN_GROUP`` if set, else the invoking ``dvc`` process (its pid and start time,
   read from ``/proc``) - so every stage of one ``dvc repro`` / ``dvc exp run`` lands under one parent.
   The first stage of the group creates the parent (tag ``grpo.run_group``); later stages find it by
   that tag. The stages own it: each marks it RUNNING while it works and FINISHED/FAILED when done,
   so after the last stage its status is the pipeline's.
3. Neither (a stage run by hand outside DVC, or no ``/proc``): a parent of its own for this one stage.

Store: ``tracking.tracking_uri`` > env ``MLFLOW_TRACKING_URI`` > ``sqlite:///<store root>/mlflow.db``
(``flows.tracking.resolve_tracking_uri``), where the store root is the *original* repo (``DVC_ROOT``),
also for ``dvc exp run --temp/--queue``. Experiment: env ``GRPO_EXPERIMENT_NAME`` (the flow's
``experiment_name``) > ``tracking.experiment_name``.

Tags on every run: ``stage``, ``git.sha`` (and ``mlflow.source.git.commit``), ``git.dirty``,
``grpo.run_group``, ``prefect.flow_run_id`` (env ``GRPO_FLOW_RUN_ID``), ``dvc.exp_name``,
``dvc.baseline_rev`` (for DVC experiments), and ``data.md5.<path>`` for the data files the stage reads.
Params: the resolved params.yaml, flattened (``train.learning_rate``, ``rewards.0.name``, ...).

Tracking never fails a stage: if the store cannot be reached the stage warns and goes on.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PARENT_RUN_ENV = "GRPO_PARENT_RUN_ID"
RUN_GROUP_ENV = "GRPO_RUN_GROUP"
FLOW_RUN_ENV = "GRPO_FLOW_RUN_ID"
EXPERIMENT_ENV = "GRPO_EXPERIMENT_NAME"
RUN_GROUP_TAG = "grpo.run_group"
ROLE_TAG = "grpo.role"


# --------------------------------------------------------------------------------------------------
# where and what


def safe_key(key: str) -> str:
    """An MLflow metric/param/tag key: ``pass@4`` -> ``pass_at_4``, other characters MLflow refuses -> ``_``,
    no leading ``/`` or ``..`` (MLflow refuses a whole batch over one bad key)."""
    key = re.sub(r"[^/\w.\- :]", "_", str(key).replace("@", "_at_"))
    key = re.sub(r"/+", "/", key).strip("/")
    return key.replace("..", "_") or "_"


def tracking_uri_for(cfg, store_root: Path) -> str:
    from flows.tracking import resolve_tracking_uri

    return resolve_tracking_uri(cfg.tracking.tracking_uri, store_root)


def experiment_name_for(cfg, environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return (env.get(EXPERIMENT_ENV) or "").strip() or cfg.tracking.experiment_name


def _proc_stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # fields from the 3rd on (state, ppid, ...)


def _is_dvc_command(argv: list[str]) -> bool:
    for i, arg in enumerate(argv[:3]):
        if Path(arg).name == "dvc":
            return True
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] == "dvc":
            return True
    return False


def dvc_invocation_id(max_depth: int = 8) -> str | None:
    """``dvc-<host>-<pid>-<start ticks>`` of the nearest ``dvc`` ancestor process, or None (no /proc)."""
    pid = os.getppid()
    for _ in range(max_depth):
        if pid <= 1:
            return None
        stat = _proc_stat(pid)
        if stat is None:
            return None
        try:
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            return None
        if _is_dvc_command(argv):
            return f"dvc-{socket.gethostname()}-{pid}-{stat[19]}"
        pid = int(stat[1])
    return None


def run_group(environ: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    return (env.get(RUN_GROUP_ENV) or "").strip() or dvc_invocation_id()


def git_info(root: Path) -> dict[str, str]:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if not sha:
        return {"git.sha": "unknown"}
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"git.sha": sha, "mlflow.source.git.commit": sha, "git.dirty": str(bool(dirty)).lower()}


def common_tags(root: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    tags = git_info(root)
    for key, var in (("prefect.flow_run_id", FLOW_RUN_ENV), ("dvc.exp_name", "DVC_EXP_NAME"),
                     ("dvc.baseline_rev", "DVC_EXP_BASELINE_REV")):
        if env.get(var):
            tags[key] = env[var]
    tags["host"] = socket.gethostname()
    return tags


# --------------------------------------------------------------------------------------------------
# the parent run


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def create_parent_run(uri: str, experiment: str, *, run_name: str, tags: Mapping[str, Any],
                      params: Mapping[str, str] | None = None) -> str:
    """A top-level pipeline run (tag ``grpo.role=pipeline``) with the flattened config as params."""
    from mlflow.entities import Param

    from flows.tracking import default_artifact_location, get_or_create_experiment

    client = _client(uri)
    exp_id = get_or_create_experiment(client, experiment, default_artifact_location(uri))
    run = client.create_run(exp_id, tags={ROLE_TAG: "pipeline", **{k: str(v) for k, v in tags.items()}},
                            run_name=run_name)
    items = list((params or {}).items())
    for start in range(0, len(items), 100):
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in items[start:start + 100]],
                         synchronous=True)
    return run.info.run_id


def find_group_parent(uri: str, experiment: str, group: str) -> str | None:
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_GROUP_TAG}` = '{group}'",
                              max_results=1, order_by=["attribute.start_time ASC"])
    return runs[0].info.run_id if runs else None


# --------------------------------------------------------------------------------------------------
# the stage's run


class StageRun:
    """Context manager around one stage's MLflow child run; a no-op (with a warning) if the store fails.

    ``log_params / log_metrics / set_tags / log_artifact / log_table / log_text / log_data_hashes``; ``run_id``;
    ``client`` (an MlflowClient for the registry, None when tracking is off).
    """

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.tracker = None
        self.client = None
        self.uri: str | None = None
        self.experiment: str | None = None
        self.parent_run_id: str | None = None
        self.tags: dict[str, str] = {}
        self._owns_parent = False
        self._tmp = tempfile.TemporaryDirectory(prefix=f"grpo-{ctx.stage}-")
        self._tables: list[dict] = []  # the table artifacts logged so far (mlflow.loggedArtifacts)

    @property
    def run_id(self) -> str | None:
        return getattr(self.tracker, "run_id", None)

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> StageRun:
        try:
            self._open()
        except Exception as exc:  # noqa: BLE001 - tracking must not stop the stage
            warnings.warn(f"{self.ctx.stage}: MLflow tracking is off for this run ({self.uri}): "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
            self.tracker = None
        return self

    def _open(self) -> None:
        from flows.tracking import MLflowTracker, default_artifact_location, flatten_params

        ctx = self.ctx
        self.uri = tracking_uri_for(ctx.cfg, ctx.store_root)
        self.experiment = experiment_name_for(ctx.cfg)
        self.client = _client(self.uri)
        tags = common_tags(ctx.root)
        self.tags = tags
        group = None
        params = flatten_params(ctx.cfg.to_dict())
        self.parent_run_id = (os.environ.get(PARENT_RUN_ENV) or "").strip() or None
        if self.parent_run_id is None:
            group = run_group()
            if group:
                tags[RUN_GROUP_TAG] = group
                self.parent_run_id = find_group_parent(self.uri, self.experiment, group)
            if self.parent_run_id is None:
                name = f"pipeline-{os.environ.get('DVC_EXP_NAME') or time.strftime('%Y%m%d-%H%M%S')}"
                self.parent_run_id = create_parent_run(self.uri, self.experiment, run_name=name, tags=tags,
                                                       params=params)
            else:
                self.client.update_run(self.parent_run_id, status="RUNNING")
            self._owns_parent = True
        self.tracker = MLflowTracker(self.uri, self.experiment, run_name=ctx.stage,
                                     parent_run_id=self.parent_run_id,
                                     tags={"stage": ctx.stage, ROLE_TAG: "stage", "params_file": str(ctx.params_path),
                                           **tags},
                                     artifact_location=default_artifact_location(self.uri))
        self.tracker.log_params(params)
        if self.tracker.run_id:
            print(f"{ctx.stage}: MLflow run {self.tracker.run_id} (parent {self.parent_run_id}) in "
                  f"experiment '{self.experiment}' at {self.uri}", file=sys.stderr)

    def __exit__(self, exc_type, exc, tb) -> None:
        failed = exc_type is not None and not (exc_type is SystemExit and not getattr(exc, "code", 1))
        status = "FAILED" if failed else "FINISHED"
        try:
            if self.tracker is not None:
                self.tracker.close(status)
            if self._owns_parent and self.client is not None and self.parent_run_id:
                self.client.set_terminated(self.parent_run_id, status)
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"{self.ctx.stage}: could not close MLflow runs: {err}", RuntimeWarning, stacklevel=2)
        finally:
            self._tmp.cleanup()

    # -- logging -----------------------------------------------------------------------------------

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.tracker is not None:
            self.tracker.log_params({safe_key(k): v for k, v in params.items()})

    def log_metrics(self, metrics: Mapping[str, Any], step: int = 0) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics({safe_key(k): v for k, v in metrics.items()}, step=step)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.tracker is not None:
            self.tracker.set_tags({safe_key(k): v for k, v in tags.items()})

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if self.tracker is not None and Path(path).exists():
            self.tracker.log_artifact(str(path), artifact_path)

    def log_table(self, columns: Mapping[str, list], artifact_file: str) -> None:
        """A table artifact as ``mlflow.log_table`` writes one (pandas' split-oriented JSON), listed in the run's
        ``mlflow.loggedArtifacts`` tag so the UI shows it as a table; queued like every artifact."""
        if self.tracker is None or not columns:
            return
        import pandas as pd

        path = Path(self._tmp.name) / artifact_file
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(dict(columns)).to_json(path, orient="split", index=False, date_format="iso")
        folder = str(Path(artifact_file).parent) if Path(artifact_file).parent != Path(".") else None
        self.tracker.log_artifact(str(path), folder)
        self._tables.append({"path": artifact_file, "type": "table"})
        self.tracker.set_tags({"mlflow.loggedArtifacts": json.dumps(self._tables)})

    def log_text(self, text: str, name: str, artifact_path: str | None = None) -> None:
        """A text artifact that is no pipeline output (written to a temp file kept until the run closes)."""
        if self.tracker is None:
            return
        path = Path(self._tmp.name) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        self.tracker.log_artifact(str(path), artifact_path)

    def log_data_hashes(self, paths: list[str | os.PathLike]) -> None:
        """Tags ``data.md5.<path>`` = md5 of each data file (or directory) the stage reads."""
        from flows.stages.common import md5_path

        tags = {}
        for p in paths:
            full = self.ctx.path(p)
            digest = md5_path(full)
            if digest is not None:
                try:
                    name = full.resolve().relative_to(self.ctx.root.resolve()).as_posix()
                except ValueError:
                    name = str(full)
                tags[f"data.md5.{name}"] = digest
        self.set_tags(tags)

    def flush(self) -> bool:
        return bool(self.tracker is not None and self.tracker.flush())
