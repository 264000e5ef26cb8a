"""The validate stage with tools: what can be known before training is refused there, naming it -
a tool path that does not import, a tool without type hints or docstring, a chat template that cannot show
tool calls, an environment whose reset cannot take the rows, plain-text prompts, a row naming no
environment."""

from __future__ import annotations

import json

import pytest

from flows.stages.__main__ import main
from grpo_core.common.errors import EXIT_CONFIG, EXIT_DATA, EXIT_OK, EXIT_VALIDATION
from tests.tiny import in_stage_repo
from tests.tool_fixtures import qwen_tokenizer, tiny_model

pytest.importorskip("trl")  # the fixture's chat templates are TRL's copies of the hub's

QUESTION = [{"role": "user", "content": "what is 12 times 34"}]


class NarrowReset:
    """reset() takes no row columns."""

    def reset(self):
        return None

    def increment(self, by: int) -> str:
        """Add.

        Args:
            by: how much
        """
        return str(by)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool-model")
    tok = qwen_tokenizer()
    tiny_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def repo(tmp_path, monkeypatch, model_dir, rows, **train):
    data = tmp_path / "raw"
    data.mkdir()
    for split in ("train", "eval"):
        with open(data / f"{split}.jsonl", "w") as fh:
            for i, r in enumerate(rows):
                fh.write(
                    json.dumps({**r,
                                "prompt": [{"role": "user", "content": f"{split} {i}: what is 2 times 3"}]
                                if r.get("prompt") is None else r["prompt"]}) + "\n")
    raw = {"data": {"train_files": ["raw/train.jsonl"], "eval_files": ["raw/eval.jsonl"]},
           "model": {"name_or_path": str(model_dir)},
           "rewards": [{"name": "counter", "function": "environment_reward"}]
                      if "environment_factory" in train
           else [{"name": "len", "function": "tests.test_tool_stages:length"}],
           "train": train}
    return in_stage_repo(tmp_path, raw, monkeypatch, "tool-stages")


def length(prompts, completions, **columns):
    return [float(len(str(c))) for c in completions]


def test_tools_and_environments_that_fit_pass(tmp_path, monkeypatch, model_dir):
    rows = [{"environment": "counter", "start": 1}, {"environment": "counter", "start": 2}]
    root = repo(tmp_path, monkeypatch, model_dir, rows, tools=["tests.tool_fixtures:multiply"],
                environment_factory={"counter": "tests.tool_fixtures:Counter"})
    assert main(["validate"]) == EXIT_OK
    assert json.loads((root / "reports/validation.json").read_text())["ok"]


def test_a_row_naming_no_environment_fails_validation_naming_the_row(tmp_path, monkeypatch, model_dir):
    rows = [{"environment": "counter"}, {"environment": "countr"}]
    root = repo(tmp_path, monkeypatch, model_dir, rows,
                environment_factory={"counter": "tests.tool_fixtures:Counter"})
    assert main(["validate"]) == EXIT_VALIDATION
    failures = json.loads((root / "reports/validation.json").read_text())["failures"]
    unknown = [f for f in failures if f["check"] == "environment_unknown"]
    assert [(f["split"], f["row"]) for f in unknown] == [("train", 1), ("eval", 1)]
    assert "'countr' is not one of train.environment_factory's ['counter']" in unknown[0]["value"]


