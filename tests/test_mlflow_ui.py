"""Comparing two pipelines the way users do: a real `mlflow server` over the store two `dvc` runs wrote
(the session's built pipeline, then `dvc exp run --temp -S train.learning_rate=0.002`), read with the client
API and opened in Debian's chromium (selenium, headless). Screenshots go to ``test-artifacts/`` at the repo
root (or ``$GRPO_TEST_ARTIFACTS``); README's "Comparing runs" shows one.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import pytest
import yaml

from flows.comparison import VIEW_TAG, experiment_url
from tests.test_pipeline import BIN, GIT, REPO, built_pipeline, copy_repo, dvc, pipeline_env, run, stage_runs
from tests.test_servers import Server, free_port

pytestmark = pytest.mark.slow
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SHOTS = Path(os.environ.get("GRPO_TEST_ARTIFACTS") or REPO / "test-artifacts")


@pytest.fixture(scope="module")
def two_pipelines(tmp_path_factory):
    """(repo, exp name): the built pipeline committed, then one `dvc exp run` with another learning rate."""
    repo = copy_repo(built_pipeline(tmp_path_factory)[0], tmp_path_factory.mktemp("compare") / "repo")
    run(repo, "git", "add", "-A")
    run(repo, *GIT, "commit", "-q", "-m", "results")
    proc = dvc(repo, "exp", "run", "--temp", "-S", "train.learning_rate=0.002")
    out = proc.stdout + proc.stderr
    for stage in ("prepare", "validate", "calibrate"):
        assert f"Stage '{stage}' didn't change" in out
    assert "Running stage 'train'" in out and "Running stage 'evaluate'" in out
    shown = json.loads(dvc(repo, "exp", "show", "--json").stdout)
    names = [e["name"] for rev in shown for e in (rev.get("experiments") or []) if e.get("name")]
    assert len(names) == 1, shown
    return repo, names[0]


@pytest.fixture(scope="module")
def server(two_pipelines, tmp_path_factory):
    """`mlflow server` on 127.0.0.1 over the repo's sqlite store; yields its URL."""
    repo, _ = two_pipelines
    port = free_port()
    server = Server("mlflow server", [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{repo / 'mlflow.db'}",
                                      "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                    f"http://127.0.0.1:{port}/health", pipeline_env(),
                    tmp_path_factory.mktemp("mlflow-server") / "server.log")
    server.start(timeout=120)
    yield f"http://127.0.0.1:{port}"
    server.stop()


def client_for(url: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=url)


def parents(client) -> dict[str, object]:
    exp = client.get_experiment_by_name("grpo-pipeline")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`grpo.role` = 'pipeline'")
    return {r.info.run_name: r for r in runs}


def children(client, parent) -> dict[str, object]:
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return {r.data.tags["stage"]: r for r in runs}


def built_commit(repo: Path) -> str:
    """The commit the built pipeline ran at (the clone's first; `two_pipelines` commits the results on top)."""
    return run(repo, "git", "rev-list", "--max-parents=0", "HEAD").stdout.strip()


def train_log(repo: Path) -> list[dict]:
    with open(repo / "metrics/train_log.csv", newline="") as fh:
        return list(csv.DictReader(fh))


# --------------------------------------------------------------------------------------------------
# client API against the server


def test_parents_carry_names_summary_params_datasets_and_source(two_pipelines, server):
    repo, exp_name = two_pipelines
    client = client_for(server)
    sha, head = built_commit(repo), run(repo, "git", "rev-parse", "HEAD").stdout.strip()
    by_name = parents(client)
    assert set(by_name) == {f"baseline {sha[:7]}", exp_name}  # what changed, or that nothing did
    base, exp = by_name[f"baseline {sha[:7]}"], by_name[exp_name]

    # the baseline's summary is its outputs', worked out here from the files
    metrics, rows = json.loads((repo / "metrics/eval.json").read_text()), train_log(repo)
    summary = base.data.metrics
    assert summary["summary/accuracy_base"] == metrics["base"]["accuracy"]
    assert summary["summary/accuracy_trained"] == metrics["trained"]["accuracy"]
    assert summary["summary/accuracy_delta"] == metrics["delta"]["accuracy"]
    for k in (1, 2, 4):
        assert summary[f"summary/pass_at_{k}"] == metrics["trained"][f"pass@{k}"]
    assert summary["summary/final_reward"] == float(rows[-1]["reward"])
    assert summary["summary/final_kl"] == float(rows[-1]["kl"])
    assert summary["summary/median_step_time"] == statistics.median(float(r["step_time"]) for r in rows)
    assert {k for k in exp.data.metrics if k.startswith("summary/")} == {k for k in summary if k.startswith("summary/")}

    # the params that differ, named and recorded; the changed value is a param of the parent
    assert json.loads(exp.data.tags["grpo.params_diff"]) == {"train.learning_rate": 0.002}
    assert json.loads(base.data.tags["grpo.params_diff"]) == {}
    assert exp.data.params["train.learning_rate"] == "0.002" and base.data.params["train.learning_rate"] == "0.001"
    assert exp.data.tags["dvc.exp_name"] == exp_name

    # datasets: the validated files with their DVC hashes
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    dvc_md5 = {o["path"]: o["md5"] for o in lock["stages"]["validate"]["outs"]}
    for parent, commit in ((base, sha), (exp, head)):
        inputs = {i.dataset.name: i for i in parent.inputs.dataset_inputs}
        assert set(inputs) == {"train", "eval"}
        assert inputs["train"].dataset.digest == dvc_md5["data/validated/train.parquet"]
        assert inputs["eval"].dataset.digest == dvc_md5["data/validated/eval.parquet"]
        assert {t.value for t in inputs["train"].tags} == {"training"}
        assert json.loads(inputs["train"].dataset.profile)["num_rows"] == 48
        assert parent.data.tags["mlflow.source.git.commit"] == commit
        assert parent.data.tags["mlflow.source.name"] == "dvc.yaml"
        assert parent.info.status == "FINISHED"

    exp_meta = client.get_experiment(base.info.experiment_id)
    assert exp_meta.tags["mlflow.experimentKind"] == "finetuning"
    view = json.loads(json.loads(exp_meta.tags[VIEW_TAG])["state"])
    assert "params.`train.learning_rate`" in view["selectedColumns"]
    assert view["selectedColumns"].index("metrics.`summary/accuracy_trained`") < view["selectedColumns"].index(
        "params.`train.learning_rate`")


def test_train_run_leads_with_reward_and_kl_and_the_model_is_logged_and_registered(two_pipelines, server,
                                                                                   monkeypatch):
    import mlflow
    from mlflow.models import Model
    from transformers import AutoModelForCausalLM

    repo, _ = two_pipelines
    client = client_for(server)
    sha = built_commit(repo)
    runs = children(client, parents(client)[f"baseline {sha[:7]}"])
    assert set(runs) == {"prepare", "validate", "calibrate", "train", "evaluate"}
    train = runs["train"]
    rewards = [float(r["reward"]) for r in train_log(repo)]
    headline = [m.value for m in sorted(client.get_metric_history(train.info.run_id, "0_overview/reward"),
                                        key=lambda m: m.step)]
    assert headline == rewards == [m.value for m in sorted(client.get_metric_history(train.info.run_id, "reward"),
                                                           key=lambda m: m.step)]
    assert len(client.get_metric_history(train.info.run_id, "0_overview/kl")) == len(rewards)

    evaluate = runs["evaluate"]
    (output,) = evaluate.outputs.model_outputs
    logged = client.get_logged_model(output.model_id)
    assert logged.source_run_id == evaluate.info.run_id and logged.status.value == "READY"
    (version,) = [v for v in client.search_model_versions("name = 'grpo-policy'") if v.run_id == evaluate.info.run_id]
    assert version.source == f"models:/{logged.model_id}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)  # what a user downloading from the team's server sets
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", server)
    folder = mlflow.artifacts.download_artifacts(f"models:/grpo-policy/{version.version}")
    assert AutoModelForCausalLM.from_pretrained(folder) is not None
    signature = Model.load(str(Path(folder) / "MLmodel")).signature
    assert signature.inputs.input_names() == ["prompt"] and signature.outputs.input_names() == ["completion"]


def test_exp_run_logs_its_stages_under_its_own_parent(two_pipelines, server):
    repo, exp_name = two_pipelines
    client = client_for(server)
    exp_runs = children(client, parents(client)[exp_name])
    assert set(exp_runs) == {"train", "evaluate"}  # DVC re-ran just what the param feeds
    train = exp_runs["train"]
    assert train.data.params["train.learning_rate"] == "0.002" and train.data.tags["dvc.exp_name"] == exp_name
    assert train.data.tags["train.checkpoints"] == "fresh"  # new params: no resume from the old checkpoints
    assert len(stage_runs(repo)) == 2 + 5 + 2


# --------------------------------------------------------------------------------------------------
# a real browser


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)")
        pytest.skip("Debian's chromium and chromium-driver are not installed")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=2200,1100"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(120)
    yield driver
    driver.quit()


