"""Scoring a batch of completions with K reward functions into an (N, K) matrix."""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import threading
import urllib.error
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from grpo_core.common.errors import TrainingFailure, TransientFailure
from grpo_core.common.options import Options, option
from grpo_core.rewards.base import CALL_ABANDONED, RewardFunction, is_async_reward

log = logging.getLogger(__name__)


@dataclass
class RewardCallOptions(Options):
    """params.yaml `train:` keys of how reward functions are called, in every stage that scores (calibrate,
    train, evaluate)."""

    reward_errors: Literal["raise", "none"] = option("raise",
                                                     "a raising reward function: stop, or count as None")
    reward_timeout_s: float = option(60.0, "seconds one reward-function call may take; a call past it scores "
                                     "None for its samples and is counted (0 = no limit)", ge=0)


class RewardFunctionError(TrainingFailure, RuntimeError):
    """A reward function raised, or returned something other than N floats/ints/Nones."""


class RewardServiceUnavailable(TransientFailure):
    """A reward function could not reach the service it scores with (a judge server refused, dropped or timed
    out the connection, or answered HTTP 5xx/429): a retry once it is back can succeed."""


# client libraries' names for "the server could not be reached" (requests, httpx, aiohttp are not imported)
_NETWORK_ERROR_NAMES = frozenset({"ConnectionError", "Timeout", "TimeoutError", "TransportError",
                                  "ClientConnectionError", "ServerTimeoutError"})


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an HTTP client's error carries (urllib's ``code``, aiohttp's ``status``, requests' and
    httpx's ``response.status_code``), or None."""
    response = getattr(exc, "response", None)
    for holder, attribute in ((exc, "code"), (exc, "status"), (response, "status_code")):
        status = getattr(holder, attribute, None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
    return None


def is_service_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception in its chain) says a server did not answer or was overloaded: a
    connection refused/reset/timed out, a name that did not resolve, HTTP 5xx or 429. A 4xx or an answer the
    reward could not parse is not: the same request fails the same way again."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        status = _http_status(seen)
        if status is not None:
            return status >= 500 or status == 429
        if (isinstance(seen, ConnectionError | TimeoutError | urllib.error.URLError)
                or any(cls.__name__ in _NETWORK_ERROR_NAMES for cls in type(seen).__mro__)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def reward_failure(name: str, where: str, exc: BaseException) -> TransientFailure | TrainingFailure:
    """The error for reward ``name`` raising ``exc`` on ``where`` (a sample, the batch): transient (exit 1)
    when it could not reach its server, else RewardFunctionError (exit 4)."""
    message = f"reward function {name!r} raised on {where}: {type(exc).__name__}: {exc}"
    if is_service_unreachable(exc):
        return RewardServiceUnavailable(f"{message}; its server did not answer: check it is up, then run the "
                                        "stage again (training resumes from its last checkpoint)")
    return RewardFunctionError(message)


class RewardTimeout(RuntimeError):
    """A reward function call did not return within the timeout."""


# Set inside a reward call that ``_call`` runs in a thread: the event is set when the call is abandoned at its
# timeout, so a reward that fans work out (code_execution's pool) can stop starting more.
@dataclass
class Scores:
    """What ``score_completions`` returns.

    rewards:        (N, K) float64, NaN where a function returned None, failed, or timed out.
    error_counts:   {function name: samples on which it raised (on_error="none")}, one key per function.
    timeout_counts: {function name: calls that did not return within ``timeout_s``}, one key per function.
    """

    rewards: np.ndarray
    error_counts: dict[str, int] = field(default_factory=dict)
    timeout_counts: dict[str, int] = field(default_factory=dict)

    def __iter__(self):  # ``rewards, errors = score_completions(...)`` keeps working
        return iter((self.rewards, self.error_counts))


def _name(fn: RewardFunction) -> str:
    return getattr(fn, "__name__", repr(fn))


def _check_output(values: Any, n: int, name: str) -> list[float]:
    """`values` as N floats, NaN for None; error naming the function when it is not a length-N list."""
    if isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, list | tuple):
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(values).__name__}, "
            f"expected a list of {n} float|int|None"
        )
    if len(values) != n:
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(values)} values for {n} completions"
        )
    out: list[float] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isinf(v):
            out.append(float(v))  # NaN is kept: it means None
        else:
            raise RewardFunctionError(
                f"reward function {name!r} returned {v!r} ({type(v).__name__}) for sample {i}; "
                "expected a finite float, an int or None"
            )
    return out


