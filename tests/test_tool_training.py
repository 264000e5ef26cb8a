"""Training with tools through every path a round takes: the async sampler worker (staleness 0 is the
synchronous run, token for token), a checkpoint inside a round (resumed with its tool mask, new environments
for the next round), and evaluation during training (eval/tool_* metrics)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.config import config_from_dict
from grpo_core.train.loop import TrainHooks, train
from tests.tiny import read_log
from tests.tool_fixtures import ScriptedFactory, counter_policy, qwen_tokenizer, tiny_model

pytest.importorskip("trl")  # the fixture's chat templates are TRL's copies of the hub's

TIMING = {"step_time", "generation_time", "async/staleness", "async/wait_time", "eval/runtime"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-training")
    tok = qwen_tokenizer()
    tiny_model(tok).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    with open(root / "rows.jsonl", "w") as fh:
        for i in range(4):
            fh.write(
                json.dumps({"prompt": [{"role": "user", "content": f"count {i}"}], "start": i, "answer": "3"})
                + "\n")
    return root


def config(root, **knobs):
    return config_from_dict({
        "data": {"train_files": [str(root / "rows.jsonl")], "eval_files": [str(root / "rows.jsonl")],
                 "max_prompt_length": None},
        "model": {"name_or_path": str(root / "model")},
        "generation": {"max_completion_length": 100},
        "rewards": [{"name": "counter", "function": "environment_reward"}],
        "train": {"num_generations": 2, "per_device_train_batch_size": 4, "max_steps": 2, "save_steps": 100,
                  "output_dir": "out", "learning_rate": 1e-3, "beta": 0.04,
                  "environment_factory": "tests.tool_fixtures:Counter", **knobs},
    })


def run(root, out, **knobs):
    result = train_(root, out, **knobs)
    return result, [{k: v for k, v in r.items() if k not in TIMING} for r in read_log(root / out / "log.csv")]


def train_(root, out, **knobs):
    (root / out).mkdir(exist_ok=True)
    return train(config(root, **knobs), reward_weights=[1.0], root=root / out, progress=False,
                 log_path="log.csv", hooks=TrainHooks(backend_factory=ScriptedFactory(counter_policy, 100)))


def weights(result):
    return load_file(result.model_dir / "model.safetensors")


def same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_async_rollouts_with_tools_at_staleness_0_are_the_synchronous_run(assets):
    """The worker samples the conversations (its own environments) and ships the round, tool mask included."""
    sync, sync_log = run(assets, "sync", max_steps=2)
    zero, zero_log = run(assets, "zero", max_steps=2, async_rollouts=True, max_staleness=0)
    assert same_weights(weights(sync), weights(zero))
    assert sync_log == zero_log and float(sync_log[0]["tools/call_frequency"]) > 0


def test_a_checkpoint_inside_a_round_resumes_with_its_tool_mask(assets):
    knobs = {"steps_per_generation": 2, "per_device_train_batch_size": 2, "save_steps": 1,
             "save_total_limit": 5}
    whole, _ = run(assets, "whole", max_steps=4, **knobs)
    train_(assets, "cut", max_steps=1, **knobs)  # checkpoint-1 holds the rest of the round
    resumed = train_(assets, "cut", max_steps=4, **knobs)
    assert resumed.resumed_from.name == "checkpoint-1"
    assert same_weights(weights(whole), weights(resumed))


def test_evaluation_during_training_logs_the_tool_metrics(assets):
    _, log = run(assets, "eval", max_steps=2, eval_strategy="steps", eval_steps=1, num_generations_eval=2)
    for key in ("eval/tool_call_frequency", "eval/tool_failure_frequency", "eval/tool_success_rate",
                "eval/sampled/tool_success_rate"):
        assert key in log[0] and log[0][key] != "", key
    assert (0 < float(log[0]["eval/tool_success_rate"]) <= 1
            and float(log[0]["eval/tool_failure_frequency"]) == 0)


def test_the_completion_table_counts_each_rows_tool_calls(assets):
    """Each logged row carries its calls, failed calls and turns, as its text shows them: a call per
    <tool_call> block, a turn per generation prompt after the first (special tokens are left out of the text,
    the role word stays); their mean is the step's tools/call_frequency."""
    _, log = run(assets, "table", max_steps=1, log_completions_steps=1, num_completions_to_log=100)
    rows = [json.loads(line) for line in (assets / "table/log.completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["step"] for r in rows} == {1}
    for r in rows:
        assert r["tool_calls"] == r["completion"].count("<tool_call>") and r["tool_failures"] == 0
        assert r["turns"] == 1 + r["completion"].count("</tool_response>\nassistant\n")
    assert max(r["tool_calls"] for r in rows) == 2 and max(r["turns"] for r in rows) >= 2  # the script's most
    assert (sum(r["tool_calls"] for r in rows) / len(rows)
            == pytest.approx(float(log[0]["tools/call_frequency"])))
