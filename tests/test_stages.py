"""Stage plumbing without DVC: exit codes, params parsing, checkpoint fingerprints, the promotion gate,
MLflow key sanitising, and the calibrate stage's wiring run in-process on a tiny model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from flows.stages import EXIT_CONFIG, EXIT_DATA, EXIT_ERROR, EXIT_TRAINING, EXIT_VALIDATION, exit_code_for
from flows.stages.common import StageConfigError, StageContext, find_repo_root, load_params, store_root
from flows.stages.evaluate import known_metric_names, promotion_decision
from flows.stages.runs import safe_key

REPO = Path(__file__).resolve().parents[1]


def test_exit_codes_follow_the_exception_class():
    from grpo_core.config import ConfigError
    from grpo_core.data.loading import DataError
    from grpo_core.data.validation import DataValidationError
    from grpo_core.rollout.vllm import VLLMUnavailable
    from grpo_core.train.guards import GuardStop
    from grpo_core.train.state import TrainingError

    class Sub(DataError):
        pass

    class TrainingErrorLookalike(RuntimeError):  # a name is not a category: only the class hierarchy counts
        pass

    assert exit_code_for(ConfigError("x")) == EXIT_CONFIG
    assert exit_code_for(DataValidationError("x")) == EXIT_VALIDATION
    assert exit_code_for(Sub("x")) == EXIT_DATA
    assert exit_code_for(TrainingError("x")) == EXIT_TRAINING
    assert exit_code_for(GuardStop("x")) == EXIT_TRAINING  # permanent: the Prefect task is not retried
    assert exit_code_for(VLLMUnavailable("x")) == EXIT_CONFIG  # was 1, so Prefect retried a setup error
    assert exit_code_for(TrainingErrorLookalike("x")) == EXIT_ERROR
    assert exit_code_for(RuntimeError("x")) == EXIT_ERROR
    assert (isinstance(ConfigError("x"), ValueError)
            and isinstance(GuardStop("x"), RuntimeError))  # callers' catches


# Raised inside one module and handled there, never a stage's failure; PicturesError is `make pictures`' own
# (no stage and no Prefect task runs flows/pictures.py).
INTERNAL_ERRORS = {"RewardTimeout", "StageFailed", "PermanentStageFailure", "StageTimeout", "PicturesError"}


def test_every_error_class_of_the_project_carries_an_exit_code():
    """A new error class must choose its category (grpo_core.common.errors): one that does not falls through
    to exit 1 and Prefect retries a failure that cannot heal."""
    import ast

    from grpo_core.common.errors import PipelineError

    found = []
    for path in [*REPO.glob("grpo_core/**/*.py"), *REPO.glob("flows/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ClassDef)
                    and node.name.endswith(("Error", "Stop", "Failed", "Unavailable"))):
                found.append((path, node.name))
    assert len(found) >= 12
    import importlib

    for path, name in found:
        if name in INTERNAL_ERRORS or path.name == "errors.py":
            continue
        module = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
        assert issubclass(getattr(module, name), PipelineError), f"{path.relative_to(REPO)}: {name}"


def test_safe_key_makes_mlflow_accept_eval_metric_names():
    assert safe_key("trained/pass@4") == "trained/pass_at_4"
    assert safe_key("rewards/format/mean") == "rewards/format/mean"
    assert safe_key("/abs/file") == "abs/file"
    assert safe_key("/x/../y") == "x/_/y"
    assert safe_key("a b:c-d.e") == "a b:c-d.e"


def test_promotion_gate():
    first = promotion_decision("accuracy", 0.6, base=0.5, champion=None, margin=0.0)
    assert first["promote"] and first["against"] == "base"
    assert not promotion_decision("accuracy", 0.5, base=0.5, champion=None,
                                  margin=0.0)["promote"]  # must beat
    assert not promotion_decision("accuracy", 0.55, base=0.5, champion=None, margin=0.1)["promote"]
    vs_champion = promotion_decision("accuracy", 0.7, base=0.1, champion=0.69, margin=0.02)
    assert not vs_champion["promote"] and vs_champion["against"] == "champion"
    assert promotion_decision("accuracy", 0.72, base=0.1, champion=0.69, margin=0.02)["promote"]
    assert not promotion_decision("accuracy", None, base=0.1, champion=None, margin=0.0)["promote"]


def test_known_metric_names_cover_eval_json_keys():
    cfg = load_params(REPO / "params.yaml")
    names = known_metric_names(cfg)
    assert {"accuracy", "pass@4", "rewards/correctness/mean", "sampled/format_compliance"} <= set(names)


def test_params_are_read_as_dvc_writes_them(tmp_path):
    """`dvc exp run -S` rewrites params.yaml with ruamel and drops the quotes around "no"."""
    text = (REPO / "params.yaml").read_text().replace('mixed_precision: "no"', "mixed_precision: no")
    # the train section's learning rate, rewritten the way ruamel writes a float it round-trips
    text = re.sub(r"(?m)^  learning_rate: \S+", "  learning_rate: 5e-4", text)
    assert "mixed_precision: no " in text
    (tmp_path / "params.yaml").write_text(text)
    cfg = load_params(tmp_path / "params.yaml")
    assert cfg.train.forward.mixed_precision == "no"
    assert cfg.train.optim.learning_rate == 5e-4


def test_bad_params_name_the_key_and_exit_2(tmp_path, capsys, monkeypatch):
    from flows.stages.__main__ import main

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    text = re.sub(r"(?m)^  learning_rate:", "  learning_rat:", (REPO / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert main(["train"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "train.learning_rat: unknown key; did you mean 'learning_rate'?" in err
    assert main(["validate", "--params", "nope.yaml"]) == EXIT_CONFIG
    assert "nope.yaml: no such parameters file" in capsys.readouterr().err


def test_roots_find_the_repo_and_the_original_store(tmp_path, monkeypatch):
    (tmp_path / ".dvc").mkdir()
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert find_repo_root(tmp_path / "a" / "b") == tmp_path.resolve()
    other = tmp_path / "original"
    other.mkdir()
    assert store_root(tmp_path, {"DVC_ROOT": str(other)}) == other.resolve()
    assert store_root(tmp_path, {}) == tmp_path


def _fake_checkpoint(ckpt_dir: Path, step: int) -> None:
    from grpo_core.train.checkpoint import write_manifest

    d = ckpt_dir / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    write_manifest(d)  # resume trusts no checkpoint without one


def test_checkpoints_resume_only_for_the_same_inputs(tmp_path, capsys):
    from flows.stages.train import FINGERPRINT, prepare_checkpoints

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    ctx = StageContext.create("train", start=tmp_path)
    cfg = ctx.cfg
    ckpt = tmp_path / "artifacts" / "checkpoints"
    fp = {"params_hash": "a", "train_data_md5": "b"}
    assert prepare_checkpoints(ctx, cfg, fp) == "fresh"  # nothing there yet
    _fake_checkpoint(ckpt, 50)
    assert prepare_checkpoints(ctx, cfg, fp) == "resume:checkpoint-50"  # e.g. max_steps raised, or a crash
    assert (ckpt / "checkpoint-50").exists()
    # new params: start over (the old checkpoints set aside: tests/test_checkpoint_safety.py)
    assert prepare_checkpoints(ctx, cfg, {**fp, "params_hash": "changed"}) == "fresh"
    assert not (ckpt / "checkpoint-50").exists()
    assert "starting fresh" in capsys.readouterr().err
    assert json.loads((ckpt / FINGERPRINT).read_text())["params_hash"] == "changed"
    _fake_checkpoint(ckpt, 500)  # past max_steps (150): neither an overtrained export nor a silent wipe
    with pytest.raises(StageConfigError, match="below the newest checkpoint"):
        prepare_checkpoints(ctx, cfg, {**fp, "params_hash": "changed"})
    assert (ckpt / "checkpoint-500").exists()


def test_difficulty_kept_indices_drop_only_sampled_extremes():
    import dataclasses

    from flows.stages.calibrate import difficulty_doc

    cfg = load_params(REPO / "params.yaml")
    cfg = dataclasses.replace(cfg, calibrate=dataclasses.replace(cfg.calibrate, drop_always_solved=True,
                                                                 drop_never_solved=True))
    out = {"difficulty": {"correctness_function": "correctness",
                          "pass_rate_per_prompt": [1.0, 0.0, 0.5, None],
                          "mean_pass_rate": 0.5, "always_solved": 1, "never_solved": 1, "histogram": {}}}
    doc = difficulty_doc(out, [1, 3, 5, 7], num_train=9, c=cfg.calibrate)
    assert doc["kept_indices"] == [0, 2, 4, 5, 6, 7, 8]  # 1 (always) and 3 (never) dropped; unsampled kept
    assert doc["num_dropped"] == 2


# ---------------------------------------------------------------------------------------------------
# calibrate, in-process, on a tiny model: the stage's wiring (the rule itself: tests/test_calibration.py)


@pytest.fixture()
def tiny_repo(tmp_path, monkeypatch):
    import yaml

    from tests.tiny import in_stage_repo, make_prompts, make_tiny_model

    make_tiny_model(tmp_path / "artifacts" / "base_model")
    rows = [json.loads(line) for line in make_prompts(tmp_path / "p.jsonl", n=12).read_text().splitlines()]
    (tmp_path / "data" / "validated").mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(tmp_path / "data/validated/train.parquet", index=False)
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["calibrate"].update(num_prompts=5, num_generations=3)
    raw["train"].update(num_generations=4, per_device_train_batch_size=8)
    raw["generation"]["max_completion_length"] = 6
    raw["rewards"] = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction",
                       "target_share": 0.5},
                      {"name": "correctness", "function": "correctness", "target_share": 0.5}]
    return in_stage_repo(tmp_path, raw, monkeypatch, "test-calibrate")


def test_calibrate_stage_writes_weights_difficulty_report_and_logs_a_child_run(tiny_repo):
    from mlflow import MlflowClient

    from flows.stages.__main__ import main

    assert main(["calibrate"]) == 0
    weights = json.loads((tiny_repo / "artifacts/calibration/reward_weights.json").read_text())
    assert weights["names"] == ["digits", "correctness"] and len(weights["weights_list"]) == 2
    assert {"rule", "stats", "shares", "flags", "calibration"} <= set(weights)
    assert weights["calibration"]["num_prompts"] == 5 and weights["calibration"]["num_generations"] == 3
    diff = json.loads((tiny_repo / "artifacts/calibration/difficulty.json").read_text())
    assert len(diff["prompt_indices"]) == 5 and len(diff["pass_rates"]) == 5 and diff["kept_indices"] is None
    assert "# Reward calibration" in (tiny_repo / "reports/calibration.md").read_text()

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("grpo-pipeline")
    runs = client.search_runs([exp.experiment_id])
    child = next(r for r in runs if r.data.tags.get("stage") == "calibrate")
    parent = client.get_run(child.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["grpo.run_group"] == "test-calibrate" and parent.info.status == "FINISHED"
    assert child.data.params["calibrate.num_prompts"] == "5"
    assert "calibration/weight/digits" in child.data.metrics
    assert {a.path for a in client.list_artifacts(child.info.run_id)} >= {"calibration", "reports", "samples"}

    # disabled: equal weights, rule "disabled", same parent (same run group)
    text = (tiny_repo / "params.yaml").read_text().replace("enabled: true", "enabled: false")
    (tiny_repo / "params.yaml").write_text(text)
    assert main(["calibrate"]) == 0
    weights = json.loads((tiny_repo / "artifacts/calibration/reward_weights.json").read_text())
    assert weights["rule"] == "disabled" and weights["weights_list"] == [1.0, 1.0]
    runs = client.search_runs([exp.experiment_id], filter_string="tags.stage = 'calibrate'")
    assert len(runs) == 2 and len({r.data.tags["mlflow.parentRunId"] for r in runs}) == 1


# Imported by a stage but deliberately not its dvc.yaml dep (dvc.yaml's header says why): plumbing that
# changes nothing a stage computes (MLflow runs, exit codes), and config code whose values reach stages as
# params.
NOT_DEPS = {
    "*": {"flows/stages/runs.py", "flows/tracking.py", "flows/comparison.py", "grpo_core/embedded/config.py",
          "grpo_core/common/errors.py"},
    "prepare": {"grpo_core/config.py"},
    "convert": {"grpo_core/config.py"},
    "validate": {"grpo_core/config.py"},
    "calibrate": {"grpo_core/config.py"},
    "evaluate": {"grpo_core/config.py"},
    "export": {"grpo_core/config.py", "flows/stages/evaluate.py"},  # evaluate: the registry plumbing
}


def project_imports(path: Path) -> set[Path]:
    """The grpo_core / flows files ``path`` imports anywhere in it (function-level imports included)."""
    import ast

    def module_file(name: str) -> Path | None:
        for candidate in (REPO / (name.replace(".", "/") + ".py"),
                          REPO / name.replace(".", "/") / "__init__.py"):
            if candidate.exists():
                return candidate
        return None

    found = set()
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("grpo_core", "flows") and (file := module_file(name)):
                found.add(file)
    return found


@pytest.mark.parametrize("stage", ["prepare", "convert", "validate", "calibrate", "train", "evaluate",
                                   "export"])
def test_every_module_a_stage_runs_is_its_dvc_dep(stage):
    """An edit to code a stage runs must re-run the stage: follow the stage module's imports through the
    project and check each file is under one of the stage's deps. A file exempt from a stage's deps is not
    followed: the params loader (config.py) imports every section's declarations, not the code that computes
    with them."""
    import yaml

    deps = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][stage]["deps"]
    allowed = NOT_DEPS["*"] | NOT_DEPS.get(stage, set())
    seen, todo = set(), [REPO / "flows/stages" / f"{stage}.py"]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            if str(path.relative_to(REPO)) not in allowed:
                todo.extend(project_imports(path))
    files = {str(p.relative_to(REPO)) for p in seen} - {"flows/__init__.py", "flows/stages/__init__.py",
                                                        "grpo_core/__init__.py"}
    missing = sorted(f for f in files - allowed
                     if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps))
    assert missing == [], f"dvc.yaml stage {stage} runs these files without listing them as deps"
    assert allowed - NOT_DEPS["*"] <= files, "an exception for a file the stage no longer imports"


def test_calibrate_samples_through_the_backend_train_names(tiny_repo, monkeypatch):
    """generation.backend reaches calibrate (as it reaches train and evaluate through rollout.backend_for)."""
    import yaml

    import grpo_core.rollout as rollout
    from flows.stages.__main__ import main

    chosen = []
    real = rollout.default_backend

    def spy(model, tokenizer, choice="auto", **options):
        chosen.append(choice)
        return real(model, tokenizer, choice, **options)

    monkeypatch.setattr(rollout, "default_backend", spy)
    raw = yaml.safe_load((tiny_repo / "params.yaml").read_text())
    raw["generation"]["backend"] = "hf"
    (tiny_repo / "params.yaml").write_text(yaml.safe_dump(raw))
    assert main(["calibrate"]) == 0
    assert chosen == ["hf"]


# ---------------------------------------------------------------------------------------------------
# evaluate, in-process, with scripted sampling: the registry decision as data (reports/registry.json)


def scripted_sampling(accuracy: dict[str, float]):
    """A stand-in for evaluate's ``sample_policy``: each policy answers the first ``accuracy * n`` prompts
    right, greedy and sampled alike, so the stage's metrics (and with them the gate's inputs) are known in
    advance."""

    def sample(policy, model_cfg, cfg, ctx, rows, indices):
        right = round(accuracy[policy] * len(indices))
        modes = (("greedy", 1), ("sampled", cfg.evaluate.num_generations))
        return [{"policy": policy, "prompt_index": i, "sample_index": j, "mode": mode, "correct": i < right,
                 "reward/correctness": float(i < right), "reward/format": 1.0, "format_ok": True,
                 "completion_length": 3, "prompt": rows[i]["prompt"], "answer": rows[i]["answer"],
                 "completion": "x"}
                for i in indices for mode, count in modes for j in range(count)]

    return sample


@pytest.fixture()
def eval_repo(tmp_path, monkeypatch):
    """A repo evaluate can run in: 8 held-out prompts, a stub trained-model folder (only uploaded, never
    loaded: sampling is scripted), a private MLflow store with a model registry."""
    import yaml

    from tests.tiny import in_stage_repo, make_prompts

    rows = [json.loads(line) for line in make_prompts(tmp_path / "p.jsonl", n=8).read_text().splitlines()]
    (tmp_path / "data/validated").mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(tmp_path / "data/validated/eval.parquet", index=False)
    (tmp_path / "artifacts/model").mkdir(parents=True)
    (tmp_path / "artifacts/model/config.json").write_text("{}")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["evaluate"].update(max_samples=8, num_generations=4, pass_k=[1, 4])
    return in_stage_repo(tmp_path, raw, monkeypatch, "test-evaluate")


def evaluate_with(repo: Path, monkeypatch, trained: float, margin: float, new_model: bool = True) -> dict:
    """One evaluate run (base accuracy 0.25) under ``tracking.promotion_margin = margin``; its registry JSON.
    new_model: the trained model's files change first, as after a retrain."""
    import yaml

    import flows.stages.evaluate as evaluate
    from flows.stages.__main__ import main

    raw = yaml.safe_load((repo / "params.yaml").read_text())
    raw["tracking"]["promotion_margin"] = margin
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    if new_model:  # a retrained model: other files (the same files are registered once)
        (repo / "artifacts/model/config.json").write_text(json.dumps({"trained": trained, "margin": margin}))
    monkeypatch.setattr(evaluate, "sample_policy", scripted_sampling({"base": 0.25, "trained": trained}))
    assert main(["evaluate"]) == 0
    return json.loads((repo / "reports/registry.json").read_text())


