"""reasoning-gym as a data source and its scorers as the reward: the bad inputs named, the scorer's partial
credit as reasoning-gym itself gives it, the prepared files the same bytes on a re-run with no prompt twice
and none shared by the splits, and a tiny two-task pipeline through every stage."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from grpo_core.common.options import ConfigError
from grpo_core.common.text import text_key

try:
    import reasoning_gym as rg
except ImportError as exc:  # the reasoning-gym extra, which `make setup` installs: CI must run these
    if os.environ.get("CI"):
        raise ImportError(f"CI must test reasoning-gym, and it is not installed ({exc}): make setup "
                          "installs it") from exc
    pytest.skip(f"reasoning-gym is not installed: {exc}", allow_module_level=True)

from grpo_core.config import config_from_dict  # noqa: E402
from grpo_core.data.reasoning_gym import (  # noqa: E402
    ReasoningGymConfig,
    decode_value,
    encode_value,
    prepare_reasoning_gym,
    task_row,
)
from grpo_core.data.validation import ValidationRules, normalise_prompt, validate_frames  # noqa: E402
from grpo_core.rewards import build_reward_functions  # noqa: E402
from grpo_core.rewards.reasoning_gym import extract_answer  # noqa: E402

# chain_sum with 2 one-digit terms: 10 x 10 x (+, -) = 200 distinct prompts
SMALL_SUMS = {"name": "chain_sum",
              "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
FEW_LEGS = {"name": "leg_counting", "config": {"min_animals": 1, "max_animals": 2, "max_instances": 3}}


def gym(**section) -> ReasoningGymConfig:
    return ReasoningGymConfig(**{"tasks": [SMALL_SUMS], "train_size": 40, "eval_size": 10, **section})


def reward(**kwargs):
    return build_reward_functions([{"name": "rg", "function": "reasoning_gym", "kwargs": kwargs}])[0]


def score(fn, completions: list[str], rows: list[dict]) -> list:
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    return fn([r["prompt"] for r in rows], completions, **columns)


def tiny_params(tasks: list[dict]) -> dict:
    """params.yaml with reasoning-gym ``tasks`` as the data (32 train / 8 held-out prompts) and the tiny model
    (models/tiny), scored by the reasoning_gym reward on the last number, 2 training steps."""
    from tests.test_stages import REPO
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw.update(embedded=None, reasoning_gym={"tasks": tasks, "train_size": 32, "eval_size": 8})
    raw["model"]["name_or_path"] = "models/tiny"
    raw["data"]["max_prompt_length"] = 128
    raw["rewards"] = [{"name": "rg", "function": "reasoning_gym", "kwargs": {"extract": ["last_number"]},
                       "target_share": 1.0}]
    raw["guards"]["reward_hacking"] = {"format_reward": None, "correctness_reward": None}
    raw["calibrate"].update(num_prompts=4, num_generations=4)
    raw["generation"]["max_completion_length"] = 8
    raw["train"].update(num_generations=4, per_device_train_batch_size=8, max_steps=2, save_steps=2,
                        async_rollouts=False)
    raw["evaluate"].update(max_samples=8, num_generations=2, pass_k=[1, 2], batch_size=16)
    return raw


def test_partial_credit_is_reasoning_gyms_own():
    """chain_sum's scorer, seed 1, entry 0 (4 - 1 - 7 = -4): "-4" is 1.0, "The answer is -4" 0.125 (the gold's
    share of the text). The reward gives what the task gives the extracted text, partial credit kept."""
    dataset = rg.create_dataset("chain_sum", size=1, seed=1)
    entry = dataset[0]
    assert entry["answer"] == "-4"
    assert dataset.score_answer("-4", entry) == 1.0
    assert dataset.score_answer("The answer is -4", entry) == 0.125
    row = task_row(rg_task("chain_sum"), entry, "t")
    whole, default = reward(extract=["whole"]), reward()
    assert score(whole, ["The answer is -4", "-4"], [row, row]) == [0.125, 1.0]
    texts = ["The answer is -4.", "so <answer>-4</answer>", "\\boxed{-4}", "-4", "<answer>-3</answer>"]
    # a bare "-4" is no answer under the default ways
    assert score(default, texts, [row] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert score(default, ["The answer is -4"], [{**row, "task": None}]) == [None]  # not a reasoning-gym row


def rg_task(name: str, **config):
    from grpo_core.data.reasoning_gym import ReasoningGymTask

    return ReasoningGymTask(name=name, config=config)


@pytest.mark.parametrize("text,ways,expected", [
    ("<answer> 12 </answer>", ["answer_tag"], "12"),
    ("The final answer is: **12**.", ["answer_is"], "12"),
    ("the answer is 3.5.\nDone", ["answer_is"], "3.5"),
    ("so \\boxed{x+1} and \\boxed{7}", ["boxed"], "7"),
    ("first 3 then -41 apples", ["last_number"], "-41"),
    ("no anchor here", ["answer_tag", "boxed", "answer_is"], None),
    ("The answer is 5 <answer>6</answer>", ["answer_tag", "answer_is"], "6"),  # the first way that finds one
])
def test_extraction(text, ways, expected):
    assert extract_answer(text, ways) == expected


@pytest.mark.parametrize("question", ["What is 2 + 2?", "  Two\n\nlines\t and  TABS ", "\u00c9t\u00c9 \u00df",
                                      "a\u00a0b\u2003c"])
def test_the_dedupe_key_is_validates(question):
    assert text_key(question) == normalise_prompt(question)


def test_metadata_keeps_tuples_and_keys_json_drops():
    value = {"grid": ((1, 2), (3, 4)), "by_id": {1: "a", (2, 3): "b"}, "plain": [1, "x", None, 2.5]}
    text = json.dumps(encode_value(value))
    assert decode_value(json.loads(text)) == value
    assert isinstance(decode_value(json.loads(text))["grid"][0], tuple)
    with pytest.raises(TypeError, match="set"):
        encode_value({"s": {1, 2}})


@pytest.mark.parametrize("section,match", [
    ({"tasks": [{"name": "chain_summ"}]},
     r"tasks\[0\]\.name: reasoning-gym has no task 'chain_summ'; did you mean 'chain_sum'"),
    ({"tasks": [{"name": "chain_sum", "config": {"min_term": 2}}]},
     r"tasks\[0\]\.config\.min_term: chain_sum's generator takes no such key; did you mean 'min_terms'"),
    ({"tasks": [{"name": "chain_sum", "config": {"seed": 3}}]}, r"config\.seed: set for every task by"),
    ({"tasks": [{"name": "chain_sum", "config": {"min_terms": 0}}]},
     r"tasks\[0\]\.config: chain_sum refuses \{'min_terms': 0\}: min_terms must be positive"),
    ({"tasks": [{"name": "composite"}]}, r"'composite' mixes tasks itself"),
    ({"tasks": [{"name": "rubiks_cube"}]},
     r"tasks\[0\]\.name: rubiks_cube's entries have no reference answer"),
    ({"eval_size": 200, "train_size": 10}, r"reasoning_gym: the train split is empty: chain_sum gave 0 of 10 "
                                           r"\(100 drawn: 0 repeats, 100 held-out prompts\)"),
])
def test_bad_tasks_name_the_key_and_the_reason(tmp_path, section, match):
    with pytest.raises(ConfigError, match=match):
        prepare_reasoning_gym(gym(**section), tmp_path, log=None)
    assert not (tmp_path / "train.jsonl").exists()


@pytest.mark.parametrize("raw,match", [
    ({"reasoning_gym": {"tasks": []}}, r"reasoning_gym\.tasks: empty"),
    ({"reasoning_gym": {"tasks": [SMALL_SUMS], "eval_seed": 0}},
     r"reasoning_gym\.eval_seed: 0, the same as seed"),
    ({"reasoning_gym": {"tasks": [{"name": "chain_sum", "weight": 0}]}},
     r"reasoning_gym\.tasks\[0\]\.weight: 0.0 is out of range; allowed: > 0"),
    ({"reasoning_gym": {"tasks": [{"nme": "chain_sum"}]}},
     r"reasoning_gym\.tasks\[0\]\.nme: unknown key; did you mean 'name'"),
    ({"reasoning_gym": {"tasks": [SMALL_SUMS]}, "embedded": {}},
     r"reasoning_gym: set together with embedded"),
    ({"rewards": [{"name": "rg", "function": "reasoning_gym", "kwargs": {"extract": ["tags"]}}]},
     r"extract: \['tags'\]; choose from answer_tag, boxed, answer_is"),
])
def test_bad_params_name_the_key(raw, match):
    from grpo_core.rewards import RewardConfigError

    base = {"data": {"train_files": "data/prepared/train.jsonl"},
            "rewards": [{"name": "rg", "function": "reasoning_gym"}]}
    with pytest.raises((ConfigError, RewardConfigError), match=match):
        cfg = config_from_dict({**base, **raw})
        build_reward_functions(cfg.rewards)


def test_prepared_splits_are_the_same_bytes_disjoint_and_pass_validation(tmp_path):
    """Two tasks mixed 1:2; held-out drawn first under its own seed, train skipping every held-out prompt and
    every repeat; the small task runs out of distinct prompts and the summary says how far it got."""
    section = gym(tasks=[SMALL_SUMS, {**FEW_LEGS, "weight": 2}], train_size=600, eval_size=60)
    first = prepare_reasoning_gym(section, tmp_path / "a", log=None)
    prepare_reasoning_gym(section, tmp_path / "b", log=None)
    for name in ("train.jsonl", "eval.jsonl", "summary.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    splits = {s: [json.loads(line) for line in (tmp_path / "a" / f"{s}.jsonl").read_text().splitlines()]
              for s in ("train", "eval")}
    keys = {s: [normalise_prompt(r["prompt"]) for r in rows] for s, rows in splits.items()}
    assert all(len(set(k)) == len(k) for k in keys.values()) and not set(keys["train"]) & set(keys["eval"])
    sums = first["tasks"]["train"]["chain_sum"]
    assert sums["asked"] == 200 and sums["ran_out"] and sums["rows"] == 200 - 20  # all but eval's 20
    assert sums["held_out"] > 0 and sums["drawn"] == sums["rows"] + sums["duplicates"] + sums["held_out"]
    legs = first["tasks"]["train"]["leg_counting"]
    assert legs == {**legs, "asked": 400, "rows": 400, "ran_out": False}
    assert first["num_eval"] == 60 and [r["task"] for r in splits["eval"]].count("chain_sum") == 20
    assert [r["task"] for r in splits["eval"][:10]] != ["chain_sum"] * 10  # shuffled: the first N mix

    import pandas as pd

    fn = reward()
    report = validate_frames(pd.DataFrame(splits["train"]), pd.DataFrame(splits["eval"]), ValidationRules(
        require_answer=True, reward_fns_for_gold=[fn], parse_gold=lambda raw: raw, reward_fns_for_smoke=[fn]))
    assert report.ok, report.to_text()
    # the overlap check would see a held-out prompt in train
    leaked = pd.DataFrame(splits["train"] + splits["eval"][:1])
    assert not validate_frames(leaked, pd.DataFrame(splits["eval"]), ValidationRules(require_answer=False)).ok


def test_gold_check_names_a_task_the_extraction_cannot_read():
    """Extracting "The answer is N" reads one line: a multi-line gold cannot be stated that way, and
    validate's gold check (the same reward) says so, row by row."""
    import pandas as pd

    entry = {"question": "q", "answer": "1 2\n3 4", "metadata": {}}
    row = task_row(rg_task("chain_sum"), entry, "t")
    frame = pd.DataFrame([{**row, "prompt": "a"}, {**row, "prompt": "b", "answer": "12"}])
    rules = ValidationRules(require_answer=True, reward_fns_for_gold=[reward(extract=["answer_is"])],
                            parse_gold=lambda raw: raw)
    report = validate_frames(frame, None, rules)
    assert [f["check"] for f in report.failures] == ["gold_reward:rg"] and report.failures[0]["row"] == 0


