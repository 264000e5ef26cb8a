"""Prompt loading from local files (through datasets.load_dataset) and prompt encoding."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from grpo_core.config import DataConfig
from grpo_core.data import DataError, PromptEncoder, completion_for_reward, load_split
from grpo_core.embedded.tasks import vocabulary_words
from grpo_core.embedded.tokenizer import build_tokenizer

ROWS = [{"question": "Mia has 3 apples", "answer": "3", "level": 1},
        {"question": "Tom has 5 pens", "answer": "5", "level": 2}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(vocabulary_words())


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_local_files_load_with_renamed_columns_and_extras(tmp_path, fmt):
    path = tmp_path / f"train.{fmt}"
    df = pd.DataFrame(ROWS)
    if fmt == "jsonl":
        df.to_json(path, orient="records", lines=True)
    elif fmt == "parquet":
        df.to_parquet(path)
    else:
        df.to_csv(path, index=False)
    cfg = DataConfig(train_files=[path.name], prompt_column="question")
    ds = load_split(cfg, "train", root=tmp_path)  # relative paths resolve against the root
    assert ds["prompt"] == ["Mia has 3 apples", "Tom has 5 pens"]
    assert [str(a) for a in ds["answer"]] == ["3", "5"]
    assert ds["level"] == [1, 2]  # extra columns survive: rewards get them as keyword arguments


def test_bad_sources_are_named(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        load_split(DataConfig(train_files=["missing.jsonl"]), "train", root=tmp_path)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        load_split(DataConfig(train_files=["x.txt"]), "train", root=tmp_path)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(DataError, match="no 'prompt' column .*columns are \\['text'\\]"):
        load_split(DataConfig(train_files=["a.jsonl"]), "train", root=tmp_path)
    (tmp_path / "empty.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match="the train split is empty"):
        load_split(DataConfig(train_files=["empty.csv"]), "train", root=tmp_path)
    with pytest.raises(DataError, match="data.eval_files: no files configured"):
        load_split(DataConfig(train_files=["a.jsonl"]), "eval", root=tmp_path)


def test_chat_prompts_use_the_template_and_the_system_prompt(tokenizer):
    enc = PromptEncoder(tokenizer, max_prompt_length=None, system_prompt="Be brief. ")
    messages = [{"role": "user", "content": "Mia has 3 apples"}]
    # the embedded tokenizer's template concatenates message contents
    assert enc.render(messages) == "Be brief. Mia has 3 apples"
    assert completion_for_reward("x", messages) == [{"role": "assistant", "content": "x"}]
    assert completion_for_reward("x", "plain") == "x"


def test_overlong_prompts_are_left_truncated_and_counted_or_rejected(tokenizer):
    text = "Mia has 3 apples and 4 pens"
    full = tokenizer(text)["input_ids"]
    enc = PromptEncoder(tokenizer, max_prompt_length=4)
    assert enc.encode(text) == full[-4:]  # the end of the prompt (the question) is kept
    enc.encode(text)
    assert enc.truncated_count == 2
    strict = PromptEncoder(tokenizer, max_prompt_length=4, overlong="error")
    with pytest.raises(DataError, match=f"row 7 has {len(full)} tokens, over data.max_prompt_length=4"):
        strict.encode(text, row=7)
