"""benchmarks/recipes.py: the claims file against configs/ and the docs, the comparison of a run's
metrics/eval.json with the stated figures, bad claims, `--list`, and one recipe's run with a stand-in `dvc`.

It runs no recipe: `make bench-recipes` does (benchmarks/README.md, "Every recipe as shipped").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks import recipes as rc

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def claims() -> dict[str, rc.Claim]:
    return rc.load_claims(rc.CLAIMS, CONFIGS)


def claim(**kw) -> rc.Claim:
    fields = {"config": "x.yaml", "fits_cpu": True, "metric": "accuracy", "base": 0.373, "trained": 0.900,
              "source": "README.md", "min_gain": None}
    return rc.Claim(**{**fields, **kw})


def eval_doc(base: float, trained: float, metric: str = "accuracy") -> dict:
    return {"base": {metric: base, "num_prompts": 400}, "trained": {metric: trained, "num_prompts": 400}}


# ---------------------------------------------------------------------------------------------------
# The claims file against configs/ and the docs


def test_every_config_has_an_entry_or_is_listed_as_no_stated_figure(tmp_path):
    listed = rc.recipes(claims(), CONFIGS)
    assert [r.config for r in listed] == sorted(p.name for p in CONFIGS.glob("*.yaml"))
    for r in listed:
        line = rc.describe(r)
        assert line.startswith(r.config)
        assert r.claim is not None or rc.NO_FIGURE in line
    # a recipe added without an entry is listed, not skipped
    configs = tmp_path / "configs"
    shutil.copytree(CONFIGS, configs)
    (configs / "a-new-recipe.yaml").write_text("embedded: null\n")
    added = {r.config: r for r in rc.recipes(rc.load_claims(rc.CLAIMS, configs), configs)}
    new = added["a-new-recipe.yaml"]
    assert new.claim is None and new.fits() is None
    assert rc.NO_FIGURE in rc.describe(new)
    assert rc.not_run(new)["status"] == rc.NO_FIGURE
    assert set(added) - {new.config} == {p.name for p in CONFIGS.glob("*.yaml")}


def test_the_hub_recipes_do_not_fit_and_the_cpu_ones_state_the_docs_figures():
    by_name = claims()
    for name, c in by_name.items():
        assert c.fits_cpu == (not name.startswith("gsm8k-qwen2.5-")), name
        assert c.fits_cpu or "hub" in c.why
    smol, tools = by_name["smollm2-135m-word-problems.yaml"], by_name["embedded-tools.yaml"]
    assert (smol.metric, smol.base, smol.trained) == ("accuracy", 0.373, 0.900)
    assert (tools.metric, tools.base, tools.trained) == ("accuracy", 0.344, 0.998)
    assert by_name["embedded-vllm.yaml"].trained is not None


@pytest.mark.parametrize("name", [e["config"] for e in yaml.safe_load(rc.CLAIMS.read_text())["recipes"]])
def test_each_source_file_states_the_numbers_as_written(name):
    c = claims()[name]
    text = (REPO / c.source.split()[0].rstrip(",:;")).read_text(encoding="utf-8")
    for value in (c.base, c.trained):
        if value is not None:
            assert f"{value:.3f}" in text, f"{name}: {value:.3f} not in {c.source.split()[0]}"
    if c.min_gain is not None:
        assert f"+{c.min_gain:g}" in text, f"{name}: +{c.min_gain:g} not in {c.source.split()[0]}"


# ---------------------------------------------------------------------------------------------------
# The comparison


def test_a_run_inside_the_tolerance_passes():
    verdict = rc.compare(claim(min_gain=0.48), eval_doc(0.3725, 0.88))
    assert verdict["passed"] and verdict["reasons"] == []
    assert verdict["measured"] == {"base": 0.3725, "trained": 0.88, "gain": 0.5075}
    assert rc.compare(claim(), eval_doc(0.373 + 0.05, 0.900 - 0.05))["passed"]   # the edges count as inside


def test_a_trained_figure_outside_the_tolerance_misses_by_how_much():
    verdict = rc.compare(claim(), eval_doc(0.373, 0.800))
    assert not verdict["passed"]
    assert verdict["reasons"] == ["trained accuracy 0.800, stated 0.900: off by -0.100 (tolerance 0.05)"]
    assert not rc.compare(claim(), eval_doc(0.373, 0.960))["passed"]    # better than stated is off too
    assert rc.compare(claim(tolerance=0.2), eval_doc(0.373, 0.800))["passed"]


def test_a_base_figure_off_misses():
    verdict = rc.compare(claim(), eval_doc(0.480, 0.900))
    assert not verdict["passed"]
    assert verdict["reasons"] == ["base accuracy 0.480, stated 0.373: off by +0.107 (tolerance 0.05)"]


def test_a_gain_short_of_min_gain_misses():
    verdict = rc.compare(claim(min_gain=0.48), eval_doc(0.41, 0.87))    # each figure inside, the gain 0.46
    assert not verdict["passed"]
    assert verdict["reasons"] == ["gain +0.460, stated at least +0.480: short by 0.020"]


def test_an_eval_json_without_the_metric_misses():
    verdict = rc.compare(claim(metric="mean_score"), eval_doc(0.4, 0.9))
    assert not verdict["passed"]
    assert verdict["reasons"] == ["metrics/eval.json has no base.mean_score",
                                  "metrics/eval.json has no trained.mean_score"]


# ---------------------------------------------------------------------------------------------------
# Bad claims


def write_claims(tmp_path: Path, entries: list) -> Path:
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump({"recipes": entries}, sort_keys=False))
    return path


GOOD = {"config": "embedded-tools.yaml", "fits_cpu": True, "metric": "accuracy", "base": 0.356,
        "trained": 0.816, "source": "docs/agentic.md, second paragraph"}


@pytest.mark.parametrize("change,expected", [
    ({"metric": None}, "recipes[1] (embedded-tools.yaml): missing key(s) 'metric'"),
    ({"trained": None, "base": None}, "recipes[1] (embedded-tools.yaml): missing key(s) 'base', 'trained'"),
    ({"config": None}, "recipes[1]: missing key(s) 'config'"),
    ({"config": "no-such.yaml"}, "recipes[1] (no-such.yaml): 'config' names 'no-such.yaml', which is not"),
    ({"tolerence": 0.1}, "recipes[1] (embedded-tools.yaml): unknown key(s) 'tolerence'"),
    ({"fits_cpu": False}, "recipes[1] (embedded-tools.yaml): 'why' is required when fits_cpu is false"),
    ({"fits_cpu": "yes"}, "recipes[1] (embedded-tools.yaml): 'fits_cpu' must be true or false"),
    ({"trained": "0.816"}, "recipes[1] (embedded-tools.yaml): 'trained' must be a number or null"),
    ({"tolerance": -0.05}, "recipes[1] (embedded-tools.yaml): 'tolerance' must be at least 0"),
    ({"source": "docs/nowhere.md, a section"}, "recipes[1] (embedded-tools.yaml): 'source' must start with"),
])
def test_a_bad_entry_is_an_error_naming_the_entry_and_key(tmp_path, change, expected):
    bad = {k: v for k, v in {**GOOD, **change}.items() if not (v is None and k in change)}
    other = {**GOOD, "config": "embedded-vllm.yaml", "source": "README.md"}
    path = write_claims(tmp_path, [other, bad])
    with pytest.raises(rc.ClaimsError) as err:
        rc.load_claims(path, CONFIGS)
    assert f"{path}: {expected}" in str(err.value)


def test_a_second_entry_for_one_config_and_a_file_without_recipes_are_errors(tmp_path):
    with pytest.raises(rc.ClaimsError, match=r"recipes\[1\] \(embedded-tools.yaml\): a second entry"):
        rc.load_claims(write_claims(tmp_path, [GOOD, GOOD]), CONFIGS)
    (tmp_path / "empty.yaml").write_text("embedded-tools.yaml: 0.816\n")
    with pytest.raises(rc.ClaimsError, match="expected a mapping with a 'recipes' list"):
        rc.load_claims(tmp_path / "empty.yaml", CONFIGS)


def test_only_names_a_recipe_by_file_or_stem_and_an_unknown_one_is_an_error():
    listed = rc.recipes(claims(), CONFIGS)
    assert [r.config for r in rc.select(listed, ["embedded-tools", "embedded-tools.yaml"])] == \
        ["embedded-tools.yaml"]
    with pytest.raises(rc.ClaimsError, match="--only: no recipe 'embeded-tools' in configs/"):
        rc.select(listed, ["embeded-tools"])
    hub = [r for r in listed if r.fits() is False][:1]
    with pytest.raises(rc.ClaimsError, match="does not fit this machine"):
        rc.run_selected(hub, named=True, workdir=Path("/nonexistent"))


# ---------------------------------------------------------------------------------------------------
# The command


def command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.recipes", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_list_prints_every_config_and_runs_nothing(tmp_path):
    proc = command("--list", "--workdir", str(tmp_path / "work"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert "smollm2-135m-word-problems.yaml: fits this machine; accuracy 0.373 -> 0.900" in proc.stdout
    assert "gsm8k-qwen2.5-0.5b.yaml: does not fit" in proc.stdout
    assert not (tmp_path / "work").exists()
    # an entry taken out: its config is still listed, as having no stated figure
    doc = yaml.safe_load(rc.CLAIMS.read_text())
    doc["recipes"] = [e for e in doc["recipes"] if e["config"] != "embedded-vllm.yaml"]
    trimmed = tmp_path / "claims.yaml"
    trimmed.write_text(yaml.safe_dump(doc))
    proc = command("--list", "--claims", str(trimmed))
    assert proc.returncode == 0, proc.stderr
    assert f"embedded-vllm.yaml: {rc.NO_FIGURE}" in proc.stdout


def test_bad_input_exits_2_naming_it():
    proc = command("--list", "--only", "nosuch")
    assert proc.returncode == 2
    assert "--only: no recipe 'nosuch'" in proc.stderr


# ---------------------------------------------------------------------------------------------------
# One recipe's run, `dvc repro` a stand-in script


def fake_clone(tmp_path: Path, script: str):
    """make_clone's stand-in: a folder whose .venv/bin/dvc is ``script``."""
    def make(recipe, workdir):
        clone = workdir / recipe.stem
        (clone / ".venv" / "bin").mkdir(parents=True)
        dvc = clone / ".venv" / "bin" / "dvc"
        dvc.write_text("#!/bin/sh\n" + script)
        dvc.chmod(0o755)
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(clone)]
        subprocess.run(["git", "init", "-q", str(clone)], check=True)
        subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "recipe"], check=True)
        return clone
    return make


