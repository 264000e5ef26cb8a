"""Completions you can read: the round's samples every log_completions_steps, in a jsonl beside the step log
(cut back on resume) and as an MLflow table the UI and ``mlflow.load_table`` read."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpo_core.train.completions import CompletionLog, as_table, completion_rows
from grpo_core.train.loop import train
from grpo_core.train.round import Round
from tests.tiny import make_prompts, make_tiny_model, read_log, tiny_config

DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("completions")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


def test_rows_are_the_decoded_texts_rewards_and_advantages(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets[0])
    prompt = tok("what is 2 + 3 ?")["input_ids"]
    completion = tok("5")["input_ids"] + [tok.eos_token_id]
    round_ = Round(prompt_ids=torch.tensor([[tok.pad_token_id] + prompt, [tok.pad_token_id] + prompt]),
                   prompt_mask=torch.tensor([[0] + [1] * len(prompt)] * 2),
                   completion_ids=torch.tensor([completion, completion]),
                   completion_mask=torch.ones(2, len(completion), dtype=torch.long),
                   is_truncated=torch.zeros(2, dtype=torch.bool), advantages=torch.tensor([0.5, -0.5]),
                   rewards=torch.tensor([[1.0, math.nan], [0.0, 2.0]]))
    rows = completion_rows(round_, tok, ["correct", "judge"], step=7, limit=None)
    assert rows[0] == {"step": 7, "prompt": tok.decode(prompt, skip_special_tokens=True),
                       "completion": tok.decode(completion, skip_special_tokens=True),
                       "reward/correct": 1.0, "reward/judge": None, "advantage": 0.5}
    assert rows[1]["reward/judge"] == 2.0 and rows[1]["advantage"] == -0.5
    assert tok.eos_token not in rows[0]["completion"]
    assert len(completion_rows(round_, tok, ["correct", "judge"], step=7, limit=1)) == 1
    assert as_table(rows)["advantage"] == [0.5, -0.5]


def test_the_file_is_cut_back_to_the_resume_step(tmp_path):
    path = tmp_path / "log.completions.jsonl"
    log = CompletionLog(path, resume_step=0)
    log.append([{"step": 2, "x": 1}, {"step": 2, "x": 2}])
    log.append([{"step": 4, "x": 3}])
    CompletionLog(path, resume_step=2)
    assert [json.loads(line)["x"] for line in path.read_text().splitlines()] == [1, 2]
    CompletionLog(path, resume_step=0)  # a fresh run starts an empty file
    assert path.read_text() == ""


def test_training_writes_every_nth_steps_round_and_a_resume_does_not_repeat_it(assets, tmp_path):
    model_dir, data = assets
    knobs = {"log_completions_steps": 2, "num_completions_to_log": 6, "save_steps": 2}
    train(tiny_config(model_dir, data, DIGITS, max_steps=2, **knobs), root=tmp_path, progress=False)
    train(tiny_config(model_dir, data, DIGITS, max_steps=4, **knobs), root=tmp_path,
          progress=False)  # resumes at 2
    rows = [json.loads(line)
            for line in (tmp_path / "metrics/train_log.completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] * 6 + [4] * 6
    for r in rows:  # the reward is the digit fraction of the very text shown (the reward reads that text)
        text = r["completion"]
        assert (r["reward/digits"]
                == pytest.approx(sum(ch.isdigit() for ch in text) / max(len(text), 1), abs=1e-6))
    step4 = [r for r in rows if r["step"] == 4][:4]  # the first group (G = 4): advantages sum to 0
    assert sum(r["advantage"] for r in step4) == pytest.approx(0.0, abs=1e-5)
    assert len(read_log(tmp_path / "metrics/train_log.csv")) == 4


def test_the_stage_logs_a_table_mlflow_reads_back(tmp_path, monkeypatch):
    import mlflow

    from flows.stages.common import StageContext
    from flows.stages.runs import StageRun
    from grpo_core.config import config_from_dict

    cfg = config_from_dict({"rewards": DIGITS, "data": {"train_files": ["t.jsonl"]},
                            "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}})
    ctx = StageContext(stage="train", root=tmp_path, store_root=tmp_path,
                       params_path=tmp_path / "params.yaml", cfg=cfg)
    table = {"step": [2, 2], "prompt": ["a", "b"], "completion": ["x", "y"], "reward/digits": [0.5, None],
             "advantage": [0.7, -0.7]}
    with StageRun(ctx) as run:
        assert run.tracker is not None
        run.log_table(table, "completions/step_000002.json")
        run.log_table(table, "completions/step_000004.json")
        run_id = run.run_id
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = client.get_run(run_id).info.experiment_id
    # load_table searches through the fluent API, which reads the variable; mlflow.set_tracking_uri would pin
    # a process-wide URI that later tests' stores (set by the variable) never override
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    frame = client.load_table(experiment_id, "completions/step_000002.json", run_ids=[run_id])
    assert list(frame.columns) == list(table) and frame["advantage"].tolist() == pytest.approx([0.7, -0.7])
    tag = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert tag == [{"path": "completions/step_000002.json", "type": "table"},
                   {"path": "completions/step_000004.json", "type": "table"}]
