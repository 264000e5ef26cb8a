"""Sample G completions per prompt from a policy and score them: the one "sample and score" of calibration,
evaluation and the trainer's generation round.

    rows (P dicts with `prompt` and reward columns)
      -> prompt batches of ``batch_size`` -> backend.generate(..., num_generations=G)
         (rollout.default_backend)
      -> texts, completion lengths, truncation flags, reward matrix (P*G, K) with NaN for None

Rows of every output are grouped G at a time, prompt-major (rows ``[p*G, (p+1)*G)`` belong to prompt
``p``), the layout ``compute_advantages`` and ``grpo_core.calibration`` expect. The trainer's generation
round is one batch of it, with the token tensors kept (``keep_batches``).

With tools (``tools``: train.tools / environment_factory) a batch is sampled as conversations
(``grpo_core/rollout/multiturn.py``): each rollout gets its tools (and a new environment, reset with its row),
its prompt is rendered with their schemas, completions reach the rewards as message lists, and environments as
``environments=`` (TRL's convention); the environments are closed once the batch is scored.

Deterministic under a seed: ``seed`` (when given) seeds torch right before the first batch, so the same
model, rows, batch_size and seed give the same completions (on the same device and thread count).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from grpo_core.data.loading import DataError, PromptEncoder, completion_for_reward, is_conversational
from grpo_core.rewards import score_completions
from grpo_core.rollout import (
    RolloutBatch,
    SamplingParams,
    decode_completions,
    default_backend,
    pad_and_eos_ids,
)
from grpo_core.rollout.custom import RolloutContext, run_rollout_func
from grpo_core.rollout.multiturn import ToolRollouts, TurnLimits, generate_with_tools
from grpo_core.tools import Toolbox, ToolChat, close_all


@dataclass
class SampleResult:
    """Completions of P prompts, G each, and their rewards (rows grouped G at a time).

    texts: N = P*G completion strings (EOS and padding removed; with tools, every turn and tool block).
    completion_lengths: (N,) int, the model's tokens including the EOS when one was produced
    (tool blocks out). truncated: (N,) bool, True when no EOS came within ``max_new_tokens``.
    rewards: (N, K) float64, NaN where reward function k returned None (or failed with on_error="none").
    reward_names: the K function names (``__name__``), in column order.
    error_counts: {function name: samples on which it raised} (on_error="none").
    timeout_counts: {function name: samples whose call ran past ``reward_timeout_s``}.
    generation_time: seconds spent in ``backend.generate`` (decoding and scoring excluded).
    batches: the backends' ``RolloutBatch`` of each prompt batch (token ids and masks), when asked for.
    completions: with tools, each completion's messages (assistant, tool, ..., assistant); else empty.
    tool_calls, tool_failures: (N,) int, with tools: per completion, the tool calls the model made and those
        answered with an error; else empty.
    turns: (N,) int, with tools: assistant turns per completion; else empty.
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
    completions: list = field(default_factory=list)
    tool_calls: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tool_failures: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    turns: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

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


@dataclass(frozen=True)
class SamplePlan:
    """How ``sample_and_score`` draws and scores: G completions per prompt,
    ``batch_size`` prompts per call."""

    num_generations: int
    sampling: SamplingParams                    # greedy: do_sample=False with num_generations=1
    batch_size: int                             # prompts per generate call (batch_size * G sequences)
    seed: int | None = None                     # torch.manual_seed before sampling; None leaves the RNG alone
    on_error: Literal["raise", "none"] = "raise"  # a reward function that raises: fail, or score None
    reward_timeout_s: float | None = None       # per reward call; a call past it scores None (timeout_counts)
    keep_batches: bool = False                  # keep each batch's token tensors (the trainer trains on them)
    tools: Toolbox | None = None                # sample conversations with these tools (module docstring)
    rollout_func: Callable | None = None        # the user's rollout instead (train.rollout_func,
                                                # rollout/custom.py)

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError(f"sample_and_score: num_generations must be >= 1, got {self.num_generations}")
        if self.batch_size < 1:
            raise ValueError(f"sample_and_score: batch_size must be >= 1, got {self.batch_size}")


