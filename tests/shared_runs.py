"""Expensive set-ups the whole test run shares (a `dvc repro` of a pipeline, a real model's conversion):
built once, by whichever pytest-xdist worker asks first, in the run's common temporary folder; a worker that
asks while it is being built waits on a file lock, then reads what the builder recorded. Without xdist it is
a plain once-per-session cache.

A build that fails is recorded too: every worker that asks later fails with the first one's error instead of
building again. docs/testing.md says when a new slow test should use one of these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

_BUILT: dict[str, object] = {}


def run_root(tmp_path_factory) -> Path:
    """The temporary folder every worker of this test run shares (each xdist worker's own base folder is
    ``<run folder>/popen-gwN``)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once_per_run(tmp_path_factory, name: str, build: Callable[[Path], object]) -> object:
    """``build(folder)`` once for the whole run (``folder``: a new ``<run folder>/<name>``); every caller in
    every worker gets its result as JSON gives it back (a tuple comes back a list, a Path must be a str)."""
    if name in _BUILT:
        return _BUILT[name]
    root = run_root(tmp_path_factory)
    record = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if record.is_file():
            saved = json.loads(record.read_text())
            if "error" in saved:
                raise RuntimeError(f"the shared set-up {name!r} failed in another worker: {saved['error']}")
            _BUILT[name] = saved["value"]
            return _BUILT[name]
        folder = root / name
        folder.mkdir()
        try:
            value = build(folder)
        except BaseException as exc:
            record.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"[-8000:]}))
            raise
        record.write_text(json.dumps({"value": value}))  # read only under the lock: never half written
        _BUILT[name] = json.loads(record.read_text())["value"]
    return _BUILT[name]