def test_a_run_is_compared_and_a_failed_dvc_repro_is_a_miss_with_its_log(tmp_path, monkeypatch):
    recipe = rc.Recipe("smollm2-135m-word-problems.yaml", claims()["smollm2-135m-word-problems.yaml"])
    doc = json.dumps(eval_doc(0.3725, 0.9))
    monkeypatch.setattr(rc, "make_clone", fake_clone(tmp_path, f"mkdir -p metrics && echo '{doc}' > "
                                                               "metrics/eval.json\n"))
    good = rc.run_recipe(recipe, tmp_path / "a")
    assert good["status"] == "pass" and good["measured"]["trained"] == 0.9 and good["wall_s"] >= 0
    head = subprocess.run(["git", "-C", str(tmp_path / "a" / recipe.stem), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert good["commit"] == head  # the commit the recipe's clone ran, not the repository's HEAD at the end
    monkeypatch.setattr(rc, "make_clone", fake_clone(tmp_path, "echo 'ERROR: stage train failed'; exit 3\n"))
    bad = rc.run_recipe(recipe, tmp_path / "b")
    assert bad["status"] == "miss" and bad["reasons"] == ["dvc repro exited 3"]
    assert "ERROR: stage train failed" in bad["log_tail"]
    text, status = rc.summary([good, bad])
    assert status == 1 and "missed their stated figures: smollm2-135m-word-problems.yaml" in text
    assert rc.summary([good, rc.not_run(rc.Recipe("new.yaml", None))])[1] == 0
    out = tmp_path / "results" / "recipes.json"
    rc.write_results([good, bad], out, ["--only", recipe.config])
    assert json.loads(out.read_text())["recipes"][1]["status"] == "miss"
    assert "| `smollm2-135m-word-problems.yaml` | 0.373 -> 0.900" in out.with_suffix(".md").read_text()
    assert sorted(p.name for p in out.parent.iterdir()) == ["recipes.json", "recipes.md"]


def test_the_stages_get_the_venv_first_and_nothing_pointing_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////work/main/mlflow.db")
    monkeypatch.setenv("GRPO_REPO_DIR", "/work/main")
    env = rc.recipe_env(tmp_path)
    assert env["PATH"].split(os.pathsep)[0] == str(tmp_path / ".venv" / "bin")
    assert "MLFLOW_TRACKING_URI" not in env and "GRPO_REPO_DIR" not in env
    assert {k: env[k] for k in ("DVC_NO_ANALYTICS", "PREFECT_SERVER_ANALYTICS_ENABLED",
                                "MLFLOW_DISABLE_TELEMETRY", "HF_HUB_OFFLINE")} == \
        {"DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
         "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1"}
