"""The infra/ files a team deploys: parseable, self-consistent, and safe by default."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

INFRA = Path(__file__).resolve().parents[1] / "infra"
PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def placeholders(node) -> set[str]:
    if isinstance(node, dict):
        return set().union(*(placeholders(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(placeholders(v) for v in node)) if node else set()
    return set(PLACEHOLDER.findall(node)) if isinstance(node, str) else set()


@pytest.mark.parametrize("name", ["gpu-process-pool.json", "gpu-kubernetes-pool.json"])
def test_work_pool_templates_declare_every_placeholder_they_use(name):
    template = json.loads((INFRA / "prefect" / name).read_text())
    used = placeholders(template["job_configuration"])
    declared = set(template["variables"]["properties"])
    assert used and used <= declared, f"{name}: undeclared {sorted(used - declared)}"


def test_kubernetes_template_requests_gpus():
    template = json.loads((INFRA / "prefect/gpu-kubernetes-pool.json").read_text())
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert template["variables"]["properties"]["gpus"]["default"] >= 1


def test_compose_publishes_ports_on_localhost_only_and_has_the_services():
    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "minio", "mlflow", "prefect-server", "prefect-worker"} <= set(services)
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert published and all(p.startswith("127.0.0.1:") for p in published), published
    assert "postgresql://" in services["mlflow"]["command"] and "s3://mlflow" in services["mlflow"]["command"]
    assert "local/dvc" in services["minio-buckets"]["entrypoint"]  # the DVC remote's bucket
