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


@pytest.mark.parametrize("name",
                         ["gpu-process-pool.json", "gpu-kubernetes-pool.json",
                          "multinode-kubernetes-pool.json"])
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


def render_multinode(**values) -> dict:
    """The Job manifest Prefect's worker submits: the template's defaults, then ``values`` (as a deployment's
    job variables and the worker's flow-run command would set them)."""
    from prefect.utilities.templating import apply_values

    template = json.loads((INFRA / "prefect/multinode-kubernetes-pool.json").read_text())
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    return apply_values(template["job_configuration"],
                        {**defaults, "command": "prefect flow-run execute", **values})


def test_the_multinode_template_renders_one_indexed_job_of_a_pod_per_machine():
    job = render_multinode(machines=2, gpus=8, image="registry.example.com/grpo:cuda")["job_manifest"]
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert pod["subdomain"] == "grpo-train" and container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"]: e for e in container["env"]}
    assert env["MACHINE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert (env["JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.labels['batch.kubernetes.io/job-name']")
    claim = {v["name"]: v for v in pod["volumes"]}["workspace"]["persistentVolumeClaim"]["claimName"]
    assert claim == "grpo-workspace"
    assert {"name": "workspace", "mountPath": "/workspace/grpo-pipeline"} in container["volumeMounts"]


@pytest.mark.parametrize("rank, runs", [("0", "prefect flow-run execute"),
                                        ("1", "python -m flows.stages train --params params.yaml")])
def test_pod_0_runs_the_flow_and_the_others_join_its_train_stage(tmp_path, rank, runs):
    """The pod's script, run by bash with stand-ins for prefect and python that print what they were given."""
    import os
    import subprocess

    workspace = tmp_path / "workspace"
    workspace.mkdir()
    job = render_multinode(workspace=str(workspace))["job_manifest"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("prefect", "python"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $* | $PWD | $MACHINE_RANK $MAIN_PROCESS_IP $LAUNCH_ID"\n')
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "JOB_NAME": "grpo-pipeline-x7k2p", "MACHINE_RANK": rank}
    out = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout.strip()
    command, cwd, seen = out.split(" | ")
    assert command == runs
    assert seen == f"{rank} grpo-pipeline-x7k2p-0.grpo-train grpo-pipeline-x7k2p"  # every pod finds pod 0
    assert cwd == (str(workspace) if rank == "1" else str(tmp_path))
    assert os.environ.get("MACHINE_RANK") is None  # nothing leaked into this process


def test_compose_publishes_ports_on_localhost_only_and_has_the_services():
    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "minio", "mlflow", "prefect-server", "prefect-worker"} <= set(services)
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert published and all(p.startswith("127.0.0.1:") for p in published), published
    assert "postgresql://" in services["mlflow"]["command"] and "s3://mlflow" in services["mlflow"]["command"]
    assert "local/dvc" in services["minio-buckets"]["entrypoint"]  # the DVC remote's bucket
