"""A training curriculum: levels in the reasoning-gym data (prepare), and the rule that moves each task up a
level when its rolling training accuracy reaches the threshold (train.curriculum,
grpo_core/train/curriculum.py) - by hand on a built dataset, then in a short real run and its resume."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from grpo_core.common.options import ConfigError
from grpo_core.config import config_from_dict
from grpo_core.data.loading import DataConfig, DataError
from grpo_core.rewards.base import RewardSpec
from grpo_core.rewards.judges import Judges
from grpo_core.train.curriculum import (
    AccuracyJudge,
    CurriculumOptions,
    CurriculumRule,
    CurriculumSampler,
    build_sampler,
)
from tests.tiny import make_tiny_model, read_log, tiny_config

try:
    import reasoning_gym  # noqa: F401
    HAVE_REASONING_GYM = True
except ImportError as exc:  # the reasoning-gym extra, which `make setup` installs: CI must run these
    if os.environ.get("CI"):
        raise ImportError(f"CI must test reasoning-gym levels, and it is not installed ({exc})") from exc
    HAVE_REASONING_GYM = False
needs_reasoning_gym = pytest.mark.skipif(not HAVE_REASONING_GYM, reason="reasoning-gym is not installed")

G = 4  # completions per prompt in the hand-built rounds


class OneProcess:
    num_processes, is_main_process, device = 1, True, "cpu"


class TwoProcesses:
    """Process 0 of two: ``reduce`` adds the other process's counts, as the all-reduce would."""

    num_processes, is_main_process, device = 2, True, "cpu"

    def __init__(self, other: torch.Tensor):
        self.other = other

    def reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        assert op == "sum"
        return tensor + self.other


# ---------------------------------------------------------------------------------------------------
# The rule, by hand: task a has levels 0, 1, 2 (rows 0-5), task b levels 0, 1 (rows 6-9), task c one level


TASKS = ["a"] * 6 + ["b"] * 4 + ["c"] * 2
LEVELS = [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 0, 0]


def judge() -> AccuracyJudge:
    return AccuracyJudge(0, Judges(None, 1.0, None).is_correct)


def sampler(threshold: float = 0.75, window: int = 2, **kwargs) -> CurriculumSampler:
    rule = CurriculumRule(threshold=threshold, window=window)
    return CurriculumSampler(TASKS, LEVELS, rule, judge(), seed=0, **kwargs)


def row_at(s: CurriculumSampler, task: str) -> int:
    """A row of ``task`` at its current level."""
    return next(i for i, (t, lv) in enumerate(zip(TASKS, LEVELS)) if t == task and lv == s.current[task])


def play_round(s: CurriculumSampler, correct: dict[str, int], accelerator=None) -> dict[str, float]:
    """One round: a prompt of each task in ``correct`` whose G completions have that many right (reward 1.0;
    the rest 0.0, and one None - NaN in the rewards - which is never correct); the round closed."""
    indices = [row_at(s, task) for task in correct]
    scores = [[1.0] * n + [0.0] * (G - n - 1) + ([float("nan")] if n < G else []) for n in correct.values()]
    s.observe(indices, torch.tensor([[v] for group in scores for v in group]))
    metrics, _ = s.close_round(accelerator or OneProcess())
    return metrics


