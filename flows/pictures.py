"""The README's MLflow pictures, made the way a user makes them: ``make pictures``
(``python -m flows.pictures``).

In a clone of the repository:

1. ``make repro`` - the baseline pipeline on params.yaml (the embedded default), one MLflow parent run;
2. ``dvc exp run --temp -S train.learning_rate=<lr>`` - one experiment with another learning rate (train and
   evaluate re-run, the rest is reused), a second parent run (``--temp``: the clone's workspace stays the
   baseline's);
3. ``mlflow server`` over the clone's store on 127.0.0.1, opened in Debian's headless chromium (selenium) at
   the saved view ``make ui`` links to (``flows.comparison.experiment_url``);
4. two screenshots into ``docs/images/``: ``mlflow-runs.png`` (the runs table: one row per pipeline) and
   ``mlflow-charts.png`` (the chart view: the two pipelines' learning curves overlaid).

Before writing them it reads back what the page shows - the runs table's rows and column headers, and each
chart's plotly traces (``read_charts``) - and stops (``PicturesError``) unless both pipelines are rows, no
header is cut, and each learning-curve chart draws one curve per pipeline, in some chart the curves apart.
tests/test_mlflow_ui.py runs steps 2-4 on its tiny pipelines (``exp_run``, ``mlflow_ui``, ``chromium``,
``take_pictures``).

``make repro`` and the experiment train 150 steps each: ~6 minutes for both on 2 CPU cores,
the pictures seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from flows.comparison import CURVE_CHARTS, CURVES_SECTION, HEADLINE, experiment_url

RUNS_PICTURE = "mlflow-runs.png"
CHARTS_PICTURE = "mlflow-charts.png"
WIDTH = 1600  # the page's width in CSS pixels; each picture sets its own height
RUNS_HEIGHT = 440  # the runs table's rows, without the empty space below them
CHARTS_HEIGHT = 1100  # the learning-curves section: two rows of three charts


class PicturesError(RuntimeError):
    """The page does not show what the pictures are for; the message says what is missing."""


# --------------------------------------------------------------------------------------------------
# the runs: make repro, then one dvc experiment


def tool_env(repo: Path) -> dict[str, str]:
    """The environment of ``make`` / ``dvc``: this interpreter's bin first on PATH (``python`` in dvc.yaml is
    the project's), no telemetry, and no inherited run ids or tracking URI (the stages use the clone's
    store)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for var in ("MLFLOW_TRACKING_URI", "GRPO_PARENT_RUN_ID", "GRPO_FLOW_RUN_ID", "GRPO_RUN_GROUP",
                "GRPO_EXPERIMENT_NAME", "DVC_ROOT", "DVC_STAGE", "PREFECT_API_URL"):
        env.pop(var, None)
    env.update({"DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1"})
    return env