def wait_for(driver, condition, what: str, timeout: float = 90.0, shot: str | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition(driver)
        if value:
            return value
        time.sleep(0.5)
    if shot:
        driver.save_screenshot(str(SHOTS / f"FAILED-{shot}"))
    raise AssertionError(f"the page never showed {what}; body text:\n{driver.find_element('tag name', 'body').text[:3000]}")


def test_browser_shows_the_parents_with_metrics_and_the_comparison_chart(two_pipelines, server, browser):
    from selenium.webdriver.common.by import By

    repo, exp_name = two_pipelines
    SHOTS.mkdir(parents=True, exist_ok=True)
    client = client_for(server)
    by_name = parents(client)
    exp_id = next(iter(by_name.values())).info.experiment_id
    sha = built_commit(repo)

    browser.get(experiment_url(server, exp_id))
    body = lambda d: d.find_element(By.TAG_NAME, "body").text  # noqa: E731
    wait_for(browser, lambda d: exp_name in body(d) and f"baseline {sha[:7]}" in body(d),
             "both parent runs in the runs table", shot="runs.png")
    for close in browser.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):  # the assistant panel
        close.click()
    wait_for(browser, lambda d: "summary/accuracy_trained" in body(d) and "train.learning_rate" in body(d),
             "the summary metrics and the changed param as columns", shot="runs.png")
    for parent in by_name.values():  # each pipeline's row shows its summary and its learning rate
        kl = f"{parent.data.metrics['summary/final_kl']:.6g}"
        wait_for(browser, lambda d, kl=kl: kl in body(d), f"final KL {kl}", shot="runs.png")
    assert "0.002" in body(browser) and "0.001" in body(browser)
    time.sleep(1)
    browser.save_screenshot(str(SHOTS / "mlflow-runs.png"))

    browser.get(experiment_url(server, exp_id, chart=True))
    for close in browser.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
        close.click()
    charts = wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")) >= 3 and
                      d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot"), "the comparison charts", shot="charts.png")
    wait_for(browser, lambda d: "summary" in body(d) and "accuracy_trained" in body(d),
             "the summary section first", shot="charts.png")
    # the bar chart of a summary metric has one bar per pipeline
    bars = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .bars path, "
                                                                          ".js-plotly-plot .point path"),
                    "bars in the charts", shot="charts.png")
    assert charts and bars
    time.sleep(1)
    browser.save_screenshot(str(SHOTS / "mlflow-charts.png"))

    train = children(client, by_name[f"baseline {sha[:7]}"])["train"]
    browser.get(f"{server}/#/experiments/{exp_id}/runs/{train.info.run_id}/model-metrics")
    wait_for(browser, lambda d: "0_overview" in body(d), "the overview section", shot="train.png")
    text = body(browser)
    assert text.index("0_overview") < text.index("clip_ratio")  # reward and KL before the clip ratios
    browser.save_screenshot(str(SHOTS / "mlflow-train-run.png"))