def test_a_task_moves_up_exactly_when_its_window_reaches_the_threshold():
    """threshold 0.75, window 2 rounds of 4 completions: a 3/4 then 3/4 = 6/8 = 0.75 moves up; b 4/4 then 1/4
    = 5/8 stays; a round alone (window not full) never promotes, even at 4/4."""
    s = sampler()
    first = play_round(s, {"a": 3, "b": 4})
    assert first == {"curriculum/a/level": 0.0, "curriculum/a/accuracy": 0.75,
                     "curriculum/b/level": 0.0, "curriculum/b/accuracy": 1.0}  # c has one level: not logged
    assert s.current == {"a": 0, "b": 0, "c": 0}
    second = play_round(s, {"a": 3, "b": 1})
    assert second["curriculum/a/accuracy"] == 0.75 and second["curriculum/a/level"] == 0.0  # as sampled
    assert second["curriculum/b/accuracy"] == 5 / 8
    assert s.current == {"a": 1, "b": 0, "c": 0} and len(s.windows["a"]) == 0  # a's window cleared
    # the pool changed: a's level-1 rows (2, 3), b's level-0 rows (6, 7), c's (10, 11)
    assert sorted(s.take(6)) == [2, 3, 6, 7, 10, 11]
    third = play_round(s, {"a": 4, "b": 4})
    assert third["curriculum/a/accuracy"] == 1.0 and s.current["a"] == 1  # one round at level 1: not full
    assert s.current["b"] == 0 and third["curriculum/b/accuracy"] == 5 / 8  # the window slid: 1/4 + 4/4


def test_one_below_the_threshold_stays_and_the_window_slides():
    s = sampler()
    play_round(s, {"a": 3})
    play_round(s, {"a": 2})                 # 5/8 = 0.625 < 0.75
    assert s.current["a"] == 0
    play_round(s, {"a": 4})                 # the last two rounds: 2/4 + 4/4 = 0.75
    assert s.current["a"] == 1


def test_a_round_without_the_task_leaves_its_window_alone():
    s = sampler()
    play_round(s, {"a": 4})
    play_round(s, {"b": 0})                 # a not sampled: no entry, its window still holds one round
    assert s.current["a"] == 0 and list(s.windows["a"]) == [(4, 4)]
    play_round(s, {"a": 2})                 # 6/8
    assert s.current["a"] == 1


def test_never_past_the_top_level_and_tasks_climb_independently():
    s = sampler(threshold=0.5, window=1)
    for _ in range(5):
        play_round(s, {"a": 4, "b": 1})     # a always right, b 1/4 < 0.5
    assert s.current == {"a": 2, "b": 0, "c": 0}
    assert len(s.windows["a"]) == 1         # a full window at the top level: nowhere to go
    assert sorted(s.take(6)) == [4, 5, 6, 7, 10, 11]
    play_round(s, {"b": 2})                 # 2/4 = 0.5
    assert s.current == {"a": 2, "b": 1, "c": 0}


def test_counts_are_summed_over_processes_before_deciding():
    """window 1, threshold 0.75: this process's 4/4 alone would promote; with the other process's 0/4 on the
    same task the round is 4/8."""
    s = sampler(window=1)
    other = torch.tensor([[0.0, 4.0], [0.0, 0.0]], dtype=torch.float64)  # (a, b) x (correct, completions)
    metrics = play_round(s, {"a": 4}, TwoProcesses(other))
    assert metrics["curriculum/a/accuracy"] == 0.5 and s.current["a"] == 0
    play_round(s, {"a": 4}, TwoProcesses(torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)))
    assert s.current["a"] == 1              # 7/8


def test_the_state_round_trips_and_a_level_state_always_gives_the_same_order():
    """window 3, threshold 0.75: three rounds move a (12/12) and b (9/12) up; a sampler loaded with the state
    takes and decides as the one that went on; right after a promotion the order is the level state's own."""
    s = sampler(window=3)
    play_round(s, {"a": 4, "b": 3})
    s.take(5)
    play_round(s, {"a": 4, "b": 3})
    play_round(s, {"a": 4, "b": 3})
    s.take(3)
    play_round(s, {"a": 1, "b": 2})
    state = json.loads(json.dumps(s.state_dict()))  # as a checkpoint's trainer_state.json holds it
    assert state["levels"] == {"a": 1, "b": 1, "c": 0} and state["windows"] == {"a": [[1, 4]], "b": [[2, 4]]}
    resumed = sampler(window=3)
    resumed.load_state_dict(state)
    assert resumed.take(7) == s.take(7)
    for verdicts in ({"a": 4, "b": 0}, {"a": 4, "b": 0}):  # a: (1 + 4 + 4) / 12 = 0.75 moves up
        assert play_round(resumed, verdicts) == play_round(s, verdicts)
    assert resumed.current == s.current == {"a": 2, "b": 1, "c": 0}
    fresh = sampler(window=3)
    fresh.load_state_dict({"levels": s.current, "windows": {}, "pool": {"epoch": 0, "position": 0}})
    first = fresh.take(9)
    assert first == resumed.take(9) == s.take(9) and set(first[:6]) == {4, 5, 8, 9, 10, 11}  # one epoch


