"""Types shared by the reward functions, and the one helper every built-in needs: completion → text.

A reward function follows TRL's convention:

    fn(prompts: list, completions: list, **columns) -> list[float | None]     # one value per completion

`completions[i]` is a string, or (chat prompts) a list of messages `[{"role": "assistant", "content": ...}]`.
Extra dataset columns arrive as keyword lists aligned with `completions`; `None` = "does not apply".
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from grpo_core.common.options import ConfigError, Options, option

RewardValue = float | None


@runtime_checkable
class RewardFunction(Protocol):
    """A TRL-compatible reward function; `__name__` is the metric name (`rewards/<name>/mean`)."""

    __name__: str

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]: ...


@dataclass
class RewardSpec(Options):
    """One params.yaml `rewards:` entry: which function, its arguments,
    and how calibration and scoring treat it."""

    name: str = option("", "metric name: logged as rewards/<name>/mean")
    function: str = option("", "built-in reward name, or package.module:function (trusted code)")
    kwargs: dict = option({}, "keyword arguments for the built-in factory or bound to the function")
    target_share: float = option(1.0, "share of within-group advantage variance calibration aims for", ge=0)
    clip: list[float] | None = option(None, "[low, high]: clip this reward to the range")
    isolated: bool = option(False, "run it in a worker process of its own: a call past "
                            "train.reward_timeout_s kills the worker (the work ends) instead of abandoning a "
                            "thread (grpo_core/rewards/isolated.py)")

    def check(self) -> None:
        if not self.name or not self.function:
            raise ConfigError("name: both `name` and `function` are required")
        if self.clip is not None and (len(self.clip) != 2 or self.clip[0] > self.clip[1]):
            raise ConfigError(f"clip: expected [low, high] with low <= high, got {self.clip}")


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is; a chat completion (list of messages) as the
    concatenated `content` of the model's messages (tool results, ``role: tool``, left out: a conversation
    with tool calls is scored on what the model wrote); a single message dict as its `content`.

    Multimodal content lists (`[{"type": "text", "text": ...}, ...]`) contribute their text parts.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content", ""))
    if isinstance(completion, Sequence):
        return "".join(
            _content_text(m.get("content", "")) if isinstance(m, Mapping) else str(m) for m in completion
            if not (isinstance(m, Mapping) and m.get("role") == "tool")
        )
    raise TypeError(
        f"completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # multimodal parts
        return "".join(
            p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return str(content)


def named(fn: Callable[..., list[RewardValue]], name: str) -> RewardFunction:
    """`fn` under the metric name `name` (TRL and the trainer read `__name__`);
    the original is `__wrapped__`."""

    @functools.wraps(fn)
    def reward(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        return fn(prompts, completions, **kwargs)

    reward.__name__ = name
    reward.__qualname__ = name
    return reward  # type: ignore[return-value]


def is_async_reward(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` (through ``named``/``functools.wraps`` wrappers and ``functools.partial``) is
    ``async def``: such rewards are awaited, all of a batch's concurrently (``score_completions``)."""
    target = inspect.unwrap(fn)
    target = getattr(target, "func", target)
    return inspect.iscoroutinefunction(target)


def texts(completions: Sequence[Any]) -> list[str]:
    """`completion_text` for each completion: (N,) → (N,) strings."""
    return [completion_text(c) for c in completions]


# the scorer sets it, in the thread that runs a timed reward call, once it stops waiting for that call
CALL_ABANDONED: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "reward_call_abandoned", default=None)


def call_abandoned() -> threading.Event:
    """The event that is set once the scorer stops waiting for the reward call this thread runs (its timeout
    passed); a fresh, never-set event outside a timed call. Read it in the call's own thread."""
    return CALL_ABANDONED.get() or threading.Event()