def run_command(repo: Path, cmd: Sequence[str]) -> str:
    """Run ``cmd`` in ``repo``, its output shown as it comes (on stderr) and returned; PicturesError with the
    tail of it when the command fails."""
    print(f"pictures: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    lines = []
    with subprocess.Popen(list(cmd), cwd=repo, env=tool_env(repo), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        for line in proc.stdout:
            lines.append(line)
            sys.stderr.write(line)
    out = "".join(lines)
    if proc.returncode != 0:
        raise PicturesError(f"{shlex.join(cmd)} exited {proc.returncode} in {repo}:\n{out[-4000:]}")
    return out


def exp_run(repo: Path, learning_rate: str) -> str:
    """``dvc exp run --temp -S train.learning_rate=<lr>``; its output."""
    dvc = Path(sys.executable).parent / "dvc"
    return run_command(repo, [str(dvc) if dvc.exists() else "dvc", "exp", "run", "--temp",
                              "-S", f"train.learning_rate={learning_rate}"])


def pipelines(tracking_uri: str, experiment: str) -> tuple[str, dict[str, set[str]]]:
    """(experiment id, its pipeline parent runs oldest first: name -> the metrics it logged)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise PicturesError(f"no experiment '{experiment}' at {tracking_uri}: did the pipeline run?")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`grpo.role` = 'pipeline'",
                              order_by=["attribute.start_time ASC"], max_results=1000)
    return exp.experiment_id, {r.info.run_name: set(r.data.metrics) for r in runs}


def logged_curves(metrics: Iterable[Collection[str]]) -> tuple[str, ...]:
    """The learning-curve charts (``CURVE_CHARTS``) with a curve for every pipeline, given each pipeline's
    logged metrics: the charts the page must draw before its picture is taken."""
    metrics = list(metrics)
    return tuple(c for c in CURVE_CHARTS if all(c in logged for logged in metrics))


# --------------------------------------------------------------------------------------------------
# the UI and the browser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def mlflow_ui(backend_store_uri: str, log_path: Path, env: dict[str, str] | None = None,
              timeout: float = 120) -> Iterator[str]:
    """``mlflow server`` over ``backend_store_uri`` on a free port of 127.0.0.1 (its own session, so stopping
    it stops its workers too); yields its URL once /health answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    mlflow = Path(sys.executable).parent / "mlflow"
    cmd = [str(mlflow) if mlflow.exists() else "mlflow", "server", "--backend-store-uri", backend_store_uri,
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise PicturesError(f"mlflow server did not start (exit {proc.poll()}):\n"
                                    f"{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@contextlib.contextmanager
def chromium(width: int = WIDTH, height: int = 1000) -> Iterator[Any]:
    """Debian's chromium, headless, driven by its chromedriver (``make browser`` installs both)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver_path):
        raise PicturesError("chromium and chromedriver are not installed: `make browser` "
                            "(apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition: Callable[[Any], Any], what: str, timeout: float = 90.0) -> Any:
    """``condition(driver)`` once it is truthy; PicturesError naming ``what`` and the page's text
    otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition(driver)
        if value:
            return value
        time.sleep(0.5)
    raise PicturesError(f"the page never showed {what}; its text:\n{page_text(driver)[:3000]}")


def set_viewport(driver, width: int, height: int) -> None:
    """Size the window so that the page itself (what a screenshot holds) is ``width`` x ``height``."""
    frame_w, frame_h = driver.execute_script("return [window.outerWidth - window.innerWidth, "
                                             "window.outerHeight - window.innerHeight]")
    driver.set_window_size(width + frame_w, height + frame_h)


def page_text(driver) -> str:
    return driver.find_element("tag name", "body").text


def close_panels(driver) -> None:
    """Close what covers the page: MLflow's assistant panel."""
    for button in driver.find_elements("css selector", "button[aria-label='Close']"):
        with contextlib.suppress(Exception):  # a button that went away or is hidden
            button.click()


# --------------------------------------------------------------------------------------------------
# what the page shows


#: each header of the runs table, left to right as shown (ag-grid's DOM order is not): its text, and whether
#: the text is wider than its column (cut with an ellipsis)
HEADERS_JS = """return Array.from(document.querySelectorAll('[data-testid^="sort-header-"]')).map(label => ({
  text: label.textContent, left: label.getBoundingClientRect().left,
  cut: label.getBoundingClientRect().width > label.parentElement.clientWidth + 0.5})).sort((a, \
b) => a.left - b.left)"""

#: each chart of the chart view: its metric (the card's title where a trace does not name it) and its plotly
#: traces. MLflow 3.17 draws each run twice under the run's name: the line shown (smoothed where the chart
#: says so) and, faded and skipped by the hover box, the raw values.
CHARTS_JS = """return Array.from(document.querySelectorAll('.js-plotly-plot')).map(plot => {
  const card = plot.closest('[data-testid="experiment-view-compare-runs-card"]');
  const traces = (plot.data || []).map(t => ({name: t.name || '', metric: t.metricKey || '', \
hover: t.hoverinfo || '',
                                             x: Array.from(t.x || []), y: Array.from(t.y || [])}));
  const metric = traces.map(t => t.metric).find(m => m);
  return {title: metric || (card ? card.innerText.split('\\n')[0].trim() : ''), traces: traces};
})"""


@dataclasses.dataclass(frozen=True)
class Chart:
    """One chart of the chart view: its metric and the values drawn per run, run name -> [(x, y), ...] as
    logged (``curves``; the shown lines may be their moving average)."""

    title: str
    curves: dict[str, list[tuple[float, float]]]


def read_headers(driver) -> list[dict[str, Any]]:
    return driver.execute_script(HEADERS_JS)


def read_charts(driver) -> list[Chart]:
    """The charts on the page, in page order, each run's values read from its raw trace (the one the hover box
    skips; with no smoothing both traces hold the raw values)."""
    charts = []
    for card in driver.execute_script(CHARTS_JS):
        by_run: dict[str, list[dict]] = {}
        for trace in card["traces"]:
            if trace["name"]:
                by_run.setdefault(trace["name"], []).append(trace)
        curves = {}
        for name, traces in by_run.items():
            raw = next((t for t in traces if t["hover"] == "skip"), traces[0])
            curves[name] = [(float(x), float(y)) for x, y in zip(raw["x"], raw["y"])]
        charts.append(Chart(card["title"], curves))
    return charts


def curve_charts(charts: Sequence[Chart], names: Sequence[str], curves: Collection[str]) -> dict[str, Chart]:
    """The learning-curve charts (``CURVE_CHARTS``) on the page once each of ``curves`` is there and each
    draws a curve of >1 point for every pipeline in ``names``; {} while the page is still loading them (it
    draws its charts one by one)."""
    shown = {c.title: c for c in charts if c.title in CURVE_CHARTS}
    if not set(curves) <= set(shown):
        return {}
    return shown if all(len(c.curves.get(n, [])) > 1 for c in shown.values() for n in names) else {}


def check_curves(charts: dict[str, Chart], names: Sequence[str]) -> None:
    """PicturesError unless some learning-curve chart draws the pipelines' curves apart (equal curves
    everywhere would be one line drawn twice: nothing to compare)."""
    if not any(len({tuple(c.curves[n]) for n in names}) == len(names) for c in charts.values()):
        raise PicturesError(f"the pipelines {list(names)} drew the same curves in every chart: "
                            + "; ".join(f"{t}: {c.curves[names[0]]}" for t, c in charts.items()))


@dataclasses.dataclass(frozen=True)
class Pictures:
    """What the pictures show: the runs table's headers, the learning-curve charts, and the files written."""

    headers: list[dict[str, Any]]
    charts: dict[str, Chart]
    files: list[Path]


def take_pictures(driver, ui_url: str, experiment_id: str, names: Sequence[str], curves: Collection[str],
                  out_dir: Path) -> Pictures:
    """The runs table and the chart view of the saved view, checked (see the module docstring), as PNGs in
    ``out_dir``; each is written to a temp name, then renamed. ``curves``: the learning-curve charts to wait
    for (``logged_curves``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []

    driver.get(experiment_url(ui_url, experiment_id))
    set_viewport(driver, WIDTH, RUNS_HEIGHT)
    wait_for(driver, lambda d: all(n in page_text(d) for n in names),
             f"the pipelines {list(names)} in the runs table")
    close_panels(driver)
    headers = wait_for(driver, lambda d: (h := read_headers(d)) and set(HEADLINE) <= {x["text"] for x in h}
                       and h, f"the columns {list(HEADLINE)}")
    cut = [h["text"] for h in headers if h["cut"]]
    if cut:
        raise PicturesError(f"the runs table cuts the column names {cut}")
    files.append(_screenshot(driver, out_dir / RUNS_PICTURE))

    driver.get(experiment_url(ui_url, experiment_id, chart=True))
    set_viewport(driver, WIDTH, CHARTS_HEIGHT)
    wait_for(driver, lambda d: CURVES_SECTION in page_text(d), f"the section '{CURVES_SECTION}'")
    close_panels(driver)
    charts = wait_for(driver, lambda d: curve_charts(read_charts(d), names, curves),
                      f"the learning curves {list(curves)} of {list(names)} (a curve per pipeline in each)")
    check_curves(charts, names)
    files.append(_screenshot(driver, out_dir / CHARTS_PICTURE))
    return Pictures(headers=headers, charts=charts, files=files)


def _screenshot(driver, path: Path) -> Path:
    time.sleep(1)  # plotly's transitions
    tmp = path.with_name(f".{path.name}.tmp.png")
    if not driver.save_screenshot(str(tmp)):
        raise PicturesError(f"chromium could not save {tmp}")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------------
# command line


def main(argv: Sequence[str] | None = None) -> int:
    from flows.stages.common import find_repo_root, load_params
    from flows.tracking import resolve_tracking_uri

    parser = argparse.ArgumentParser(prog="python -m flows.pictures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=None, help="the clone to run in (default: this one)")
    parser.add_argument("--learning-rate", default="1e-4", help="the experiment's train.learning_rate (1e-4)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the PNGs go (default: <repo>/docs/images)")
    parser.add_argument("--repro", default="make repro", help="the baseline's command ('make repro')")
    parser.add_argument("--no-runs", action="store_true",
                        help="picture the pipelines the store holds already")
    args = parser.parse_args(argv)

    repo = find_repo_root(args.repo)
    out = (args.out or repo / "docs/images").resolve()
    cfg = load_params(repo / "params.yaml")
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri, repo, environ={})
    if not args.no_runs:
        run_command(repo, shlex.split(args.repro))
        exp_run(repo, args.learning_rate)
    experiment_id, runs = pipelines(uri, cfg.tracking.experiment_name)
    if len(runs) < 2:
        raise PicturesError(f"the store {uri} holds {len(runs)} pipeline run(s); the pictures compare two")
    names = list(runs)[-2:]  # the baseline and the experiment: the two newest
    curves = logged_curves(runs[n] for n in names)
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="grpo-pictures-")))
        url = uri if uri.startswith(("http://", "https://")) else stack.enter_context(
            mlflow_ui(uri, logs / "mlflow-server.log", env=tool_env(repo)))
        driver = stack.enter_context(chromium())
        pictures = take_pictures(driver, url, experiment_id, names, curves, out)
    for name in names:
        print(f"pictures: {name}: "
              + ", ".join(f"{t} {c.curves[name][0][1]:.4g} -> {c.curves[name][-1][1]:.4g}"
                          for t, c in pictures.charts.items()), file=sys.stderr)
    for path in pictures.files:
        print(f"pictures: wrote {path} ({path.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
