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
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flows.comparison import PipelineSummary

PARENT_RUN_ENV = "GRPO_PARENT_RUN_ID"
RUN_GROUP_ENV = "GRPO_RUN_GROUP"
FLOW_RUN_ENV = "GRPO_FLOW_RUN_ID"
EXPERIMENT_ENV = "GRPO_EXPERIMENT_NAME"
RUN_GROUP_TAG = "grpo.run_group"
ROLE_TAG = "grpo.role"
OWNER_TAG = "grpo.owner"  # <host>:<pid>:<start ticks> of the process whose death leaves the run RUNNING
HEADLINE_METRICS = ("reward", "kl")  # also logged as 0_overview/<name>: the first charts of a run's page
HEADLINE_SECTION = "0_overview"


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
    """``dvc-<host>:<pid>:<start ticks>`` of the nearest ``dvc`` ancestor process, or None (no /proc)."""
    pid = os.getppid()
    for _ in range(max_depth):
        if pid <= 1:
            return None
        stat = _proc_stat(pid)
        if stat is None:
            return None
        try:
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if a]
        except OSError:
            return None
        if _is_dvc_command(argv):
            return f"dvc-{socket.gethostname()}:{pid}:{stat[19]}"
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
    tags = {"git.sha": sha, "mlflow.source.git.commit": sha, "git.dirty": str(bool(dirty)).lower()}
    # The runs table's Source column: the repository (a link when it is a git URL), else dvc.yaml;
    # Version: the commit
    origin = git("remote", "get-url", "origin")
    tags.update({"mlflow.source.type": "PROJECT", "mlflow.source.name": origin or "dvc.yaml"})
    if origin:
        tags["mlflow.source.git.repoURL"] = origin
    branch = git("rev-parse", "--abbrev-ref", "HEAD")
    if branch and branch != "HEAD":
        tags["mlflow.source.git.branch"] = branch
    return tags


def committed_params(root: Path, params_path: Path) -> dict | None:
    """params.yaml as committed at HEAD (None outside git or when HEAD has none)."""
    from ruamel.yaml import YAML

    try:
        rel = params_path.resolve().relative_to(root.resolve()).as_posix()
        out = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=root, capture_output=True, text=True,
                             timeout=20)
    except (ValueError, OSError, subprocess.TimeoutExpired):
        return None
    return (YAML(typ="safe", pure=True).load(out.stdout) or {}) if out.returncode == 0 else None


def run_name_and_diff(root: Path, params_path: Path,
                      environ: Mapping[str, str] | None = None) -> tuple[str, dict]:
    """The parent's name - the DVC experiment's name under `dvc exp run`, else the params that differ from
    the committed params.yaml (``learning_rate=0.002``), else ``baseline <commit>`` - and that diff."""
    from ruamel.yaml import YAML

    from flows.comparison import diff_name, params_diff

    env = os.environ if environ is None else environ
    try:
        current = YAML(typ="safe", pure=True).load(Path(params_path).read_text(encoding="utf-8")) or {}
    except OSError:  # a stage run from a config object with no params file behind it
        current = None
    diff = {} if current is None else params_diff(current, committed_params(root, Path(params_path)))
    if env.get("DVC_EXP_NAME"):
        return env["DVC_EXP_NAME"], diff
    if current is None:
        return time.strftime("pipeline-%Y%m%d-%H%M%S"), diff
    if diff:
        return diff_name(diff), diff
    sha = git_info(root).get("git.sha", "unknown")
    return f"baseline {sha[:7]}", diff


def process_owner(pid: int | None = None) -> str | None:
    """``<host>:<pid>:<start ticks>`` of a process (default: this one); None without /proc."""
    pid = os.getpid() if pid is None else pid
    stat = _proc_stat(pid)
    return f"{socket.gethostname()}:{pid}:{stat[19]}" if stat else None