def _call(fn: RewardFunction, prompts: list, completions: list, columns: Mapping[str, Sequence[Any]],
          timeout_s: float | None = None) -> Any:
    """``fn(prompts, completions, **columns)``; with ``timeout_s``,
    in a daemon thread joined for at most that long.

    Python cannot kill a thread: a call that times out is abandoned (its thread is a daemon, so it never
    holds the process open) and RewardTimeout is raised here; a reward marked ``isolated`` runs in a worker
    process instead, which is killed (grpo_core/rewards/isolated.py). A reward that calls a remote service
    should still set its own socket timeouts; this one is the last line of defence.
    """
    kwargs = {k: list(v) for k, v in columns.items()}
    if is_async_reward(fn):  # cancelled at the timeout: the work ends at its next await
        return asyncio.run(_awaited(fn, prompts, completions, kwargs, timeout_s))
    if hasattr(fn, "call_with_timeout"):  # an isolated reward: past the timeout its worker process is killed
        return fn.call_with_timeout(prompts, completions, kwargs, timeout_s or None)
    if not timeout_s:
        return fn(prompts=prompts, completions=completions, **kwargs)
    box: dict[str, Any] = {}
    abandoned = threading.Event()

    def target() -> None:
        CALL_ABANDONED.set(abandoned)
        try:
            box["out"] = fn(prompts=prompts, completions=completions, **kwargs)
        except BaseException as exc:  # handed to the caller's thread below
            box["err"] = exc

    worker = threading.Thread(target=target, name=f"reward-{_name(fn)}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        abandoned.set()
        raise RewardTimeout(f"reward function {_name(fn)!r} did not return within {timeout_s:g}s "
                            f"on a batch of {len(completions)}")
    if "err" in box:
        raise box["err"]
    return box["out"]


def call_reward(fn: RewardFunction, prompts: list, completions: list, **columns: Any) -> Any:
    """``fn(prompts, completions, **columns)``, awaited when ``fn`` is ``async def``: a reward called outside
    ``score_completions`` (validate's checks) the way ``score_completions`` calls it, without a time limit."""
    return _call(fn, list(prompts), list(completions), columns)


async def _awaited(fn: RewardFunction, prompts: list, completions: list, kwargs: dict,
                   timeout_s: float | None) -> Any:
    try:
        return await asyncio.wait_for(fn(prompts=prompts, completions=completions, **kwargs),
                                      timeout_s or None)
    except TimeoutError:
        raise RewardTimeout(f"reward function {_name(fn)!r} did not return within {timeout_s:g}s on a batch "
                            f"of {len(completions)}; it was cancelled") from None


async def _gather_async(fns: dict[int, RewardFunction], prompts: list, completions: list,
                        columns: Mapping[str, Sequence[Any]], timeout_s: float | None) -> dict[int, Any]:
    """Every async reward's batch call at once (a judge over HTTP waits on the network, not the CPU): k -> its
    values, or the exception it ended with."""
    kwargs = {k: list(v) for k, v in columns.items()}
    calls = [_awaited(fn, prompts, completions, kwargs, timeout_s) for fn in fns.values()]
    return dict(zip(fns, await asyncio.gather(*calls, return_exceptions=True)))


def _per_sample(
    fn: RewardFunction,
    prompts: list,
    completions: list,
    columns: Mapping[str, Sequence[Any]],
    on_error: str,
    timeout_s: float | None = None,
) -> tuple[list[float], int, int]:
    """Fallback after a batch call raised: one call per sample, so only failing samples become None.

    Returns (values, samples that raised, calls that timed out)."""
    name, values, failures, timeouts = _name(fn), [], 0, 0
    for i in range(len(completions)):
        row = {k: [v[i]] for k, v in columns.items()}
        try:
            out = _call(fn, [prompts[i]], [completions[i]], row, timeout_s)
        except RewardTimeout:
            values.append(math.nan)  # a hang is survived in both modes: that sample is ignored
            timeouts += 1
            continue
        except Exception as exc:
            if on_error == "raise":
                raise reward_failure(name, f"sample {i}", exc) from exc
            values.append(math.nan)
            failures += 1
            continue
        values.extend(_check_output(out, 1, name))
    return values, failures, timeouts


def score_completions(
    reward_fns: Sequence[RewardFunction],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]] | None = None,
    on_error: Literal["raise", "none"] = "raise",
    timeout_s: float | None = None,
) -> Scores:
    """Score N completions with K reward functions.

    Args:
        reward_fns: K functions `fn(prompts, completions, **columns) -> list[float | None]`.
        prompts, completions: N each (a prompt repeated once per completion, as TRL does).
        columns: extra keyword lists, each of length N (dataset columns, `completion_ids`, ...).
        on_error: "raise" → a raising function raises RewardFunctionError naming it and the first failing
            sample; "none" → its failing samples score None (NaN) and are counted.
        timeout_s: seconds a call may take (None or 0 = no limit). ``async def`` rewards are awaited together,
            each cancelled at its timeout (the work ends at its next await). A batch call that times out
            scores None (NaN) for all N samples of that function, in both modes, is counted in
            ``timeout_counts`` and logged as a warning; it is not retried sample by sample (that could
            wait N times as long). Samples of a per-sample retry (after the batch call raised) time out
            one by one.

    Returns:
        ``Scores``: rewards (N, K), error_counts and timeout_counts; it unpacks as ``rewards, error_counts``.

    A function that returns anything but N values of float/int/None raises RewardFunctionError in both modes.
    """
    if timeout_s is not None and timeout_s < 0:
        raise ValueError(f"timeout_s must be >= 0 (0 = no limit), got {timeout_s}")
    if on_error not in ("raise", "none"):
        raise ValueError(f"on_error must be 'raise' or 'none', got {on_error!r}")
    prompts, completions, columns = list(prompts), list(completions), dict(columns or {})
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions: repeat each prompt per completion")
    for key, col in columns.items():
        if len(col) != n:
            raise ValueError(f"column {key!r} has {len(col)} values for {n} completions")
    rewards = np.full((n, len(reward_fns)), np.nan, dtype=np.float64)
    error_counts: dict[str, int] = {}
    timeout_counts: dict[str, int] = {}
    concurrent = {k: fn for k, fn in enumerate(reward_fns) if is_async_reward(fn)}
    awaited = (asyncio.run(_gather_async(concurrent, prompts, completions, columns, timeout_s)) if concurrent
               else {})
    for k, fn in enumerate(reward_fns):
        name = _name(fn)
        failures = timeouts = 0
        try:
            out = awaited[k] if k in awaited else _call(fn, prompts, completions, columns, timeout_s)
            if isinstance(out, BaseException):
                raise out
            values = _check_output(out, n, name)
        except RewardTimeout as exc:
            log.warning("%s: its %d samples score None for it", exc, n)
            values, timeouts = [math.nan] * n, 1
        except RewardFunctionError:
            raise  # a bad return value is the function's bug, not a sample's
        except Exception as batch_error:
            values, failures, timeouts = _per_sample(fn, prompts, completions, columns, on_error, timeout_s)
            if timeouts:
                log.warning("reward function %r timed out on %d single samples (%gs each)", name, timeouts,
                            timeout_s)
            if failures == 0 and timeouts == 0 and on_error == "raise":
                # Every sample passes alone, yet the batch call failed: report the batch, not a sample.
                raise reward_failure(name, f"the batch of {n} (no single sample fails)",
                                     batch_error) from batch_error
        rewards[:, k] = values
        error_counts[name] = error_counts.get(name, 0) + failures
        timeout_counts[name] = timeout_counts.get(name, 0) + timeouts
    return Scores(rewards, error_counts, timeout_counts)