def test_calibrations_allowed_rows_are_respected():
    s = sampler(allowed=[0, 2, 3, 6, 8, 10])
    assert sorted(s.take(3)) == [0, 6, 10]
    assert s.ladders == {"a": [0, 1], "b": [0, 1], "c": [0]}  # a's level 2 rows were all dropped


def test_a_split_without_levels_or_with_odd_ones_is_named():
    import datasets

    options = CurriculumOptions(curriculum=CurriculumRule())
    specs = [RewardSpec(name="acc", function="correctness")]
    data = DataConfig(train_files="data/validated/train.parquet")
    plain = datasets.Dataset.from_list([{"prompt": "p", "answer": "1"}])
    with pytest.raises(ConfigError, match=r"train\.curriculum: the train split \(data\.train_files "
                                          r"data/validated/train\.parquet\) has no 'level' column"):
        build_sampler(options, plain, specs, data, seed=0, allowed=None, shuffle=True)
    odd = datasets.Dataset.from_list([{"prompt": "p", "level": 0.0}, {"prompt": "q", "level": 1.5}])
    with pytest.raises(DataError, match=r"has level 0\.0 at row 0; levels are integers"):
        build_sampler(options, odd, specs, data, seed=0, allowed=None, shuffle=True)
    # no task column: one task, logged without a name
    rows = datasets.Dataset.from_list([{"prompt": f"p{i}", "level": i % 2} for i in range(4)])
    s = build_sampler(options, rows, specs, data, seed=0, allowed=None, shuffle=True)
    assert s.metric_names() == ["curriculum/level", "curriculum/accuracy"] and sorted(s.take(2)) == [0, 2]
    named = rows.add_column("task", ["gsm8k:hard"] * 4)  # a character an MLflow metric key cannot hold
    assert build_sampler(options, named, specs, data, seed=0, allowed=None, shuffle=True).metric_names() == [
        "curriculum/gsm8k_hard/level", "curriculum/gsm8k_hard/accuracy"]
    assert type(build_sampler(CurriculumOptions(), plain, specs, data, seed=0, allowed=None,
                              shuffle=True)).__name__ == "PromptSampler"


@pytest.mark.parametrize("train,rewards,match", [
    ({"curriculum": {"threshold": 0}}, None,
     r"train\.curriculum\.threshold: 0\.0 is out of range; allowed: > 0"),
    ({"curriculum": {"threshold": 1.01}}, None, r"train\.curriculum\.threshold: 1\.01 is out of range"),
    ({"curriculum": {"window": 0}}, None, r"train\.curriculum\.window: 0 is out of range; allowed: >= 1"),
    ({"curriculum": {"metric": "reward"}}, None, r"train\.curriculum\.metric: 'reward' is not allowed"),
    ({"curriculum": {"treshold": 0.5}}, None, r"train\.curriculum\.treshold: unknown key; did you mean"),
    ({"curriculum": {}, "async_rollouts": True}, None,
     r"train\.async_rollouts: not with train\.curriculum: the sampler worker draws the next round before"),
    ({"curriculum": {}}, [{"name": "f", "function": "soft_format"}],
     r"train\.curriculum: promotes on training accuracy.*rewards has none \(f \(soft_format\)\)"),
])
def test_bad_curriculum_params_name_the_key(train, rewards, match):
    raw = {"data": {"train_files": "x.jsonl"}, "train": train,
           "rewards": rewards or [{"name": "acc", "function": "correctness"}]}
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