# every other bad tool: tests/test_tools.py (the same build_toolbox)
@pytest.mark.parametrize("train, words", [
    ({"tools": ["tests.test_tools:no_docstring"]}, ["train.tools[0]", "no docstring"]),
    ({"environment_factory": "tests.test_tool_stages:NarrowReset"},
     ["train row 0", "reset(**row) cannot take the row's columns ['prompt']", "accept **kwargs"]),
])
def test_tools_that_cannot_run_stop_validate_with_exit_2(tmp_path, monkeypatch, model_dir, capsys, train,
                                                         words):
    repo(tmp_path, monkeypatch, model_dir, [{}, {}], **train)
    assert main(["validate"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_a_chat_template_without_tool_calls_stops_validate(tmp_path, monkeypatch, model_dir, capsys):
    from transformers import AutoTokenizer

    plain = tmp_path / "plain-model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(plain)
    tiny_model(tok).save_pretrained(plain)
    repo(tmp_path, monkeypatch, plain, [{}, {}], tools=["tests.tool_fixtures:multiply"])
    assert main(["validate"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "train.tools / environment_factory" in err and "does not show the call's name" in err


def test_plain_text_prompts_with_tools_stop_validate(tmp_path, monkeypatch, model_dir, capsys):
    repo(tmp_path, monkeypatch, model_dir, [{"prompt": "what is 2 times 3"}, {"prompt": "what is 4 times 5"}],
         tools=["tests.tool_fixtures:multiply"])
    assert main(["validate"]) == EXIT_DATA
    assert "need chat prompts" in capsys.readouterr().err


def test_the_plots_show_the_tool_metrics(tmp_path, monkeypatch):
    import pandas as pd

    from flows.stages import plots

    shown = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: shown.append(fig) or path)
    log = pd.DataFrame({"step": [1, 2], "reward": [0.1, 0.2], "reward_std": [0.1, 0.1], "kl": [0.0, 0.01],
                        "completions/mean_length": [20, 22], "tools/call_frequency": [0.5, 0.9],
                        "tools/failure_frequency": [0.3, 0.1]})
    plots.training_figure(log, tmp_path / "t.png")
    assert "tool calls (brown) / failed share (olive)" in [ax.get_title() for ax in shown[0].axes]
    metrics = {"base": {"accuracy": 0.1, "tool_success_rate": 0.2},
               "trained": {"accuracy": 0.3, "tool_success_rate": 0.6}}
    plots.evaluation_figure(log, metrics, [], tmp_path / "e.png")
    bars = shown[1].axes[2]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["accuracy\n(greedy)", "tool\nsuccess"]
    assert [round(p.get_height(), 2) for p in bars.patches] == [0.1, 0.2, 0.3, 0.6]


# -- calibrate and evaluate sample conversations too ---------------------------------------------------------


def test_calibrate_and_evaluate_sample_with_the_tools(tmp_path, monkeypatch, model_dir):
    import shutil

    import pandas as pd

    import grpo_core.rollout as rollout
    from tests.tool_fixtures import Script, ScriptedBackend, calculator_policy

    rows = [{"prompt": [{"role": "user", "content": f"what is {a} times {b}"}], "answer": str(a * b)}
            for a, b in ((12, 34), (5, 6), (7, 8), (9, 3))]
    (tmp_path / "data/validated").mkdir(parents=True)
    for split in ("train", "eval"):
        pd.DataFrame(rows).to_parquet(tmp_path / f"data/validated/{split}.parquet", index=False)
    shutil.copytree(model_dir, tmp_path / "artifacts/model")
    raw = {"data": {"train_files": ["x.jsonl"], "max_prompt_length": None},
           "model": {"name_or_path": str(model_dir)}, "generation": {"max_completion_length": 160},
           "rewards": [{"name": "correctness", "function": "correctness", "kwargs": {"answer_tag": None}}],
           "calibrate": {"num_prompts": 4, "num_generations": 2},
           "evaluate": {"max_samples": 4, "num_generations": 2, "pass_k": [1, 2]},
           "train": {"num_generations": 2, "per_device_train_batch_size": 4,
                     "tools": ["tests.tool_fixtures:multiply", "tests.tool_fixtures:add"]}}
    in_stage_repo(tmp_path, raw, monkeypatch, "tool-sampling-stages")
    monkeypatch.setattr(rollout, "backend_for", lambda model, tok, g, **kw: ScriptedBackend(
        Script(tok, calculator_policy, g.max_completion_length)))
    assert main(["calibrate"]) == EXIT_OK
    # a sample shows a tool result
    assert "<tool_response>" in (tmp_path / "reports/calibration.md").read_text()
    assert main(["evaluate"]) == EXIT_OK
    metrics = json.loads((tmp_path / "metrics/eval.json").read_text())
    for policy in ("base", "trained"):  # the same script: the same numbers
        assert 0 < metrics[policy]["tool_success_rate"] <= 1 and metrics[policy]["tool_call_frequency"] > 0
        # "The answer is <the tool's product>": the judge reads the model
        assert metrics[policy]["accuracy"] > 0
    completions = pd.read_parquet(tmp_path / "artifacts/eval/completions.parquet")
    assert {"tool_calls", "tool_failures", "turns"} <= set(completions.columns)
