"""A teammate's path through the shared DVC remote: `dvc push` from one clone, then a fresh clone's
`dvc pull && dvc repro` does no work.

The remote is the committed `minio` remote of `.dvc/config` (the compose file's MinIO, bucket `dvc`),
pointed with `dvc remote modify --local` at moto's S3 server started on 127.0.0.1 - the same S3 API,
pip-installable. The pushed repository is the session's built pipeline (tests/test_pipeline.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_pipeline import DVC, GIT, STAGES, built_pipeline, copy_repo, pipeline_env
from tests.test_servers import Server, free_port

pytestmark = pytest.mark.slow
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "grpo", "AWS_SECRET_ACCESS_KEY": "grpo-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 with the compose file's bucket `dvc`; yields its endpoint URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = Server("moto S3 server",
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                    f"{url}/moto-api/", {**os.environ, **CREDENTIALS},
                    tmp_path_factory.mktemp("moto") / "server.log")
    server.start(timeout=60)
    try:
        import boto3

        s3 = boto3.client("s3", endpoint_url=url, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
        s3.create_bucket(Bucket="dvc")
        yield url, s3
    finally:
        server.stop()


def sh(repo: Path, *cmd: str) -> str:
    proc = subprocess.run(list(cmd), cwd=repo, env=pipeline_env(**CREDENTIALS), capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{out[-4000:]}"
    return out


def cached_outputs(repo: Path) -> dict[str, str]:
    """{path: md5} of every cached output dvc.lock records."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {o["path"]: o["md5"] for st in lock["stages"].values() for o in st.get("outs", [])}


def test_push_then_a_fresh_clone_pulls_and_repro_does_no_work(tmp_path_factory, s3_server):
    url, s3 = s3_server
    team = copy_repo(built_pipeline(tmp_path_factory)[0], tmp_path_factory.mktemp("team") / "repo")
    sh(team, "git", "add", "-A")
    sh(team, *GIT, "commit", "-q", "-m", "pipeline results")
    sh(team, DVC, "remote", "modify", "--local", "minio", "endpointurl", url)  # this machine only
    pushed = sh(team, DVC, "push", "-r", "minio")
    assert "pushed" in pushed
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="dvc")
            for o in page.get("Contents", [])]
    assert keys and all(k.startswith("grpo-pipeline/files/md5/") for k in keys), keys[:5]

    clone = tmp_path_factory.mktemp("teammate") / "repo"
    subprocess.run(["git", "clone", "-q", str(team), str(clone)], check=True)
    assert not (clone / "artifacts/model").exists() and not (clone / ".dvc/cache").exists()
    sh(clone, DVC, "remote", "modify", "--local", "minio", "endpointurl", url)
    sh(clone, DVC, "pull", "-r", "minio")
    for path in ("data/validated/train.parquet", "artifacts/base_model", "artifacts/model",
                 "artifacts/checkpoints", "artifacts/calibration/reward_weights.json"):
        assert (clone / path).exists(), path

    status = sh(clone, DVC, "status")
    assert "Data and pipelines are up to date." in status, status
    repro = sh(clone, DVC, "repro")
    for stage in STAGES:
        assert f"Stage '{stage}' didn't change, skipping" in repro, repro
    assert "Running stage" not in repro
    assert not (clone / "mlflow.db").exists()  # no stage ran, so none opened a run
    assert cached_outputs(clone) == cached_outputs(team)
