"""`calibrate`: sample the base policy on training prompts, score, and derive the reward weights.

``calibrate.num_prompts`` training prompts (seeded choice from data/validated/train.parquet) x
``calibrate.num_generations`` completions sampled as training samples (params.yaml ``generation``: backend,
temperature, top_p, top_k, min_p, repetition_penalty, length, generation_kwargs), except for the
``calibrate.temperature`` override when set -> reward matrix -> ``grpo_core.calibration.calibrate_weights``
(the rule is documented there).

Outputs
  artifacts/calibration/reward_weights.json  weights (``weights``, ``weights_list``), the rule, target and
                                             realised shares, statistics, flags, warnings, sampling setup
  artifacts/calibration/difficulty.json      per-prompt pass rates of the sampled prompts; with
                                             ``drop_always_solved`` / ``drop_never_solved`` the training
                                             prompt indices to keep (``kept_indices``: every training
                                             prompt except sampled ones found always / never solved;
                                             prompts not sampled are kept), else ``kept_indices: null``
  reports/calibration.md                     the same, readable

``calibrate.enabled: false``: equal weights (1.0 each) with ``rule: "disabled"`` and no sampling.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flows.stages.common import (
    CALIBRATION_DIFFICULTY,
    CALIBRATION_WEIGHTS,
    VALIDATED_TRAIN,
    require_file,
    with_validated_data,
)
from flows.stages.runs import StageRun
from grpo_core.common.files import jsonable, write_json_atomic, write_text_atomic
from grpo_core.rewards.judges import CORRECTNESS_FUNCTIONS, reward_index

REPORT = "reports/calibration.md"


@dataclass(frozen=True)
class CalibrateInputs:
    """Everything calibrate reads of params.yaml: whole sections, and the groups of `train:` it needs
    (tests/test_dvc_params.py checks dvc.yaml lists each)."""

    calibrate: Any
    generation: Any
    model: Any
    rewards: list
    data: Any
    reward_calls: Any    # train.reward_errors, reward_timeout_s
    tool_use: Any        # train.tools, environment_factory, ...: sampled with the tools training samples with
    generation_batch_size: int = field(metadata={"param": (  # as many sequences at once as a training round
        "train.per_device_train_batch_size", "train.gradient_accumulation_steps",
        "train.steps_per_generation", "train.num_processes")})


def stage_inputs(cfg) -> CalibrateInputs:
    return CalibrateInputs(cfg.calibrate, cfg.generation, cfg.model, cfg.rewards, cfg.data,
                           cfg.train.reward_calls, cfg.train.tool_use,
                           cfg.train.batch_plan.generation_batch_size)


def sampling_rows(inp: CalibrateInputs) -> list[tuple[str, Any, str]]:
    """(setting, value, where it comes from) of how calibration samples: for the report and the weights
    file."""
    g, c = inp.generation, inp.calibrate
    rows = [("backend", g.backend, "generation"),
            ("temperature", c.temperature if c.temperature is not None else g.temperature,
             "calibrate (override)" if c.temperature is not None else "generation")]
    rows += [(k, getattr(g, k), "generation") for k in ("top_p", "top_k", "min_p", "repetition_penalty",
                                                        "max_completion_length", "generation_kwargs")]
    return rows


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def disabled_outputs(names: list[str], num_train: int, drop: tuple[bool, bool]) -> tuple[dict, dict, str]:
    weights = {"names": names, "weights": {n: 1.0 for n in names}, "weights_list": [1.0] * len(names),
               "rule": "disabled", "stats": None, "flags": {n: [] for n in names},
               "warnings": ["calibration disabled (calibrate.enabled: false): equal weights"],
               "calibration": {"enabled": False}}
    difficulty = {"enabled": False, "num_train_prompts": num_train, "prompt_indices": [], "pass_rates": [],
                  "drop_always_solved": drop[0], "drop_never_solved": drop[1], "kept_indices": None}
    report = ("# Reward calibration\n\nCalibration is disabled (`calibrate.enabled: false`): every reward "
              "function gets weight 1.0 and no prompt is dropped.\n\n"
              + "\n".join(f"- `{n}`: 1.0" for n in names) + "\n")
    return weights, difficulty, report


def difficulty_doc(out: dict, indices: list[int], num_train: int, c) -> dict:
    diff = out.get("difficulty")
    doc = {"enabled": True, "num_train_prompts": num_train, "prompt_indices": indices,
           "correctness_function": diff["correctness_function"] if diff else None,
           "pass_rates": diff["pass_rate_per_prompt"] if diff else [],
           "mean_pass_rate": diff["mean_pass_rate"] if diff else None,
           "always_solved": diff["always_solved"] if diff else None,
           "never_solved": diff["never_solved"] if diff else None,
           "histogram": diff["histogram"] if diff else None,
           "drop_always_solved": c.drop_always_solved, "drop_never_solved": c.drop_never_solved,
           "kept_indices": None}
    if (c.drop_always_solved or c.drop_never_solved) and diff:
        from grpo_core.calibration import select_training_prompts

        rates: list = [None] * num_train
        for i, r in zip(indices, diff["pass_rate_per_prompt"]):
            rates[i] = r
        kept = select_training_prompts(rates, c.drop_always_solved, c.drop_never_solved)
        doc.update(kept_indices=kept, num_kept=len(kept), num_dropped=num_train - len(kept))
    elif c.drop_always_solved or c.drop_never_solved:
        doc["warning"] = "drop_* is set but no correctness reward is configured: no prompt dropped"
    return doc


def report_markdown(out: dict, difficulty: dict, inp: CalibrateInputs, samples: list[dict]) -> str:
    c = inp.calibrate
    cal = out["calibration"]
    lines = ["# Reward calibration", "",
             f"Base policy `{inp.model.name_or_path}`: {cal['num_prompts']} training prompts x "
             f"{cal['num_generations']} completions (seed {c.seed}); mean completion "
             f"length {_fmt(cal['mean_completion_length'], '.1f')}, truncated "
             f"{_fmt(cal['truncated_ratio'], '.1%')}.", "", "Sampling:", "", "| setting | value | from |",
             "| --- | --- | --- |",
             *(f"| {k} | {json.dumps(v) if isinstance(v, dict) else v} | {src} |"
               for k, v, src in sampling_rows(inp)),
             "",
             "| reward | weight | target share | realised share | mean | within-group std | None | flags |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    per = out["stats"]["per_function"]
    for n in out["names"]:
        lines.append(
            f"| `{n}` | {out['weights'][n]:.4f} | {_fmt(out['target_shares']['effective'][n], '.1%')} | "
            f"{_fmt(out['shares']['realised_chosen'][n], '.1%')} | {_fmt(per[n]['mean'])} | "
            f"{_fmt(per[n]['mean_within_group_std'])} | {_fmt(per[n]['none_fraction'], '.0%')} | "
            f"{', '.join(out['flags'][n]) or '-'} |")
    lines += ["", f"Rule: {out['rule']}", ""]
    if out["warnings"]:
        lines += ["**Warnings**", ""] + [f"- {w}" for w in out["warnings"]] + [""]
    if difficulty.get("correctness_function"):
        hist = difficulty["histogram"]
        lines += [f"## Difficulty (correctness reward `{difficulty['correctness_function']}`)", "",
                  f"Mean pass rate {_fmt(difficulty['mean_pass_rate'])}; always solved "
                  f"{difficulty['always_solved']}, never solved {difficulty['never_solved']} of "
                  f"{len(difficulty['prompt_indices'])} sampled prompts.", "",
                  "| pass rate | prompts |", "| ---: | ---: |"]
        lines += [f"| {r:.3f} | {n} |" for r, n in zip(hist["pass_rate"], hist["count"])]
        if difficulty["kept_indices"] is not None:
            lines += ["", f"Training keeps {difficulty['num_kept']} of {difficulty['num_train_prompts']} "
                          f"prompts ({difficulty['num_dropped']} dropped: "
                          f"drop_always_solved={c.drop_always_solved}, "
                          f"drop_never_solved={c.drop_never_solved})."]
        lines.append("")
    if samples:
        lines += ["## Sample completions", ""]
        for s in samples:
            rewards = ", ".join(f"{k}={_fmt(v, '.2f')}" for k, v in s["rewards"].items())
            lines += [f"- prompt {s['prompt_index']} ({rewards}):", "", "  ```", *(
                "  " + ln for ln in s["completion"].splitlines() or [""]), "  ```"]
        lines.append("")
    return "\n".join(lines)


def run(ctx) -> int:
    from flows.stages.common import quiet_libraries
    from grpo_core.data.loading import load_split

    quiet_libraries()
    inp = stage_inputs(with_validated_data(ctx.cfg))
    c, names = inp.calibrate, [r.name for r in inp.rewards]
    require_file(ctx.path(VALIDATED_TRAIN), "validate")
    with StageRun(ctx) as run:
        num_train = len(load_split(inp.data, "train", ctx.root))
        run.log_data_hashes([VALIDATED_TRAIN])
        if not c.enabled:
            weights, difficulty, report = disabled_outputs(names, num_train, (c.drop_always_solved,
                                                                               c.drop_never_solved))
        else:
            weights, difficulty, report = calibrate_base_policy(inp, ctx, run)
        write_json_atomic(ctx.path(CALIBRATION_WEIGHTS), weights)
        write_json_atomic(ctx.path(CALIBRATION_DIFFICULTY), difficulty)
        write_text_atomic(ctx.path(REPORT), report)
        run.set_tags({"calibration.rule": "disabled" if not c.enabled else "sqrt_share_over_variance"})
        for path, where in ((CALIBRATION_WEIGHTS, "calibration"), (CALIBRATION_DIFFICULTY, "calibration"),
                            (REPORT, "reports")):
            run.log_artifact(ctx.path(path), where)
        print(f"calibrate: weights {json.dumps(weights['weights'])}", file=sys.stderr)
    return 0


def calibrate_base_policy(inp: CalibrateInputs, ctx, run) -> tuple[dict, dict, str]:
    """Sample the base policy on calibrate.num_prompts training prompts and derive the weights: the weights
    file, the difficulty file and the report (the samples and metrics go to the tracker)."""
    from grpo_core.calibration import calibrate_weights
    from grpo_core.data.loading import load_split

    c, G, names = inp.calibrate, inp.calibrate.num_generations, [r.name for r in inp.rewards]
    dataset = load_split(inp.data, "train", ctx.root)
    rng = np.random.default_rng(c.seed)
    indices = sorted(int(i) for i in rng.choice(len(dataset), size=min(c.num_prompts, len(dataset)),
                                                replace=False))
    rows = [dataset[i] for i in indices]
    res = sample_base_policy(inp, ctx, rows)
    out = calibrate_weights(res.rewards, G, names, [r.target_share for r in inp.rewards],
                            dead_std_threshold=c.dead_std_threshold, dominant_share=c.dominant_share,
                            correctness_index=reward_index(inp.rewards, CORRECTNESS_FUNCTIONS))
    out["calibration"] = {
        "enabled": True, "num_prompts": len(indices), "num_generations": G,
        "sampling": {k: v for k, v, _ in sampling_rows(inp)}, "seed": c.seed, "prompt_indices": indices,
        "base_model": inp.model.name_or_path, "mean_completion_length": float(res.completion_lengths.mean()),
        "truncated_ratio": float(res.truncated.mean()), "reward_errors": res.error_counts,
        "reward_timeouts": res.timeout_counts}
    weights = jsonable(out)
    difficulty = jsonable(difficulty_doc(out, indices, len(dataset), c))
    samples = [{"prompt_index": indices[res.prompt_of(r)], "sample": r % G,
                "prompt": rows[res.prompt_of(r)]["prompt"], "completion": res.texts[r],
                "length": int(res.completion_lengths[r]), "truncated": bool(res.truncated[r]),
                "rewards": {n: jsonable(float(res.rewards[r, k])) for k, n in enumerate(names)}}
               for r in range(len(res.texts))]
    report = report_markdown(weights, difficulty, inp, [s for s in samples if s["sample"] < 2][:6])
    run.log_text("".join(json.dumps(jsonable(s)) + "\n" for s in samples), "calibration_samples.jsonl",
                 "samples")
    run.log_metrics(calibration_metrics(weights, difficulty))
    for w in weights["warnings"]:
        print(f"calibrate: warning: {w}", file=sys.stderr)
    return weights, difficulty, report


def sample_base_policy(inp: CalibrateInputs, ctx, rows: list[dict]):
    """calibrate.num_generations completions of each row, sampled as training samples (``generation``, with
    calibrate's temperature override) by the base policy, scored by the rewards."""
    from grpo_core.data.loading import PromptEncoder
    from grpo_core.model.loading import load_for_inference
    from grpo_core.rewards import build_reward_functions
    from grpo_core.rollout import backend_for, sampling_params
    from grpo_core.rollout.sampling import SamplePlan, sample_and_score
    from grpo_core.tools import build_toolbox, load_rollout_func

    c, G = inp.calibrate, inp.calibrate.num_generations
    # the base policy as loaded: LoRA adapters (model.lora) would only add zero-initialised weights
    model, tokenizer = load_for_inference(dataclasses.replace(inp.model, lora=None), ctx.root)
    encoder = PromptEncoder.from_config(tokenizer, inp.data)
    # prompts per generate call: as many sequences at once as one training generation round
    batch_size = max(1, inp.generation_batch_size // G)
    plan = SamplePlan(G, sampling_params(inp.generation, temperature=c.temperature), batch_size, seed=c.seed,
                      on_error=inp.reward_calls.reward_errors,
                      reward_timeout_s=inp.reward_calls.reward_timeout_s,
                      tools=build_toolbox(inp.tool_use), rollout_func=load_rollout_func(inp.tool_use))
    return sample_and_score(model, tokenizer, rows, encoder, build_reward_functions(inp.rewards), plan,
                            backend=backend_for(model, tokenizer, inp.generation, seed=c.seed,
                                                max_prompt_length=inp.data.max_prompt_length))


def calibration_metrics(weights: dict, difficulty: dict) -> dict[str, float]:
    metrics = {f"calibration/weight/{n}": w for n, w in weights["weights"].items()}
    metrics.update({f"calibration/realised_share/{n}": v
                    for n, v in weights["shares"]["realised_chosen"].items() if v is not None})
    metrics["calibration/mean_completion_length"] = weights["calibration"]["mean_completion_length"]
    if difficulty.get("mean_pass_rate") is not None:
        metrics.update({"calibration/mean_pass_rate": difficulty["mean_pass_rate"],
                        "calibration/always_solved": difficulty["always_solved"],
                        "calibration/never_solved": difficulty["never_solved"]})
    return metrics