@pytest.mark.slow
def test_two_tasks_through_every_stage(tmp_path, monkeypatch):
    """prepare (reasoning-gym, two tasks) -> convert -> validate -> calibrate -> train (2 steps) -> evaluate
    on the tiny model, in-process: eval.json has the accuracy and mean score per task."""
    from flows.stages.__main__ import main
    from tests.tiny import in_stage_repo, make_tiny_model

    make_tiny_model(tmp_path / "models" / "tiny")
    raw = tiny_params([SMALL_SUMS, FEW_LEGS])
    raw["tracking"]["promotion_metric"] = "mean_score"  # the task's own score may gate promotion
    repo = in_stage_repo(tmp_path, raw, monkeypatch, "test-reasoning-gym")
    for stage in ("prepare", "convert", "validate", "calibrate", "train", "evaluate"):
        assert main([stage]) == 0, stage
    summary = json.loads((repo / "data/prepared/summary.json").read_text())
    assert summary["num_train"] == 32 and set(summary["tasks"]["eval"]) == {"chain_sum", "leg_counting"}
    metrics = json.loads((repo / "metrics/eval.json").read_text())
    for side in ("base", "trained"):
        m = metrics[side]
        assert sum(m[f"tasks/{t}/num_prompts"] for t in ("chain_sum", "leg_counting")) == 8
        assert 0.0 <= m["tasks/chain_sum/accuracy"] <= m["tasks/chain_sum/mean_score"] <= 1.0
        assert m["mean_score"] == pytest.approx(m["rewards/rg/mean"])
        # extract last_number: a tiny model's reply answers when it holds a number
        assert m["tasks/chain_sum/format_compliance"] in [i / 8 for i in range(9)]
        assert ("tasks/chain_sum/accuracy_well_formed" in m and "accuracy_well_formed" in m)
    assert "tasks/chain_sum/accuracy" in metrics["delta"]
    assert "tasks/chain_sum/num_prompts" not in metrics["delta"]
    assert json.loads((repo / "reports/registry.json").read_text())["metric"] == "mean_score"


