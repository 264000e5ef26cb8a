"""A flow run's record in Prefect when the Prefect server was away at its end.

A flow run reports its end to the Prefect server; when the server is down past the client's retries
(``PREFECT_CLIENT_MAX_RETRIES``) at that moment, the stages have all run but the record stays RUNNING. The
flow writes its outcome into its repo lock's holder file (``.dvc/tmp/grpo-flow.holder``) before reporting; the
next flow run in the repo, holding the lock (so the earlier run's process is gone), reads it and settles the
stale record: COMPLETED or FAILED as the run ended, CRASHED when its process died before writing an outcome.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx

#: what the holder file's ``ended`` says (the MLflow parent's status) -> the Prefect state the record gets
ENDED_AS = {"FINISHED": "COMPLETED", "FAILED": "FAILED"}
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def write_outcome(holder: Path, record: dict[str, Any], *, status: str, stages: list[dict],
                  mlflow_parent: str | None) -> None:
    """The flow's end, into its holder file, before Prefect is told: status and what each stage did. Never
    raises: it runs while the flow ends, maybe on its way out with another error."""
    try:
        held = json.loads(holder.read_text())
    except (OSError, ValueError):
        held = {}
    done = {**held, **record, "ended": status, "mlflow_parent": mlflow_parent,
            "stages": {r["stage"]: "ran" if r["ran"] else "up to date" for r in stages}}
    tmp = holder.with_name(holder.name + ".tmp")
    try:
        tmp.write_text(json.dumps(done))
        tmp.replace(holder)
    except OSError as exc:
        logging.getLogger(__name__).warning("could not record the flow's end in %s: %s", holder, exc)


def settle_message(previous: dict[str, Any]) -> str:
    stages = ", ".join(f"{k} {v}" for k, v in previous.get("stages", {}).items()) or "none recorded"
    if "ended" not in previous:
        return (f"its process (PID {previous.get('pid')}) ended before the flow did, killed or crashed; "
                f"settled by the next flow run in this repo. Stages finished: {stages}")
    return (f"ended {previous['ended']} (MLflow parent run {previous.get('mlflow_parent')}) while the "
            "Prefect server could not be reached; settled by the next flow run in this repo. Stages: "
            f"{stages}")


def settle_previous_run(previous: dict[str, Any] | None, logger) -> str | None:
    """Give the previous flow run of this repo the end its process could not report; returns the state given,
    or None when there was nothing to settle (no earlier run, or its record already final)."""
    if not previous or not previous.get("flow_run_id"):
        return None
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound
    from prefect.states import State

    run_id = previous["flow_run_id"]
    try:
        with get_client(sync_client=True) as client:
            left = client.read_flow_run(run_id).state_type.value
            if left in FINAL:
                return None
            kind = StateType(ENDED_AS.get(previous.get("ended"), "CRASHED"))
            message = settle_message(previous)
            client.set_flow_run_state(run_id, State(type=kind, message=message), force=True)
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
            for task_run in tasks:
                if task_run.state_type is not None and task_run.state_type.value not in FINAL:
                    client.set_task_run_state(task_run.id, State(type=kind, message=message), force=True)
    except (httpx.HTTPError, ObjectNotFound, ValueError) as exc:
        # a record of another server, or deleted: nothing to settle
        logger.warning("could not settle the previous flow run %s in Prefect: %s", run_id, exc)
        return None
    logger.warning("the previous flow run %s in this repo was left %s in Prefect: now %s (%s)",
                   run_id, left, kind.value, message)
    return kind.value
