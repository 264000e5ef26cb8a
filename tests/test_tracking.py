"""The MLflow tracker against a real SQLite store, a flaky store and an unreachable server."""

from __future__ import annotations

import socket
import warnings
from pathlib import Path

import pytest

from flows.tracking import (
    PARENT_RUN_TAG,
    MLflowTracker,
    Tracker,
    default_artifact_location,
    default_tracking_uri,
    flatten_params,
    get_or_create_experiment,
    resolve_tracking_uri,
)

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite store for the module (creating one runs MLflow's migrations: seconds)."""
    root = tmp_path_factory.mktemp("repo")
    return default_tracking_uri(root), root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_flatten_params():
    cfg = {"train": {"learning_rate": 5e-4, "epsilon_high": None, "pass_k": [1, 4]},
           "rewards": [{"name": "correctness", "kwargs": {}}], "model": {"name_or_path": "x" * 7000}}
    flat = flatten_params(cfg)
    assert flat["train.learning_rate"] == "0.0005"
    assert flat["train.epsilon_high"] == "null" and flat["train.pass_k"] == "[1, 4]"
    assert flat["rewards.0.name"] == "correctness" and flat["rewards.0.kwargs"] == "{}"
    assert len(flat["model.name_or_path"]) == 6000 and flat["model.name_or_path"].endswith("...")


def test_uris(tmp_path):
    uri = default_tracking_uri(tmp_path)
    assert uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db" and uri.startswith("sqlite:////")
    assert default_artifact_location(uri) == (tmp_path.resolve() / "mlruns").as_uri()
    assert default_artifact_location("http://host:5000") is None
    assert resolve_tracking_uri(None, tmp_path, environ={}) == uri
    assert resolve_tracking_uri("http://h:1", tmp_path, environ={}) == "http://h:1"
    env = {"MLFLOW_TRACKING_URI": "http://e:2"}
    assert resolve_tracking_uri("http://h:1", tmp_path, environ=env) == "http://h:1"  # params.yaml wins
    assert resolve_tracking_uri(None, tmp_path, environ=env) == "http://e:2"  # env replaces the default
    assert resolve_tracking_uri("sqlite:///sub/m.db", tmp_path, environ={}) == f"sqlite:///{tmp_path.resolve()}/sub/m.db"
    assert resolve_tracking_uri("m.db", tmp_path, environ={}) == f"sqlite:///{tmp_path.resolve()}/m.db"


def test_parent_and_child_runs(store, tmp_path):
    uri, root = store
    client = mlflow.MlflowClient(uri)
    exp_id = get_or_create_experiment(client, "exp-a", default_artifact_location(uri))
    parent = client.create_run(exp_id, run_name="pipeline").info.run_id

    artifact = tmp_path / "reward_weights.json"
    artifact.write_text("{}")
    with MLflowTracker(uri, "exp-a", run_name="train", parent_run_id=parent,
                       tags={"stage": "train", "k": "v"}) as child:
        assert isinstance(child, Tracker)
        child.log_params({"train": {"learning_rate": 5e-4, "beta": 0.04}})
        for step in range(1, 4):
            child.log_metrics({"reward": step / 10, "rewards/correctness/mean": step / 5}, step=step)
        child.set_tags({"status_note": "ok"})
        child.log_artifact(artifact, "calibration")
    client = mlflow.MlflowClient(uri)
    run = client.get_run(child.run_id)
    assert run.data.tags[PARENT_RUN_TAG] == parent and run.data.tags["stage"] == "train"
    assert run.data.tags["k"] == "v" and run.data.tags["status_note"] == "ok"
    assert run.info.run_name == "train" and run.info.status == "FINISHED"
    assert run.data.params == {"train.learning_rate": "0.0005", "train.beta": "0.04"}
    history = client.get_metric_history(child.run_id, "reward")
    assert ([(m.step, m.value) for m in sorted(history, key=lambda m: m.step)]
            == [(1, 0.1), (2, 0.2), (3, 0.3)])
    assert ([a.path for a in client.list_artifacts(child.run_id, "calibration")]
            == ["calibration/reward_weights.json"])
    exp = client.get_experiment_by_name("exp-a")
    assert exp.artifact_location == (root.resolve() / "mlruns").as_uri()
    assert Path(root, "mlruns").is_dir()
    assert child.close() == 0 and child.unsent["metrics"] == 0


def test_transient_failure_is_retried(store, monkeypatch):
    uri, _ = store
    tracker = MLflowTracker(uri, "exp-b", "flaky", retry_interval_s=0.0)
    real = tracker._client.log_batch
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("store went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(tracker._client, "log_batch", flaky)
    with pytest.warns(RuntimeWarning, match="store went away"):
        tracker.log_metrics({"loss": 1.0}, step=1)
    assert tracker.pending["metrics"] == 1
    tracker.log_metrics({"loss": 0.5}, step=2)  # the retry sends both
    assert tracker.pending["metrics"] == 0
    assert tracker.close() == 0
    history = mlflow.MlflowClient(uri).get_metric_history(tracker.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 0.5)]


def test_refused_param_is_dropped_not_retried(store):
    uri, _ = store
    tracker = MLflowTracker(uri, "exp-b", "params")
    tracker.log_params({"lr": 1})
    with pytest.warns(RuntimeWarning, match="refused"):
        tracker.log_params({"lr": 2})  # MLflow params are immutable: INVALID_PARAMETER_VALUE
    tracker.log_metrics({"x": 1.0}, step=0)  # the run keeps working
    with pytest.warns(RuntimeWarning, match="1 value"):
        assert tracker.close() == 1
    assert tracker.unsent["rejected"] == 1


def test_unreachable_server_does_not_raise(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    uri = f"http://127.0.0.1:{free_port()}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = MLflowTracker(uri, "exp", "train", max_backlog=5, retry_interval_s=3600)
        tracker.log_params({"train": {"lr": 0.1}})
        for step in range(4):
            tracker.log_metrics({"reward": 0.1 * step, "kl": 0.0}, step=step)  # 8 values, backlog of 5
        tracker.set_tags({"a": "b"})
        unsent = tracker.close("FAILED")
    assert tracker.run_id is None
    assert tracker.unsent == {"metrics": 5, "params": 1, "tags": 1, "artifacts": 0, "dropped_metrics": 3,
                              "rejected": 0}
    assert unsent == 10
    messages = [str(w.message) for w in caught]
    assert sum("failed, values kept" in m for m in messages) == 1  # one warning per outage
    assert any(f"10 value(s) were not sent to {uri}" in m for m in messages)
