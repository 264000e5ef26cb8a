"""Several data files per split (a list, a glob) under `dvc repro`: each split's files are read in name order,
DVC hashes the folder `data.<split>_dir` that holds them (dvc.yaml can interpolate only one path into a
dependency), and a value that cannot work is our error naming the key and the accepted forms."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import yaml

from grpo_core.data.loading import DATA_FILES_FORMS
from tests.test_pipeline import copy_repo, dvc, make_clone

SHARDS = ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]


def set_data(repo, **data) -> None:
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    raw["data"].update(data)
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def write_shards(folder, rows: list[dict]) -> None:
    """``rows`` split in order over the two SHARDS in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    half = len(rows) // 2
    for name, part in zip(SHARDS, (rows[:half], rows[half:])):
        pd.DataFrame(part).to_parquet(folder / name, index=False)


def shard_rows(n: int = 8) -> list[dict]:
    return [{"prompt": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(n)]


# ---------------------------------------------------------------------------------------------------
# dvc.yaml parses a list and a glob (before: "Cannot interpolate data of type 'list'")


@pytest.mark.parametrize("files", [[f"data/raw/{s}" for s in SHARDS], "data/raw/train-*.parquet"])
def test_dvc_parses_a_list_or_a_glob_and_hashes_the_folder_holding_them(tmp_path, files):
    repo = make_clone(tmp_path / "repo")
    write_shards(repo / "data/raw", shard_rows())
    set_data(repo, train_files=files, train_dir="data/raw")
    out = dvc(repo, "status", "validate").stdout  # never run: every dep is listed, by the path DVC hashes
    deps = out.split("changed deps:")[1].split("changed outs:")[0].split()
    # train_dir; eval_dir (the embedded eval file's folder)
    assert "data/raw" in deps and "data/prepared" in deps
    assert not any("train-" in d for d in deps)


# ---------------------------------------------------------------------------------------------------
# validate's check that DVC hashes every file it reads (in-process, no model needed: it runs first)


@pytest.fixture()
def shard_repo(tmp_path, monkeypatch):
    from tests.test_config import base
    from tests.tiny import in_stage_repo

    write_shards(tmp_path / "data/raw", shard_rows())
    (tmp_path / "data/prepared").mkdir(parents=True)
    pd.DataFrame(shard_rows(4)).to_json(tmp_path / "data/prepared/eval.jsonl", orient="records", lines=True)
    raw = base()
    raw["data"].update(train_files="data/raw/train-*.parquet", train_dir="data/raw",
                       eval_files="data/prepared/eval.jsonl", eval_dir="data/prepared")
    return in_stage_repo(tmp_path, raw, monkeypatch, "test-data-files")


def sources(root, **data):
    from flows.stages.common import StageContext
    from flows.stages.validate import local_sources

    set_data(root, **data)
    return local_sources(StageContext.create("validate"))


def test_every_file_read_lies_in_the_folder_dvc_hashes(shard_repo):
    got = sources(shard_repo)
    assert got == {"train": [str(shard_repo / "data/raw" / s) for s in SHARDS],
                   "eval": [str(shard_repo / "data/prepared/eval.jsonl")]}
    assert sources(shard_repo, train_dir=None)["train"] == got["train"]  # null: not checked (no DVC)


@pytest.mark.parametrize("data, message", [
    ({"train_dir": "data/prepared"},
     "data.train_dir: data/prepared does not hold data/raw/train-00000-of-00002.parquet (named by "
     "data.train_files); DVC hashes data.train_dir as validate's dependency (it cannot take a list or a "
     "glob), so set it to a folder holding every train file; data/raw holds them all"),
    ({"train_dir": "data"}, "data.train_dir: data holds validate's own outputs "
                            "(data/validated/train.parquet, reports/validation.json), so DVC cannot depend "
                            "on it; keep the data in a folder of its own, e.g. data/raw"),
    ({"train_dir": "data/nope"}, "data.train_dir: data/nope: no such file or folder; name the folder holding "
                                 "data.train_files"),
    ({"eval_files": ["data/prepared/eval.jsonl", "data/raw/train-00001-of-00002.parquet"]},
     "data.eval_dir: data/prepared does not hold data/raw/train-00001-of-00002.parquet (named by "
     "data.eval_files); DVC hashes data.eval_dir as validate's dependency (it cannot take a list or a glob), "
     "so set it to a folder holding every eval file; the folder holding them all also holds validate's "
     "outputs: move them to a folder of their own"),
])
def test_a_file_dvc_would_not_hash_is_our_error_naming_the_key(shard_repo, data, message):
    from flows.stages.common import StageConfigError

    with pytest.raises(StageConfigError) as err:
        sources(shard_repo, **data)
    assert str(err.value) == message


# ---------------------------------------------------------------------------------------------------
# end to end: `dvc repro` on the tiny pipeline with the train split as two parquet shards


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A copy of the built tiny pipeline whose train split is two parquet shards (the embedded train rows but
    the last, so validated data changes and the whole pipeline runs again), named by a list; (repo, log)."""
    from tests.test_pipeline import built_pipeline

    repo = copy_repo(built_pipeline(tmp_path_factory)[0], tmp_path_factory.mktemp("sharded") / "repo")
    rows = [json.loads(line) for line in (repo / "data/prepared/train.jsonl").read_text().splitlines()][:-1]
    write_shards(repo / "data/raw", rows)
    set_data(repo, train_files=[f"data/raw/{s}" for s in SHARDS], train_dir="data/raw")
    proc = dvc(repo, "repro")
    return repo, proc.stdout + proc.stderr, rows


def validated_prompts(repo) -> list[str]:
    return pd.read_parquet(repo / "data/validated/train.parquet")["prompt"].tolist()


@pytest.mark.slow
def test_a_list_of_shards_validates_and_trains_under_dvc_repro(sharded):
    repo, log, rows = sharded
    for stage in ("validate", "calibrate", "train", "evaluate"):
        assert f"Running stage '{stage}'" in log
    assert "Running stage 'prepare'" not in log
    assert validated_prompts(repo) == [r["prompt"] for r in rows]  # both shards' rows, in name order
    report = json.loads((repo / "reports/validation.json").read_text())
    assert report["sources"]["train"] == [f"data/raw/{s}" for s in SHARDS]
    assert dvc(repo, "status").stdout.strip().endswith("Data and pipelines are up to date.")


@pytest.mark.slow
def test_a_glob_reads_the_same_rows_and_editing_or_adding_a_shard_reruns_validate(sharded, tmp_path):
    repo = copy_repo(sharded[0], tmp_path / "repo")
    set_data(repo, train_files="data/raw/train-*.parquet")
    # the stages after validate list the whole data section as params (dvc.yaml), so they are due too;
    # validate alone shows the glob reads the same rows
    log = dvc(repo, "repro", "validate").stdout
    assert "Running stage 'validate'" in log
    assert validated_prompts(repo) == [r["prompt"] for r in sharded[2]]
    assert "validate:" not in dvc(repo, "status").stdout

    shard = repo / "data/raw" / SHARDS[1]
    pd.read_parquet(shard).iloc[:-1].to_parquet(shard, index=False)
    status = dvc(repo, "status").stdout
    assert "validate:" in status and "modified:" in status and "data/raw" in status
    dvc(repo, "repro", "validate")
    assert validated_prompts(repo) == [r["prompt"] for r in sharded[2][:-1]]
    assert "validate:" not in dvc(repo, "status").stdout

    shutil.copy(shard, repo / "data/raw/train-00002-of-00002.parquet")  # a new file the glob matches
    assert "validate:" in dvc(repo, "status").stdout


@pytest.mark.slow
@pytest.mark.parametrize("data, message", [
    ({"train_files": "data/raw/test-*.parquet"},
     f"data.train_files: the glob 'data/raw/test-*.parquet' matches no file (looked for {{repo}}/data/raw/"
     f"test-*.parquet); expected {DATA_FILES_FORMS}"),
    ({"train_files": ["data/raw/" + SHARDS[0], "data/raw/gone.parquet"]},
     "data.train_files: {repo}/data/raw/gone.parquet: no such data file or folder; "
     f"expected {DATA_FILES_FORMS}"),
    ({"train_files": 5}, f"data.train_files: 5 is not {DATA_FILES_FORMS}"),
    ({"train_dir": "data/prepared"}, "data.train_dir: data/prepared does not hold data/raw/" + SHARDS[0]),
])
def test_a_bad_value_under_dvc_repro_is_our_error_naming_the_key_and_the_forms(sharded, tmp_path, data,
                                                                               message):
    repo = copy_repo(sharded[0], tmp_path / "repo")
    set_data(repo, **data)
    proc = dvc(repo, "repro", "validate", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "failed to reproduce 'validate'" in out
    assert "Cannot interpolate" not in out
    assert message.format(repo=repo) in " ".join(out.split())  # (DVC wraps nothing; our line may be long)