def sample_and_score(model, tokenizer, rows: Sequence[dict], encoder: PromptEncoder, reward_fns: Sequence,
                     plan: SamplePlan, *, backend: Any = None,
                     row_ids: Sequence[int] | None = None) -> SampleResult:
    """Sample ``plan.num_generations`` completions for each row's prompt and score them with ``reward_fns``.

    rows: dicts with ``prompt`` (string or chat messages) and the columns reward functions read
    (``answer`` ...). encoder: turns a prompt into ids (chat template, left truncation). backend: a
    ``RolloutBackend`` to use instead of ``default_backend(model, tokenizer)``. row_ids: each row's index in
    its dataset, named in prompt errors (default: its position in ``rows``).
    """
    rows = list(rows)
    names = [getattr(fn, "__name__", repr(fn)) for fn in reward_fns]
    G = plan.num_generations
    if not rows:
        return SampleResult(G, [], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool),
                            np.zeros((0, len(names))), names, {n: 0 for n in names})
    for i, row in enumerate(rows):
        if "prompt" not in row:
            raise ValueError(f"sample_and_score: row {i} has no 'prompt' column (columns: {sorted(row)})")
    backend = backend if backend is not None else default_backend(model, tokenizer)
    if plan.seed is not None:
        torch.manual_seed(plan.seed)

    chat = ToolChat.for_tokenizer(tokenizer, encoder.chat_template_kwargs) if plan.tools is not None else None
    texts: list[str] = []
    lengths, truncated, rewards = [], [], []  # per batch: (n,) int, (n,) bool, (n, K) float64
    errors: dict[str, int] = {n: 0 for n in names}
    timeouts: dict[str, int] = {n: 0 for n in names}
    row_ids = list(row_ids) if row_ids is not None else list(range(len(rows)))
    generation_time, batches = 0.0, []
    conversations: list[ToolRollouts] = []
    for start in range(0, len(rows), plan.batch_size):
        batch_rows, batch_ids = rows[start:start + plan.batch_size], row_ids[start:start + plan.batch_size]
        t0 = time.perf_counter()
        drawn = (_draw_custom(plan, backend, tokenizer, batch_rows) if plan.rollout_func is not None
                 else _draw(plan, backend, tokenizer, encoder, batch_rows, batch_ids, chat))
        generation_time += time.perf_counter() - t0
        batch = drawn.batch
        try:
            if plan.keep_batches:
                batches.append(batch)
            batch_texts = decode_completions(tokenizer, batch)
            completions = (drawn.completions
                           or [completion_for_reward(t, p) for t, p in zip(batch_texts, drawn.prompts)])
            columns = {**_reward_columns(batch_rows, G), **drawn.columns}
            columns["completion_ids"] = [ids[m.bool()].tolist()
                                         for ids, m in zip(batch.completion_ids, batch.completion_mask)]
            if reward_fns:
                scored = score_completions(list(reward_fns), drawn.prompts, completions, columns,
                                           on_error=plan.on_error, timeout_s=plan.reward_timeout_s)
                scores = scored.rewards
                for k, v in scored.error_counts.items():
                    errors[k] = errors.get(k, 0) + v
                for k, v in scored.timeout_counts.items():
                    timeouts[k] = timeouts.get(k, 0) + v
            else:
                scores = np.zeros((len(completions), 0))
        finally:
            close_all(drawn.opened)
        conversations += [drawn.rollouts] if drawn.rollouts is not None else []
        texts.extend(batch_texts)
        lengths.append(batch.completion_lengths.cpu().numpy().astype(np.int64))
        truncated.append(batch.is_truncated.cpu().numpy().astype(bool))
        rewards.append(np.asarray(scores, dtype=np.float64))
    return SampleResult(
        num_generations=G, texts=texts, completion_lengths=np.concatenate(lengths),
        truncated=np.concatenate(truncated), rewards=np.concatenate(rewards, axis=0), reward_names=names,
        error_counts=errors, timeout_counts=timeouts, generation_time=generation_time, batches=batches,
        completions=[c for r in conversations for c in r.completions],
        tool_calls=_per_row(conversations, "calls"), tool_failures=_per_row(conversations, "failures"),
        turns=_per_row(conversations, "turns"))