def owner_alive(owner: str) -> bool | None:
    """Whether the process an owner tag names still runs; None when it is another host's (unknowable here)."""
    try:
        host, pid, ticks = owner.rsplit(":", 2)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    stat = _proc_stat(int(pid))
    return stat is not None and stat[19] == ticks


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
                      params: Mapping[str, str] | None = None, diff: Mapping[str, Any] | None = None,
                      owner: str | None = None) -> str:
    """A top-level pipeline run (tag ``grpo.role=pipeline``) with the flattened config as params.

    First marks KILLED the runs a killed pipeline left RUNNING (``reap_killed_runs``), then creates the run
    (``diff``: the params that differ from the committed params.yaml, tag ``grpo.params_diff``; ``owner``: the
    process whose death ends it; a color other than the previous pipeline's,
    ``flows.comparison.next_run_color``) and refreshes the experiment's kind and saved view
    (``flows.comparison.prepare_experiment_view``).
    """
    from mlflow.entities import Param

    from flows.comparison import RUN_COLOR_TAG, next_run_color, prepare_experiment_view
    from flows.tracking import default_artifact_location, get_or_create_experiment

    client = _client(uri)
    exp_id = get_or_create_experiment(client, experiment, default_artifact_location(uri))
    reap_killed_runs(client, exp_id)
    newest = client.search_runs([exp_id], filter_string=f"tags.`{ROLE_TAG}` = 'pipeline'", max_results=1,
                                order_by=["attribute.start_time DESC"])
    extra = {ROLE_TAG: "pipeline", "mlflow.project.entryPoint": "pipeline",
             RUN_COLOR_TAG: next_run_color(newest[0].data.tags.get(RUN_COLOR_TAG) if newest else None)}
    if diff is not None:
        extra["grpo.params_diff"] = json.dumps(diff, default=str)[:7000]
    if owner:
        extra[OWNER_TAG] = owner
    run = client.create_run(exp_id, tags={**extra, **{k: str(v) for k, v in tags.items()}}, run_name=run_name)
    items = list((params or {}).items())
    for start in range(0, len(items), 100):
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in items[start:start + 100]],
                         synchronous=True)
    prepare_experiment_view(client, exp_id, diff or {})
    return run.info.run_id


def reap_killed_runs(client, experiment_id: str) -> list[str]:
    """Mark KILLED every RUNNING run of the experiment whose owner process (tag ``grpo.owner``) is gone on
    this host: what a SIGKILLed pipeline leaves behind. Runs of other hosts are left alone. Returns their
    ids."""
    reaped = []
    for run in client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=1000):
        owner = run.data.tags.get(OWNER_TAG)
        if owner and owner_alive(owner) is False:
            client.set_terminated(run.info.run_id, "KILLED")
            client.set_tag(run.info.run_id, "grpo.killed",
                           "its process was gone when the next pipeline run started")
            reaped.append(run.info.run_id)
    return reaped


def find_group_parent(uri: str, experiment: str, group: str) -> str | None:
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id],
                              filter_string=f"tags.`{RUN_GROUP_TAG}` = '{group}' and "
                                            f"tags.`{ROLE_TAG}` = 'pipeline'",
                              max_results=1, order_by=["attribute.start_time ASC"])
    return runs[0].info.run_id if runs else None


def dataset_input(ctx, name: str, path: str, context: str, commit: str | None, digest: str):
    """An ``mlflow.entities.DatasetInput`` for one data file whose DVC md5 is ``digest``."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    full = ctx.path(path)
    schema, profile = None, None
    if full.suffix == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(full)
        schema = json.dumps(
            {"mlflow_colspec": [{"name": f.name, "type": "string" if str(f.type) in ("string", "large_string")
                                 else str(f.type)} for f in meta.schema_arrow]})
        profile = json.dumps({"num_rows": meta.metadata.num_rows})
    source = json.dumps({"path": path, "git_commit": commit, "dvc_md5": digest})
    return DatasetInput(Dataset(name=name, digest=digest[:36], source_type="dvc", source=source,
                                schema=schema, profile=profile),
                        tags=[InputTag("mlflow.data.context", context)])


# --------------------------------------------------------------------------------------------------
# the stage's run


OPEN_ATTEMPTS = 4      # the stage's MLflow runs are opened with this many tries ...
OPEN_BACKOFF_S = 1.0   # ... 1, 2, 4 s apart: a store restarting as the stage starts still gets its record


def mlflow_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The keys a stage logs ``metrics`` under: MLflow-safe names,
    and ``reward`` / ``kl`` again in the overview."""
    values = {safe_key(k): v for k, v in metrics.items()}
    values.update({f"{HEADLINE_SECTION}/{k}": metrics[k] for k in HEADLINE_METRICS if k in metrics})
    return values


def _is_number(value: Any) -> bool:
    try:
        return not math.isnan(float(value))
    except (TypeError, ValueError):
        return False