def test_the_format_judge_beside_the_scorer_is_an_answer_it_can_read():
    from grpo_core.rewards.base import RewardSpec
    from grpo_core.rewards.judges import build_judges
    spec = RewardSpec(name="rg", function="reasoning_gym", kwargs={"extract": ["answer_is"]})
    judges = build_judges([spec])
    got = judges.format_fn(["q"] * 3, ["The answer is 3.", "3", "the answer is: **-7**"])
    assert got == [1.0, 0.0, 1.0]
    with_format = build_judges([RewardSpec(name="rg", function="reasoning_gym"),
                                RewardSpec(name="f", function="soft_format")])
    assert with_format.format_fn.__name__ != "reasoning_gym_answered"  # a configured format reward judges


def test_accuracy_among_well_formed_replies_per_task():
    import pandas as pd

    from grpo_core.evaluation import task_metrics
    # prompts 0-3 chain_sum: right+answered, wrong+answered, wrong+unanswered x2; 4-5 legs: right, wrong,
    # both answered; a sampled row must not count
    frame = pd.DataFrame({"prompt_index": [0, 1, 2, 3, 4, 5, 0],
                          "mode": ["greedy"] * 6 + ["sampled"],
                          "correct": [True, False, False, False, True, False, False],
                          "format_ok": [True, True, False, False, True, True, False],
                          "reward/rg": [1.0, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0]})
    task_of = {0: "chain_sum", 1: "chain_sum", 2: "chain_sum", 3: "chain_sum", 4: "legs", 5: "legs"}
    m = task_metrics(frame, task_of, "reward/rg")
    assert m["tasks/chain_sum/accuracy"] == 0.25 and m["tasks/chain_sum/format_compliance"] == 0.5
    assert m["tasks/chain_sum/accuracy_well_formed"] == 0.5 and m["tasks/legs/accuracy_well_formed"] == 0.5
    assert m["accuracy_well_formed"] == 0.5 and m["mean_score"] == pytest.approx(2.5 / 6)
    none_formed = frame.assign(format_ok=False)
    assert task_metrics(none_formed, task_of, "reward/rg")["accuracy_well_formed"] is None