def test_curriculum_params_parse_and_auto_async_turns_off():
    raw = {"data": {"train_files": "x.jsonl"}, "rewards": [{"name": "acc", "function": "correctness"}],
           "train": {"curriculum": {"threshold": 1, "window": 3}, "async_rollouts": "auto"}}
    cfg = config_from_dict(raw)
    assert cfg.train.levels.curriculum == CurriculumRule(threshold=1.0, window=3, metric="accuracy")
    assert cfg.train.rollouts.async_rollouts is False
    plain = json.loads(json.dumps(cfg.to_dict()))  # what benchmarks and MLflow's params get
    assert config_from_dict(plain).train.levels == cfg.train.levels
    assert config_from_dict({**raw, "train": {"curriculum": None}}).train.levels.curriculum is None


# ---------------------------------------------------------------------------------------------------
# Levels in the data (prepare)


TARGET = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}
LADDER = [{"min_digits": 1, "max_digits": 1}, {"min_digits": 1, "max_digits": 2}, {}]
LEGS = {"name": "leg_counting", "config": {"min_animals": 1, "max_animals": 2, "max_instances": 3}}


def gym(**section):
    from grpo_core.data.reasoning_gym import ReasoningGymConfig

    return ReasoningGymConfig(**{"train_size": 20, "eval_size": 6, **section})


def term_digits(question: str) -> list[int]:
    """The digit count of each term of a chain_sum question ('...problem: 98 + 7 =')."""
    expression = re.search(r"problem: (.*) =$", question).group(1)
    return [len(term) for term in re.findall(r"\d+", expression)]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@needs_reasoning_gym
