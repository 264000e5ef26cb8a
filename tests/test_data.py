"""Prompt loading from local files (through datasets.load_dataset) and prompt encoding."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from grpo_core.data.loading import (
    DATA_FILES_FORMS,
    DataConfig,
    DataError,
    PromptEncoder,
    completion_for_reward,
    load_split,
    resolve_data_paths,
)
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


def write_shards(folder, rows, names):
    """``rows`` split in order over parquet files ``names`` in ``folder``; the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(rows) // len(names))
    for i, name in enumerate(names):
        pd.DataFrame(rows[i * per:(i + 1) * per]).to_parquet(folder / name, index=False)
    return [folder / n for n in names]


SHARD_ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)]


@pytest.mark.parametrize("spec", [
    ["raw/train-00000-of-00002.parquet", "raw/train-00001-of-00002.parquet"],  # a list
    "raw/train-*.parquet",                                                    # a glob, expanded in name order
    ["raw/train-0000[01]-of-00002.parquet"],                                  # a list of globs
    "raw",                                                                    # a folder
])
def test_a_split_reads_every_shard_in_name_order(tmp_path, spec):
    # written in reverse name order: the order rows are read in is the names', not the file system's
    write_shards(tmp_path / "raw", SHARD_ROWS[3:], ["train-00001-of-00002.parquet"])
    write_shards(tmp_path / "raw", SHARD_ROWS[:3], ["train-00000-of-00002.parquet"])
    ds = load_split(DataConfig(train_files=spec), "train", root=tmp_path)
    assert ds["prompt"] == [r["prompt"] for r in SHARD_ROWS]


def test_paths_with_glob_characters_that_exist_are_read_as_they_are(tmp_path):
    write_shards(tmp_path / "v[1]", SHARD_ROWS, ["train.parquet"])  # an existing name is not a pattern
    assert (load_split(DataConfig(train_files="v[1]/train.parquet"), "train", root=tmp_path)["prompt"][0]
            == "q0")
    root = tmp_path / "repo[x]"  # nor is the root a pattern is resolved against
    write_shards(root / "raw", SHARD_ROWS, ["a.parquet", "b.parquet"])
    assert (resolve_data_paths(["raw/*.parquet"], "k", root)
            == [str(root / "raw/a.parquet"), str(root / "raw/b.parquet")])


@pytest.mark.parametrize("spec, message", [
    ("raw/test-*.parquet", "data.train_files: the glob 'raw/test-*.parquet' matches no file"),
    (["raw/a.parquet", "raw/missing.parquet"],
     "data.train_files: {root}/raw/missing.parquet: no such data file or folder"),
    (["raw/a.parquet", "raw/*.parquet"],
     "data.train_files: {root}/raw/a.parquet is named twice (again by 'raw/*.parquet')"),
    ("empty", "data.train_files: {root}/empty is a folder with no .jsonl, .json, .parquet, .csv files"),
])
def test_data_paths_that_cannot_work_name_the_key_and_the_accepted_forms(tmp_path, spec, message):
    write_shards(tmp_path / "raw", SHARD_ROWS, ["a.parquet", "b.parquet"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as err:
        load_split(DataConfig(train_files=spec), "train", root=tmp_path)
    assert message.format(root=tmp_path) in str(err.value)
    assert str(err.value).endswith(f"expected {DATA_FILES_FORMS}") or "named twice" in message


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
