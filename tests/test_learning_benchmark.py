"""benchmarks/learning.py: TRL gets our recipe value for value, the table's arithmetic,
and one run of every side.

It measures nothing here: `make bench-learning` does (benchmarks/README.md, "Learning").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import learning

REPO = Path(__file__).resolve().parents[1]


def test_trl_gets_the_recipe_of_params_yaml_value_for_value(tmp_path):
    from trl import GRPOConfig

    from grpo_core.config import load_config
    from grpo_core.train.options import flat_train

    cfg = load_config(REPO / "params.yaml", {"generation.min_p": 0.05, "generation.repetition_penalty": 1.1,
                                             "train.use_bias_correction_kl": False})  # TRL's default: True
    t, g = flat_train(cfg.train), cfg.generation  # params.yaml's train: keys, TRL's names
    args = GRPOConfig(**learning.trl_args(cfg, tmp_path, [0.6, 0.4]))
    for name in ("max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        assert getattr(args, name) == getattr(g, name), name
    for name in ("learning_rate", "num_generations", "per_device_train_batch_size", "beta",
                 "use_bias_correction_kl", "epsilon",
                 "loss_type", "scale_rewards", "num_iterations",
                 "max_steps", "seed", "adam_beta1", "adam_beta2", "weight_decay", "max_grad_norm",
                 "mask_truncated_completions", "multi_objective_aggregation", "gradient_checkpointing"):
        assert getattr(args, name) == t[name], name
    plan = cfg.train.batch_plan
    assert args.steps_per_generation == plan.micro_batches_per_round
    assert args.reward_weights == [0.6, 0.4]
    assert args.lr_scheduler_type.value == t["lr_scheduler_type"] == "constant"
    # TRL's own defaults that differ from this recipe are overridden, not inherited
    assert not args.bf16 and not args.fp16 and args.epsilon_high == t["epsilon_high"]
    assert args.generation_batch_size == plan.generation_batch_size


def test_summary_and_table_from_hand_numbers():
    runs = [{"side": "ours", "seed": 0, "accuracy": 0.70, "completion_tokens_per_s": 1400.0},
            {"side": "trl", "seed": 0, "accuracy": 0.75, "completion_tokens_per_s": 700.0},
            {"side": "ours", "seed": 1, "accuracy": 0.80, "completion_tokens_per_s": 1600.0},
            {"side": "trl", "seed": 1, "accuracy": 0.65, "completion_tokens_per_s": 800.0}]
    summary = learning.summarize(runs, ["ours", "trl"], [0, 1])
    assert summary["ours"]["mean"] == pytest.approx(0.75) and summary["trl"]["mean"] == pytest.approx(0.70)
    assert summary["ours"]["std"] == pytest.approx(0.0707107, rel=1e-5)   # sample std of 0.70, 0.80
    assert summary["ours"]["mean_minus_baseline"] == pytest.approx(0.05)      # (-0.05 + 0.15) / 2
    assert summary["ours"]["worst_seed_minus_baseline"] == pytest.approx(-0.05)
    table = learning.table(runs, ["ours", "trl"], [0, 1], summary)
    assert "| 0 | 0.700 | 0.750 | -0.050 |" in table and "| 1 | 0.800 | 0.650 | +0.150 |" in table
    assert "| mean | 0.750 | 0.700 | +0.050 |" in table
    # Welch by hand: variances 0.005 and
    # 0.005, se = sqrt(0.005/2 + 0.005/2) = 0.070711, df = 2, t = 0.05 / se = 0.70711; with 2 df
    # P(T > t) = 1/2 - t / (2 sqrt(2 + t^2)) = 0.27639, p = 0.55279; CI 0.05 -+ 4.30265 * se
    assert summary["ours"]["p_value"] == pytest.approx(0.55279, abs=1e-5)
    assert summary["ours"]["ci95"] == pytest.approx([-0.25424, 0.35424], abs=1e-5)
    assert "ours − trl: +0.050, 95% CI [-0.254, +0.354], Welch p = 0.55 (2 seeds a side)" in table
    assert (summary["ours"]["completion_tokens_per_s"] == 1500.0
            and summary["trl"]["completion_tokens_per_s"] == 750.0)
    assert "train-stage completion tokens/s (mean over seeds): ours 1,500, trl 750 (ours/trl 2.00x)" in table


def test_without_trl_the_first_side_is_the_baseline():
    """`--sides ours ours-async`: async is compared with the synchronous default
    (the async decision's command)."""
    runs = [{"side": side, "seed": seed, "accuracy": acc} for side, seed, acc in
            [("ours", 0, 0.60), ("ours-async", 0, 0.70), ("ours", 1, 0.70), ("ours-async", 1, 0.80),
             ("ours", 2, 0.80), ("ours-async", 2, 0.75)]]
    summary = learning.summarize(runs, ["ours", "ours-async"], [0, 1, 2])
    assert "mean_minus_baseline" not in summary["ours"]
    assert summary["ours-async"]["baseline"] == "ours"
    assert summary["ours-async"]["mean_minus_baseline"] == pytest.approx(0.05)   # (0.10 + 0.10 - 0.05) / 3
    assert summary["ours-async"]["worst_seed_minus_baseline"] == pytest.approx(-0.05)
    table = learning.table(runs, ["ours", "ours-async"], [0, 1, 2], summary)
    assert "| train.seed | ours | ours-async | ours-async − ours |" in table
    assert "| 2 | 0.800 | 0.750 | -0.050 |" in table and "ours-async − ours: +0.050, 95% CI" in table


def test_with_unequal_seeds_the_interval_is_about_the_difference_of_the_means():
    """A side with seeds the other lacks: the mean row keeps the per-seed mean difference (seeds both have),
    and the Welch line states the difference of the means, the number its interval is about."""
    runs = [{"side": side, "seed": seed, "accuracy": acc} for side, seed, acc in
            [("ours", 0, 0.40), ("trl", 0, 0.45), ("ours", 1, 0.30), ("trl", 1, 0.35), ("ours", 2, 0.20)]]
    summary = learning.summarize(runs, ["ours", "trl"], [0, 1, 2])
    assert summary["ours"]["mean_minus_baseline"] == pytest.approx(-0.05)       # seeds 0 and 1
    assert summary["ours"]["difference_of_means"] == pytest.approx(-0.10)       # 0.30 - 0.40
    table = learning.table(runs, ["ours", "trl"], [0, 1, 2], summary)
    assert "| mean | 0.300 | 0.400 | -0.050 |" in table
    assert "ours − trl: -0.100, 95% CI" in table and "(ours 3 seeds, trl 2 seeds)" in table


def test_completion_tokens_count_every_completion_of_every_step():
    """Each optimizer step trains on per_device_train_batch_size x gradient_accumulation_steps completions."""
    from grpo_core.config import load_config

    cfg = load_config(REPO / "params.yaml", {"train.per_device_train_batch_size": 16,
                                               "train.gradient_accumulation_steps": 2})
    assert learning.completion_tokens(cfg, [10.0, 12.5]) == (10.0 + 12.5) * 16 * 2


def tiny_root(root: Path) -> Path:
    """A repo root as `dvc repro calibrate` leaves it: validated parquet splits, a base model, params.yaml."""
    import pandas as pd
    import yaml

    from tests.tiny import make_prompts, make_tiny_model

    make_tiny_model(root / "artifacts" / "base_model")
    rows = [json.loads(line) for line in open(make_prompts(root / "prompts.jsonl", n=16))]
    (root / "data" / "validated").mkdir(parents=True)
    pd.DataFrame(rows[:12]).to_parquet(root / "data" / "validated" / "train.parquet")
    pd.DataFrame(rows[12:]).to_parquet(root / "data" / "validated" / "eval.parquet")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["embedded"] = None
    params["data"].update(train_files="data/validated/train.parquet",
                          eval_files="data/validated/eval.parquet")
    params["train"].update(per_device_train_batch_size=16, num_generations=4, reward_weights=[0.5, 0.5])
    params["generation"]["max_completion_length"] = 6
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root


# ours-vllm needs a head size vLLM's CPU attention takes (>= 32); the tiny model's is 8. The vLLM side's one
# run on a real model is the SmolLM2 recipe's (benchmarks/README.md), its backend tests/test_vllm_engine.py.
SIDES_ON_THE_TINY_MODEL = [s for s in learning.SIDES if s != "ours-vllm"]


@pytest.mark.slow
def test_one_step_of_every_side_and_the_table(tmp_path):
    root = tiny_root(tmp_path / "repo")
    out = tmp_path / "learning.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.learning", "--root", str(root), "--seeds", "0", "--max-steps", "1",
         "--sides", *SIDES_ON_THE_TINY_MODEL, "--workdir", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {r["side"] for r in doc["runs"]} == set(SIDES_ON_THE_TINY_MODEL)
    for run in doc["runs"]:
        assert (0.0 <= run["accuracy"] <= 1.0 and run["num_prompts"] == 4
                and run["reward_weights"] == [0.5, 0.5])
        assert run["steps"] == 1 and 16 <= run["completion_tokens"] <= 16 * 6  # 16 completions of 1..6 tokens
    assert 0.0 <= doc["base_accuracy"] <= 1.0
    assert "| 0 |" in doc["table"] and "| mean |" in doc["table"] and doc["table"] in proc.stdout


@pytest.mark.parametrize("prompt_format, system", [("chat", "Solve the problem."), ("chat", None),
                                                    ("auto", "Solve the problem."), ("auto", None)])
def test_trl_renders_the_prompt_our_encoder_renders(prompt_format, system):
    """TRL's chat-template step on ``trl_prompt``'s output gives the text PromptEncoder gives our trainer: the
    SmolLM2 recipe (chat, a system prompt) and the embedded default (plain text) alike."""
    from trl.data_utils import maybe_apply_chat_template

    from grpo_core.config import load_config
    from grpo_core.data.loading import PromptEncoder
    from tests.hub_fixture import build_chat_tokenizer

    question = "Mia has 9 pens and gives away 3. How many pens are left?"
    tok = build_chat_tokenizer([question, "Solve the problem."])
    data = load_config(REPO / "params.yaml",
                       {"data.prompt_format": prompt_format, "data.system_prompt": system}).data
    ours = PromptEncoder.from_config(tok, data).render(question)
    theirs = maybe_apply_chat_template({"prompt": learning.trl_prompt(question, data)}, tok)["prompt"]
    assert theirs == ours
    if prompt_format == "chat":
        assert ours.endswith("<|im_start|>assistant\n") and (system is None or f"system\n{system}" in ours)


def test_cached_tables_the_kept_results_without_running_anything(tmp_path):
    """`--cached`: the results a cut-short invocation kept (here ours seeds 1, 2 and TRL seed 1) become the
    table; the missing run shows as -, and nothing is launched (there is no repo at --root to run one)."""
    kept = {("ours", 1): 0.90, ("trl", 1): 0.88, ("ours", 2): 0.80}
    for (side, seed), acc in kept.items():
        (tmp_path / "work" / f"{side}-seed{seed}").mkdir(parents=True)
        result = {"side": side, "seed": seed, "accuracy": acc,
                  "completion_tokens_per_s": 20.0 if side == "ours" else 8.0}
        if (side, seed) == ("ours", 1):
            result["base"] = {"accuracy": 0.37}
        (tmp_path / "work" / f"{side}-seed{seed}" / "result.json").write_text(json.dumps(result))
    out = tmp_path / "table.json"
    assert learning.main(["--cached", "--sides", "ours", "trl", "--seeds", "1", "2", "--root",
                          str(tmp_path / "none"), "--workdir", str(tmp_path / "work"), "--out",
                          str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "| 2 | 0.800 | – | – |" in doc["table"] and "| mean | 0.850 | 0.880 | +0.020 |" in doc["table"]
    assert doc["base_accuracy"] == 0.37 and "(ours/trl 2.50x)" in doc["table"]


def test_a_failed_run_leaves_the_others_and_the_table_names_it(tmp_path):
    """A run that fails (here: no repo at --root, so its subprocess exits non-zero) stops neither the other
    runs nor the table: the kept runs are tabled, the failure is named with its log, and the command exits
    1."""
    for seed, acc in ((1, 0.9), (2, 0.8)):
        (tmp_path / "work" / f"ours-seed{seed}").mkdir(parents=True)
        (tmp_path / "work" / f"ours-seed{seed}" / "result.json").write_text(
            json.dumps({"side": "ours", "seed": seed, "accuracy": acc, "completion_tokens_per_s": 20.0}))
    out = tmp_path / "table.json"
    code = learning.main(["--sides", "ours", "--seeds", "1", "3", "2", "--jobs", "1", "--root",
                          str(tmp_path / "none"), "--workdir", str(tmp_path / "work"), "--out", str(out)])
    assert code == 1
    doc = json.loads(out.read_text())
    assert [(r["side"], r["seed"]) for r in doc["runs"]] == [("ours", 1), ("ours", 2)]
    assert [(f["side"], f["seed"]) for f in doc["failed"]] == [("ours", 3)]
    assert doc["failed"][0]["failed"] != 0
    assert Path(doc["failed"][0]["log"]).is_file()
    assert "| 3 | – |" in doc["table"] and "| mean | 0.850 |" in doc["table"]