def test_each_level_draws_its_own_config_and_eval_the_target(tmp_path):
    """chain_sum at 2 two-digit terms (the target), levels 1-digit / 1-2 digits / the target, beside
    leg_counting without levels: train holds chain_sum's share (10 of 20) at each level and legs' 10 at level
    0; eval is all at the target; no train prompt is held out; a re-run writes the same bytes; validate
    passes the level column."""
    import pandas as pd

    from grpo_core.data.reasoning_gym import prepare_reasoning_gym
    from grpo_core.data.validation import ValidationRules, normalise_prompt, validate_frames
    from grpo_core.rewards import build_reward_functions

    section = gym(tasks=[{"name": "chain_sum", "config": TARGET, "levels": LADDER}, LEGS])
    summary = prepare_reasoning_gym(section, tmp_path / "a", log=None)
    prepare_reasoning_gym(section, tmp_path / "b", log=None)
    for name in ("train.jsonl", "eval.jsonl", "summary.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    train, held_out = read_rows(tmp_path / "a/train.jsonl"), read_rows(tmp_path / "a/eval.jsonl")
    sums = [r for r in train if r["task"] == "chain_sum"]
    by_level = {lv: [term_digits(r["prompt"]) for r in sums if r["level"] == lv] for lv in range(3)}
    assert {lv: len(d) for lv, d in by_level.items()} == {0: 10, 1: 10, 2: 10}
    assert all(d == [1, 1] for d in by_level[0])
    assert all(set(d) <= {1, 2} for d in by_level[1]) and any(2 in d for d in by_level[1])
    assert all(d == [2, 2] for d in by_level[2])
    assert [r["level"] for r in train if r["task"] == "leg_counting"] == [0] * 10
    assert all(json.loads(r["task_config"]) == {**TARGET, **LADDER[r["level"]]} for r in sums)
    eval_sums = [r for r in held_out if r["task"] == "chain_sum"]
    assert len(eval_sums) == 3 and all(term_digits(r["prompt"]) == [2, 2] for r in eval_sums)
    assert all("level" not in r and json.loads(r["task_config"]) == TARGET for r in eval_sums)
    train_keys = {normalise_prompt(r["prompt"]) for r in train}
    assert len(train_keys) == 40 and not train_keys & {normalise_prompt(r["prompt"]) for r in held_out}
    stats = summary["tasks"]["train"]["chain_sum"]
    assert (stats["asked"], stats["rows"]) == (30, 30) and [s["config"] for s in stats["levels"]] == [
        {**TARGET, **overlay} for overlay in LADDER]
    assert [(s["level"], s["asked"], s["rows"]) for s in stats["levels"]] == [(0, 10, 10), (1, 10, 10),
                                                                              (2, 10, 10)]
    assert stats["drawn"] == sum(s["drawn"] for s in stats["levels"])
    assert "levels" not in summary["tasks"]["eval"]["chain_sum"]
    fn = build_reward_functions([{"name": "rg", "function": "reasoning_gym"}])[0]
    report = validate_frames(pd.DataFrame(train), pd.DataFrame(held_out), ValidationRules(
        require_answer=True, reward_fns_for_gold=[fn], parse_gold=lambda raw: raw, reward_fns_for_smoke=[fn]))
    assert report.ok, report.to_text()


@needs_reasoning_gym
def test_each_level_is_its_own_stream_skipping_held_out_and_earlier_levels_prompts(tmp_path):
    """chain_sum at two one-digit terms (200 distinct prompts) is the target and level 0; level 1 allows a
    second digit, so some of its prompts are one-digit ones already taken. Each level's rows are what its own
    stream (generator seed stream_seed("train", seed, "0:<level>")) gives in order, once held-out prompts and
    prompts of the split so far are skipped - walked here with reasoning-gym itself."""
    import reasoning_gym as rg

    from grpo_core.common.text import text_key
    from grpo_core.data.reasoning_gym import prepare_reasoning_gym, stream_seed

    small = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    configs = [small, {**small, "max_digits": 2}]
    section = gym(tasks=[{"name": "chain_sum", "config": small, "levels": [{}, {"max_digits": 2}]}],
                  train_size=60, eval_size=60)
    stats = prepare_reasoning_gym(section, tmp_path, log=None)["tasks"]["train"]["chain_sum"]["levels"]
    train = read_rows(tmp_path / "train.jsonl")
    held_out = {text_key(r["prompt"]) for r in read_rows(tmp_path / "eval.jsonl")}
    seen: set[str] = set()
    for level, config in enumerate(configs):
        stream = rg.create_dataset("chain_sum", size=stats[level]["drawn"],
                                   seed=stream_seed("train", 0, f"0:{level}"), **config)
        kept, skipped = [], {"held_out": 0, "duplicates": 0}
        for entry in stream:
            key = text_key(entry["question"])
            if key in held_out or key in seen:
                skipped["held_out" if key in held_out else "duplicates"] += 1
            else:
                seen.add(key)
                kept.append(entry["question"])
        assert sorted(kept) == sorted(r["prompt"] for r in train if r["level"] == level) and len(kept) == 60
        assert skipped == {k: stats[level][k] for k in skipped} and stats[level]["held_out"] > 0
    assert stats[1]["duplicates"] > 0  # one-digit prompts level 0 already took


@needs_reasoning_gym
def test_tasks_without_levels_write_what_they_wrote_before(tmp_path):
    """The sha256 of each file as the prepare before levels wrote it for this section (reasoning-gym 0.1.25):
    no level column, the same streams."""
    from grpo_core.data.reasoning_gym import prepare_reasoning_gym

    small = {"name": "chain_sum",
             "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    prepare_reasoning_gym(gym(tasks=[small, {**LEGS, "weight": 2}], train_size=30, eval_size=9), tmp_path,
                          log=None)
    import hashlib

    assert {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()
            for n in ("train.jsonl", "eval.jsonl", "summary.json")} == {
        "train.jsonl": "e4fef0b69b88df0f9f621142d6c6ba7cbcbd199790a29940f774728eaca407cc",
        "eval.jsonl": "4d01f78f4a5b8b32c68c4749e58667e59aad844ed291f8e41dd26c2400fbae94",
        "summary.json": "29248ba5ff7b8f794411f568ada7d55c8d2d6347992d2bcdb91ab98c46154be5"}


@needs_reasoning_gym
def test_curriculum_levels_are_reasoning_gyms_own_configs(tmp_path):
    """chain_sum's curriculum (ChainSumCurriculum): num_terms over 2..12, num_digits over 1..10, each range
    from its first value to the level's - so levels 0, 1, 2 are terms 2-2, 2-3, 2-4 and digits 1-1, 1-2, 1-3.
    allow_negation, which it does not set, passes through from config; max_terms, which it does, is its."""
    from grpo_core.data.reasoning_gym import prepare_reasoning_gym

    config = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "allow_negation": True}
    summary = prepare_reasoning_gym(gym(tasks=[{"name": "chain_sum", "config": config,
                                                "curriculum_levels": 3}]), tmp_path, log=None)
    expected = [{"min_terms": 2, "max_terms": 2 + lv, "min_digits": 1, "max_digits": 1 + lv,
                 "allow_negation": True} for lv in range(3)]
    assert [s["config"] for s in summary["tasks"]["train"]["chain_sum"]["levels"]] == expected
    for row in read_rows(tmp_path / "train.jsonl"):
        assert json.loads(row["task_config"]) == expected[row["level"]]
        digits = term_digits(row["prompt"].replace("-", "+"))
        assert 2 <= len(digits) <= 2 + row["level"] and max(digits) <= 1 + row["level"]


