"""Rewards run in a worker process of their own (``isolated: true`` in a ``rewards:`` entry): a call that
outlives ``train.reward_timeout_s`` is ended by killing its worker, not abandoned in a thread that keeps
running.

    trainer process                                worker process (spawned: no torch state is forked)
      IsolatedReward.call_with_timeout(...)  --->    resolve the reward (import path or built-in), then
        wait at most timeout_s for the answer <---     answer each batch: ("ok", values) | ("error", message)
        past it: SIGKILL the worker, RewardTimeout;
        the next call starts a fresh worker
"""

from __future__ import annotations

import multiprocessing
from typing import Any

from grpo_core.common.errors import TrainingFailure
from grpo_core.rewards.scoring import RewardTimeout, is_service_unreachable
from grpo_core.rewards.wrappers import clip_reward

# a fresh worker imports the reward's modules (torch included) before its first answer
_START_TIMEOUT_S = 300.0


class IsolatedRewardError(TrainingFailure, RuntimeError):
    """The isolated reward raised in its worker, or its worker could not start or died;
    the message says which. Where the worker's error said its server did not answer, a ConnectionError is its
    cause, so the trainer classes it as the in-process reward's would be (transient)."""


def _error(exc: BaseException) -> tuple[str, str, bool]:
    return "error", f"{type(exc).__name__}: {exc}", is_service_unreachable(exc)


def _serve(conn, resolve, function: str, kwargs: dict, name: str, clip: list[float] | None) -> None:
    try:
        fn = resolve(function, kwargs, name)
        fn = clip_reward(fn, clip) if clip is not None else fn
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which raises it
        conn.send(_error(exc))
        return
    conn.send(("ready", None, False))
    while True:
        try:
            prompts, completions, columns = conn.recv()
        except EOFError:  # the trainer closed its end: done
            return
        try:
            conn.send(("ok", list(fn(prompts=prompts, completions=completions, **columns)), False))
        except BaseException as exc:  # noqa: BLE001 - a failing reward is the trainer's to count or raise
            conn.send(_error(exc))


class IsolatedReward:
    """A reward function (by import path or built-in name, with kwargs and clip) answered by a worker process.
    resolve: ``(function, kwargs, name) -> reward function``, run in the worker (a module-level function, so
    the spawned worker can import it: ``registry.resolve_reward_function``)."""

    def __init__(self, function: str, kwargs: dict[str, Any], name: str, clip: list[float] | None, resolve):
        self.function, self.kwargs, self.clip, self.__name__ = function, dict(kwargs), clip, name
        self.resolve = resolve
        self._process = self._conn = None

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list:
        return self.call_with_timeout(prompts, completions, columns, None)

    def call_with_timeout(self, prompts: list, completions: list, columns: dict,
                          timeout_s: float | None) -> list:
        """The worker's values for one batch; RewardTimeout (the worker killed) when none came within
        timeout_s."""
        self.start()
        self._conn.send((list(prompts), list(completions), {k: list(v) for k, v in columns.items()}))
        if not self._conn.poll(timeout_s):
            self.stop()
            raise RewardTimeout(f"reward function {self.__name__!r} did not return within {timeout_s:g}s on "
                                f"a batch of {len(completions)}; its worker process was killed")
        status, value, unreachable = self._receive()
        if status == "error":
            error = IsolatedRewardError(f"reward {self.__name__!r} (isolated) raised {value}")
            raise error from (ConnectionError(value) if unreachable else None)
        return value

    def start(self) -> None:
        """Start the worker (it imports the reward) unless it is running;
        the first call does this by itself."""
        if self._process is not None and self._process.is_alive():
            return
        self.stop()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve,
                                    args=(child, self.resolve, self.function, self.kwargs, self.__name__,
                                          self.clip),
                                    name=f"reward-{self.__name__}", daemon=True)
        self._process.start()
        child.close()
        if not self._conn.poll(_START_TIMEOUT_S):
            self.stop()
            raise IsolatedRewardError(f"reward {self.__name__!r}: its worker did not start in "
                                      f"{_START_TIMEOUT_S:g}s")
        status, value, _ = self._receive()
        if status != "ready":
            self.stop()
            raise IsolatedRewardError(f"reward {self.__name__!r}: its worker could not load it: {value}")

    def _receive(self) -> tuple[str, Any, bool]:
        try:
            return self._conn.recv()
        except EOFError:  # the worker died mid-call (it exited, or was killed by the OOM killer)
            code = self._process.exitcode if self._process is not None else None
            self.stop()
            return "error", f"its worker process died (exit code {code})", False

    def stop(self) -> None:
        """Kill the worker, if any (SIGKILL: whatever it was doing ends now)."""
        if self._process is not None:
            self._process.kill()
            self._process.join()
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def __del__(self):
        try:
            self.stop()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