class StageRun:
    """Context manager around one stage's MLflow child run; a no-op (with a warning) if the store fails.

    ``log_params / log_metrics / set_tags / log_artifact / log_table / log_text / log_data_hashes``;
    ``run_id``; ``client`` (an MlflowClient for the registry, None when tracking is off).
    """

    def __init__(self, ctx, continue_run_id: str | None = None) -> None:
        self.ctx = ctx
        self.continue_run_id = continue_run_id  # a resumed train goes on in its own run
        self.tracker = None
        self.client = None
        self.uri: str | None = None
        self.experiment: str | None = None
        self.parent_run_id: str | None = None
        self.tags: dict[str, str] = {}
        self._owns_parent = False
        self.untracked = ""  # why the store could not be opened, when it could not
        self._steps: dict[str, set[int]] = {}  # metric key -> steps logged in this run (see _steps_of)
        self._tmp = tempfile.TemporaryDirectory(prefix=f"grpo-{ctx.stage}-")
        self._tables: list[dict] = []  # the table artifacts logged so far (mlflow.loggedArtifacts)
        self._md5: dict[Path, str | None] = {}  # data_md5's hashes, by file

    @property
    def run_id(self) -> str | None:
        return getattr(self.tracker, "run_id", None)

    @property
    def continued(self) -> bool:
        """The run is ``continue_run_id``'s, reopened: a resumed stage logging on into its killed
        predecessor's run."""
        return bool(getattr(self.tracker, "continued", False))

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> StageRun:
        for attempt in range(1, OPEN_ATTEMPTS + 1):
            try:
                self._open()
                break
            except Exception as exc:  # noqa: BLE001 - tracking must not stop the stage
                self.tracker = None
                self.untracked = f"{type(exc).__name__}: {exc}"
                if attempt == OPEN_ATTEMPTS:
                    warnings.warn(f"{self.ctx.stage}: MLflow tracking is off for this run ({self.uri}), "
                                  f"{OPEN_ATTEMPTS} attempts failed: {self.untracked}", RuntimeWarning,
                                  stacklevel=2)
                else:
                    time.sleep(OPEN_BACKOFF_S * 2 ** (attempt - 1))
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
        if self.parent_run_id is None:  # an earlier attempt that created the parent keeps it
            self.parent_run_id = (os.environ.get(PARENT_RUN_ENV) or "").strip() or None
        if self.parent_run_id is None:
            group = run_group()
            if group:
                tags[RUN_GROUP_TAG] = group
                self.parent_run_id = find_group_parent(self.uri, self.experiment, group)
            if self.parent_run_id is None:
                # the parent ends with the dvc process that runs every stage (or with this one)
                owner = (group[len("dvc-"):] if group and group.startswith("dvc-") else None if group
                         else process_owner())
                name, diff = run_name_and_diff(ctx.root, ctx.params_path)
                self.parent_run_id = create_parent_run(self.uri, self.experiment, run_name=name, tags=tags,
                                                       params=params, diff=diff, owner=owner)
            else:
                self.client.update_run(self.parent_run_id, status="RUNNING")
            self._owns_parent = True
        owner = process_owner()
        self.tracker = MLflowTracker(self.uri, self.experiment, run_name=ctx.stage,
                                     parent_run_id=self.parent_run_id,
                                     tags={"stage": ctx.stage, ROLE_TAG: "stage",
                                           "params_file": str(ctx.params_path),
                                           "mlflow.project.entryPoint": ctx.stage, **tags,
                                           **({OWNER_TAG: owner} if owner else {})},
                                     artifact_location=default_artifact_location(self.uri),
                                     continue_run_id=self.continue_run_id)
        self.tracker.log_params(params)
        if self.tracker.run_id:
            print(f"{ctx.stage}: MLflow run {self.tracker.run_id} (parent {self.parent_run_id}) in "
                  f"experiment '{self.experiment}' at {self.uri}", file=sys.stderr)

    def __exit__(self, exc_type, exc, tb) -> None:
        failed = exc_type is not None and not (exc_type is SystemExit and not getattr(exc, "code", 1))
        status = "FAILED" if failed else "FINISHED"
        try:
            if self.tracker is None:
                print(f"{self.ctx.stage}: MLflow recorded nothing for this stage ({self.uri}: "
                      f"{self.untracked}); a train stage's steps are in its train log and go to MLflow when "
                      "the stage next runs", file=sys.stderr)
            elif unsent := self.tracker.close(status):
                print(f"{self.ctx.stage}: {unsent} value(s) did not reach MLflow ({self.uri}, run "
                      f"{self.tracker.run_id or 'never created'}); a train stage's steps go there from its "
                      "train log when the stage next runs", file=sys.stderr)
            if self._owns_parent and self.client is not None and self.parent_run_id:
                self.client.set_terminated(self.parent_run_id, status)
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"{self.ctx.stage}: could not close MLflow runs: {err}", RuntimeWarning,
                          stacklevel=2)
        finally:
            self._tmp.cleanup()

    # -- logging -----------------------------------------------------------------------------------

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.tracker is not None:
            self.tracker.log_params({safe_key(k): v for k, v in params.items()})

    def log_metrics(self, metrics: Mapping[str, Any], step: int = 0) -> None:
        """Under their own names; ``reward`` and ``kl`` also as ``0_overview/<name>``, the section the run
        page shows first (MLflow orders sections by name: prefixed ones alphabetically, unprefixed ones
        last)."""
        if self.tracker is not None:
            self._log_new(mlflow_metrics(metrics), step)

    def backfill(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Send each row's metrics (a train log's rows: ``step`` and values) that this run neither holds nor
        has queued at that step: what an outage's backlog lost when the stage was killed. Returns how many
        values went out; a key is never logged twice at one step."""
        if self.tracker is None:
            return 0
        sent = 0
        for row in rows:
            row = dict(row)
            step = int(row.pop("step"))
            sent += self._log_new({k: v for k, v in mlflow_metrics(row).items() if _is_number(v)}, step)
        self.tracker.flush()
        return sent

    def _log_new(self, values: Mapping[str, Any], step: int) -> int:
        """Queue the values this run does not hold at ``step`` yet; how many."""
        new = {k: v for k, v in values.items() if step not in self._steps_of(k)}
        if new:
            self.tracker.log_metrics(new, step=step)
            for key in new:
                self._steps[key].add(step)
        return len(new)

    def _steps_of(self, key: str) -> set[int]:
        """The steps ``key`` is logged at in this run: queued by this process, and for a run it continues (a
        resumed stage's) what MLflow held when first asked - the steps the killed process got through
        before."""
        if key not in self._steps:
            held: set[int] = set()
            if self.continued:
                try:
                    held = {m.step for m in self.client.get_metric_history(self.run_id, key)}
                except Exception as exc:  # noqa: BLE001 - tracking must not fail the stage
                    warnings.warn(f"{self.ctx.stage}: could not read {key}'s history from MLflow: {exc}",
                                  RuntimeWarning, stacklevel=3)
            self._steps[key] = held
        return self._steps[key]

    def log_to_parent(self, summary: PipelineSummary) -> None:
        """The learning curves and summary numbers (a ``flows.comparison.PipelineSummary``) on the pipeline's
        parent run: what the experiment's chart view compares."""
        from flows.comparison import log_summary

        if self.client is not None and self.parent_run_id and summary:
            try:
                log_summary(self.client, self.parent_run_id, summary)
            except Exception as exc:  # noqa: BLE001 - tracking must not fail the stage
                warnings.warn(f"{self.ctx.stage}: could not log the summary to the parent run: {exc}",
                              RuntimeWarning, stacklevel=2)

    def log_datasets(self, datasets: list[tuple[str, str, str]]) -> None:
        """MLflow dataset inputs of this run and of the parent: ``(name, path, context)`` each, the digest the
        file's DVC md5, the source its path and commit, the schema its parquet columns, the profile its row
        count."""
        if self.client is None or self.run_id is None:
            return
        try:
            inputs = [dataset_input(self.ctx, name, path, context, self.tags.get("git.sha"), digest)
                      for name, path, context in datasets if (digest := self.data_md5(path)) is not None]
            for run_id in (self.run_id, self.parent_run_id):
                if run_id and inputs:
                    self.client.log_inputs(run_id, datasets=inputs)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"{self.ctx.stage}: could not log dataset inputs: {exc}", RuntimeWarning,
                          stacklevel=2)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.tracker is not None:
            self.tracker.set_tags({safe_key(k): v for k, v in tags.items()})

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if self.tracker is not None and Path(path).exists():
            self.tracker.log_artifact(str(path), artifact_path)

    def log_table(self, columns: Mapping[str, list], artifact_file: str) -> None:
        """A table artifact as ``mlflow.log_table`` writes one (pandas' split-oriented JSON), listed in the
        run's ``mlflow.loggedArtifacts`` tag so the UI shows it as a table; queued like every artifact."""
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

    def data_md5(self, path: str | os.PathLike) -> str | None:
        """The md5 of a data file (or directory) the stage reads, hashed once per run (tags and dataset inputs
        both use it); None when it is missing."""
        from flows.stages.common import md5_path

        full = self.ctx.path(path)
        if full not in self._md5:
            self._md5[full] = md5_path(full)
        return self._md5[full]

    def log_data_hashes(self, paths: list[str | os.PathLike]) -> None:
        """Tags ``data.md5.<path>`` = md5 of each data file (or directory) the stage reads."""
        tags = {}
        for p in paths:
            full = self.ctx.path(p)
            digest = self.data_md5(p)
            if digest is not None:
                try:
                    name = full.resolve().relative_to(self.ctx.root.resolve()).as_posix()
                except ValueError:
                    name = str(full)
                tags[f"data.md5.{name}"] = digest
        self.set_tags(tags)

    def flush(self) -> bool:
        return bool(self.tracker is not None and self.tracker.flush())
