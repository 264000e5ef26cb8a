"""User code (a tool, an environment's constructor, ``reset`` or ``close``) run in a daemon thread, so that
waiting for it has a bound: past it the caller goes on (a tool's error for the model) or fails naming what
hung, and the thread is left behind (a daemon: it does not keep the process alive)."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any


class Running:
    """One call in its daemon thread; ``value`` or ``error`` once it returns."""

    def __init__(self, fn: Callable, arguments: dict):
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, arguments), daemon=True,
                                       name=f"tool-{getattr(fn, '__name__', 'call')}")
        self.thread.start()

    def _run(self, fn: Callable, arguments: dict) -> None:
        try:
            result = fn(**arguments)
            self.value = asyncio.run(result) if inspect.isawaitable(result) else result
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc


def call_within(fn: Callable, arguments: dict, timeout_s: float | None) -> Any:
    """``fn(**arguments)``'s value, or its exception; TimeoutError when it has not returned within
    ``timeout_s`` seconds (None or 0: no bound)."""
    run = Running(fn, arguments)
    run.thread.join(timeout_s or None)
    if run.thread.is_alive():
        raise TimeoutError(f"did not return within {timeout_s:g} s")
    if run.error is not None:
        raise run.error
    return run.value
