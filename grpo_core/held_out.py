"""A policy on held-out prompts: greedy and sampled completions, each judged for correctness and format, as the
per-sample records ``grpo_core.evaluation.summarize_evaluation`` aggregates. The one scorer of the evaluate stage
and of evaluation during training (``train.eval_strategy``).

    rows (P prompts) -> per mode: sample_and_score(G completions each) -> rewards (N, K) + judges (N, 2)
      -> records {prompt_index, sample_index, mode, correct, format_ok, completion_length, reward/<name>, ...}
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from grpo_core.data import PromptEncoder
from grpo_core.evaluation import GREEDY, SAMPLED
from grpo_core.rewards.judges import Judges
from grpo_core.rollout import SamplingParams
from grpo_core.sampling import sample_and_score
from grpo_core.tools import Toolbox


@dataclass(frozen=True)
class EvalMode:
    """One way of sampling the held-out prompts: ``greedy`` (one completion, no sampling) or ``sampled``."""

    name: Literal["greedy", "sampled"]
    num_generations: int
    sampling: SamplingParams
    batch_size: int              # prompts per generate call
    seed: int | None = None      # seeds torch before the first call (sampled modes)


def eval_modes(*, max_new_tokens: int, num_generations: int, sampling: SamplingParams, sequences_per_call: int,
               seed: int | None) -> list[EvalMode]:
    """Greedy decoding, then (``num_generations`` > 0) ``num_generations`` samples per prompt drawn with
    ``sampling``; each generate call holds about ``sequences_per_call`` sequences."""
    modes = [EvalMode(GREEDY, 1, SamplingParams(max_new_tokens=max_new_tokens, do_sample=False), sequences_per_call)]
    if num_generations > 0:
        sampling = dataclasses.replace(sampling, max_new_tokens=max_new_tokens, do_sample=True)
        modes.append(EvalMode(SAMPLED, num_generations, sampling, max(1, sequences_per_call // num_generations), seed))
    return modes


def prompt_text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, default=str)


def score_policy(tokenizer, rows: Sequence[dict], indices: Sequence[int], encoder: PromptEncoder, reward_fns: Sequence,
                 reward_names: Sequence[str], judges: Judges, modes: Sequence[EvalMode], *, backend,
                 on_error: Literal["raise", "none"] = "raise", reward_timeout_s: float | None = None,
                 policy: str = "policy", tools: Toolbox | None = None,
                 rollout_func: Callable | None = None) -> list[dict]:
    """Every mode's completions of ``rows`` (dataset positions ``indices``) as records, rewards under
    ``reward/<name>``; ``correct`` and ``format_ok`` as the judges say. tools: sampled as conversations with
    them (train.tools / environment_factory, as training samples); the records then carry each completion's
    ``tool_calls``, ``tool_failures`` and ``turns``. rollout_func: sampled by the user's rollout function
    (train.rollout_func; greedy modes hand it greedy sampling)."""
    K = len(reward_names)
    fns = [*reward_fns, judges.correct_fn, judges.format_fn]
    records: list[dict] = []
    for mode in modes:
        res = sample_and_score(None, tokenizer, rows, encoder, fns, num_generations=mode.num_generations,
                               sampling=mode.sampling, batch_size=mode.batch_size, on_error=on_error, seed=mode.seed,
                               reward_timeout_s=reward_timeout_s, backend=backend, row_ids=list(indices),
                               tools=tools, rollout_func=rollout_func)
        for r, text in enumerate(res.texts):
            p = res.prompt_of(r)
            rec = {"policy": policy, "prompt_index": indices[p], "sample_index": r % mode.num_generations,
                   "mode": mode.name, "prompt": prompt_text(rows[p]["prompt"]), "answer": rows[p].get("answer"),
                   "completion": text, "completion_length": int(res.completion_lengths[r]),
                   "truncated": bool(res.truncated[r]), "correct": judges.is_correct(float(res.rewards[r, K])),
                   "format_ok": judges.is_well_formed(float(res.rewards[r, K + 1]))}
            rec.update({f"reward/{n}": float(res.rewards[r, k]) for k, n in enumerate(reward_names)})
            if tools is not None:
                rec.update({"tool_calls": int(res.tool_calls[r]), "tool_failures": int(res.tool_failures[r]),
                            "turns": int(res.turns[r])})
            records.append(rec)
    return records
