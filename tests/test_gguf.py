"""A GGUF model.name_or_path: converted once into a safetensors folder (the `convert` stage), the same bytes
on a re-run, later stages sent there; bad files fail naming the file and the reason, with exit 5 and nothing
written."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_core.common.errors import EXIT_DATA
from grpo_core.model.gguf import (
    CONVERTED_MODEL_DIR,
    GGUFError,
    convert_gguf,
    converted_model_dir,
    read_architecture,
)
from grpo_core.model.loading import resolve_model_path
from tests.real_model import smollm2_gguf


def digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def write_gguf(path: Path, arch: str) -> Path:
    """A minimal, well-formed GGUF of architecture ``arch`` (one tensor)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The converted folder's files (sha256). Two conversions, in other folders at other times (2026-11-27,
# transformers 5.19.0, gguf 0.19.0), wrote exactly these bytes; a third here - the test run's convert
# stage - must as well.
CONVERTED_SHA256 = {
    "chat_template.jinja": "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
    "config.json": "77f3c3aab6bf3aa6f443e660b5bd96505846a0b318a56836f2d4e0cc4c892e0e",
    "generation_config.json": "ba691a927ae160e4736bfceff8fa45a0d7e8dd9436bbdc99aa1dd15a1617994c",
    "gguf_source.json": "de196623fee6502e0b68fd65f5ff160516d8d946332126000af00199278c95fb",
    "model.safetensors": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
    "tokenizer.json": "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4",
    "tokenizer_config.json": "9a35ec54a7aefb72c27d6aa575cf9e0cc4c213995a62afbe8e4a5fac33c7d5c5",
}


@pytest.mark.slow
def test_conversion_is_the_real_smollm2_and_deterministic(converted_smollm2):
    """The folder is SmolLM2-135M-Instruct as the hub ships it (Llama, 30 layers, 134.5M parameters, 49,152
    tokens, ChatML template, <|im_end|> as EOS and pad), no GGUF quantization entry left, and the same bytes
    as every earlier conversion (CONVERTED_SHA256)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(converted_smollm2)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama", 30, 576, 49152)
    assert config.head_dim == 64 and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None
    source = json.loads((converted_smollm2 / "gguf_source.json").read_text())
    assert source["gguf_file"] == smollm2_gguf().name and source["parameters"] == 134_515_008
    tok = AutoTokenizer.from_pretrained(converted_smollm2)
    assert (tok.eos_token, tok.pad_token, tok.eos_token_id) == ("<|im_end|>", "<|im_end|>", 2)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n")
    assert digests(converted_smollm2) == CONVERTED_SHA256


@pytest.mark.slow
def test_converted_weights_equal_transformers_own_dequantization(converted_smollm2):
    """The saved tensors are the ones transformers dequantizes from the GGUF (a second reading, straight from
    ``from_pretrained(gguf_file=...)``), and the model answers a pretrained model's answer greedily."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    saved = load_file(converted_smollm2 / "model.safetensors")
    # tied to the embedding
    expected = {k: v for k, v in direct.state_dict().items() if k != "lm_head.weight"}
    assert set(saved) == set(expected)
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    tok = AutoTokenizer.from_pretrained(converted_smollm2)
    model = AutoModelForCausalLM.from_pretrained(converted_smollm2, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    assert "12" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(GGUFError, match=r"model.name_or_path: GGUF file .*nowhere.gguf does not exist"):
        convert_gguf(tmp_path / "nowhere.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="model.gguf is not a GGUF file"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_gguf_is_named(tmp_path):
    """Cut after the header: the tensor table promises bytes the file does not have."""
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf(), "rb") as src:
        cut.write_bytes(src.read(8 << 20))
    with pytest.raises(GGUFError,
                       match=r"cut.gguf is a truncated or corrupt GGUF file: ValueError: cannot reshape"):
        read_architecture(cut)


def test_corrupt_header_is_named(tmp_path):
    """The magic intact, the header's counts garbage: the reader cannot parse it."""
    data = bytearray(smollm2_gguf().read_bytes()[: 1 << 20])
    data[8:24] = b"\xff" * 16  # tensor and key-value counts
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="bad.gguf is a truncated or corrupt GGUF file"):
        read_architecture(bad)


def test_an_architecture_transformers_cannot_dequantize_is_named(tmp_path):
    odd = write_gguf(tmp_path / "odd.gguf", "made-up-arch")
    assert read_architecture(odd) == "made-up-arch"
    with pytest.raises(GGUFError,
                       match=r"cannot load the 'made-up-arch' model in .*odd.gguf: .*not supported"):
        convert_gguf(odd, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failed_conversion_keeps_the_previous_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "gguf_source.json").write_text('{"gguf_file": "old.gguf"}')
    with pytest.raises(GGUFError):
        convert_gguf(write_gguf(tmp_path / "odd.gguf", "made-up-arch"), out)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left
    assert json.loads((out / "gguf_source.json").read_text()) == {"gguf_file": "old.gguf"}


def test_a_gguf_name_or_path_resolves_to_the_converted_folder(tmp_path):
    with pytest.raises(GGUFError, match="run the `convert` stage"):
        resolve_model_path("models/m.gguf", tmp_path)
    folder = tmp_path / CONVERTED_MODEL_DIR
    folder.mkdir(parents=True)
    (folder / "gguf_source.json").write_text(json.dumps({"gguf_file": "other.gguf"}))
    with pytest.raises(GGUFError, match="converted from other.gguf, not m.gguf"):
        converted_model_dir("models/m.gguf", tmp_path)
    (folder / "gguf_source.json").write_text(json.dumps({"gguf_file": "m.gguf"}))
    assert resolve_model_path("models/m.gguf", tmp_path) == str(folder)


def test_convert_stage_exits_5_naming_the_file_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """`python -m flows.stages convert` on a corrupt GGUF: exit 5 (data unreadable, not retried), the message
    names the file, artifacts/converted_model is not created."""
    import yaml

    from flows.stages.__main__ import main

    repo = tmp_path / "repo"
    (repo / "models").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "params.yaml", repo / "params.yaml")
    (repo / ".dvc").mkdir()
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    raw["model"]["name_or_path"] = "models/broken.gguf"
    (repo / "params.yaml").write_text(yaml.safe_dump(raw))
    (repo / "models/broken.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    monkeypatch.chdir(repo)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    assert main(["convert"]) == EXIT_DATA
    err = capsys.readouterr().err
    assert "convert failed: GGUFError: model.name_or_path:" in err and "broken.gguf" in err
    assert not (repo / CONVERTED_MODEL_DIR).exists()
    raw["model"]["name_or_path"] = "artifacts/base_model"  # not GGUF: an empty folder for DVC
    (repo / "params.yaml").write_text(yaml.safe_dump(raw))
    assert main(["convert"]) == 0
    assert list((repo / CONVERTED_MODEL_DIR).iterdir()) == []
