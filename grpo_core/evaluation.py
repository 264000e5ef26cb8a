"""A policy on held-out prompts, and its metrics: the one evaluation of the evaluate stage and of evaluation
during training (``train.eval_strategy``).

    rows (P prompts) -> per mode: sample_and_score(G completions each) -> rewards (N, K) + judges (N, 2)
      -> records {prompt_index, sample_index, mode, correct, format_ok, completion_length, reward/<name>, ...}
      -> summarize_evaluation: greedy accuracy, unbiased pass@k, per-reward means -> metrics/eval.json's
         {"base": {"accuracy": ..., "pass@4": ..., ...}, "trained": {...}, "delta": {...}}
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any, Literal

import numpy as np
import pandas as pd

from grpo_core.common.files import finite_or_none
from grpo_core.common.options import ConfigError, Options, option
from grpo_core.data.loading import PromptEncoder
from grpo_core.rewards.judges import Judges
from grpo_core.rollout import SamplingParams
from grpo_core.rollout.sampling import SamplePlan, sample_and_score
from grpo_core.tools import Toolbox

GREEDY = "greedy"
SAMPLED = "sampled"
#: what an evaluation with tools adds per mode (``tool_metrics``)
TOOL_EVAL_METRICS = ("tool_call_frequency", "tool_failure_frequency", "tool_success_rate")


@dataclass
class EvalOptions(Options):
    """params.yaml `train:` keys of evaluation during training and of the best checkpoint."""

    eval_strategy: Literal["no", "steps"] = option(
        "no", "steps = score the policy on held-out prompts (the eval split) every eval_steps and at the "
        "last step, into the step log and the tracker as eval/* (grpo_core/train/periodic_eval.py); "
        "no = never")
    eval_steps: int | None = option(None, "eval_strategy steps: optimizer steps between evaluations (None = "
                                    "logging_steps, as in TRL)", ge=1)
    eval_max_samples: int | None = option(100, "held-out prompts each evaluation scores: the first N of the "
                                          "eval split (None = all)", ge=1)
    num_generations_eval: int | None = option(
        None, "completions sampled per held-out prompt at the training temperature, for eval/pass@N and "
        "eval/sampled/* (None = num_generations, TRL's default; 0 = greedy decoding only)", ge=0)
    per_device_eval_batch_size: int = option(64, "sequences per generate call during evaluation", ge=1)
    metric_for_best_model: str | None = option(
        None, "an eval metric (eval/accuracy, eval/pass@N, eval/rewards/<name>/mean, ...; the eval/ prefix "
        "may be left out): the best checkpoint by it is never pruned by save_total_limit "
        "(None = eval/accuracy under load_best_model_at_end, else no best is tracked)")
    greater_is_better: bool = option(True, "metric_for_best_model: a larger value is better (false: smaller, "
                                     "e.g. eval/mean_completion_length)")
    load_best_model_at_end: bool = option(
        False, "export the best checkpoint's weights by metric_for_best_model instead of the last step's "
        "(needs save_steps to be a multiple of eval_steps, so every checkpoint has an evaluation)")

    def check(self) -> None:
        wants_eval = self.metric_for_best_model is not None or self.load_best_model_at_end
        if wants_eval and self.eval_strategy != "steps":
            key = ("metric_for_best_model" if self.metric_for_best_model is not None
                   else "load_best_model_at_end")
            raise ConfigError(f"{key}: the best checkpoint is judged by evaluations; set "
                              "train.eval_strategy: steps")

    def resolved(self, *, num_generations: int, logging_steps: int) -> EvalOptions:
        """A copy with the defaults that follow other keys filled in: eval_steps, num_generations_eval."""
        return dataclasses.replace(
            self, eval_steps=self.eval_steps or logging_steps,
            num_generations_eval=num_generations if self.num_generations_eval is None
                                 else self.num_generations_eval)

    @property
    def best_metric(self) -> str | None:
        """metric_for_best_model as a step-log key (``eval/...``); eval/accuracy under
        load_best_model_at_end."""
        name = self.metric_for_best_model or ("accuracy" if self.load_best_model_at_end else None)
        if name is None:
            return None
        return name if name.startswith("eval/") else f"eval/{name}"


def summary_metric_names(reward_names: Sequence[str], pass_k: Sequence[int], *, sampled: bool,
                         tools: bool = False) -> list[str]:
    """The keys ``summarize_evaluation`` can give: accuracy and the per-mode means (sampled: the ``sampled/``
    ones and pass@k too); tools: with the tool metrics."""
    per = [*(f"rewards/{n}/mean" for n in reward_names), "format_compliance", "mean_completion_length",
           *(TOOL_EVAL_METRICS if tools else ())]
    return ["accuracy", *per,
            *((*(f"pass@{k}" for k in pass_k), *(f"sampled/{m}" for m in per)) if sampled else ())]


def eval_metric_names(e: EvalOptions, reward_names: Sequence[str], tools: bool = False) -> list[str]:
    """The step-log keys of one evaluation during training (``e`` resolved) a best model can be chosen by
    (``eval/runtime``, seconds, is logged besides); tools: with the tool metrics."""
    G = e.num_generations_eval
    names = summary_metric_names(reward_names, sorted({1, G}), sampled=G > 0, tools=tools)
    return [f"eval/{m}" for m in names]
REQUIRED_COLUMNS = ("prompt_index", "sample_index", "mode", "correct", "format_ok", "completion_length")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from n samples of which c are correct (Chen et al. 2021).

        pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)

    The product form avoids huge binomials. When n - c < k every k-subset contains a correct sample,
    so the estimate is exactly 1.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"pass_at_k: {name} must be an integer, got {value!r}")
    if n < 1:
        raise ValueError(f"pass_at_k: n must be >= 1, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n} (draw at least k samples)")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def _check_frame(df: pd.DataFrame, reward_names: Sequence[str]) -> None:
    missing = [c for c in (*REQUIRED_COLUMNS, *(f"reward/{n}" for n in reward_names)) if c not in df.columns]
    if missing:
        raise ValueError(f"summarize_evaluation: per-sample frame lacks columns {missing}; "
                         f"has {list(df.columns)}")
    modes = set(df["mode"].unique()) - {GREEDY, SAMPLED}
    if modes:
        raise ValueError(f"summarize_evaluation: unknown mode(s) {sorted(map(str, modes))}; "
                         f"expected '{GREEDY}' or '{SAMPLED}'")
    dup = df.duplicated(["prompt_index", "sample_index", "mode"])
    if dup.any():
        first = df.loc[dup, ["prompt_index", "sample_index", "mode"]].iloc[0].tolist()
        raise ValueError(f"summarize_evaluation: {int(dup.sum())} duplicate (prompt_index, sample_index, "
                         f"mode) rows, first {first}")


def _metric_keys(reward_names: Sequence[str], prefix: str) -> list[str]:
    return [*(f"{prefix}rewards/{n}/mean" for n in reward_names), f"{prefix}format_compliance",
            f"{prefix}mean_completion_length"]


def tool_metrics(rows: pd.DataFrame, prefix: str) -> dict[str, Any]:
    """With tools (records with ``tool_calls`` / ``tool_failures``): calls per completion and failed calls per
    call (TRL's tools/call_frequency and tools/failure_frequency), and the share of completions with at least
    one call that succeeded (``tool_success_rate``)."""
    calls = rows["tool_calls"].astype(np.float64)
    failures = rows["tool_failures"].astype(np.float64)
    return {f"{prefix}tool_call_frequency": float(calls.mean()),
            f"{prefix}tool_failure_frequency": float(failures.sum() / calls.sum()) if calls.sum() else 0.0,
            f"{prefix}tool_success_rate": float((calls > failures).mean())}


def _sample_metrics(rows: pd.DataFrame, reward_names: Sequence[str], prefix: str) -> dict[str, Any]:
    """Means over the rows of one mode: per-reward means (NaN ignored), format compliance, length."""
    out: dict[str, Any] = {}
    for name in reward_names:
        col = rows[f"reward/{name}"].astype(np.float64)
        out[f"{prefix}rewards/{name}/mean"] = finite_or_none(col.mean()) if col.notna().any() else None
    out[f"{prefix}format_compliance"] = float(rows["format_ok"].astype(bool).mean())
    out[f"{prefix}mean_completion_length"] = float(rows["completion_length"].astype(np.float64).mean())
    if "tool_calls" in rows.columns:
        out.update(tool_metrics(rows, prefix))
    return out


def summarize_evaluation(per_sample: pd.DataFrame, ks: Iterable[int],
                         reward_names: Sequence[str]) -> dict[str, Any]:
    """Aggregate one policy's evaluation.

    ``per_sample``: one row per (prompt_index, sample_index, mode), mode in {"greedy", "sampled"}, with
    columns ``correct`` (bool), ``reward/<name>`` (float, NaN allowed), ``format_ok`` (bool),
    ``completion_length`` (int).

    Returns (None where there are no rows to average):
      ``accuracy``: greedy pass@1 = mean over prompts of the greedy sample's correctness;
      ``pass@k`` for each k: mean over prompts of ``pass_at_k(n_p, c_p, k)`` on the sampled rows;
      ``rewards/<name>/mean``, ``format_compliance``, ``mean_completion_length`` (and with tools, records
      with ``tool_calls`` / ``tool_failures``, TOOL_EVAL_METRICS): over greedy rows (the policy's answer), and
      the same under ``sampled/`` over sampled rows;
      ``num_prompts``, ``num_samples_per_prompt`` (sampled, minimum over prompts).
    """
    _check_frame(per_sample, reward_names)
    ks = [int(k) for k in ks]
    greedy = per_sample[per_sample["mode"] == GREEDY]
    sampled = per_sample[per_sample["mode"] == SAMPLED]
    out: dict[str, Any] = {"num_prompts": int(per_sample["prompt_index"].nunique())}

    if len(greedy):
        # mean per prompt first, so a prompt with two greedy rows does not count twice
        out["accuracy"] = float(greedy.groupby("prompt_index")["correct"].mean().mean())
        out.update(_sample_metrics(greedy, reward_names, ""))
    else:
        out["accuracy"] = None
        out.update({key: None for key in _metric_keys(reward_names, "")})

    if len(sampled):
        per_prompt = sampled.groupby("prompt_index")["correct"].agg(["size", "sum"])
        n_min = int(per_prompt["size"].min())
        for k in ks:
            if k > n_min:
                short = per_prompt.index[per_prompt["size"] < k].tolist()[:5]
                raise ValueError(f"summarize_evaluation: pass@{k} needs >= {k} sampled completions per "
                                 f"prompt; prompts {short} have {n_min}")
            out[f"pass@{k}"] = float(np.mean([pass_at_k(int(n), int(c), k)
                                              for n, c in zip(per_prompt["size"], per_prompt["sum"])]))
        out["num_samples_per_prompt"] = n_min
        out.update(_sample_metrics(sampled, reward_names, "sampled/"))
    else:
        out.update({f"pass@{k}": None for k in ks})
        out["num_samples_per_prompt"] = 0
    return out


def _accuracy_well_formed(rows: pd.DataFrame) -> float | None:
    """Accuracy among the greedy replies the format judge passes: whether a model that answers is right
    more often, apart from how often it answers at all."""
    formed = rows[rows["format_ok"] > 0.5]
    return float(formed["correct"].mean()) if len(formed) else None


def task_metrics(per_sample: pd.DataFrame, task_of: Mapping[int, str], score_column: str) -> dict[str, Any]:
    """Greedy results per task, for data that mixes tasks (``task_of``: prompt index -> its task):
    ``tasks/<task>/accuracy`` (the judges' correct), ``tasks/<task>/mean_score`` (``score_column``, a reward
    with partial credit: the mean counts it), ``tasks/<task>/format_compliance`` (the format judge's share:
    beside a reasoning_gym reward, replies with an answer it can read), ``tasks/<task>/accuracy_well_formed``
    (accuracy among those) and ``tasks/<task>/num_prompts``; and ``mean_score`` and ``accuracy_well_formed``
    over all."""
    greedy = per_sample[per_sample["mode"] == GREEDY]
    if not len(greedy):
        return {}
    # mean per prompt first, as accuracy does: a prompt with two greedy rows counts once
    per_prompt = greedy.groupby("prompt_index").agg(correct=("correct", "mean"), score=(score_column, "mean"),
                                                    format_ok=("format_ok", "mean"))
    per_prompt["task"] = [str(task_of[i]) for i in per_prompt.index]
    out: dict[str, Any] = {"mean_score": finite_or_none(per_prompt["score"].mean()),
                           "accuracy_well_formed": _accuracy_well_formed(per_prompt)}
    for task, rows in per_prompt.groupby("task", sort=True):
        out[f"tasks/{task}/accuracy"] = float(rows["correct"].mean())
        out[f"tasks/{task}/mean_score"] = finite_or_none(rows["score"].mean())
        out[f"tasks/{task}/format_compliance"] = float(rows["format_ok"].mean())
        out[f"tasks/{task}/accuracy_well_formed"] = _accuracy_well_formed(rows)
        out[f"tasks/{task}/num_prompts"] = int(len(rows))
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(float(x))


def compare(base: Mapping[str, Any], trained: Mapping[str, Any]) -> dict[str, Any]:
    """trained - base for every key both have with finite numeric values (bools excluded); nested
    dicts are compared key by key and kept only when they have a delta."""
    out: dict[str, Any] = {}
    for key in base.keys() & trained.keys():
        b, t = base[key], trained[key]
        if isinstance(b, Mapping) and isinstance(t, Mapping):
            sub = compare(b, t)
            if sub:
                out[key] = sub
        elif _is_number(b) and _is_number(t):
            out[key] = float(t) - float(b)
    return dict(sorted(out.items()))


def eval_report(base: Mapping[str, Any], trained: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """The metrics/eval.json object: {"base", "trained", "delta", **extra}."""
    return {"base": dict(base), "trained": dict(trained), "delta": compare(base, trained), **extra}


@dataclass(frozen=True)
class EvalMode:
    """One way of sampling the held-out prompts: ``greedy`` (one completion, no sampling) or ``sampled``."""

    name: Literal["greedy", "sampled"]
    num_generations: int
    sampling: SamplingParams
    batch_size: int                       # prompts per generate call
    seed: int | None = None               # seeds torch before the first call (sampled modes)
    tools: Toolbox | None = None          # sampled as conversations with them (train.tools,
                                          # environment_factory)
    # sampled by the user's rollout (train.rollout_func; greedy: greedy params)
    rollout_func: Callable | None = None


def eval_modes(*, max_new_tokens: int, num_generations: int, sampling: SamplingParams,
               sequences_per_call: int, seed: int | None, tools: Toolbox | None = None,
               rollout_func: Callable | None = None) -> list[EvalMode]:
    """Greedy decoding, then (``num_generations`` > 0) ``num_generations`` samples per prompt drawn with
    ``sampling``; each generate call holds about ``sequences_per_call`` sequences. tools, rollout_func: as
    training samples (train.tools / environment_factory, train.rollout_func)."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens, do_sample=False)
    modes = [EvalMode(GREEDY, 1, greedy, sequences_per_call, None, tools, rollout_func)]
    if num_generations > 0:
        sampling = dataclasses.replace(sampling, max_new_tokens=max_new_tokens, do_sample=True)
        per_call = max(1, sequences_per_call // num_generations)
        modes.append(EvalMode(SAMPLED, num_generations, sampling, per_call, seed, tools, rollout_func))
    return modes


@dataclass(frozen=True)
class Grading:
    """What scores a held-out completion: the run's reward functions, by name,
    and the answer/format judges."""

    reward_fns: Sequence
    reward_names: Sequence[str]
    judges: Judges
    on_error: Literal["raise", "none"] = "raise"  # a reward function that raises: fail, or score None
    reward_timeout_s: float | None = None        # per reward call (train.reward_timeout_s)


def prompt_text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, default=str)


def score_policy(tokenizer, rows: Sequence[dict], indices: Sequence[int], encoder: PromptEncoder,
                 grading: Grading, modes: Sequence[EvalMode], *, backend,
                 policy: str = "policy") -> list[dict]:
    """Every mode's completions of ``rows`` (dataset positions ``indices``) as records, rewards under
    ``reward/<name>``; ``correct`` and ``format_ok`` as the judges say. Sampled with tools, the records also
    carry each completion's ``tool_calls``, ``tool_failures`` and ``turns``."""
    reward_names, judges = grading.reward_names, grading.judges
    K = len(reward_names)
    fns = [*grading.reward_fns, judges.correct_fn, judges.format_fn]
    records: list[dict] = []
    for mode in modes:
        plan = SamplePlan(mode.num_generations, mode.sampling, mode.batch_size, seed=mode.seed,
                          on_error=grading.on_error, reward_timeout_s=grading.reward_timeout_s,
                          tools=mode.tools, rollout_func=mode.rollout_func)
        res = sample_and_score(None, tokenizer, rows, encoder, fns, plan, backend=backend,
                               row_ids=list(indices))
        for r, text in enumerate(res.texts):
            p = res.prompt_of(r)
            rec = {"policy": policy, "prompt_index": indices[p], "sample_index": r % mode.num_generations,
                   "mode": mode.name, "prompt": prompt_text(rows[p]["prompt"]),
                   "answer": rows[p].get("answer"), "completion": text,
                   "completion_length": int(res.completion_lengths[r]),
                   "truncated": bool(res.truncated[r]),
                   "correct": judges.is_correct(float(res.rewards[r, K])),
                   "format_ok": judges.is_well_formed(float(res.rewards[r, K + 1]))}
            rec.update({f"reward/{n}": float(res.rewards[r, k]) for k, n in enumerate(reward_names)})
            if mode.tools is not None:
                rec.update({"tool_calls": int(res.tool_calls[r]), "tool_failures": int(res.tool_failures[r]),
                            "turns": int(res.turns[r])})
            records.append(rec)
    return records