def test_evaluate_writes_its_registry_decision_as_data_and_renders_the_report_from_it(eval_repo, monkeypatch):
    from mlflow import MlflowClient

    from flows.stages.evaluate import registry_markdown

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    champion = lambda: int(client.get_model_version_by_alias("grpo-policy", "champion").version)  # noqa: E731

    # no champion yet: 0.75 vs the base's 0.25 is more than 0.1 better -> v1 becomes champion
    first = evaluate_with(eval_repo, monkeypatch, trained=0.75, margin=0.1)
    assert {k: first[k] for k in ("registered", "model_name", "version", "promote", "alias", "metric",
                                  "trained", "reference", "against", "margin", "previous_champion")} == {
        "registered": True, "model_name": "grpo-policy", "version": 1, "promote": True, "alias": "champion",
        "metric": "accuracy", "trained": 0.75, "reference": 0.25, "against": "base", "margin": 0.1,
        "previous_champion": None}
    assert first["delta"] == pytest.approx(0.5) and champion() == 1
    assert "beats the base's 0.2500 by more than 0.1" in first["reason"]

    # better than the champion (0.875 vs 0.75) but not by more than 0.2 -> v2, no alias, v1 stays champion
    second = evaluate_with(eval_repo, monkeypatch, trained=0.875, margin=0.2)
    assert (second["version"], second["promote"], second["alias"]) == (2, False, None)
    assert (second["against"], second["reference"], second["previous_champion"]) == ("champion", 0.75, 1)
    assert second["delta"] == pytest.approx(0.125) and champion() == 1

    # the same 0.125 gain with margin 0.1 -> v3 takes the alias
    third = evaluate_with(eval_repo, monkeypatch, trained=0.875, margin=0.1)
    assert ((third["version"], third["promote"], third["alias"], third["reference"])
            == (3, True, "champion", 0.75))
    assert champion() == 3

    # the report's Registry section is the rendering of that JSON, not a second account of the decision
    report = (eval_repo / "reports/evaluation.md").read_text()
    section = report.split("## Registry\n\n", 1)[1].split("\n\n## ", 1)[0].strip()
    assert section == registry_markdown(third) and "version 3. Promoted to `@champion`" in section