def _flat(d: dict, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "reasoning_gym":  # the section is one change
            out.update(_flat(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def test_the_recipe_is_the_word_problems_recipe_on_chain_sum_and_its_splits_hold(tmp_path):
    """configs/smollm2-135m-reasoning-gym.yaml changes of the word-problems recipe only what its header says
    why; its prepare as shipped gives every prompt asked for, none twice, none in both splits."""
    from tests.test_stages import REPO
    recipe = yaml.safe_load((REPO / "configs/smollm2-135m-reasoning-gym.yaml").read_text())
    word = _flat(yaml.safe_load((REPO / "configs/smollm2-135m-word-problems.yaml").read_text()))
    changed = {k for k, v in _flat(recipe).items() if word.get(k, "absent") != v}
    assert changed == {
        ("reasoning_gym",), ("rewards",), ("generation", "max_completion_length"),
        *((("data", k)) for k in ("train_files", "eval_files", "train_dir", "eval_dir")),
        *((("train", k)) for k in ("num_generations", "per_device_train_batch_size", "max_steps",
                                    "save_steps")),
        ("tracking", "experiment_name"), ("tracking", "registered_model_name")}
    assert recipe["rewards"][0]["function"] == "reasoning_gym"
    summary = prepare_reasoning_gym(config_from_dict(recipe).reasoning_gym, tmp_path, log=None)
    assert (summary["num_train"], summary["num_eval"]) == (2000, 400)
    rows = {s: [json.loads(x) for x in (tmp_path / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "eval")}
    keys = {s: [text_key(r["prompt"]) for r in rs] for s, rs in rows.items()}
    assert all(len(set(k)) == len(k) for k in keys.values()) and not set(keys["train"]) & set(keys["eval"])
