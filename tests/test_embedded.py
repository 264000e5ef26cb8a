"""The embedded default: synthetic splits, demonstrations, tokenizer, tiny model, `prepare` (tiny config)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.embedded import EmbeddedConfig, build_tokenizer, generate_splits, prepare, vocabulary_words
from grpo_core.embedded.tasks import FORMAT_BREAKS, TEMPLATES, template_noise
from grpo_core.embedded.tokenizer import TAGS
from grpo_core.rewards import correctness, parse_gold, soft_format, strict_format

TASKS = ["arithmetic", "multiple_choice"]


def tiny_config(root: Path, **overrides) -> EmbeddedConfig:
    """A config that prepares in about a second: a one-layer model and a few warm-start steps."""
    values = dict(
        seed=3,
        num_train=60,
        num_eval=20,
        data_dir=str(root / "data"),
        model_dir=str(root / "model"),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        warm_start_steps=4,
        warm_start_batch_size=8,
        num_threads=1,
    )
    values.update(overrides)
    return EmbeddedConfig(**values)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[EmbeddedConfig, dict]:
    cfg = tiny_config(tmp_path_factory.mktemp("prepared"))
    return cfg, prepare(cfg, log=None)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(vocabulary_words())


# --- tasks -------------------------------------------------------------------------------------------


def test_splits_are_disjoint_deterministic_and_balanced():
    train, evaluation = generate_splits(300, 100, TASKS, 9, seed=0)
    again_train, again_eval = generate_splits(300, 100, TASKS, 9, seed=0)
    assert [p.row() for p in train] == [p.row() for p in again_train]
    assert [p.row() for p in evaluation] == [p.row() for p in again_eval]
    train_prompts, eval_prompts = {p.prompt for p in train}, {p.prompt for p in evaluation}
    assert len(train_prompts) == 300 and len(eval_prompts) == 100  # no prompt twice within a split
    assert not train_prompts & eval_prompts
    assert sum(p.task == "multiple_choice" for p in evaluation) == 50
    other_seed, _ = generate_splits(300, 100, TASKS, 9, seed=1)
    assert [p.prompt for p in other_seed] != [p.prompt for p in train]


def test_too_few_distinct_prompts_is_an_error():
    with pytest.raises(ValueError, match="max_operand"):
        generate_splits(10_000_000, 10, TASKS, 3, seed=0)


def test_every_gold_answer_scores_the_maximum_and_the_wrong_reading_scores_zero():
    train, evaluation = generate_splits(400, 100, TASKS, 9, seed=0)
    problems = train + evaluation
    prompts, golds = [p.prompt for p in problems], [p.answer for p in problems]
    assert all(parse_gold(g) is not None for g in golds)
    reward = correctness()
    assert reward(prompts, [p.completion() for p in problems], answer=golds) == [1.0] * len(problems)
    assert reward(prompts, [p.completion(wrong_op=True) for p in problems], answer=golds) == [0.0] * len(
        problems
    )


def test_demonstration_format():
    train, _ = generate_splits(10, 2, TASKS, 9, seed=0)
    problem = next(p for p in train if p.task == "arithmetic")
    mc_problem = next(p for p in train if p.task == "multiple_choice")
    a, b = mc_problem.a, mc_problem.b
    assert f"\nA) {a + b} B) {a - b} C) " in mc_problem.prompt  # unshuffled: A = sum, B = difference
    clean = problem.completion()
    assert (
        clean
        == f"<reasoning>\n{problem.a}{problem.op}{problem.b}={problem.result}\n</reasoning>\n<answer>\n"
           f"{problem.result}\n</answer>"
    )
    assert mc_problem.completion().endswith(f"<answer>\n\\boxed{{{mc_problem.answer}}}\n</answer>")
    strict, soft = strict_format(), soft_format()
    breaks = [problem.completion(format_break=i) for i in range(len(FORMAT_BREAKS))]
    assert strict(["q"] * 4, breaks) == [1.0, 0.0, 0.0, 0.0]
    assert soft(["q"] * 4, breaks) == [1.0, 0.0, 0.0, 1.0]  # trailing text keeps the soft layout


def test_template_noise_spans_label_noise_plus_minus_spread():
    rates = template_noise(0.5, 0.3)
    assert len(rates) == len(TEMPLATES)
    assert rates[0] == pytest.approx(0.2) and rates[-1] == pytest.approx(0.8)
    assert sum(rates) / len(rates) == pytest.approx(0.5)
    assert template_noise(0.9, 0.3)[-1] == 1.0  # clipped


# --- tokenizer ---------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_single_token_tags(tokenizer):
    train, _ = generate_splits(50, 10, TASKS, 9, seed=0)
    for problem in train:
        for text in (problem.prompt, problem.completion(), problem.completion(wrong_op=True, format_break=3)):
            assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    for tag in TAGS:
        assert len(tokenizer(tag)["input_ids"]) == 1
    assert len(tokenizer(" apples")["input_ids"]) == 1
    assert tokenizer("17")["input_ids"] == tokenizer("1")["input_ids"] + tokenizer("7")["input_ids"]
    assert tokenizer.decode(tokenizer("Zoë wrote ∑")["input_ids"]) == "Zoë wrote ∑"  # byte-level: no UNK
    ids = tokenizer("x")["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "x"
    assert len({tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id}) == 3


def test_lengths_fit_the_train_limits(tokenizer):
    train, evaluation = generate_splits(400, 100, TASKS, 9, seed=0)
    for problem in train + evaluation:
        assert len(tokenizer(problem.prompt)["input_ids"]) <= 64
        longest = max(len(tokenizer(problem.completion(w, f))["input_ids"]) for w in (0, 1) for f in range(4))
        assert longest + 1 <= 32  # + EOS


# --- prepare -----------------------------------------------------------------------------------------


def test_prepare_writes_rows_and_a_loadable_model(prepared, tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, summary = prepared
    rows = [json.loads(line) for line in Path(cfg.data_dir, "train.jsonl").read_text().splitlines()]
    eval_rows = [json.loads(line) for line in Path(cfg.data_dir, "eval.jsonl").read_text().splitlines()]
    assert len(rows) == cfg.num_train and len(eval_rows) == cfg.num_eval
    assert set(rows[0]) == {"prompt", "answer", "task"}
    assert summary["num_train"] == cfg.num_train and summary["warm_start_steps"] == cfg.warm_start_steps
    assert summary["warm_start_final_loss"] < summary["warm_start_first_loss"]
    assert (Path(cfg.model_dir) / "model.safetensors").is_file()
    assert not list(Path(cfg.model_dir).parent.glob(".*.tmp"))  # no temp folder left behind

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded_tok = AutoTokenizer.from_pretrained(cfg.model_dir)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(loaded_tok) == len(tokenizer)
    text = rows[0]["prompt"] + "<reasoning>\n3+4=7\n</reasoning>\n<answer>\n\\boxed{B}\n</answer>"
    assert loaded_tok(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded_tok.eos_token_id == model.generation_config.eos_token_id == model.config.eos_token_id
    assert loaded_tok.pad_token_id == model.generation_config.pad_token_id


def test_prepare_is_deterministic(prepared, tmp_path):
    cfg, _ = prepared
    again = dataclasses.replace(cfg, data_dir=str(tmp_path / "data"), model_dir=str(tmp_path / "model"))
    prepare(again, log=None)
    for name in ("train.jsonl", "eval.jsonl"):
        assert Path(cfg.data_dir, name).read_bytes() == Path(again.data_dir, name).read_bytes()
    first, second = (
        load_file(Path(cfg.model_dir, "model.safetensors")),
        load_file(Path(again.model_dir, "model.safetensors")),
    )
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    # every saved file but the metadata (which names the folders) is byte-identical: DVC caches hit
    names = sorted(p.name for p in Path(cfg.model_dir).iterdir() if p.name != "embedded.json")
    assert names == sorted(p.name for p in Path(again.model_dir).iterdir() if p.name != "embedded.json")
    assert all(Path(cfg.model_dir, n).read_bytes() == Path(again.model_dir, n).read_bytes() for n in names)


def test_prepare_replaces_an_existing_model_dir(prepared, tmp_path):
    cfg, _ = prepared
    target = dataclasses.replace(
        cfg, data_dir=str(tmp_path / "d"), model_dir=str(tmp_path / "m"), warm_start_steps=0
    )
    Path(target.model_dir).mkdir(parents=True)
    Path(target.model_dir, "stale.txt").write_text("old")
    prepare(target, log=None)
    assert not Path(target.model_dir, "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "m"]


def test_warm_started_model_generates_the_format_and_stops_at_eos(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tiny_config(tmp_path, warm_start_steps=150, warm_start_batch_size=16, warm_start_learning_rate=1e-2)
    prepare(cfg, log=None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(cfg.model_dir)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir)
    prompts = [
        json.loads(line)["prompt"] for line in Path(cfg.data_dir, "eval.jsonl").read_text().splitlines()[:8]
    ]
    batch = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    out = model.generate(**batch, do_sample=False, max_new_tokens=32)[:, batch["input_ids"].shape[1] :]
    for row in out.tolist():
        assert tok.eos_token_id in row
        end = row.index(tok.eos_token_id)
        assert all(t == tok.pad_token_id for t in row[end + 1 :])  # nothing after EOS
        assert tok.decode(row[:end]).startswith("<reasoning>\n")