@needs_reasoning_gym
@pytest.mark.parametrize("task,match", [
    ({"name": "chain_sum", "levels": [{}], "curriculum_levels": 2},
     r"tasks\[0\]\.curriculum_levels: 2, set together with levels"),
    ({"name": "chain_sum", "levels": [{"min_digits": 1}, {"min_digit": 2}]},
     r"reasoning_gym\.tasks\[0\]\.levels\[1\]\.min_digit: chain_sum's generator takes no such key; did you "
     r"mean 'min_digits'"),
    ({"name": "chain_sum", "levels": [{"seed": 1}]}, r"tasks\[0\]\.levels\[0\]\.seed: set for every task by"),
    ({"name": "chain_sum", "levels": [{"min_terms": 0}]},
     r"reasoning_gym\.tasks\[0\]\.levels\[0\]: chain_sum refuses \{'min_terms': 0\}"),
    ({"name": "chain_sum", "levels": [{"max_digits": 2}, {"max_digits": 2}]},
     r"tasks\[0\]\.levels\[1\]: the same generator config as level 0"),
    ({"name": "gsm_symbolic", "curriculum_levels": 2},
     r"tasks\[0\]\.curriculum_levels: reasoning-gym has no curriculum for gsm_symbolic"),
    ({"name": "chain_sum", "levels": [3]}, r"tasks\[0\]\.levels\[0\]: expected a mapping"),
])
def test_bad_levels_name_the_key(tmp_path, task, match):
    from grpo_core.data.reasoning_gym import prepare_reasoning_gym

    with pytest.raises(ConfigError, match=match):
        prepare_reasoning_gym(gym(tasks=[task]), tmp_path, log=None)
    assert not (tmp_path / "train.jsonl").exists()


