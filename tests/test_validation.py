"""Data validation: every failure collected, each naming split, row, column, check and value."""

from __future__ import annotations

import json
from fractions import Fraction
from types import SimpleNamespace

import pandas as pd
import pytest

from grpo_core.data.loading import DataFileError, read_table
from grpo_core.data.validation import (
    DataValidationError,
    ValidationRules,
    gold_completion_text,
    schema_failures,
    validate_frames,
)


def parse_gold_standin(answer):
    """Local stand-in for rewards.parse_gold: integers and single letters A-D."""
    text = str(answer).strip()
    if text in tuple("ABCD"):
        return SimpleNamespace(kind="choice", value=text)
    try:
        return SimpleNamespace(kind="number", value=Fraction(int(text)))
    except ValueError:
        return None


def exact_answer(prompts, completions, answer, **_):
    """Stand-in correctness: 1.0 when the <answer> section is the gold (or \\boxed{gold})."""
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else c[0]["content"]
        got = text.split("<answer>\n")[-1].split("\n</answer>")[0]
        out.append(1.0 if got in (str(a), f"\\boxed{{{a}}}") else 0.0)
    return out


def always_zero(prompts, completions, **_):
    return [0.0] * len(completions)


def crashes(prompts, completions, **_):
    raise RuntimeError("boom")


def frames():
    train = pd.DataFrame({
        "prompt": ["What is 2+3?", "Pick: A or B?", [{"role": "user", "content": "What is 4*4?"}]],
        "answer": ["5", "B", "16"],
        "task": ["arithmetic", "multiple_choice", "arithmetic"],
    })
    eval_ = pd.DataFrame({"prompt": ["What is 7-2?"], "answer": ["5"], "task": ["arithmetic"]})
    return train, eval_


def run(train, eval_, **kw):
    args = {"require_answer": True, "reward_fns_for_gold": [exact_answer], "count_tokens": None,
            "max_prompt_length": None, "overlong_policy": "truncate", "max_report_rows": 1000,
            "parse_gold": parse_gold_standin}
    args.update(kw)
    return validate_frames(train, eval_, ValidationRules(**args))


def checks(report):
    return {(f["split"], f["row"], f["column"], f["check"]) for f in report.failures}


def test_clean_data_passes():
    report = run(*frames())
    assert report.ok, report.to_text()
    assert report.summary["splits"]["train"]["rows"] == 3
    report.raise_for_failures()


def test_check_names_do_not_depend_on_which_schema_one_process_built_first():
    """The prompt checks are PromptSchema's and, inherited, PromptAnswerSchema's: each reports them under the
    same names, built in either order (pandera forgets a check's ``name=`` once one schema used it)."""
    df = pd.DataFrame({"prompt": ["  ", 42, [{"role": "wizard", "content": "hi"}]],
                       "answer": ["1", "2", "3"]})
    expected = {(0, "prompt_not_empty"), (1, "prompt_type"), (2, "chat_messages_well_formed")}
    for require_answer in (False, True, False, True):
        assert {(f["row"], f["check"]) for f in schema_failures(df, "train", require_answer)} == expected


def test_every_failure_is_collected():
    train = pd.DataFrame({
        "prompt": ["What is 2+3?", "   ", None, "what IS  2+3? ",
                   [{"role": "user", "content": ""}], [{"role": "wizard", "content": "hi"}], [], 42],
        "answer": ["5", "1", "2", "5", "3", "4", None, "forty-two"],
    })
    eval_ = pd.DataFrame({"prompt": ["WHAT is 2+3?", "Fine?"], "answer": ["5", "zzz"]})
    report = run(train, eval_)
    assert not report.ok
    got = checks(report)
    expected = {
        ("train", 1, "prompt", "prompt_not_empty"),
        ("train", 2, "prompt", "not_nullable"),
        ("train", 3, "prompt", "duplicate_prompt"),  # case and whitespace differ only
        ("train", 4, "prompt", "chat_messages_well_formed"),  # empty content
        ("train", 5, "prompt", "chat_messages_well_formed"),  # unknown role
        ("train", 6, "prompt", "prompt_not_empty"),  # no messages
        ("train", 6, "answer", "not_nullable"),
        ("train", 7, "prompt", "prompt_type"),
        ("train", 7, "answer", "gold_parseable"),
        ("eval", 0, "prompt", "train_eval_overlap"),
        ("eval", 1, "answer", "gold_parseable"),
    }
    assert expected <= got, sorted(got - expected)
    assert got <= expected, sorted(got - expected)
    dup = next(f for f in report.failures if f["check"] == "duplicate_prompt")
    assert "same prompt as row 0" in dup["value"]
    assert report.summary["splits"]["train"]["failures_by_check"]["chat_messages_well_formed"] == 2
    text = report.to_text()
    assert "FAILED" in text and "[eval] row=0 column=prompt check=train_eval_overlap" in text
    assert json.loads(report.to_json())["summary"]["total_failures"] == len(expected)
    with pytest.raises(DataValidationError, match="train_eval_overlap"):
        report.raise_for_failures()


