"""sample_and_score on a tiny model: layout, rewards with None, truncation flags, determinism under a seed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from grpo_core.data.loading import PromptEncoder
from grpo_core.model.loading import load_policy
from grpo_core.rewards import build_reward_functions
from grpo_core.rollout import SamplingParams
from grpo_core.rollout.sampling import SamplePlan, sample_and_score
from tests.tiny import make_prompts, make_tiny_model, tiny_config

REWARDS = [
    {"name": "digits", "function": "tests.reward_helpers:digit_fraction"},
    {"name": "correctness", "function": "correctness"},  # None for rows without a parseable gold
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("sampling")
    model_dir, data = make_tiny_model(d / "model"), make_prompts(d / "prompts.jsonl", n=10)
    cfg = tiny_config(model_dir, data, REWARDS)
    model, tokenizer = load_policy(cfg.model)
    model.eval()
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[3]["answer"] = None  # correctness does not apply here -> NaN
    encoder = PromptEncoder(tokenizer, 48)
    fns = build_reward_functions(cfg.rewards)
    return model, tokenizer, rows, encoder, fns


def run(setup, **kw):
    model, tokenizer, rows, encoder, fns = setup
    args = dict(num_generations=3, sampling=SamplingParams(max_new_tokens=6), batch_size=4, seed=7)
    args.update(kw)
    backend = args.pop("backend", None)
    return sample_and_score(model, tokenizer, rows, encoder, fns, SamplePlan(**args), backend=backend)


def test_layout_lengths_truncation_and_nan(setup):
    res = run(setup)
    rows = setup[2]
    n = len(rows) * 3
    assert res.num_prompts == len(rows) and len(res.texts) == n
    assert res.rewards.shape == (n, 2) and res.reward_names == ["digits", "correctness"]
    assert res.completion_lengths.shape == (n,) and res.truncated.shape == (n,)
    assert (res.completion_lengths <= 6).all() and (res.completion_lengths >= 1).all()
    # a truncated completion used every token; an ended one stopped at its EOS
    assert (res.completion_lengths[res.truncated] == 6).all()
    # rows grouped G at a time: prompt 3's completions are rows 9..11, and only they are NaN
    nan_rows = np.flatnonzero(np.isnan(res.rewards[:, 1]))
    assert nan_rows.tolist() == [9, 10, 11]
    assert not np.isnan(res.rewards[:, 0]).any()
    expected = [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in res.texts]
    np.testing.assert_allclose(res.rewards[:, 0], expected)
    assert res.grouped(res.rewards).shape == (len(rows), 3, 2)
    assert res.prompt_of(11) == 3


def test_same_seed_same_completions_and_different_seed_differs(setup):
    a, b, c = run(setup), run(setup), run(setup, seed=8)
    assert a.texts == b.texts
    np.testing.assert_array_equal(a.rewards, b.rewards)
    assert a.texts != c.texts


def test_greedy_does_not_depend_on_batching(setup):
    greedy = SamplingParams(max_new_tokens=6, do_sample=False)
    one = run(setup, num_generations=1, sampling=greedy, batch_size=1, seed=None)
    many = run(setup, num_generations=1, sampling=greedy, batch_size=10, seed=None)
    assert one.texts == many.texts
    assert one.num_prompts == 10


def test_errors_are_clear(setup):
    model, tokenizer, rows, encoder, fns = setup
    with pytest.raises(ValueError, match="row 0 has no 'prompt'"):
        sample_and_score(model, tokenizer, [{"question": "x"}], encoder, fns,
                         SamplePlan(2, SamplingParams(max_new_tokens=2), batch_size=1))
    empty = sample_and_score(model, tokenizer, [], encoder, fns,
                             SamplePlan(2, SamplingParams(max_new_tokens=2), 1))
    assert empty.rewards.shape == (0, 2) and empty.num_prompts == 0
