"""The MLflow tracker the stages log through (the per-step train log is the trainer's own CSV).

Run layout: one MLflow *parent* run per pipeline run and one *child* run per stage. The parent's id
travels between stages (separate processes started by DVC) in the environment variable
``GRPO_PARENT_RUN_ID`` (``PARENT_RUN_ENV``); ``flows/stages/runs.py`` finds or creates the parent and opens
each stage's ``MLflowTracker`` under it (the ``mlflow.parentRunId`` tag). Without the variable a stage run
is top-level.

Store: ``default_tracking_uri(repo_root)`` = ``sqlite:////<repo_root>/mlflow.db`` (absolute; MLflow 3 refuses
a ``./mlruns`` file store) with artifacts in ``<repo_root>/mlruns`` (``file://`` experiment
artifact_location, set when the experiment is created). ``resolve_tracking_uri``:
``tracking.tracking_uri`` > env ``MLFLOW_TRACKING_URI`` > the default.

Every run is driven through an explicit ``mlflow.MlflowClient`` and run id - never the global active run,
which is per-process state that stages running in threads would share.

An unreachable tracking server never stops training: ``MLflowTracker`` catches errors, keeps a bounded
backlog in memory, retries on a later call (at most once per ``retry_interval_s``), and on ``close``
warns with the number of values it could not send. Each attempt against a dead http server costs what
MLflow's client retries cost: set ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``MLFLOW_HTTP_REQUEST_TIMEOUT``
to bound it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote

PARENT_RUN_ENV = "GRPO_PARENT_RUN_ID"
PARENT_RUN_TAG = "mlflow.parentRunId"
RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
MAX_PARAM_VALUE_CHARS = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_TAG_VALUE_CHARS = 8000  # mlflow.utils.validation.MAX_TAG_VAL_LENGTH
MAX_KEY_CHARS = 250
BATCH_METRICS = 1000  # log_batch limits: 1000 metrics, 100 params + tags, 1000 entities in all
BATCH_PARAMS_TAGS = 100
# MLflow error codes that mean "the server understood and refused": retrying cannot help.
PERMANENT_ERROR_CODES = frozenset({"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST",
                                   "INVALID_STATE", "PERMISSION_DENIED", "RESOURCE_DOES_NOT_EXIST"})


@runtime_checkable
class Tracker(Protocol):
    """Where stages send parameters, per-step metrics (TRL names), tags and artifacts."""

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def set_tags(self, tags: Mapping[str, Any]) -> None: ...

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None: ...

    def close(self, status: str = "FINISHED") -> Any: ...


# --------------------------------------------------------------------------------------------------
# value helpers


def _to_number(value: Any) -> float | None:
    """A metric value as float (numpy/torch scalars via .item()); None when not a number."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # multi-element arrays/tensors are not scalars
            return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def flatten_params(params: Any, prefix: str = "") -> dict[str, str]:
    """Nested mappings (or dataclasses) -> {"section.key": str}; lists of mappings by index
    ("rewards.0.name"), other lists and scalars as JSON; values truncated to MLflow's 6000 chars."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        params = dataclasses.asdict(params)
    out: dict[str, str] = {}
    if isinstance(params, Mapping):
        if not params and prefix:  # keep an empty section visible: "{}"
            out[prefix[:MAX_KEY_CHARS]] = "{}"
        for key, value in params.items():
            out.update(flatten_params(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(params, list | tuple) and params and all(
            isinstance(v, Mapping) or dataclasses.is_dataclass(v) for v in params):
        for i, value in enumerate(params):
            out.update(flatten_params(value, f"{prefix}.{i}" if prefix else str(i)))
        return out
    if not prefix:
        raise TypeError(f"flatten_params needs a mapping or dataclass, got {type(params).__name__}")
    text = params if isinstance(params, str) else json.dumps(params, default=str)
    out[prefix[:MAX_KEY_CHARS]] = _truncate(text, MAX_PARAM_VALUE_CHARS)
    return out


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def default_tracking_uri(repo_root: str | os.PathLike) -> str:
    """``sqlite:////<abs repo_root>/mlflow.db`` - absolute, so the store does not depend on the cwd."""
    return f"sqlite:///{Path(repo_root).resolve() / 'mlflow.db'}"