def test_evaluate_run_again_on_the_same_model_registers_no_second_version(eval_repo, monkeypatch):
    from mlflow import MlflowClient

    from flows.stages.evaluate import MODEL_MD5_TAG, model_files_md5

    first = evaluate_with(eval_repo, monkeypatch, trained=0.75, margin=0.0)
    assert (first["registered"], first["version"]) == (True, 1)
    again = evaluate_with(eval_repo, monkeypatch, trained=0.75, margin=0.0, new_model=False)
    md5 = model_files_md5(eval_repo / "artifacts/model")
    assert again == {"registered": False, "promote": False, "alias": None,
                     "reason": f"this trained model (files md5 {md5[:12]}) is already version 1 of "
                               "grpo-policy; a re-run does not register it twice"}
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    (version,) = client.search_model_versions("name='grpo-policy'")
    assert version.tags[MODEL_MD5_TAG] == md5
    assert (evaluate_with(eval_repo, monkeypatch, trained=0.8, margin=0.0)["version"]
            == 2)  # retrained: a new one


def test_evaluate_records_why_nothing_was_registered(eval_repo, monkeypatch):
    text = (eval_repo / "params.yaml").read_text().replace("register_model: true", "register_model: false")
    (eval_repo / "params.yaml").write_text(text)
    decision = evaluate_with(eval_repo, monkeypatch, trained=0.75, margin=0.0)
    assert decision == {"registered": False, "promote": False, "alias": None,
                        "reason": "tracking.register_model is false"}
    assert ("Not registered: tracking.register_model is false."
            in (eval_repo / "reports/evaluation.md").read_text())


def test_a_stage_process_does_not_print_bitsandbytes_kernels_warning():
    """peft imports bitsandbytes, which on AVX512-BF16 CPUs warns that the hub-fetched `kernels` package is
    absent: a stage process silences that logger (on other CPUs the warning is forced through it here)."""
    code = ("import logging; from flows.stages.common import prepare_process_env; prepare_process_env(); "
            "import peft, bitsandbytes; "
            "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('gemm_4bit_forward')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gemm_4bit_forward" not in proc.stdout + proc.stderr
