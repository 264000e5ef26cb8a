"""Test-session environment: offline, no telemetry. Thread counts are left to torch's defaults."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def smollm2_pipeline(tmp_path_factory):
    """(repo, log): configs/smollm2-135m-word-problems.yaml scaled down under `dvc repro` in a fresh clone,
    once for the whole run (tests/real_model.py)."""
    from tests.real_model import build_smollm2_pipeline

    return build_smollm2_pipeline(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="session")
def converted_smollm2(smollm2_pipeline):
    """SmolLM2-135M-Instruct as the convert stage wrote it (the suite converts once): a safetensors folder."""
    return smollm2_pipeline[0] / "artifacts" / "converted_model"


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server for flow runs in this process (one for the whole run)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture()
def clean_env(monkeypatch):
    """No tracking URI or run ids inherited from the caller: the stages find the store at their repo's
    root."""
    for var in ("MLFLOW_TRACKING_URI", "GRPO_PARENT_RUN_ID", "GRPO_FLOW_RUN_ID", "GRPO_RUN_GROUP",
                "GRPO_EXPERIMENT_NAME", "DVC_ROOT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
