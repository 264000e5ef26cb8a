"""A sequence-classification reward model as a reward (`function: reward_model`): batched, right-padded scores
equal each text scored alone, unpadded; chat prompts go through the model's own chat template, as TRL does."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from grpo_core.rewards import build_reward_functions
from tests.hub_fixture import IM_END, build_chat_tokenizer

PROMPTS = ["What is 2 + 3?", "Name a colour.", "Count to three, please, slowly and clearly.", "Hi", "Why?"]
COMPLETIONS = [" 5", " Blue, or maybe red.", " One. Two. Three.", " Hello there!", " Because."]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm")
    tok = build_chat_tokenizer(PROMPTS + COMPLETIONS)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def alone(path, texts):
    """Each text scored by itself: no padding anywhere."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path)
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                for t in texts]


def test_plain_prompts_batched_and_padded_equal_each_alone(classifier_dir):
    (reward,) = build_reward_functions([{"name": "rm", "function": "reward_model",
                                         "kwargs": {"model": str(classifier_dir), "batch_size": 3}}])
    scores = reward(PROMPTS, COMPLETIONS)
    expected = alone(classifier_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) == 5  # the texts really differ to the model


def test_chat_prompts_use_the_models_chat_template(classifier_dir):
    from transformers import AutoTokenizer

    (reward,) = build_reward_functions([{"name": "rm", "function": "reward_model",
                                         "kwargs": {"model": str(classifier_dir)}}])
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c.strip()}] for c in COMPLETIONS]
    tok = AutoTokenizer.from_pretrained(classifier_dir)
    texts = [tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    assert all(t.rstrip().endswith(IM_END) for t in texts)
    assert reward(prompts, completions) == pytest.approx(alone(classifier_dir, texts), abs=1e-5)


def test_a_tokenizer_without_pad_token_pads_with_eos(classifier_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(classifier_dir)
    tok.pad_token = None
    tok.save_pretrained(classifier_dir)  # the model folder as some hubs ship it
    (reward,) = build_reward_functions([{"name": "rm", "function": "reward_model",
                                         "kwargs": {"model": str(classifier_dir), "batch_size": 5}}])
    expected = alone(classifier_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert reward(PROMPTS, COMPLETIONS) == pytest.approx(expected, abs=1e-5)


def test_a_missing_model_is_a_config_error_naming_the_reward(tmp_path):
    from grpo_core.rewards import RewardConfigError

    with pytest.raises((RewardConfigError, OSError), match="rm|no_such_model"):
        build_reward_functions([{"name": "rm", "function": "reward_model",
                                 "kwargs": {"model": str(tmp_path / "no_such_model")}}])