@needs_reasoning_gym
def test_levels_through_the_stages_to_a_climbing_train_run(tmp_path, monkeypatch, caplog):
    """The tiny reasoning-gym pipeline (prepare -> convert -> validate -> calibrate -> train) with chain_sum
    at two levels and train.curriculum (window 1, threshold 0.1): validate keeps the level column, and the
    train stage samples level 0 until a step's accuracy reaches 0.1, then level 1 - in the step log, MLflow
    and the checkpoint. The judge is a correctness reward that calls any number right (the tiny model is
    never right on chain_sum), put first so that it is the one evaluate judges by."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from flows.stages.__main__ import main
    from tests.test_reasoning_gym import tiny_params
    from tests.tiny import in_stage_repo

    make_tiny_model(tmp_path / "models" / "tiny")
    raw = tiny_params([{"name": "chain_sum", "config": TARGET, "levels": [LADDER[0], {}]}])
    raw["rewards"].insert(0, {**ANY_NUMBER[0], "target_share": 1.0})
    raw["train"].update(max_steps=6, save_steps=6, curriculum={"threshold": 0.1, "window": 1})
    repo = in_stage_repo(tmp_path, raw, monkeypatch, "test-curriculum")
    for stage in ("prepare", "convert", "validate", "calibrate", "train"):
        assert main([stage]) == 0, stage
    assert pd.read_parquet(repo / "data/validated/train.parquet")["level"].tolist().count(1) == 32
    log = read_log(repo / "metrics/train_log.csv")
    levels = [int(float(r["curriculum/chain_sum/level"])) for r in log]
    accuracy = [float(r["curriculum/chain_sum/accuracy"]) for r in log]
    assert accuracy == [float(r["rewards/acc/mean"]) for r in log]  # window 1: each step's own round
    assert levels == [0] + [lv + (a >= 0.1 and lv == 0) for lv, a in zip(levels, accuracy)][:-1]
    assert 1 in levels
    step = levels.index(1)  # the step whose round decided the promotion
    assert f"curriculum: chain_sum level 0 -> 1 at step {step}: rolling accuracy" in caplog.text
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("grpo-pipeline").experiment_id],
                                filter_string="tags.stage = 'train'")
    logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                         "curriculum/chain_sum/level"))
    assert logged == [(i + 1, float(lv)) for i, lv in enumerate(levels)]
    state = json.loads((repo / "artifacts/checkpoints/checkpoint-6/trainer_state.json").read_text())
    assert state["sampler"]["levels"] == {"chain_sum": levels[-1] if accuracy[-1] < 0.1 else 1}


# ---------------------------------------------------------------------------------------------------
# A short real run, and its resume


def level_rows(path: Path) -> Path:
    """sums at three levels, 8 prompts each, numeric golds."""
    with open(path, "w") as fh:
        for level in range(3):
            for i in range(8):
                row = {"prompt": f"Q{level}{i}: what is {level} + {i}?", "answer": str(level + i),
                       "task": "sums", "level": level}
                fh.write(json.dumps(row) + "\n")
    return path


# the correctness judge calls any number right: a random model's replies then hold some right and some not
ANY_NUMBER = [{"name": "acc", "function": "correctness", "kwargs": {"answer_tag": None, "rel_tol": 1e9}},
              {"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]
KNOBS = {"per_device_train_batch_size": 8, "steps_per_generation": 2, "save_steps": 5,
         "curriculum": {"threshold": 0.125, "window": 2}}


@pytest.fixture(scope="module")
def level_assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("curriculum")
    return make_tiny_model(d / "model"), level_rows(d / "train.jsonl")


def test_a_real_run_climbs_by_the_rule_and_resumes_at_the_same_levels(level_assets, tmp_path, monkeypatch,
                                                                       caplog):
    """8 steps, a round (4 prompts x 4) every 2 steps: each round samples only rows of the logged level; the
    logged rolling accuracy is the mean of the last (up to 2) rounds' accuracy at that level (the acc reward's
    mean, a 0/1 score) and the level moves up after a round exactly when 2 rounds reach 0.125, never past 2.
    A run stopped at checkpoint-5 (inside a round, its task's window holding a round) and resumed logs the
    same rows and ends at the same levels."""
    import grpo_core.train.loop as loop_mod
    from grpo_core.train.loop import train

    model_dir, data = level_assets
    sampled_levels = []
    real = loop_mod.sample_round

    def record(**kwargs):
        sampled_levels.append({row["level"] for row in kwargs["rows"]})
        return real(**kwargs)

    monkeypatch.setattr(loop_mod, "sample_round", record)
    whole = train(tiny_config(model_dir, data, ANY_NUMBER, max_steps=8, **KNOBS), root=tmp_path / "whole",
                  progress=False)
    log = read_log(tmp_path / "whole/metrics/train_log.csv")
    rounds = log[::2]  # the rows of a round's first step; its second logs the same round's metrics
    levels = [int(float(r["curriculum/sums/level"])) for r in rounds]
    assert [{lv} for lv in levels] == sampled_levels
    window, expected_levels = [], [0]
    for r in rounds:
        window = (window + [float(r["rewards/acc/mean"])])[-2:]
        assert float(r["curriculum/sums/accuracy"]) == pytest.approx(sum(window) / len(window), abs=1e-6)
        promote = len(window) == 2 and sum(window) / 2 >= 0.125 and expected_levels[-1] < 2
        expected_levels.append(expected_levels[-1] + promote)
        window = [] if promote else window
    assert levels == expected_levels[:-1] and max(levels) > 0  # the run did climb
    assert "curriculum: sums level 0 -> 1 at step" in caplog.text
    saved = json.loads((whole.checkpoint_dir / "checkpoint-8/trainer_state.json").read_text())
    assert saved["sampler"]["levels"] == {"sums": expected_levels[-1]}

    monkeypatch.setattr(loop_mod, "sample_round", real)
    train(tiny_config(model_dir, data, ANY_NUMBER, max_steps=5, **KNOBS), root=tmp_path / "split",
          progress=False)
    split = train(tiny_config(model_dir, data, ANY_NUMBER, max_steps=8, **KNOBS), root=tmp_path / "split",
                  progress=False)
    assert split.resumed_from.name == "checkpoint-5"
    drop = {"step_time", "generation_time"}

    def timeless(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in drop} for r in rows]

    assert timeless(read_log(tmp_path / "split/metrics/train_log.csv")) == timeless(log)
    resumed = json.loads((split.checkpoint_dir / "checkpoint-8/trainer_state.json").read_text())
    assert resumed["sampler"] == saved["sampler"]


def test_under_dynamic_sampling_the_accuracy_counts_every_sampled_completion(level_assets, tmp_path,
                                                                               monkeypatch):
    """Dynamic sampling drops groups whose rewards tie (with the acc reward alone: all wrong, or all right)
    and samples again; the rolling accuracy is over everything sampled for the round, as the policy did, not
    over the groups kept."""
    import grpo_core.train.loop as loop_mod
    from grpo_core.train.loop import train

    model_dir, data = level_assets
    samplings: list[list[torch.Tensor]] = [[]]
    real_sample, real_close = loop_mod.sample_round, loop_mod.close_round

    def sample(**kwargs):
        sampled = real_sample(**kwargs)
        samplings[-1].append(sampled.rewards[:, 0])
        return sampled

    def close(*args):
        samplings.append([])
        return real_close(*args)

    monkeypatch.setattr(loop_mod, "sample_round", sample)
    monkeypatch.setattr(loop_mod, "close_round", close)
    knobs = {**KNOBS, "steps_per_generation": None, "dynamic_sampling": True, "save_steps": 100,
             "curriculum": {"threshold": 0.5, "window": 2}}
    train(tiny_config(model_dir, data, ANY_NUMBER[:1], max_steps=4, **knobs), root=tmp_path, progress=False)
    rounds = samplings[:-1]
    assert len(rounds) == 4 and max(len(r) for r in rounds) > 1  # some round sampled again
    right = [int((torch.cat(r) == 1.0).sum()) for r in rounds]
    completions = [sum(len(s) for s in r) for r in rounds]
    logged = [float(r["curriculum/sums/accuracy"]) for r in read_log(tmp_path / "metrics/train_log.csv")]
    assert max(logged) < 0.5  # no promotion: the window is always the step's round and the one before
    assert logged == pytest.approx([right[0] / completions[0], *(
        (right[i - 1] + right[i]) / (completions[i - 1] + completions[i]) for i in range(1, 4))], abs=1e-6)