def default_artifact_location(tracking_uri: str) -> str | None:
    """``file:///<dir of the sqlite db>/mlruns`` for a sqlite store, else None (the server decides)."""
    prefix = "sqlite:///"
    db_path = unquote(tracking_uri[len(prefix):].split("?", 1)[0]) if tracking_uri.startswith(prefix) else ""
    if not db_path or db_path == ":memory:":
        return None
    # sqlite:////abs/x.db -> /abs/x.db (absolute); sqlite:///x.db -> x.db,
    # relative to the cwd as SQLAlchemy reads it
    return (Path(db_path).resolve().parent / "mlruns").as_uri()


def resolve_tracking_uri(configured: str | None, repo_root: str | os.PathLike,
                         environ: Mapping[str, str] | None = None) -> str:
    """The tracking URI to use: ``configured`` (tracking.tracking_uri) > env MLFLOW_TRACKING_URI >
    ``default_tracking_uri(repo_root)``.

    params.yaml wins because it is versioned with the run (and the Makefile exports MLFLOW_TRACKING_URI
    for every command, which would otherwise shadow it); the env var replaces the default when the
    config leaves it null.

    Relative sqlite paths (``sqlite:///mlflow.db``) and bare ``*.db`` paths are made absolute against
    ``repo_root``.
    """
    env = os.environ if environ is None else environ
    uri = (configured or "").strip() or (env.get("MLFLOW_TRACKING_URI") or "").strip()
    if not uri:
        return default_tracking_uri(repo_root)
    root = Path(repo_root).resolve()
    if "://" not in uri and uri.endswith(".db"):
        return f"sqlite:///{(root / uri).resolve()}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////") and uri != "sqlite:///:memory:":
        return f"sqlite:///{(root / uri[len('sqlite:///'):]).resolve()}"
    return uri


def ui_url(tracking_uri: str, environ: Mapping[str, str] | None = None) -> str:
    """Where the MLflow UI for ``tracking_uri`` is: the server itself for http(s), else env ``MLFLOW_UI_URL``,
    else what ``make ui`` serves (http://127.0.0.1:5000)."""
    env = os.environ if environ is None else environ
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return (env.get("MLFLOW_UI_URL") or "http://127.0.0.1:5000").rstrip("/")


def run_url(tracking_uri: str, experiment_id: str, run_id: str,
            environ: Mapping[str, str] | None = None) -> str:
    """The MLflow UI page of one run."""
    return f"{ui_url(tracking_uri, environ)}/#/experiments/{experiment_id}/runs/{run_id}"


