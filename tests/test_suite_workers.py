"""How `make test` shares out the suite between its two workers (tests/conftest.py, docs/testing.md): a module
runs whole on one worker, and the modules that use one session-wide run share a worker, so that run is built
once with no worker waiting for the other."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import SHARED_WORKER

REPO = Path(__file__).resolve().parents[1]
# the session-wide runs of the real model and the modules that name them (tests/conftest.py's fixtures)
SMOLLM2_FIXTURES = re.compile(r"\b(smollm2_pipeline|converted_smollm2)\b")

WORKER_TEST = '''
import os
from pathlib import Path


def test_{n}_a():
    Path(os.environ["SEEN"], "{module}.a").write_text(os.environ["PYTEST_XDIST_WORKER"])


def test_{n}_b():
    Path(os.environ["SEEN"], "{module}.b").write_text(os.environ["PYTEST_XDIST_WORKER"])
'''


def test_every_module_using_the_real_models_shared_run_is_in_its_worker_group():
    users = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")
             if p.name != Path(__file__).name and SMOLLM2_FIXTURES.search(p.read_text())}
    assert users == {"tests/test_gguf.py", "tests/test_gguf_export.py", "tests/test_smollm2.py"}
    assert {SHARED_WORKER.get(m) for m in users} == {"smollm2"}
    assert all((REPO / m).is_file() for m in SHARED_WORKER)


def test_two_workers_run_each_module_whole_and_a_groups_modules_on_one_worker(tmp_path):
    """pytest -n 2 --dist loadgroup under the suite's scheduler, over stand-ins named as the suite's modules:
    the smollm2 group's three modules on one worker, every module's tests on one."""
    modules = sorted(SHARED_WORKER) + ["tests/test_alone_one.py", "tests/test_alone_two.py",
                                       "tests/test_alone_three.py"]
    for n, module in enumerate(modules):
        path = tmp_path / module
        path.parent.mkdir(exist_ok=True)
        path.write_text(WORKER_TEST.format(n=n, module=Path(module).stem))
    seen = tmp_path / "seen"
    seen.mkdir()
    env = {**os.environ, "SEEN": str(seen), "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                          "--no-loadscope-reorder", "-p", "tests.conftest", "--import-mode=importlib",
                          "-c", os.devnull, "--rootdir", str(tmp_path), "tests"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    worker = {}
    for module in modules:
        stem = Path(module).stem
        ran_on = {(seen / f"{stem}.{t}").read_text() for t in "ab"}
        assert len(ran_on) == 1, (module, ran_on)  # the module whole on one worker
        worker[module] = ran_on.pop()
    assert len({worker[m] for m in SHARED_WORKER}) == 1, worker
    assert set(worker.values()) == {"gw0", "gw1"}  # and both workers had work
