"""Sample G completions per prompt from a policy and score them: the one "sample and score" of calibration,
evaluation and the trainer's generation round.

    rows (P dicts with `prompt` and reward columns)
      -> prompt batches of ``batch_size`` -> backend.generate(..., num_generations=G)  (rollout.default_backend)
      -> texts, completion lengths, truncation flags, reward matrix (P*G, K) with NaN for None

Rows of every output are grouped G at a time, prompt-major (rows ``[p*G, (p+1)*G)`` belong to prompt
``p``), the layout ``compute_advantages`` and ``grpo_core.calibration`` expect. The trainer's generation
round is one batch of it, with the token tensors kept (``keep_batches``).

Deterministic under a seed: ``seed`` (when given) seeds torch right before the first batch, so the same
model, rows, batch_size and seed give the same completions (on the same device and thread count).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from grpo_core.data import PromptEncoder, completion_for_reward
from grpo_core.rewards import score_completions
from grpo_core.rollout import RolloutBatch, SamplingParams, decode_completions, default_backend


@dataclass
class SampleResult:
    """Completions of P prompts, G each, and their rewards (rows grouped G at a time).

    texts: N = P*G completion strings (EOS and padding removed).
    completion_lengths: (N,) int, tokens including the EOS when one was produced.
    truncated: (N,) bool, True when no EOS came within ``max_new_tokens``.
    rewards: (N, K) float64, NaN where reward function k returned None (or failed with on_error="none").
    reward_names: the K function names (``__name__``), in column order.
    error_counts: {function name: samples on which it raised} (on_error="none").
    timeout_counts: {function name: samples whose call ran past ``reward_timeout_s``}.
    generation_time: seconds spent in ``backend.generate`` (decoding and scoring excluded).
    batches: the backends' ``RolloutBatch`` of each prompt batch (token ids and masks), when asked for.
    """

    num_generations: int
    texts: list[str]
    completion_lengths: np.ndarray
    truncated: np.ndarray
    rewards: np.ndarray
    reward_names: list[str]
    error_counts: dict[str, int] = field(default_factory=dict)
    timeout_counts: dict[str, int] = field(default_factory=dict)
    generation_time: float = 0.0
    batches: list[RolloutBatch] = field(default_factory=list)

    @property
    def num_prompts(self) -> int:
        return len(self.texts) // self.num_generations if self.num_generations else 0

    def prompt_of(self, row: int) -> int:
        """The prompt (position in ``rows``) that completion ``row`` belongs to."""
        return row // self.num_generations

    def grouped(self, array: np.ndarray) -> np.ndarray:
        """(N, ...) -> (P, G, ...)."""
        return np.asarray(array).reshape(self.num_prompts, self.num_generations, *np.shape(array)[1:])


def _reward_columns(rows: Sequence[dict], repeat: int) -> dict[str, list[Any]]:
    """Every non-prompt column, each row repeated G times (TRL's convention for reward keyword lists)."""
    keys: list[str] = []
    for row in rows:
        for k in row:
            if k != "prompt" and k not in keys:
                keys.append(k)
    return {k: [row.get(k) for row in rows for _ in range(repeat)] for k in keys}


def sample_and_score(model, tokenizer, rows: Sequence[dict], encoder: PromptEncoder, reward_fns: Sequence,
                     *, num_generations: int, sampling: SamplingParams, batch_size: int,
                     on_error: Literal["raise", "none"] = "raise", seed: int | None = None,
                     backend: Any = None, reward_timeout_s: float | None = None,
                     row_ids: Sequence[int] | None = None, keep_batches: bool = False) -> SampleResult:
    """Sample ``num_generations`` completions for each row's prompt and score them with ``reward_fns``.

    rows: dicts with ``prompt`` (string or chat messages) and the columns reward functions read
    (``answer`` ...). encoder: turns a prompt into ids (chat template, left truncation). batch_size:
    prompts per ``generate`` call (each call samples batch_size * G sequences). sampling: use
    ``do_sample=False`` with ``num_generations=1`` for greedy decoding. seed: ``torch.manual_seed(seed)``
    before sampling (None leaves the global RNG alone). backend: a ``RolloutBackend`` to use instead of
    ``default_backend(model, tokenizer)``. reward_timeout_s: per-call limit of a reward function (a call
    that times out scores None for its samples and is counted in ``timeout_counts``). row_ids: each row's
    index in its dataset, named in prompt errors (default: its position in ``rows``). keep_batches: keep each
    batch's token tensors in ``SampleResult.batches`` (the trainer trains on them).
    """
    if num_generations < 1:
        raise ValueError(f"sample_and_score: num_generations must be >= 1, got {num_generations}")
    if batch_size < 1:
        raise ValueError(f"sample_and_score: batch_size must be >= 1, got {batch_size}")
    rows = list(rows)
    names = [getattr(fn, "__name__", repr(fn)) for fn in reward_fns]
    G = num_generations
    if not rows:
        return SampleResult(G, [], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool),
                            np.zeros((0, len(names))), names, {n: 0 for n in names})
    for i, row in enumerate(rows):
        if "prompt" not in row:
            raise ValueError(f"sample_and_score: row {i} has no 'prompt' column (columns: {sorted(row)})")
    backend = backend if backend is not None else default_backend(model, tokenizer)
    if seed is not None:
        torch.manual_seed(seed)

    texts: list[str] = []
    lengths: list[np.ndarray] = []
    truncated: list[np.ndarray] = []
    rewards: list[np.ndarray] = []
    errors: dict[str, int] = {n: 0 for n in names}
    timeouts: dict[str, int] = {n: 0 for n in names}
    row_ids = list(row_ids) if row_ids is not None else list(range(len(rows)))
    generation_time, batches = 0.0, []
    for start in range(0, len(rows), batch_size):
        batch_rows = rows[start:start + batch_size]
        prompt_ids = [encoder.encode(r["prompt"], row=row_ids[start + j]) for j, r in enumerate(batch_rows)]
        t0 = time.perf_counter()
        batch = backend.generate(prompt_ids, G, sampling)
        generation_time += time.perf_counter() - t0
        if keep_batches:
            batches.append(batch)
        batch_texts = decode_completions(tokenizer, batch)
        prompts = [r["prompt"] for r in batch_rows for _ in range(G)]
        completions = [completion_for_reward(t, p) for t, p in zip(batch_texts, prompts)]
        columns = _reward_columns(batch_rows, G)
        columns["completion_ids"] = [ids[m.bool()].tolist()
                                     for ids, m in zip(batch.completion_ids, batch.completion_mask)]
        if reward_fns:
            scored = score_completions(list(reward_fns), prompts, completions, columns, on_error=on_error,
                                       timeout_s=reward_timeout_s)
            scores = scored.rewards
            for k, v in scored.error_counts.items():
                errors[k] = errors.get(k, 0) + v
            for k, v in scored.timeout_counts.items():
                timeouts[k] = timeouts.get(k, 0) + v
        else:
            scores = np.zeros((len(completions), 0))
        texts.extend(batch_texts)
        lengths.append(batch.completion_lengths.cpu().numpy().astype(np.int64))
        truncated.append(batch.is_truncated.cpu().numpy().astype(bool))
        rewards.append(np.asarray(scores, dtype=np.float64))
    return SampleResult(
        num_generations=G,
        texts=texts,
        completion_lengths=np.concatenate(lengths),
        truncated=np.concatenate(truncated),
        rewards=np.concatenate(rewards, axis=0),
        reward_names=names,
        error_counts=errors,
        timeout_counts=timeouts,
        generation_time=generation_time,
        batches=batches,
    )