def _client(tracking_uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def _is_permanent(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) in PERMANENT_ERROR_CODES


def get_or_create_experiment(client: Any, name: str, artifact_location: str | None = None) -> str:
    """Experiment id for ``name``: created (with ``artifact_location``) if absent, restored if deleted."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location)
        except Exception as exc:  # noqa: BLE001 - another stage may have created it in between
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise exc
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


class MLflowTracker:
    """One MLflow run driven through ``MlflowClient`` (no global active run), batched, failure-tolerant.

    Values are queued and sent with ``log_batch`` (chunks within MLflow's limits). If the store fails,
    the error is caught (a warning once per outage), the values stay queued - at most ``max_backlog``
    metric values, oldest dropped first - and sending is retried on a later call once
    ``retry_interval_s`` has passed. If the run could not even be created, it is created on a later call.
    Errors the server answers as invalid (e.g. a param re-logged with another value) drop that batch.
    ``close`` makes a last attempt, ends the run and warns with the number of values not sent.
    """

    def __init__(self, tracking_uri: str, experiment_name: str, run_name: str | None = None,
                 parent_run_id: str | None = None, tags: Mapping[str, Any] | None = None, *,
                 artifact_location: str | None = None, max_backlog: int = 100_000,
                 retry_interval_s: float = 30.0, continue_run_id: str | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.parent_run_id = parent_run_id
        self.artifact_location = artifact_location or default_artifact_location(tracking_uri)
        self.max_backlog = int(max_backlog)
        self.retry_interval_s = float(retry_interval_s)
        self.run_id: str | None = None
        self.continue_run_id = continue_run_id
        self.continued = False  # True when the run is continue_run_id's (a resumed run goes on logging there)
        self.unsent: dict[str, int] = {}
        self._client = _client(tracking_uri)
        self._lock = threading.RLock()
        self._metrics: list[Any] = []  # mlflow.entities.Metric, oldest first
        self._params: dict[str, str] = {}
        self._tags: dict[str, str] = {}
        self._artifacts: list[tuple[str, str | None]] = []
        self._dropped = 0  # metric values pushed out of a full backlog
        self._rejected = 0  # values the server refused (not retried)
        self._next_attempt = 0.0
        self._failing = False
        self._closed = False
        self._initial_tags = {str(k): _truncate(str(v), MAX_TAG_VALUE_CHARS) for k, v in (tags or {}).items()}
        if parent_run_id:
            self._initial_tags[PARENT_RUN_TAG] = parent_run_id
        self._attempt(force=True)

    # -- public API ------------------------------------------------------------------------------

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Flattened to "section.key" (``flatten_params``); values truncated to 6000 chars."""
        with self._lock:
            self._params.update(flatten_params(params))
            self._attempt()

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Numeric values at ``step`` (non-numeric values are skipped); timestamped now."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        with self._lock:
            for key, value in metrics.items():
                number = _to_number(value)
                if number is not None:
                    self._metrics.append(Metric(str(key)[:MAX_KEY_CHARS], number, ts, int(step)))
            excess = len(self._metrics) - self.max_backlog
            if excess > 0:  # bounded memory during a long outage: the oldest values go first
                del self._metrics[:excess]
                self._dropped += excess
            self._attempt()

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        with self._lock:
            self._tags.update({str(k): _truncate(str(v), MAX_TAG_VALUE_CHARS) for k, v in tags.items()})
            self._attempt()

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Queue a local file or directory for upload (sent with the next successful attempt)."""
        with self._lock:
            self._artifacts.append((str(path), artifact_path))
            self._attempt()

    def flush(self) -> bool:
        """Send everything queued now (ignoring the retry interval); True when nothing is left."""
        with self._lock:
            return self._attempt(force=True)

    @property
    def pending(self) -> dict[str, int]:
        """Values queued but not yet sent, by kind."""
        return {"metrics": len(self._metrics), "params": len(self._params), "tags": len(self._tags),
                "artifacts": len(self._artifacts)}

    def close(self, status: str = "FINISHED") -> int:
        """Last attempt to send, end the run with ``status``; returns (and warns with) the number of values
        not sent: still queued + dropped from a full backlog + refused by the server."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        with self._lock:
            if self._closed:
                return sum(self.unsent.values())
            self._closed = True
            self._attempt(force=True)
            if self.run_id is not None and not self._failing:
                try:
                    self._client.set_terminated(self.run_id, status)
                except Exception as exc:  # noqa: BLE001 - tracking must not fail the stage
                    warnings.warn(f"MLflowTracker: could not end run {self.run_id} at {self.tracking_uri}: "
                                  f"{exc}", RuntimeWarning, stacklevel=2)
            self.unsent = {**self.pending, "dropped_metrics": self._dropped, "rejected": self._rejected}
            total = sum(self.unsent.values())
            if total:
                detail = ", ".join(f"{n} {k}" for k, n in self.unsent.items() if n)
                warnings.warn(f"MLflowTracker: {total} value(s) were not sent to {self.tracking_uri} "
                              f"(run {self.run_id or 'never created'}): {detail}", RuntimeWarning,
                              stacklevel=2)
            return total

    def __enter__(self) -> MLflowTracker:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close("FAILED" if exc_type else "FINISHED")

    # -- sending -----------------------------------------------------------------------------------

    def _attempt(self, force: bool = False) -> bool:
        """Create the run if needed and send the queue; False (queue kept) when the store fails."""
        if not force and time.monotonic() < self._next_attempt:
            return False
        try:
            if self.run_id is None:
                self._create_run()
            self._send_batches()
            self._send_artifacts()
        except Exception as exc:  # noqa: BLE001 - an unreachable store must not kill training
            self._next_attempt = time.monotonic() + self.retry_interval_s
            if not self._failing:  # one warning per outage, not one per step
                warnings.warn(f"MLflowTracker: tracking store {self.tracking_uri} failed, values kept for a "
                              f"retry: {type(exc).__name__}: {_truncate(str(exc), 300)}",
                              RuntimeWarning, stacklevel=3)
            self._failing = True
            return False
        self._failing = False
        return True

    def _create_run(self) -> None:
        exp_id = get_or_create_experiment(self._client, self.experiment_name, self.artifact_location)
        if self.continue_run_id and self._continue(exp_id):
            return
        run = self._client.create_run(exp_id, tags=dict(self._initial_tags), run_name=self.run_name)
        self.run_id = run.info.run_id

    def _continue(self, exp_id: str) -> bool:
        """Reopen ``continue_run_id`` (RUNNING again, this run's tags and parent) when it is in this
        experiment, not deleted and did not finish (it was killed or failed); False (a new run is created)
        otherwise."""
        from mlflow.entities import RunTag

        try:
            old = self._client.get_run(self.continue_run_id)
        except Exception as exc:  # noqa: BLE001 - not in this store (another clone's checkpoints)
            if not _is_permanent(exc):
                raise
            return False
        # a finished run is a finished pipeline's record: extending it (a larger max_steps) starts a new run
        if (old.info.experiment_id != exp_id or old.info.lifecycle_stage == "deleted"
                or old.info.status == "FINISHED"):
            return False
        self._client.update_run(old.info.run_id, status="RUNNING")
        self._client.log_batch(old.info.run_id, tags=[RunTag(k, v) for k, v in self._initial_tags.items()],
                               synchronous=True)
        self.run_id, self.continued = old.info.run_id, True
        return True

    def _send_batches(self) -> None:
        from mlflow.entities import Param, RunTag

        while self._metrics or self._params or self._tags:
            params = list(self._params.items())[:BATCH_PARAMS_TAGS]
            tags = list(self._tags.items())[: BATCH_PARAMS_TAGS - len(params)]
            metrics = self._metrics[: BATCH_METRICS - len(params) - len(tags)]
            try:
                self._client.log_batch(self.run_id, metrics=metrics, params=[Param(k, v) for k, v in params],
                                       tags=[RunTag(k, v) for k, v in tags], synchronous=True)
            except Exception as exc:
                if not _is_permanent(exc):
                    raise
                self._rejected += len(metrics) + len(params) + len(tags)
                warnings.warn(f"MLflowTracker: {self.tracking_uri} refused a batch of {len(metrics)} "
                              f"metrics, {len(params)} params, {len(tags)} tags: {_truncate(str(exc), 300)}",
                              RuntimeWarning, stacklevel=4)
            # sent or refused: either way these leave the queue
            del self._metrics[: len(metrics)]
            for k, _ in params:
                del self._params[k]
            for k, _ in tags:
                del self._tags[k]

    def _send_artifacts(self) -> None:
        while self._artifacts:
            path, artifact_path = self._artifacts[0]
            if Path(path).is_dir():
                self._client.log_artifacts(self.run_id, path, artifact_path)
            elif Path(path).exists():
                self._client.log_artifact(self.run_id, path, artifact_path)
            else:
                self._rejected += 1
                warnings.warn(f"MLflowTracker: artifact {path} does not exist; skipped", RuntimeWarning,
                              stacklevel=4)
            self._artifacts.pop(0)


# --------------------------------------------------------------------------------------------------
# parent / child runs


def end_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> bool:
    """Mark a run (e.g. the parent) terminated; False with a warning when the store fails."""
    if status not in RUN_STATUSES:
        raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
    try:
        _client(tracking_uri).set_terminated(run_id, status)
        return True
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"could not end run {run_id} at {tracking_uri}: {exc}", RuntimeWarning, stacklevel=2)
        return False
