"""End to end: `dvc repro` on a tiny config in a fresh clone of the repository.

One clone runs the whole pipeline once per test run (``built_pipeline``, shared with
tests/test_prefect_flow.py); tests that change anything work on a copy of it.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.shared_runs import once_per_run

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DVC = str(BIN / "dvc") if (BIN / "dvc").exists() else "dvc"
# Outputs (and local state) of a working copy: a fresh clone has none of them.
NOT_COPIED = ("data/prepared/", "data/validated/", "artifacts/", "metrics/", "plots/", "reports/", "mlruns/",
              "mlflow.db", "dvc.lock", ".dvc/cache/", ".dvc/tmp/")
TINY = {
    "embedded": {"num_train": 48, "num_eval": 12, "hidden_size": 32, "num_hidden_layers": 1,
                 "num_attention_heads": 4, "intermediate_size": 64, "warm_start_steps": 30,
                 "warm_start_batch_size": 16},
    "calibrate": {"num_prompts": 6, "num_generations": 4},
    "generation": {"max_completion_length": 16},
    "train": {"num_generations": 4, "per_device_train_batch_size": 16,
              "max_steps": 3, "save_steps": 2, "learning_rate": 1e-3},
    "evaluate": {"max_samples": 6, "num_generations": 4, "pass_k": [1, 2, 4], "max_completion_length": 16,
                 "batch_size": 16},
}
STAGES = ["prepare", "convert", "validate", "calibrate", "train", "evaluate", "export"]
# The stages that open an MLflow run here: convert has nothing to convert for the embedded default's model
# folder.
TRACKED_STAGES = [s for s in STAGES if s != "convert"]
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false"]


def pipeline_env(**extra: str) -> dict[str, str]:
    """The environment a user's shell would give `dvc`: the venv first on PATH, no inherited run ids.

    MLFLOW_TRACKING_URI is removed (the Makefile exports the main repo's): the stages must find the
    store at the root of the repo DVC runs in.
    """
    from flows.pictures import tool_env

    env = tool_env(REPO)  # what `make pictures` gives make and dvc
    env["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    env.update(extra)
    return env


def run(repo: Path, *cmd: str, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), cwd=repo, env=pipeline_env(), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def dvc(repo: Path, *args: str, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    return run(repo, DVC, *args, check=check, timeout=timeout)


def make_clone(dest: Path, params: dict | None = None) -> Path:
    """A fresh clone: the repository's files (tracked and new, not ignored), no outputs, tiny params."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in listed:
        if not rel or rel.startswith(NOT_COPIED) or not (REPO / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in {**TINY, **(params or {})}.items():
        raw[section].update(values)
    (dest / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    run(dest, "git", "init", "-q")
    run(dest, "git", "add", "-A")
    run(dest, *GIT, "commit", "-q", "-m", "clone")
    return dest


# files nothing writes in place (a stage replaces them whole): a copy of a repo links them instead
LINKED_SUFFIXES = {".safetensors", ".gguf", ".pt"}


def copy_repo(src: Path, dest: Path) -> Path:
    """A copy of ``src`` to run on. DVC's cache objects (read-only) and model files are hard links, so a copy
    of the real model's run costs no disk; everything else (SQLite stores, params, logs) is copied."""
    def copy(source: str, target: str) -> str:
        mode = os.stat(source).st_mode
        if not mode & stat.S_IWUSR or Path(source).suffix in LINKED_SUFFIXES:
            os.link(source, target)
            return target
        return shutil.copy2(source, target)

    shutil.copytree(src, dest, symlinks=True, copy_function=copy)
    return dest


def built_pipeline(tmp_path_factory) -> tuple[Path, str]:
    """(repo, output of its first `dvc repro`): built once per test run (tests/shared_runs.py), never modified
    afterwards."""
    def build(folder: Path) -> list[str]:
        repo = make_clone(folder / "repo")
        proc = dvc(repo, "repro")
        return [str(repo), proc.stdout + proc.stderr]

    repo, log = once_per_run(tmp_path_factory, "pipeline", build)
    return Path(repo), log


def mlflow_client(repo: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")


def stage_runs(repo: Path) -> list:
    client = mlflow_client(repo)
    exp = client.get_experiment_by_name("grpo-pipeline")
    return client.search_runs([exp.experiment_id], order_by=["attribute.start_time ASC"], max_results=500)


def logits_on_fixed_input(model_dir: Path, dtype=None):
    """Logits of the model in ``model_dir`` (loaded in ``dtype``, None: as saved) on 32 fixed token ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or "auto").eval()
    ids = torch.arange(1, 33).unsqueeze(0) % model.config.vocab_size  # any fixed ids: weights are compared
    with torch.no_grad():
        return model(input_ids=ids).logits


def differing_tensors(a: dict, b: dict) -> list[str]:
    """Names of the tensors that differ (value, dtype or shape) between two state dicts with the same keys."""
    import torch

    assert a.keys() == b.keys()
    return [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return built_pipeline(tmp_path_factory)


pytestmark = pytest.mark.slow


def test_repro_runs_every_stage_and_writes_every_declared_output(pipeline):
    repo, output = pipeline
    for stage in STAGES:
        assert f"Running stage '{stage}'" in output
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert list(lock["stages"]) == STAGES
    declared = [o["path"] for s in lock["stages"].values() for o in s.get("outs", [])]
    assert len(declared) >= 15
    missing = [p for p in declared if not (repo / p).exists()]
    assert missing == []
    # no output names where this clone lives: another clone hashes the same outputs the same (a shared cache)
    where = str(repo.resolve()).encode()
    files = [f for p in declared for f in ((repo / p).rglob("*") if (repo / p).is_dir() else [repo / p])
             if f.is_file()]
    assert [str(f.relative_to(repo)) for f in files if where in f.read_bytes()] == []

    # the contract's outputs
    weights = json.loads((repo / "artifacts/calibration/reward_weights.json").read_text())
    assert {"weights", "stats", "rule"} <= set(weights)
    assert sorted(p.name for p in (repo / "artifacts/checkpoints").glob("checkpoint-*")) == ["checkpoint-2",
                                                                                             "checkpoint-3"]
    assert ((repo / "artifacts/model/model.safetensors").is_file()
            and (repo / "artifacts/model/config.json").is_file())
    metrics = json.loads((repo / "metrics/eval.json").read_text())
    assert set(metrics) >= {"base", "trained", "delta"}
    assert 0.0 <= metrics["base"]["accuracy"] <= 1.0 and 0.0 <= metrics["trained"]["accuracy"] <= 1.0
    assert {"pass@1", "pass@4", "format_compliance", "mean_completion_length"} <= set(metrics["trained"])
    with open(repo / "metrics/train_log.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert {"reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean", "completions/mean_length",
            "completions/clipped_ratio", "frac_reward_zero_std", "grad_norm", "learning_rate", "step_time",
            "rewards/correctness/mean"} <= set(rows[0])
    import pandas as pd

    table = pd.read_parquet(repo / "artifacts/eval/completions.parquet")
    assert set(table["policy"]) == {"base", "trained"} and set(table["mode"]) == {"greedy", "sampled"}
    assert len(table) == 2 * 6 * (1 + 4)
    for png in ("plots/training.png", "plots/evaluation.png"):
        assert (repo / png).read_bytes()[:4] == b"\x89PNG"
    assert (repo / "reports/validation.txt").read_text().startswith("data validation: OK")
    assert "| accuracy |" in (repo / "reports/evaluation.md").read_text()
    from flows.stages.evaluate import registry_markdown

    # the decision as data; the report renders it
    registry = json.loads((repo / "reports/registry.json").read_text())
    assert registry["registered"] and registry["version"] == 1 and registry["against"] == "base"
    assert registry_markdown(registry) in (repo / "reports/evaluation.md").read_text()
    # the exported model is the last checkpoint's policy cast to model.dtype; training moved it off the base
    import torch
    from safetensors.torch import load_file

    model_params = yaml.safe_load((repo / "params.yaml").read_text())["model"]
    dtype = getattr(torch, model_params["dtype"])
    last, base = repo / "artifacts/checkpoints/checkpoint-3", repo / model_params["name_or_path"]
    exported = load_file(repo / "artifacts/model/model.safetensors")
    assert {t.dtype for t in exported.values()} == {dtype}
    trained = {k: v.to(dtype) for k, v in load_file(last / "model.safetensors").items()}
    assert differing_tensors(exported, trained) == []
    initial = {k: v.to(dtype) for k, v in load_file(base / "model.safetensors").items()}
    assert differing_tensors(exported, initial) == list(exported)  # every tensor took gradient steps
    logits = logits_on_fixed_input(repo / "artifacts/model")
    torch.testing.assert_close(logits, logits_on_fixed_input(last, dtype), rtol=0, atol=0)
    assert (logits - logits_on_fixed_input(base, dtype)).abs().max() > 1e-3


def test_second_repro_does_nothing(pipeline):
    repo, _ = pipeline
    proc = dvc(repo, "repro")
    assert "Running stage" not in proc.stdout
    assert "Data and pipelines are up to date." in proc.stdout
    assert "Data and pipelines are up to date." in dvc(repo, "status").stdout


def test_mlflow_holds_one_parent_with_a_child_run_per_stage(pipeline):
    repo, _ = pipeline
    # at the repo root, found via DVC_ROOT
    assert (repo / "mlflow.db").is_file() and (repo / "mlruns").is_dir()
    runs = stage_runs(repo)
    parents = [r for r in runs if r.data.tags.get("grpo.role") == "pipeline"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.params["train.max_steps"] == "3"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert [r.data.tags["stage"] for r in children] == TRACKED_STAGES
    assert all(r.info.status == "FINISHED" for r in children)
    sha = run(repo, "git", "rev-parse", "HEAD").stdout.strip()
    assert all(r.data.tags["git.sha"] == sha for r in children)
    assert children[0].data.params["train.learning_rate"] == "0.001"  # the resolved config, flattened

    client = mlflow_client(repo)
    train = children[3]
    for key in ("reward", "kl", "completions/mean_length", "rewards/correctness/mean"):
        assert [m.step for m in client.get_metric_history(train.info.run_id, key)] == [1, 2, 3]
    assert any(k.startswith("data.md5.data/validated/train.parquet") for k in train.data.tags)
    evaluate = children[4]
    assert "trained/accuracy" in evaluate.data.metrics and "trained/pass_at_4" in evaluate.data.metrics
    artifacts = {a.path for a in client.list_artifacts(evaluate.info.run_id)}
    assert {"eval", "plots", "reports", "metrics"} <= artifacts
    (output,) = evaluate.outputs.model_outputs  # the policy is a LoggedModel of the run, not a run artifact
    assert client.get_logged_model(output.model_id).source_run_id == evaluate.info.run_id
    assert ({a.path for a in client.list_artifacts(children[2].info.run_id)}
            >= {"calibration", "reports", "samples"})
    versions = client.search_model_versions("name='grpo-policy'")
    assert len(versions) == 1 and versions[0].run_id == evaluate.info.run_id


def test_dvc_metrics_and_plots_read_the_outputs(pipeline, tmp_path):
    repo, _ = pipeline
    shown = json.loads(dvc(repo, "metrics", "show", "--json").stdout)
    data = next(iter(shown.values()))["data"]["metrics/eval.json"]["data"]
    assert "accuracy" in data["trained"]
    assert "trained.accuracy" in dvc(repo, "metrics", "diff", "--all").stdout
    dvc(repo, "plots", "show", "-o", str(tmp_path / "plots"))
    html = (tmp_path / "plots" / "index.html").read_text()
    assert "reward" in html and "completions/mean_length" in html


def test_bad_data_stops_at_validate_with_a_report_naming_the_rows(pipeline, tmp_path):
    repo = copy_repo(pipeline[0], tmp_path / "repo")
    rows = [json.loads(line) for line in (repo / "data/prepared/train.jsonl").read_text().splitlines()]
    rows[3]["answer"] = "seventeen-ish"
    rows[5]["prompt"] = "   "
    rows[9]["prompt"] = rows[8]["prompt"]
    (repo / "data/bad").mkdir()
    (repo / "data/bad/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    # (prepare owns data/prepared)
    raw["data"].update(train_files="data/bad/train.jsonl", train_dir="data/bad")
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    kept = {p: (repo / p).read_bytes() for p in ("data/validated/train.parquet", "metrics/eval.json",
                                                 "artifacts/calibration/reward_weights.json")}

    proc = dvc(repo, "repro", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "failed to reproduce 'validate'" in out and "exited with 3" in out
    for stage in ("calibrate", "train", "evaluate"):
        assert f"Running stage '{stage}'" not in out
    report = (repo / "reports/validation.txt").read_text()
    assert report.startswith("data validation: FAILED - 3 failure(s)")
    assert "[train] row=3 column=answer check=gold_parseable" in report
    assert "[train] row=5 column=prompt check=prompt_not_empty" in report
    assert "[train] row=9 column=prompt check=duplicate_prompt: same prompt as row 8" in report
    assert "row=3" in out  # printed, not only written
    assert json.loads((repo / "reports/validation.json").read_text())["ok"] is False
    for path, content in kept.items():  # no validated data written, nothing downstream touched
        assert (repo / path).read_bytes() == content, path
    status = dvc(repo, "status").stdout
    assert "validate:" in status

    runs = stage_runs(repo)
    failed = [r for r in runs if r.data.tags.get("stage") == "validate" and r.info.status == "FAILED"]
    assert len(failed) == 1 and failed[0].data.tags["validation"] == "failed"
    parent = mlflow_client(repo).get_run(failed[0].data.tags["mlflow.parentRunId"])
    assert parent.info.status == "FAILED"


# `dvc exp run` with a changed param, and what the MLflow UI shows for it: tests/test_mlflow_ui.py.


def test_sigkill_during_training_then_repro_resumes_with_no_lost_steps(pipeline, tmp_path):
    """`dvc repro` is SIGKILLed (its whole process group) once training has checkpointed; the next
    `dvc repro` resumes from the newest checkpoint and the train log ends with every step exactly once."""
    import signal
    import time

    repo = copy_repo(pipeline[0], tmp_path / "repo")
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    raw["train"].update(max_steps=40, save_steps=4)  # max_steps/save_steps keep the run resumable
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    ckpts = repo / "artifacts/checkpoints"
    before = {r.info.run_id for r in stage_runs(repo)}
    proc = subprocess.Popen([DVC, "repro"], cwd=repo, env=pipeline_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        steps = [int(p.name.split("-")[1]) for p in ckpts.glob("checkpoint-*")
                 if p.name.split("-")[1].isdigit()]
        if any(4 < s < 40 for s in steps):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(int(p.name.split("-")[1]) for p in ckpts.glob("checkpoint-*")
                    if p.name.split("-")[1].isdigit())
    assert killed_at < 40

    out = dvc(repo, "repro")
    text = out.stdout + out.stderr
    assert "train: resuming from" in text and "checkpoint-" in text
    with open(repo / "metrics/train_log.csv", newline="") as fh:
        steps = [int(float(r["step"])) for r in csv.DictReader(fh)]
    assert steps == list(range(1, 41))  # none lost, none twice
    assert "Data and pipelines are up to date." in dvc(repo, "status").stdout

    # MLflow: the killed pipeline's parent is KILLED; its train run went on in the resumed pipeline, one curve
    runs = [r for r in stage_runs(repo) if r.info.run_id not in before]
    pipelines = sorted((r for r in runs if r.data.tags.get("grpo.role") == "pipeline"),
                       key=lambda r: r.info.start_time)
    assert [p.info.status for p in pipelines] == ["KILLED", "FINISHED"]
    (train,) = [r for r in runs if r.data.tags.get("stage") == "train"]
    assert (train.info.status == "FINISHED"
            and train.data.tags["mlflow.parentRunId"] == pipelines[1].info.run_id)
    assert train.data.tags["train.checkpoints"] == f"resume:checkpoint-{killed_at}"
    logged = {m.step for m in mlflow_client(repo).get_metric_history(train.info.run_id, "reward")}
    # the killed run extended the built one from its last checkpoint
    # (a larger max_steps): a new run from there on
    assert logged == set(range(TINY["train"]["max_steps"] + 1, 41))
