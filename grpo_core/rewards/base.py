"""Types shared by the reward functions, and the one helper every built-in needs: completion → text.

A reward function follows TRL's convention:

    fn(prompts: list, completions: list, **columns) -> list[float | None]     # one value per completion

`completions[i]` is a string, or (chat prompts) a list of messages `[{"role": "assistant", "content": ...}]`.
Extra dataset columns arrive as keyword lists aligned with `completions`; `None` = "does not apply".
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

RewardValue = float | None


@runtime_checkable
class RewardFunction(Protocol):
    """A TRL-compatible reward function; `__name__` is the metric name (`rewards/<name>/mean`)."""

    __name__: str

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]: ...


class RewardSpec(Protocol):
    """What `build_reward_functions` reads from each params.yaml `rewards:` entry (the lead's config objects)."""

    name: str  # metric name
    function: str  # built-in name or `package.module:function`
    kwargs: Mapping[
        str, Any
    ]  # factory kwargs (built-in) or kwargs bound with functools.partial (import path)
    target_share: float  # used by calibration, ignored here
    clip: Sequence[float] | None  # [lo, hi] applied to every non-None value, or None


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is; a chat completion (list of messages) as the
    concatenated `content` of the model's messages (tool results, ``role: tool``, left out: a conversation with tool
    calls is scored on what the model wrote); a single message dict as its `content`.

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
    """`fn` under the metric name `name` (TRL and the trainer read `__name__`); the original is `__wrapped__`."""

    @functools.wraps(fn)
    def reward(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        return fn(prompts, completions, **kwargs)

    reward.__name__ = name
    reward.__qualname__ = name
    return reward  # type: ignore[return-value]


def is_async_reward(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` (through ``named``/``functools.wraps`` wrappers and ``functools.partial``) is ``async def``:
    such rewards are awaited, all of a batch's concurrently (``score_completions``)."""
    target = inspect.unwrap(fn)
    target = getattr(target, "func", target)
    return inspect.iscoroutinefunction(target)


def texts(completions: Sequence[Any]) -> list[str]:
    """`completion_text` for each completion: (N,) → (N,) strings."""
    return [completion_text(c) for c in completions]
