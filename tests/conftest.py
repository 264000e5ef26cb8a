"""Test-session environment: offline, no telemetry. Thread counts are left to torch's defaults."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def converted_smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from its GGUF once for the whole run (~40 s): a safetensors folder."""
    from grpo_core.model.gguf import convert_gguf
    from tests.real_model import smollm2_gguf

    out = tmp_path_factory.mktemp("smollm2") / "model"
    convert_gguf(smollm2_gguf(), out)
    return out
