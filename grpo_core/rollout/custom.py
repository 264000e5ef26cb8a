"""A user's own rollout (TRL 1.16's ``rollout_func``; ``train.rollout_func: package.module:function``).

    fn(prompts, trainer) -> {"prompt_ids": [[int]], "completion_ids": [[int]], "logprobs": [[float]] | None,
                             "env_mask": [[0/1]] (optional), **extra}

As in TRL: ``prompts`` holds one prompt per completion (each row's prompt G times in a row, chat messages kept
as messages, so the function renders them itself); it returns one completion per prompt. ``env_mask`` marks
the tokens the model sampled (1) against those the function inserted (0: an environment's feedback), and is
used as the tool mask is (``Round.loss_mask``); the extra keys reach the reward functions as keyword lists.

The ``trainer`` it is handed is ``RolloutContext``: what TRL rollout functions read of the trainer under TRL's
names (``processing_class``,
``args.num_generations`` / ``max_completion_length`` / ``temperature`` / ``top_p`` / ``top_k``), and this
pipeline's sampler, ``generate(prompt_ids) -> (completion_ids, logprobs)``, whatever ``generation.backend``
is. A function that reaches into TRL's own machinery (``trainer.vllm_generation``) does not run here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.common.errors import TrainingFailure
from grpo_core.rollout.types import RolloutBackend, RolloutBatch, SamplingParams, left_pad

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")


class RolloutFuncError(TrainingFailure, RuntimeError):
    """A rollout function returned something other than TRL's dict of token lists; the message says what."""


@dataclass(frozen=True)
class RolloutArgs:
    """The ``trainer.args`` fields a rollout function reads (GRPOConfig's names)."""

    num_generations: int
    max_completion_length: int
    temperature: float
    top_p: float
    top_k: int


class RolloutContext:
    """The ``trainer`` argument of a rollout function (module docstring)."""

    def __init__(self, backend: RolloutBackend, tokenizer, sampling: SamplingParams, num_generations: int):
        self.processing_class = tokenizer
        self.args = RolloutArgs(num_generations, sampling.max_new_tokens, sampling.temperature,
                                sampling.top_p, sampling.top_k)
        self._backend, self._sampling = backend, sampling

    def generate(self, prompt_ids: list[list[int]],
                 max_new_tokens: int | None = None) -> tuple[list[list[int]], list[list[float]] | None]:
        """One completion of each prompt, sampled as training samples (``generation.*``): its token ids up to
        and including the EOS, and the sampler's log-probs of them when the backend reports them
        (else None)."""
        sampling = self._sampling if max_new_tokens is None else dataclasses.replace(
            self._sampling, max_new_tokens=max_new_tokens)
        batch = self._backend.generate([list(p) for p in prompt_ids], 1, sampling)
        ids, logps = [], [] if batch.sampling_logps is not None else None
        for i in range(len(prompt_ids)):
            keep = batch.completion_mask[i].bool()
            ids.append(batch.completion_ids[i][keep].tolist())
            if logps is not None:
                logps.append(batch.sampling_logps[i][keep].tolist())
        return ids, logps


def run_rollout_func(fn: Callable, prompts: list, context: RolloutContext, *, pad_id: int,
                     eos_ids: list[int]) -> tuple[RolloutBatch, dict[str, list]]:
    """``fn(prompts, context)`` as a RolloutBatch (``tool_mask`` = its ``env_mask``; a row is truncated when
    its last token is neither an EOS nor the pad, as TRL judges it) and the extra keys, one value per
    completion."""
    out = fn(prompts, context)
    if not isinstance(out, dict):
        raise RolloutFuncError(f"rollout_func returned {type(out).__name__}; it returns a dict with "
                               f"{list(REQUIRED_KEYS)}")
    missing = sorted(set(REQUIRED_KEYS) - out.keys())
    if missing:
        raise RolloutFuncError(f"rollout_func must return keys {missing} in its output dict.")  # TRL's words
    n = len(prompts)
    prompt_ids, completion_ids = _token_lists(out, "prompt_ids", n), _token_lists(out, "completion_ids", n)
    logprobs = None if out["logprobs"] is None else _matching(out, "logprobs", completion_ids)
    env_mask = _matching(out, "env_mask", completion_ids) if out.get("env_mask") is not None else None
    # extra keys: a list holds one value per completion, anything else is every completion's
    # (TRL broadcasts it)
    extra = {k: (list(v) if isinstance(v, list) else [v] * n) for k, v in out.items()
             if k not in (*REQUIRED_KEYS, "env_mask")}
    for key, values in extra.items():
        if len(values) != n:
            raise RolloutFuncError(f"rollout_func: {key!r} has {len(values)} values for {n} prompts")
    p_ids, p_mask = left_pad(prompt_ids, pad_id)
    width = max(1, max(len(c) for c in completion_ids))
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask, tool = torch.zeros((n, width), dtype=torch.long), torch.zeros((n, width), dtype=torch.long)
    logps = torch.zeros((n, width), dtype=torch.float32) if logprobs is not None else None
    for i, c in enumerate(completion_ids):
        ids[i, :len(c)], mask[i, :len(c)] = torch.tensor(c, dtype=torch.long), 1
        tool[i, :len(c)] = torch.tensor(env_mask[i] if env_mask is not None else [1] * len(c),
                                        dtype=torch.long)
        if logps is not None:  # vLLM's None for a token it could not score is NaN, as TRL maps it
            logps[i, :len(c)] = torch.tensor([float("nan") if x is None else x for x in logprobs[i]])
    ends = {*eos_ids, pad_id}
    truncated = torch.tensor([not c or c[-1] not in ends for c in completion_ids])
    batch = RolloutBatch(p_ids, p_mask, ids, mask, truncated, logps, tool if env_mask is not None else None)
    return batch, extra


def _token_lists(out: dict, key: str, n: int) -> list[list[int]]:
    rows = out[key]
    if not isinstance(rows, (list, tuple)) or len(rows) != n:
        raise RolloutFuncError(f"rollout_func: {key!r} must be a list of {n} token-id lists (one per "
                               "prompt), got "
                               f"{len(rows) if isinstance(rows, (list, tuple)) else type(rows).__name__}")
    lists = [list(r) for r in rows]
    if key == "completion_ids" and any(not r for r in lists):
        raise RolloutFuncError("rollout_func: an empty completion (every completion holds at least one "
                               "token)")
    if any(not isinstance(t, int) or isinstance(t, bool) for r in lists for t in r):
        raise RolloutFuncError(f"rollout_func: {key!r} holds something other than int token ids")
    return lists


def _matching(out: dict, key: str, completion_ids: list[list[int]]) -> list[list[Any]]:
    rows = out[key]
    if len(rows) != len(completion_ids) or any(len(r) != len(c) for r, c in zip(rows, completion_ids)):
        raise RolloutFuncError(f"rollout_func: {key!r} must have one value per completion token")
    if key == "env_mask" and any(v not in (0, 1) for r in rows for v in r):
        raise RolloutFuncError("rollout_func: 'env_mask' holds values other than 0 and 1")
    return [list(r) for r in rows]
