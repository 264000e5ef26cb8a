"""Test-session environment: offline, no telemetry. Thread counts are torch's defaults in a one-process run;
each pytest-xdist worker runs one thread (its core), set before torch is imported."""

import json
import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers of torch's default two threads each on two cores spend the time waiting on one another;
    # the processes a test starts inherit it (the stages pin their own, model.cpu_threads)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def smollm2_pipeline(tmp_path_factory):
    """(repo, log): configs/smollm2-135m-word-problems.yaml scaled down under `dvc repro` in a fresh clone,
    once for the whole run (tests/real_model.py, tests/shared_runs.py)."""
    from tests.real_model import build_smollm2_pipeline
    from tests.shared_runs import once_per_run

    repo, log = once_per_run(tmp_path_factory, "smollm2",
                             lambda folder: [str(p) for p in build_smollm2_pipeline(folder)])
    return Path(repo), log


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


# ---------------------------------------------------------------------------------------------------
# Both cores (`make test` runs `pytest -n 2 --dist loadgroup`; docs/testing.md)

#: modules that use one session-wide run (tests/shared_runs.py) and so one worker, which builds it once with
#: no worker waiting on another: module -> its group. A table, not xdist_group marks: xdist 3.8 groups by a
#: suffix it writes into each item's node id, which pytest 9.2's node ids no longer take.
SHARED_WORKER = {
    "tests/test_gguf.py": "smollm2",
    "tests/test_gguf_export.py": "smollm2",
    "tests/test_smollm2.py": "smollm2",
}


def scope_of(nodeid: str) -> str:
    """What one worker runs together: the test's module, or the module's group in SHARED_WORKER."""
    module = nodeid.split("::", 1)[0]
    return SHARED_WORKER.get(module, module)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # without pytest-xdist the suite runs in one process
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class ModuleGroupScheduling(LoadScopeScheduling):
        """A module runs whole on one worker (its module fixtures are built once), and the modules of one
        SHARED_WORKER group share a worker."""

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadgroup":
            return ModuleGroupScheduling(config, log)
        return None


# a module tests/durations.json does not know yet (new since it was measured): about a median module's cost
NEW_MODULE_S = 5.0


def pytest_collection_modifyitems(config, items):
    """On xdist workers: the costliest scopes first (their modules' seconds in tests/durations.json), so
    no long module starts last while the other worker idles; each scope's tests keep their order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from tests.durations import DURATIONS

    seconds = json.loads(DURATIONS.read_text())
    modules: dict[str, set[str]] = {}
    for item in items:
        modules.setdefault(scope_of(item.nodeid), set()).add(item.nodeid.split("::", 1)[0])
    cost = {scope: sum(seconds.get(m, NEW_MODULE_S) for m in names) for scope, names in modules.items()}
    items.sort(key=lambda item: -cost[scope_of(item.nodeid)])


# what the suite's temporary folders hold at most at once (docs/testing.md: measured with a fresh clone)
SUITE_PEAK_DISK_GIB = 10
FREE_AT_START = pytest.StashKey[float]()


def free_disk_gib() -> float:
    import shutil
    import tempfile

    return shutil.disk_usage(tempfile.gettempdir()).free / 2**30


def pytest_sessionstart(session):
    session.config.stash[FREE_AT_START] = free_disk_gib()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Free disk where the tests write, at the start and the end: a run short of it fails in set-ups all
    over, so the summary says so."""
    start = config.stash.get(FREE_AT_START, None)
    if start is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    short = start < SUITE_PEAK_DISK_GIB
    terminalreporter.write_line(
        f"disk: {start:.1f} GiB free at the start, {free_disk_gib():.1f} GiB at the end; the suite needs "
        f"about {SUITE_PEAK_DISK_GIB} GiB" + (" -- TOO LITTLE: tests fail writing files" if short else ""),
        red=short)

