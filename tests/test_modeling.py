"""Loading models and tokenizers: clear errors, a missing pad token handled, safetensors only."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_core.model.loading import ModelConfig, ModelLoadError, load_model, load_tokenizer
from grpo_core.train.loop import train
from tests.tiny import make_prompts, make_tiny_model, tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("modeling") / "model")


def test_missing_model_path_names_the_key_and_where_it_looked(tmp_path):
    with pytest.raises(ModelLoadError, match=r"model.name_or_path: './artifacts/nope' is not a directory "
                                             r"\(looked in .*artifacts/nope\)"):
        load_model(ModelConfig(name_or_path="./artifacts/nope"), root=tmp_path)


def test_tokenizer_without_pad_token_pads_with_eos_and_trains(tiny, tmp_path):
    model_dir = tmp_path / "nopad"
    tok = AutoTokenizer.from_pretrained(tiny)
    tok.pad_token = None
    tok.save_pretrained(model_dir)
    AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(model_dir)
    assert AutoTokenizer.from_pretrained(model_dir).pad_token_id is None

    loaded = load_tokenizer(ModelConfig(name_or_path=str(model_dir)))
    assert loaded.pad_token_id == loaded.eos_token_id is not None and loaded.padding_side == "left"
    cfg = tiny_config(model_dir, make_prompts(tmp_path / "train.jsonl"),
                      [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}], max_steps=1)
    assert train(cfg, root=tmp_path / "run", progress=False).final_step == 1


def test_tokenizer_with_neither_pad_nor_eos_is_an_error(tiny, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny)
    tok.pad_token = None
    tok.eos_token = None
    tok.save_pretrained(tmp_path / "bare")
    with pytest.raises(ModelLoadError, match="has neither a pad nor an EOS token"):
        load_tokenizer(ModelConfig(name_or_path=str(tmp_path / "bare")))


def test_pickled_weights_are_refused(tiny, tmp_path):
    """A pytorch_model.bin (pickle: arbitrary code on load) is never read; only safetensors are."""
    model_dir = tmp_path / "pickled"
    model = AutoModelForCausalLM.from_pretrained(tiny)
    model.config.save_pretrained(model_dir)
    torch.save(model.state_dict(), model_dir / "pytorch_model.bin")  # transformers 5 writes only safetensors
    AutoTokenizer.from_pretrained(tiny).save_pretrained(model_dir)
    assert (model_dir / "pytorch_model.bin").exists() and not list(model_dir.glob("*.safetensors"))
    with pytest.raises(ModelLoadError, match="model.name_or_path: cannot load a causal LM"):
        load_model(ModelConfig(name_or_path=str(model_dir)))
    assert ModelConfig().trust_remote_code is False


@pytest.mark.parametrize("damage", ["cut in half", "header overwritten"])
def test_a_damaged_weights_file_is_a_permanent_model_error(tiny, tmp_path, damage):
    """A weights file cut short or with a broken header (safetensors' own error) exits 5, naming the folder:
    retrying reads the same bytes."""
    from grpo_core.common.errors import EXIT_DATA, exit_code_for

    model_dir = tmp_path / "damaged"
    shutil.copytree(tiny, model_dir)
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if damage == "cut in half" else b"\xff" * 8 + data[8:])
    with pytest.raises(ModelLoadError, match=r"causal LM from '.*damaged'.*SafetensorError") as e:
        load_model(ModelConfig(name_or_path=str(model_dir)))
    assert exit_code_for(e.value) == EXIT_DATA
