"""Multi-turn rollouts with tool calls (TRL 1.16's ``_tool_call_loop``), above any backend: it only asks
``backend.generate`` for completions of token ids, so HF generate, the hand-written decode loop and vLLM all
run it.

    turn 1      backend.generate(prompts, G)                         -> each row's model tokens (EOS included)
    per turn    parse the row's last assistant turn (grpo_core/tools/chat.py) -> its tool calls
                run every row's calls (grpo_core/tools/calls.py: concurrently across rows, timeout per call)
                suffix = the template's tokens for the results + the next generation prompt  (tool mask 0)
                a row whose suffix would pass max_completion_length stops here, results dropped (as TRL)
                backend.generate(prompt + completion + suffix, 1), cut to the row's remaining budget
                (tool mask 1)
    until no row calls a tool, or max_iterations turns ran

One token sequence per completion: ``completion_ids`` is every token after the prompt - model turns and the
tool blocks between them - and ``tool_mask`` is 1 on the model's tokens, 0 on the tool/template tokens, which
the loss, the log-prob passes' statistics and the length metrics leave out (``Round.loss_mask``). The sequence
is built by concatenating token ids, never by re-rendering the conversation, so the tokens trained on are the
tokens sampled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from grpo_core.rollout.types import RolloutBackend, RolloutBatch, SamplingParams, left_pad, pad_and_eos_ids
from grpo_core.tools import RolloutTools, ToolChat, run_calls


@dataclass
class Conversation:
    """One rollout as it grows: model tokens and tool blocks after the prompt."""

    prompt_ids: list[int]
    tools: RolloutTools
    completion_ids: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)      # 1 = the model's token, 0 = a tool/template token
    logps: list[float] = field(default_factory=list)         # the sampler's, when the backend reports them
    messages: list[dict] = field(default_factory=list)       # assistant and tool messages (TRL's completion)
    pending: list = field(default_factory=list)              # the tool calls of the last assistant turn
    turns: int = 0
    calls: int = 0                                         # tool calls made, and those answered with an error
    failures: int = 0

    def extend(self, ids: list[int], model: bool, logps: list[float] | None = None) -> None:
        self.completion_ids += ids
        self.tool_mask += [int(model)] * len(ids)
        self.logps += logps if logps is not None else [0.0] * len(ids)


@dataclass
class ToolRollouts:
    """N completions (rows grouped G at a time) with their conversations.

    batch:        token tensors; ``batch.tool_mask`` (N, C) 1 on model tokens,
                  0 on tool/template tokens and padding
    completions:  per row, the completion's messages: assistant, tool results,
                  assistant, ... (what rewards get)
    calls, failures: per row, the tool calls the model made and those answered with an error (TRL's counts)
    turns:        assistant turns per row
    """

    batch: RolloutBatch
    completions: list[list[dict]]
    calls: list[int]
    failures: list[int]
    turns: list[int]

    @property
    def tool_calls(self) -> int:
        return sum(self.calls)

    @property
    def tool_failures(self) -> int:
        return sum(self.failures)


@dataclass(frozen=True)
class TurnLimits:
    """How long a conversation may go on besides its token budget (``sampling.max_new_tokens``)."""

    max_iterations: int | None = None  # tool-calling turns at most; None = until no row calls a tool
    timeout_s: float | None = None     # per tool call


def generate_with_tools(backend: RolloutBackend, chat: ToolChat, prompt_ids: list[list[int]],
                        num_generations: int, tools: list[RolloutTools], sampling: SamplingParams,
                        limits: TurnLimits) -> ToolRollouts:
    """Sample ``num_generations`` conversations per prompt; ``prompt_ids`` and ``tools`` have one entry per
    row (N = P * G, rows of a prompt consecutive; an environment's reset may give a rollout a prompt of its
    own). The completion budget is ``sampling.max_new_tokens`` over every turn and tool block.
    """
    budget, max_iterations = sampling.max_new_tokens, limits.max_iterations
    rows = [Conversation(list(p), t) for p, t in zip(prompt_ids, tools, strict=True)]
    first = _first_turn(backend, prompt_ids, num_generations, sampling)
    for i, row in enumerate(rows):
        ids, logps = _row(first, i)
        row.extend(ids, model=True, logps=logps)
        _take_turn(chat, row, ids, row.prompt_ids)
    active = [r for r in rows if r.pending]
    iteration = 0
    while active and (max_iterations is None or iteration < max_iterations):
        results = run_calls([(r.tools.functions, r.pending) for r in active], limits.timeout_s)
        contexts, continuing = [], []
        for row, res in zip(active, results):
            row.calls += len(res)  # counted whether or not the results fit (as TRL counts)
            row.failures += sum(c.failed for c in res)
            messages = [c.message for c in res]
            suffix = chat.suffix_ids(messages)
            if len(row.completion_ids) + len(suffix) > budget:
                continue  # past the budget: the results are dropped and the row ends as it is (TRL)
            row.messages += messages
            row.extend(suffix, model=False)
            contexts.append(row.prompt_ids + row.completion_ids)
            continuing.append(row)
        if not continuing:
            break
        room = [budget - len(r.completion_ids) for r in continuing]
        post = _continue(backend, contexts, room, sampling)
        for row, prefix, (ids, logps) in zip(continuing, contexts, post):
            row.extend(ids, model=True, logps=logps)
            row.pending = []
            if ids:  # nothing when the budget was spent exactly
                _take_turn(chat, row, ids, prefix)
        active = [r for r in continuing if r.pending]
        iteration += 1
    pad_id, eos_ids = pad_and_eos_ids(chat.tokenizer)
    batch = _assemble(rows, pad_id, eos_ids, with_logps=first.sampling_logps is not None)
    return ToolRollouts(batch, [r.messages for r in rows], [r.calls for r in rows],
                        [r.failures for r in rows], [r.turns for r in rows])


def _take_turn(chat: ToolChat, row: Conversation, ids: list[int], prefix: list[int]) -> None:
    turn = chat.parse(ids, prefix, row.tools.schemas)
    row.messages.append(turn.message)
    row.pending = turn.calls
    row.turns += 1


def _first_turn(backend: RolloutBackend, prompt_ids: list[list[int]], G: int,
                sampling: SamplingParams) -> RolloutBatch:
    """The first turn of every row: G samples of each prompt when a group's rows share their prompt (the
    backends' grouped path, as without tools), else one sample of each row's own prompt."""
    groups = [prompt_ids[g:g + G] for g in range(0, len(prompt_ids), G)]
    if all(all(p == group[0] for p in group) for group in groups):
        return backend.generate([group[0] for group in groups], G, sampling)
    return backend.generate(prompt_ids, 1, sampling)


def _row(batch: RolloutBatch, i: int) -> tuple[list[int], list[float] | None]:
    """Row i's completion tokens (up to and including the EOS) and the sampler's log-probs of them."""
    keep = batch.completion_mask[i].bool()
    ids = batch.completion_ids[i][keep].tolist()
    logps = None if batch.sampling_logps is None else batch.sampling_logps[i][keep].tolist()
    return ids, logps


def _continue(backend: RolloutBackend, contexts: list[list[int]], room: list[int],
              sampling: SamplingParams) -> list[tuple[list[int], list[float] | None]]:
    """One more assistant turn after each context, cut to its row's remaining budget (``room``, >= 0)."""
    asked = [j for j, r in enumerate(room) if r > 0]
    out: list[tuple[list[int], list[float] | None]] = [([], None) for _ in contexts]
    if not asked:
        return out
    longest = max(room[j] for j in asked)
    batch = backend.generate([contexts[j] for j in asked], 1,
                             dataclasses.replace(sampling, max_new_tokens=longest))
    for k, j in enumerate(asked):
        ids, logps = _row(batch, k)
        out[j] = (ids[:room[j]], None if logps is None else logps[:room[j]])
    return out


def _assemble(rows: list[Conversation], pad_id: int, eos_ids: list[int], with_logps: bool) -> RolloutBatch:
    """The conversations as one right-padded completion per row. completion_mask is 1 on every token after the
    prompt (the forward passes attend to all of them), tool_mask on the model's only. A row is truncated when
    its last token ends no turn (TRL: the last id is neither an EOS nor the pad)."""
    prompt_ids, prompt_mask = left_pad([r.prompt_ids for r in rows], pad_id)
    width = max(1, max(len(r.completion_ids) for r in rows))
    completion_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
    tool_mask = torch.zeros((len(rows), width), dtype=torch.long)
    logps = torch.zeros((len(rows), width), dtype=torch.float32) if with_logps else None
    ends = {*eos_ids, pad_id}
    for i, row in enumerate(rows):
        n = len(row.completion_ids)
        completion_ids[i, :n] = torch.tensor(row.completion_ids, dtype=torch.long)
        completion_mask[i, :n] = 1
        tool_mask[i, :n] = torch.tensor(row.tool_mask, dtype=torch.long)
        if logps is not None:
            logps[i, :n] = torch.tensor(row.logps, dtype=torch.float32)
    is_truncated = torch.tensor([not r.completion_ids or r.completion_ids[-1] not in ends for r in rows])
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, is_truncated, logps,
                        tool_mask)
