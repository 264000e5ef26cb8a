"""Tracking that loses nothing: a store that is down as a stage starts is retried, a stage that could not
record says so, and a train log's steps that MLflow lacks (a killed run's lost backlog) reach it exactly once.

The store is a real SQLite MLflow store; an outage is its parent-run creation failing (what an unreachable
server does to the first call a stage makes).
"""

from __future__ import annotations

import pytest

from flows.stages import runs
from flows.stages.common import StageContext
from flows.stages.runs import ROLE_TAG, StageRun
from grpo_core.config import config_from_dict

DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]


@pytest.fixture
def ctx(tmp_path, monkeypatch):
    monkeypatch.delenv("GRPO_PARENT_RUN_ID", raising=False)
    monkeypatch.delenv("GRPO_RUN_GROUP", raising=False)
    monkeypatch.setattr(runs, "OPEN_BACKOFF_S", 0.01)
    cfg = config_from_dict({"rewards": DIGITS, "data": {"train_files": ["t.jsonl"]},
                            "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}})
    return StageContext(stage="train", root=tmp_path, store_root=tmp_path,
                        params_path=tmp_path / "params.yaml", cfg=cfg)


def client(ctx):
    import mlflow

    return mlflow.MlflowClient(ctx.cfg.tracking.tracking_uri)


def failing_first(monkeypatch, times: int) -> list[int]:
    """The parent run's creation fails ``times`` times (a store not up yet), then works;
    returns the call count."""
    real, calls = runs.create_parent_run, [0]

    def create(*args, **kwargs):
        calls[0] += 1
        if calls[0] <= times:
            raise ConnectionError("Connection refused: 127.0.0.1:5000")
        return real(*args, **kwargs)

    monkeypatch.setattr(runs, "create_parent_run", create)
    return calls


def history(ctx, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client(ctx).get_metric_history(run_id, key))


def test_a_store_down_as_the_stage_starts_is_retried_and_the_stage_recorded(ctx, monkeypatch):
    calls = failing_first(monkeypatch, times=2)
    with StageRun(ctx) as run:
        run.log_metrics({"reward": 0.5}, step=1)
        run_id, parent = run.run_id, run.parent_run_id
    assert calls[0] == 3 and run_id is not None
    stored = client(ctx).get_run(run_id)
    assert stored.data.tags["mlflow.parentRunId"] == parent and stored.info.status == "FINISHED"
    pipelines = client(ctx).search_runs([stored.info.experiment_id], f"tags.`{ROLE_TAG}` = 'pipeline'")
    assert [p.info.run_id for p in pipelines] == [parent]  # one parent, however many attempts
    assert history(ctx, run_id, "reward") == [1]


def test_a_store_down_throughout_says_so_at_the_end(ctx, monkeypatch, capsys):
    calls = failing_first(monkeypatch, times=100)
    with pytest.warns(RuntimeWarning, match=r"MLflow tracking is off for this run .*4 attempts failed: "
                                            r"ConnectionError: Connection refused"):
        with StageRun(ctx) as run:
            run.log_metrics({"reward": 0.5}, step=1)  # a no-op, not an error
    assert calls[0] == runs.OPEN_ATTEMPTS and run.tracker is None
    err = capsys.readouterr().err
    assert "train: MLflow recorded nothing for this stage" in err and "Connection refused" in err


def test_a_killed_runs_lost_steps_reach_mlflow_from_the_train_log_exactly_once(ctx):
    """The first run logged steps 1-2 and was killed with 3-4 in its in-memory backlog (MLflow down); the
    resumed stage continues the same run, redoes steps 2-3 from its checkpoint (step 2 is not logged again)
    and backfills step 4 from the train log; a second backfill sends nothing."""
    rows = [{"step": s, "reward": 0.1 * s, "kl": 0.01 * s, "pass@4": 0.5} for s in (1, 2, 3, 4)]
    killed = StageRun(ctx).__enter__()  # never closed: the process died
    for row in rows[:2]:
        killed.log_metrics({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    killed.tracker.flush()
    run_id = killed.run_id

    with StageRun(ctx, continue_run_id=run_id) as resumed:
        assert resumed.run_id == run_id
        # redone from checkpoint-1
        resumed.log_metrics({k: v for k, v in rows[1].items() if k != "step"}, step=2)
        resumed.log_metrics({k: v for k, v in rows[2].items() if k != "step"}, step=3)
        assert resumed.backfill(rows) == 5  # step 4: reward, kl, pass_at_4 and the two overview keys
        assert resumed.backfill(rows) == 0
    for key in ("reward", "kl", "pass_at_4", "0_overview/reward", "0_overview/kl"):
        assert history(ctx, run_id, key) == [1, 2, 3, 4], key
    values = {m.step: m.value for m in client(ctx).get_metric_history(run_id, "reward")}
    assert values == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4})