def _per_row(conversations: list[ToolRollouts], name: str) -> np.ndarray:
    return np.asarray([n for r in conversations for n in getattr(r, name)], dtype=np.int64)


@dataclass
class _Drawn:
    """One prompt batch sampled: the tokens, the prompts rewards see (one per completion), and with tools the
    conversations, the extra reward columns and the rollouts' tools (their environments closed after
    scoring)."""

    batch: RolloutBatch
    prompts: list
    completions: list | None = None
    columns: dict = field(default_factory=dict)
    opened: list = field(default_factory=list)
    rollouts: ToolRollouts | None = None


def _draw(plan: SamplePlan, backend, tokenizer, encoder: PromptEncoder, rows: list[dict], row_ids: list[int],
          chat: ToolChat | None) -> _Drawn:
    """G completions of each row's prompt: one ``generate`` call, or with tools conversations, each rollout
    with its own tools (and environment, reset with its row, its observation appended to its prompt)."""
    G, sampling, tools = plan.num_generations, plan.sampling, plan.tools
    if tools is None:
        prompt_ids = [encoder.encode(r["prompt"], row=i) for i, r in zip(row_ids, rows)]
        return _Drawn(backend.generate(prompt_ids, G, sampling),
                      [r["prompt"] for r in rows for _ in range(G)])
    per_rollout = [(r, i) for r, i in zip(rows, row_ids) for _ in range(G)]
    opened = tools.open([r for r, _ in per_rollout], [f"row {i}" for _, i in per_rollout])
    try:
        prompts = [_with_observation(encoder.messages(r["prompt"]), t.observation)
                   for (r, _), t in zip(per_rollout, opened)]
        encoded: dict[str, list[int]] = {}  # a group's rollouts mostly share their prompt
        prompt_ids = [_encode_once(encoder, encoded, p, i, t.schemas)
                      for p, (_, i), t in zip(prompts, per_rollout, opened)]
        rollouts = generate_with_tools(backend, chat, prompt_ids, G, opened, sampling,
                                       TurnLimits(tools.max_iterations, tools.timeout_s or None))
    except BaseException:
        close_all(opened)
        raise
    columns = {"completion_lengths": rollouts.batch.completion_lengths.tolist()}  # the model's tokens only
    if tools.factories is not None:
        columns["environments"] = [t.environment for t in opened]
    return _Drawn(rollouts.batch, prompts, rollouts.completions, columns, opened, rollouts)


def _draw_custom(plan: SamplePlan, backend, tokenizer, rows: list[dict]) -> _Drawn:
    """G completions of each row's prompt from the user's rollout function (TRL's ``rollout_func``); the extra
    keys it returns are reward columns."""
    G, sampling = plan.num_generations, plan.sampling
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    pad_id, eos_ids = pad_and_eos_ids(tokenizer)
    batch, extra = run_rollout_func(plan.rollout_func, prompts,
                                    RolloutContext(backend, tokenizer, sampling, G),
                                    pad_id=pad_id, eos_ids=eos_ids)
    return _Drawn(batch, prompts, columns={**extra, "completion_lengths": batch.completion_lengths.tolist()})


def _with_observation(prompt: Any, observation: str | None) -> Any:
    """TRL: what an environment's reset() returned is appended to the prompt's last message."""
    if observation is None:
        return prompt
    if not is_conversational(prompt):
        raise DataError("an environment's reset() returned text for a plain-text prompt; environments need "
                        "chat prompts (data.prompt_format: chat, or chat messages)")
    last = prompt[-1]
    return [*prompt[:-1], {**last, "content": last["content"] + observation}]


def _encode_once(encoder: PromptEncoder, encoded: dict[str, list[int]], prompt: Any, row: int,
                 tools: list) -> list[int]:
    """``encoder.encode(prompt, row, tools)``, once per distinct (prompt, tools)."""
    key = repr((prompt, [getattr(t, "__qualname__", repr(t)) for t in tools]))
    if key not in encoded:
        encoded[key] = encoder.encode(prompt, row=row, tools=tools)
    return encoded[key]