def test_gold_reward_smoke_test_catches_broken_rewards():
    train, eval_ = frames()
    report = run(train, eval_, reward_fns_for_gold=[always_zero, crashes])
    zero = [f for f in report.failures if f["check"] == "gold_reward:always_zero"]
    assert [(f["split"], f["row"]) for f in zero] == [("train", 0), ("train", 1), ("train", 2), ("eval", 0)]
    assert "scored 0, expected 1.0 (answer: \\boxed{B})" in zero[1]["value"]  # multiple choice is boxed
    crash = [f for f in report.failures if f["check"] == "gold_reward:crashes"]
    assert len(crash) == 2 and "RuntimeError: boom" in crash[0]["value"]


def test_gold_reward_with_project_verifier():
    rewards = pytest.importorskip("grpo_core.rewards")
    train = pd.DataFrame({"prompt": ["a", "b", "c", "d"], "answer": ["#### 1,234", "0.5", "C", "-7"]})
    rules = ValidationRules(require_answer=True, reward_fns_for_gold=[rewards.correctness()],
                            count_tokens=None, max_prompt_length=None, overlong_policy="error",
                            max_report_rows=10)
    report = validate_frames(train, None, rules)
    assert report.ok, report.to_text()
    bad = pd.DataFrame({"prompt": ["a"], "answer": ["n/a"]})
    report = validate_frames(bad, None, rules)
    assert checks(report) == {("train", 0, "answer", "gold_parseable")}


def test_gold_completion_text():
    parsed = SimpleNamespace(kind="number", value=Fraction(1, 4))
    assert gold_completion_text("0.25", parsed).endswith("<answer>\n0.25\n</answer>")
    assert ("<answer>\n1/3\n</answer>"
            in gold_completion_text("1/3", SimpleNamespace(kind="number", value=Fraction(1, 3))))
    assert ("<answer>\n\\boxed{C}\n</answer>"
            in gold_completion_text("C", SimpleNamespace(kind="choice", value="C")))
    assert gold_completion_text("x", None).startswith("<reasoning>\n")


def test_prompt_length_policy_and_report_cap():
    train = pd.DataFrame({"prompt": ["short", "x" * 50, "y" * 60], "answer": ["1", "2", "3"]})
    kw = {"count_tokens": len, "max_prompt_length": 10, "reward_fns_for_gold": None}
    warn = run(train, None, overlong_policy="truncate", **kw)
    assert warn.ok and [w["row"] for w in warn.warnings] == [1, 2]
    assert warn.warnings[0]["value"].startswith("50 tokens > max_prompt_length=10")
    err = run(train, None, overlong_policy="error", max_report_rows=1, **kw)
    assert not err.ok and len(err.failures) == 1 and err.summary["total_failures"] == 2
    assert "first 1 of 2" in err.to_text()
    with pytest.raises(ValueError, match="overlong_policy"):
        run(train, None, overlong_policy="drop")


def test_chat_prompts_reach_the_token_counter_raw():
    seen = []
    train = pd.DataFrame({"prompt": [[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]]})
    report = validate_frames(train, None, ValidationRules(require_answer=False, reward_fns_for_gold=None,
                                                          count_tokens=lambda p: seen.append(p) or 1,
                                                          max_prompt_length=5, overlong_policy="error",
                                                          max_report_rows=10))
    assert report.ok and seen == [train["prompt"][0]]


def test_missing_columns_and_empty_split():
    report = run(pd.DataFrame({"question": ["q"]}), pd.DataFrame({"prompt": [], "answer": []}))
    got = checks(report)
    assert ("train", None, "prompt", "column_in_dataframe") in got
    assert ("train", None, "answer", "column_in_dataframe") in got
    assert ("eval", None, None, "split_not_empty") in got
    # no answer needed without a correctness reward
    assert run(pd.DataFrame({"prompt": ["q"]}), None, require_answer=False).ok


def test_long_values_are_truncated():
    long = "z" * 1000
    report = run(pd.DataFrame({"prompt": [long, long], "answer": ["1", "1"]}), None, reward_fns_for_gold=None)
    assert all(len(f["value"]) <= 200 for f in report.failures) and report.failures


def test_load_frame_formats_and_errors(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "What is 1+1?"}], "answer": "2"},
            {"prompt": "What is 2+2?", "answer": 4}]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    df = read_table(jl)
    assert df["prompt"][1] == "What is 2+2?" and df["answer"][1] == 4
    assert run(df, None, reward_fns_for_gold=None).ok

    pq = tmp_path / "d.parquet"
    pd.DataFrame({"prompt": [rows[0]["prompt"]], "answer": ["2"]}).to_parquet(pq)
    assert run(read_table(pq), None).ok  # chat lists come back as numpy arrays of dicts

    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\nWhat is 3+3?,6\n")
    assert read_table(csv)["answer"][0] == "6"

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(DataFileError, match=r"bad\.jsonl:2: invalid JSON"):
        read_table(bad)
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    with pytest.raises(DataFileError, match=r"broken\.parquet: cannot read as parquet"):
        read_table(broken)
    txt = tmp_path / "d.txt"
    txt.write_text("x")
    with pytest.raises(DataFileError, match="unsupported file type '.txt'"):
        read_table(txt)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_table(tmp_path / "nope.jsonl")
