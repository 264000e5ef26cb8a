"""Running one turn's tool calls for a batch of rollouts: rollouts concurrently, each rollout's calls in the
order the model wrote them (its environment's state is the rollout's), every call limited to ``timeout_s``.

    wave k = the k-th call of every rollout -> one daemon thread per call -> joined until the wave's deadline

A call that raises, runs past its time, names no tool of its rollout, was malformed, or returns what the model
cannot be shown is answered with the error - written as TRL writes it, ``{'error': '...'}`` - and counted as
failed; sampling goes on. Python cannot stop a thread: a call past its time is abandoned (a daemon thread
never holds the process open), and the rollout's later calls of that turn are not run (its environment may
still be in use).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_core.tools.bounded import Running
from grpo_core.tools.chat import ToolCall, error_content
from grpo_core.tools.registry import RESULT_TYPES


@dataclass
class CallResult:
    """What the model is answered for one call: the tool message's name and content;
    failed calls are counted."""

    name: str
    content: str
    failed: bool

    @property
    def message(self) -> dict:
        return {"role": "tool", "name": self.name, "content": self.content}


def render_result(name: str, value: Any) -> CallResult:
    """A tool's return value as the model sees it: a string as is, numbers, lists, dicts and None with
    ``str()`` (TRL's rendering); anything else is a failed call."""
    if isinstance(value, str):
        return CallResult(name, value, False)
    if isinstance(value, RESULT_TYPES):
        return CallResult(name, str(value), False)
    return failure(name, f"Tool {name} returned {type(value).__name__}; a tool returns a string (numbers, "
                         "lists, dicts and None are shown with str())")


def failure(name: str, message: str) -> CallResult:
    return CallResult(name, error_content(message), True)


def run_calls(batch: Sequence[tuple[dict[str, Callable], Sequence[ToolCall]]],
              timeout_s: float | None) -> list[list[CallResult]]:
    """``batch``: per rollout, its tools by name and the calls of its turn. Returns per rollout one CallResult
    per call, in order. timeout_s: seconds each call may take (None or 0 = no limit)."""
    results: list[list[CallResult | None]] = [[None] * len(calls) for _, calls in batch]
    timed_out = [False] * len(batch)
    for k in range(max((len(calls) for _, calls in batch), default=0)):
        running: list[tuple[int, ToolCall, Running]] = []
        for r, (functions, calls) in enumerate(batch):
            if k >= len(calls):
                continue
            call = calls[k]
            if timed_out[r]:
                results[r][k] = failure(call.name,
                                        f"Tool {call.name} not run: an earlier call of this turn timed out")
            elif call.error is not None:
                results[r][k] = failure(call.name, call.error)
            elif call.name not in functions:
                results[r][k] = failure(call.name, f"Tool {call.name} not found.")  # TRL's words
            else:
                running.append((r, call, Running(functions[call.name], call.arguments)))
        deadline = time.monotonic() + timeout_s if timeout_s else None
        for r, call, run in running:
            run.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if run.thread.is_alive():
                results[r][k] = failure(call.name, f"Tool {call.name} timed out after {timeout_s:g} s")
                timed_out[r] = True
            elif run.error is not None:
                results[r][k] = failure(call.name, str(run.error))  # TRL's: the exception's text
            else:
                results[r][k] = render_result(call.name, run.value)
    return results  # type: ignore[return-value]
