"""The trained policy as GGUF (grpo_core/model/gguf_export.py, the `export` stage), proven by readers that are
not ours: gguf's GGUFReader (every tensor and key), llama.cpp's own file (the source GGUF: a re-export of the
untrained model in its type is that file, tensor for tensor), and transformers' GGUF reader (the weights as
torch casts them, the greedy replies of the trained model). Bad inputs fail naming what, before a file is
written; an interrupted write leaves nothing; the Modelfile is Ollama's for the model's chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_core.common.options import ConfigError
from grpo_core.model.gguf_export import (
    ExportOptions,
    GGUFExportError,
    Sampling,
    export_gguf,
    plan_export,
    resolve_types,
    write_gguf,
)
from grpo_core.model.modelfile import modelfile_text
from tests.real_model import smollm2_gguf
from tests.tiny import in_stage_repo, make_tiny_model

REPO = Path(__file__).resolve().parents[1]
SAMPLING = Sampling(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repeat_penalty=1.1)
# the SmolLM2 recipe's held-out prompts and system prompt (configs/smollm2-135m-word-problems.yaml)
PROMPTS = 16
NEW_TOKENS = 32
SYSTEM = "Solve the problem. End your reply with: The answer is N."


def read_gguf(path: Path) -> tuple[dict, dict]:
    """gguf's own reader on the file: key -> (value types, value), and tensor name -> tensor."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {name: (field.types, field.contents()) for name, field in reader.fields.items()
              if not name.startswith("GGUF.")}
    return fields, {t.name: t for t in reader.tensors}


def reader_fields(path: Path) -> dict:
    return read_gguf(path)[0]


def reader_tensors(path: Path) -> dict:
    return read_gguf(path)[1]


def from_gguf(path: Path):
    """The file as transformers' GGUF reader loads it (float32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def q8_0_bound(w: torch.Tensor) -> torch.Tensor:
    """Q8_0's worst error per weight, from its definition: blocks of 32 along a row, scale d = max|x| / 127
    stored as float16; |x - q d16| <= d/2 (rounding) + 127 |d - d16| (<= 127 d 2^-11)."""
    blocks = w.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    return (d * (0.5 + 127 * 2.0 ** -11) + 1e-12).expand_as(blocks).reshape(w.shape)


# ---------------------------------------------------------------------------------------------------
# the tiny Qwen2 (the embedded default's architecture and tokenizer): no source GGUF, every type


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, layers=2)


@pytest.fixture(scope="module")
def tiny_files(tiny, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tiny-gguf")
    plan = plan_export(tiny, name="tiny-grpo", sampling=SAMPLING)
    return {t: out / write_gguf(plan, out / f"tiny-grpo.{t}.gguf", t)["file"]
            for t in ("F32", "F16", "BF16", "Q8_0", "Q4_1")}


def test_transformers_reads_the_tiny_model_back_weight_for_weight(tiny, tiny_files):
    """F32 is the model itself, F16 / BF16 its weights as torch rounds them (norms stay F32), Q8_0 within the
    format's own error bound; the architecture's keys and the tensor types as llama.cpp writes them."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()
    for gguf_type, cast in (("F32", torch.float32), ("F16", torch.float16), ("BF16", torch.bfloat16)):
        loaded = from_gguf(tiny_files[gguf_type]).state_dict()
        assert set(loaded) == set(reference)
        expected = {k: v if v.ndim < 2 else v.to(cast).float() for k, v in reference.items()}
        assert [k for k in reference if not torch.equal(loaded[k], expected[k])] == [], gguf_type
    loaded = from_gguf(tiny_files["Q8_0"]).state_dict()
    for key, w in reference.items():
        bound = q8_0_bound(w) if w.ndim == 2 else torch.zeros_like(w)
        assert ((loaded[key] - w).abs() <= bound).all(), key
    assert not all(torch.equal(loaded[k], reference[k]) for k in reference)  # it is quantized

    fields = reader_fields(tiny_files["Q4_1"])
    config = json.loads((tiny / "config.json").read_text())
    assert {k: fields[f"qwen2.{k}"][1] for k in ("block_count", "embedding_length", "feed_forward_length",
                                                 "attention.head_count", "context_length", "vocab_size")} == {
        "block_count": 2, "embedding_length": 64, "feed_forward_length": 64, "attention.head_count": 4,
        "context_length": config["max_position_embeddings"], "vocab_size": config["vocab_size"]}
    types = {name: t.tensor_type.name for name, t in reader_tensors(tiny_files["Q4_1"]).items()}
    assert types["token_embd.weight"] == "Q8_0"  # the tied output layer, as llama-quantize keeps it
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == "Q4_1"
    assert types["blk.0.attn_q.bias"] == types["output_norm.weight"] == "F32"
    assert "output.weight" not in types  # tied: llama.cpp reuses the embedding


def test_the_tiny_tokenizer_reads_back_as_the_same_tokenizer(tiny, tiny_files):
    """No source GGUF: tokens, types, merges, special ids and the pre-tokenizer from the HF tokenizer
    (convert_hf_to_gguf's way); transformers' GGUF reader rebuilds a tokenizer that encodes alike."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny)
    fields = reader_fields(tiny_files["F16"])
    tokens = fields["tokenizer.ggml.tokens"][1]
    assert tokens == hf.convert_ids_to_tokens(list(range(len(hf))))  # added tokens: their text, as here
    assert fields["tokenizer.ggml.pre"][1] == "qwen2" and fields["tokenizer.ggml.model"][1] == "gpt2"
    assert [fields[f"tokenizer.ggml.{k}_token_id"][1] for k in ("bos", "eos", "padding")] == [
        hf.bos_token_id, hf.eos_token_id, hf.pad_token_id]
    assert fields["tokenizer.ggml.add_bos_token"][1] is False  # the embedded tokenizer adds no BOS
    types = fields["tokenizer.ggml.token_type"][1]
    assert types[hf.eos_token_id] == 3 and types[hf.convert_tokens_to_ids("<answer>")] == 4  # control; user
    assert fields["tokenizer.chat_template"][1] == hf.chat_template
    assert len(fields["tokenizer.ggml.merges"][1]) == len(json.loads((tiny / "tokenizer.json").read_text())[
        "model"]["merges"])
    assert fields["general.sampling.top_k"][1] == 40
    assert fields["general.sampling.temp"][1] == pytest.approx(0.7)

    read = AutoTokenizer.from_pretrained(tiny_files["F16"].parent, gguf_file=tiny_files["F16"].name)
    assert all(read.convert_tokens_to_ids(t) == i for t, i in hf.get_vocab().items())
    for text in ("Mia has 12 apples and eats 3.", "<reasoning> 7 + 5 = 12 </reasoning><answer>12</answer>",
                 "\\boxed{42}<|eos|>"):
        assert read.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text


def test_token_types_and_padding_are_convert_hf_to_gguf_s(tiny):
    """Ids the tokenizer lacks up to the model's vocab_size are [PAD<id>] (UNUSED, as Qwen2.5's padded
    embedding needs); an added token is CONTROL when special or special-looking (<|...|>), else
    USER_DEFINED."""
    from transformers import AutoTokenizer

    from grpo_core.model.gguf_export import vocabulary

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.add_tokens(["<|unmarked|>", "<plain>"])  # added, neither marked special
    size = len(tokenizer) + 2
    tokens, types = vocabulary(tokenizer, size, tiny)
    assert tokens[-4:] == ["<|unmarked|>", "<plain>", f"[PAD{size - 2}]", f"[PAD{size - 1}]"]
    assert types[-4:] == [3, 4, 5, 5]  # CONTROL, USER_DEFINED, UNUSED, UNUSED (gguf.TokenType)
    assert types[tokenizer.eos_token_id] == 3 and types[tokenizer.convert_tokens_to_ids("Mia")] == 1  # NORMAL
    with pytest.raises(GGUFExportError, match=r"the tokenizer has id \d+, past the model's vocab_size 10"):
        vocabulary(tokenizer, 10, tiny)


def test_a_lora_folder_exports_its_merged_weights_not_the_adapters(tiny, tmp_path):
    """A LoRA run's artifacts/model holds the merged model and adapter/ beside it: only the merged weights
    are read (an adapter tensor has no GGUF name, so reading it would fail the export)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    shutil.copytree(tiny, folder)
    (folder / "adapter").mkdir()
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 64)},
              folder / "adapter/adapter_model.safetensors")
    summary = export_gguf(folder, tmp_path / "m.F16.gguf", "F16")
    with safe_open(tiny / "model.safetensors", framework="pt") as f:
        merged = len(list(f.keys()))
    assert summary["tensors"] == len(reader_tensors(tmp_path / "m.F16.gguf")) == merged


# ---------------------------------------------------------------------------------------------------
# bad inputs: named, before a file is written; an interrupted write leaves nothing


def test_bad_export_settings_are_config_errors_naming_the_key():
    import yaml

    from grpo_core.common.errors import EXIT_CONFIG, exit_code_for
    from grpo_core.config import config_from_dict

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for export, message in (
            ({"gguf_types": ["F16", "Q4_K"]}, r"export.gguf_types: 'Q4_K' is not a type this export writes; "
                                              r"choose from F32, F16, BF16, Q8_0, Q5_1, Q5_0, Q4_1, Q4_0 or "
                                              r"source"),
            ({"gguf_types": []}, r"export.gguf_types: empty"),
            ({"gguf_types": ["Q8_0", "Q8_0"]}, r"export.gguf_types: \['Q8_0', 'Q8_0'\] names a type twice"),
            ({"name": "my model/v1"}, r"export.name: 'my model/v1' is not a file name stem"),
            ({"gguf_type": ["F16"]}, r"export.gguf_type: unknown key; did you mean 'gguf_types'")):
        with pytest.raises(ConfigError, match=message) as err:
            config_from_dict({**raw, "export": export})
        assert exit_code_for(err.value) == EXIT_CONFIG
    assert config_from_dict({**raw, "export": None}).export is None
    assert ExportOptions().gguf_types == ["F16", "Q8_0"]


def test_an_unknown_type_or_a_source_type_without_a_source_is_named_and_nothing_written(tiny, tmp_path):
    with pytest.raises(GGUFExportError, match=r"GGUF type 'Q4_K': choose from F32, F16, .* or source"):
        export_gguf(tiny, tmp_path / "m.Q4_K.gguf", "Q4_K")
    with pytest.raises(GGUFExportError, match=r"`source` is the type of the GGUF the model came from, but "
                                              r".*model is not a GGUF file"):
        export_gguf(tiny, tmp_path / "m.gguf", "source")
    assert list(tmp_path.iterdir()) == []


def test_an_architecture_the_export_cannot_map_is_named_before_a_file_is_written(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    gpt2.save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(GGUFExportError, match=r"gpt2: model_type 'gpt2' has no GGUF mapping in this export "
                                              r"\(supported: llama, qwen2\); set export: null"):
        export_gguf(tmp_path / "gpt2", out / "m.F16.gguf", "F16")
    assert list(out.iterdir()) == []


def test_rope_scaling_a_pre_tokenizer_or_a_tensor_it_cannot_map_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    def variant(name: str, change) -> Path:
        folder = tmp_path / name
        shutil.copytree(tiny, folder)
        change(folder)
        return folder

    def edit_json(path: Path, key: str, value) -> None:
        data = json.loads(path.read_text())
        data[key] = value
        path.write_text(json.dumps(data))

    yarn = variant("yarn", lambda f: edit_json(f / "config.json", "rope_parameters", {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}))
    words = variant("words", lambda f: edit_json(f / "tokenizer.json", "pre_tokenizer",
                                                 {"type": "Whitespace"}))

    def add_tensor(folder: Path) -> None:
        weights = load_file(folder / "model.safetensors")
        weights["model.layers.0.mystery.weight"] = torch.ones(4, 4)
        save_file(weights, folder / "model.safetensors")

    stray = variant("stray", add_tensor)
    out = tmp_path / "out"
    out.mkdir()
    for folder, message in ((yarn, r"yarn: rope scaling 'yarn' is not written by this export"),
                            (words, r"words/tokenizer.json: its pre-tokenizer has no llama.cpp name this "
                                    r"export knows \(\{\"type\": \"Whitespace\"\}\)"),
                            (stray, r"model.safetensors: tensor 'model.layers.0.mystery.weight' has no GGUF "
                                    r"name for architecture 'qwen2'")):
        with pytest.raises(GGUFExportError, match=message):
            export_gguf(folder, out / "m.F16.gguf", "F16")
    assert list(out.iterdir()) == []


def test_an_interrupted_write_leaves_the_previous_file_and_no_partial_one(tiny, tmp_path, monkeypatch):
    """Killed while the tensors go out (the header and part of the data written): the target keeps its old
    bytes, a new target never appears, and no temp file is left beside them."""
    import gguf

    done = tmp_path / "m.F16.gguf"
    export_gguf(tiny, done, "F16")
    before = done.read_bytes()

    def interrupted(self, *, progress: bool = False) -> None:
        self.write_ti_data_to_file()
        self.fout[0].write(b"\0" * 4096)
        self.fout[0].flush()
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", interrupted)
    for target in (done, tmp_path / "m.Q8_0.gguf"):
        with pytest.raises(KeyboardInterrupt):
            export_gguf(tiny, target, target.name.split(".")[1])
    assert [p.name for p in tmp_path.iterdir()] == ["m.F16.gguf"] and done.read_bytes() == before


# ---------------------------------------------------------------------------------------------------
# Ollama's Modelfile


def chatml_tokenizer(model_dir: Path):
    """The tiny tokenizer with ChatML's markers as special tokens, <|im_end|> as EOS, and the hub stand-in's
    ChatML template (Qwen's default system message when a chat has none)."""
    from transformers import AutoTokenizer

    from tests.hub_fixture import CHATML_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


CHATML_MODELFILE = '''# Ollama: ollama create <name> -f Modelfile && ollama run <name>
FROM ./m.Q8_0.gguf
TEMPLATE """{{ range .Messages }}{{ if eq .Role "system" }}<|im_start|>system
{{ .Content }}<|im_end|>
{{ else if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ .Content }}<|im_end|>
{{ end }}{{ end }}<|im_start|>assistant
"""
SYSTEM """%s"""
PARAMETER stop "<|im_end|>"
PARAMETER stop "<|im_start|>"
PARAMETER temperature 0.7
PARAMETER top_p 0.9
PARAMETER top_k 40
PARAMETER min_p 0.05
PARAMETER repeat_penalty 1.1
'''


def test_the_modelfile_for_a_chatml_template_is_ollamas_chatml(tiny):
    """Ollama's own ChatML layout (turns between <|im_start|>role and <|im_end|>, the assistant's opening
    last), the template's default system prompt as SYSTEM, both markers as stops, training's sampling."""
    from tests.hub_fixture import DEFAULT_SYSTEM

    expected = CHATML_MODELFILE % DEFAULT_SYSTEM
    assert modelfile_text("m.Q8_0.gguf", chatml_tokenizer(tiny), SAMPLING) == expected


def test_the_modelfile_system_is_the_prompt_the_policy_was_trained_under(tiny):
    """data.system_prompt replaces the template's default; without a chat template it goes on a line of its
    own before the prompt, as the prompt encoder rendered it in training; one the Modelfile's quotes cannot
    hold is left to the chat, said in a comment."""
    from transformers import AutoTokenizer

    from grpo_core.data.loading import PromptEncoder

    lines = modelfile_text("m.Q8_0.gguf", chatml_tokenizer(tiny), SAMPLING, system=SYSTEM).splitlines()
    assert [line for line in lines if line.startswith("SYSTEM")] == [f'SYSTEM """{SYSTEM}"""']
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.chat_template = None
    lines = modelfile_text("m.F16.gguf", tokenizer, SAMPLING, system=SYSTEM).splitlines()
    template = 'TEMPLATE """{{ if .System }}{{ .System }}\n{{ end }}{{ .Prompt }}"""'
    assert lines[2:5] == [*template.split("\n"), f'SYSTEM """{SYSTEM}"""']
    # the Go template with .System = SYSTEM and .Prompt = "2 + 3 = ?", by hand, is what training rendered
    assert PromptEncoder(tokenizer, None, SYSTEM).render("2 + 3 = ?") == f"{SYSTEM}\n2 + 3 = ?"
    quoted = 'Say """done""" at the end.'
    lines = modelfile_text("m.F16.gguf", tokenizer, SAMPLING, system=quoted).splitlines()
    assert not any(line.startswith("SYSTEM") for line in lines)
    assert any(line.startswith('# SYSTEM: the system prompt holds """') for line in lines)


def test_the_modelfile_for_plain_templates_and_ones_it_cannot_translate(tiny):
    """The embedded tokenizer's template (the messages' contents, nothing around them); no template (plain
    completion); a template that is not fixed text around each message (numbered turns): Ollama reads the
    GGUF's own template, so no TEMPLATE is written."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    lines = modelfile_text("m.F16.gguf", tokenizer, SAMPLING).splitlines()
    assert lines[1:4] == ["FROM ./m.F16.gguf",
                          'TEMPLATE """{{ range .Messages }}{{ if eq .Role "system" }}{{ .Content }}'
                          '{{ else if eq .Role "user" }}{{ .Content }}{{ else if eq .Role "assistant" }}'
                          '{{ .Content }}{{ end }}{{ end }}"""',
                          'PARAMETER stop "<|eos|>"']
    tokenizer.chat_template = None
    assert modelfile_text("m.F16.gguf", tokenizer, SAMPLING).splitlines()[2:4] == [
        'TEMPLATE """{{ .Prompt }}"""', 'PARAMETER stop "<|eos|>"']
    every_turn = "{% for m in messages %}{{ loop.index }}. {{ m['content'] }}\n{% endfor %}"
    replies = ("{% set n = namespace(a=0) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
               "{% set n.a = n.a + 1 %}A{{ n.a }}: {% endif %}{{ m['content'] }}\n{% endfor %}")
    for numbered in (every_turn, replies):  # numbered turns, or numbered replies only
        tokenizer.chat_template = numbered
        lines = modelfile_text("m.F16.gguf", tokenizer, SAMPLING).splitlines()
        assert lines[2].startswith("# TEMPLATE: the chat template is not fixed text around each message")
        assert not any(line.startswith(("TEMPLATE", "SYSTEM")) for line in lines)


# ---------------------------------------------------------------------------------------------------
# the stage: files, attached to the registered version; a failed export keeps the last one


def registered_like_evaluate(root: Path, model_dir: Path) -> None:
    """What evaluate leaves in the registry for this model: a logged model of the files, a version tagged
    with their md5, the champion alias on it."""
    from mlflow import MlflowClient

    from flows.stages.evaluate import CHAMPION, MODEL_MD5_TAG, log_policy_model, model_files_md5

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("grpo-pipeline")).info.run_id
    model_id = log_policy_model(client, run_id, model_dir, {})
    client.create_registered_model("grpo-policy")
    version = client.create_model_version("grpo-policy", f"models:/{model_id}", run_id=run_id,
                                          tags={MODEL_MD5_TAG: model_files_md5(model_dir)}, model_id=model_id)
    client.set_registered_model_alias("grpo-policy", CHAMPION, version.version)
    client.set_terminated(run_id)


def test_the_stage_exports_attaches_to_the_champion_and_a_failed_export_keeps_the_last(tiny, tmp_path,
                                                                                         monkeypatch, capsys):
    import mlflow
    import yaml
    from mlflow import MlflowClient

    from flows.stages.__main__ import main
    from grpo_core.common.errors import EXIT_CONFIG

    shutil.copytree(tiny, tmp_path / "artifacts/model")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["generation"].update(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1)
    raw["data"]["system_prompt"] = SYSTEM
    repo = in_stage_repo(tmp_path, raw, monkeypatch, "test-export")
    registered_like_evaluate(repo, repo / "artifacts/model")

    assert main(["export"]) == 0
    export = repo / "artifacts/export"
    files = sorted(p.name for p in export.iterdir())
    assert files == ["Modelfile", "embedded-grpo.F16.gguf", "embedded-grpo.Q8_0.gguf"]
    modelfile = (export / "Modelfile").read_text()
    assert "FROM ./embedded-grpo.F16.gguf\n" in modelfile and "PARAMETER temperature 0.7\n" in modelfile
    assert f'SYSTEM """{SYSTEM}"""\n' in modelfile  # data.system_prompt: what the policy was trained under
    fields = reader_fields(export / "embedded-grpo.Q8_0.gguf")
    assert (fields["general.name"][1], fields["general.sampling.top_k"][1]) == ("embedded-grpo", 40)
    champion = MlflowClient().get_model_version_by_alias("grpo-policy", "champion")
    assert champion.tags["gguf.files"] == ",".join(files)
    download = Path(mlflow.artifacts.download_artifacts("models:/grpo-policy@champion",
                                                        dst_path=str(tmp_path / "download")))
    assert (download / "config.json").is_file()  # the HF folder, as evaluate registered it
    assert all((download / "gguf" / f).read_bytes() == (export / f).read_bytes() for f in files)
    assert "attached to grpo-policy v1" in capsys.readouterr().err

    kept = {f: (export / f).read_bytes() for f in files}
    raw["export"]["gguf_types"] = ["F16", "source"]
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    assert main(["export"]) == EXIT_CONFIG
    assert ("export.gguf_types: `source` is the type of the GGUF the model came from, but "
            "artifacts/base_model is not a GGUF file") in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in export.iterdir()} == kept

    raw["export"] = None
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    assert main(["export"]) == 0 and list(export.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct, the real weights: exported F16, Q8_0 and in the source's own type (Q4_1)

NEAR_TIE = 0.1      # logits: F16 rounding (2^-11 of each weight) moves SmolLM2's logits by <= 0.05 here
Q8_0_AGREEMENT = 0.95   # share of the trained model's greedy tokens Q8_0 also ranks first (measured: 0.980)
Q8_0_FLIP_MARGIN = 0.5  # logits: Q8_0 moves them by 0.67 (median), so a flip needs a gap below that


@pytest.fixture(scope="module")
def smollm2_export(converted_smollm2, tmp_path_factory) -> dict[str, Path]:
    """The converted SmolLM2 (the trained model's stand-in: same files, same architecture) exported as the
    SmolLM2 recipes do: F16, Q8_0 and `source`."""
    out = tmp_path_factory.mktemp("smollm2-gguf")
    plan = plan_export(converted_smollm2, smollm2_gguf(), name="SmolLM2-135M-Instruct-grpo",
                       sampling=SAMPLING)
    types = resolve_types(["F16", "Q8_0", "source"], plan, str(smollm2_gguf()))
    assert types == ["F16", "Q8_0", "Q4_1"]
    return {t: out / write_gguf(plan, out / f"SmolLM2-135M-Instruct-grpo.{t}.gguf", t)["file"] for t in types}


@pytest.fixture(scope="module")
def greedy_reference(converted_smollm2) -> dict:
    """The trained model's greedy replies to the first PROMPTS held-out prompts of the SmolLM2 recipe (its
    system prompt, ChatML), and at each step the gap between its two best logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_smollm2)
    tokenizer.padding_side = "left"
    rows = [json.loads(line) for line in (REPO / "data/word-problems/eval.jsonl").read_text().splitlines()]
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
             for row in rows[:PROMPTS]]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(converted_smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    reply = out.sequences[:, batch["input_ids"].shape[1]:]
    best = torch.stack(out.logits, dim=1).topk(2, dim=-1).values
    ended = (reply == tokenizer.eos_token_id).int().cumsum(dim=1)
    valid = (ended == 0) | ((ended == 1) & (reply == tokenizer.eos_token_id))  # up to its first EOS
    return {"batch": batch, "reply": reply, "margin": best[..., 0] - best[..., 1], "valid": valid,
            "weights": model.state_dict()}


def agreement(model, reference: dict) -> torch.Tensor:
    """(prompt, step) -> whether ``model`` ranks the trained model's greedy token first, given the same
    prefix (one teacher-forced pass). Greedy decoding emits that first-ranked token: where it holds at every
    step of a reply, the model's own greedy reply is the same text."""
    batch, reply = reference["batch"], reference["reply"]
    ids = torch.cat([batch["input_ids"], reply], dim=1)
    mask = torch.cat([batch["attention_mask"], torch.ones_like(reply)], dim=1)
    with torch.no_grad():  # the logits that predict the reply's tokens only
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                       logits_to_keep=reply.shape[1] + 1).logits
    first = logits[:, :-1].argmax(dim=-1)
    return (first == reply) | ~reference["valid"]


@pytest.mark.slow
def test_gguf_reader_finds_every_tensor_and_key_of_the_source(converted_smollm2, smollm2_export):
    """Against llama.cpp's own file (the source GGUF): the same 272 tensors, every key with the same type and
    value (the Llama hyperparameters we derive from config.json included) but the name, the file type and
    ours (base model, sampling); the tokens are the trained model's tokenizer's, id for id, and so are the
    chat template and special ids. In the source's own type the tensors are llama.cpp's bytes."""
    from transformers import AutoTokenizer

    source, original = read_gguf(smollm2_gguf())
    kept = {k: v for k, v in source.items() if k not in ("general.name", "general.file_type")}
    for gguf_type, file_type in (("F16", 1), ("Q8_0", 7), ("Q4_1", 3)):  # llama.cpp's file type ids
        exported, tensors = read_gguf(smollm2_export[gguf_type])
        ours = {"general.name", "general.file_type", "general.base_model.count", "general.base_model.0.name",
                *(k for k in exported if k.startswith("general.sampling."))}
        assert {k: v for k, v in exported.items() if k not in ours} == kept, gguf_type
        assert exported["general.file_type"][1] == file_type
        assert exported["general.base_model.0.name"][1] == source["general.name"][1]
        assert exported["general.sampling.top_p"][1] == pytest.approx(0.9)
        assert sorted(tensors) == sorted(original) and len(tensors) == 272
        assert all(list(tensors[n].shape) == list(original[n].shape) for n in original)
        kinds = {n: t.tensor_type.name for n, t in tensors.items()}
        if gguf_type == "Q4_1":  # re-quantizing the dequantized weights gives back llama.cpp's blocks exactly
            assert [n for n in original if kinds[n] != original[n].tensor_type.name
                    or not np.array_equal(tensors[n].data, original[n].data)] == []
        else:
            assert {kinds[n] for n in kinds if len(original[n].shape) == 2} == {gguf_type}
            assert {kinds[n] for n in kinds if len(original[n].shape) == 1} == {"F32"}
    tokenizer = AutoTokenizer.from_pretrained(converted_smollm2)
    assert source["tokenizer.ggml.tokens"][1] == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    assert source["tokenizer.chat_template"][1] == tokenizer.chat_template
    assert [source[f"tokenizer.ggml.{k}_token_id"][1] for k in ("bos", "eos", "padding")] == [
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]


@pytest.mark.slow
def test_transformers_reads_the_f16_file_as_the_trained_model(smollm2_export, greedy_reference):
    """Weights: each the trained model's, as torch rounds it to float16 (norms exact). Greedy replies to the
    held-out prompts: the same text, but for near ties (the trained model's two best logits closer than
    NEAR_TIE where they part), on at most 2 of the 16 prompts (measured: 1, at a gap of 0.0004)."""
    model = from_gguf(smollm2_export["F16"])
    weights, reference = model.state_dict(), greedy_reference["weights"]
    assert set(weights) == set(reference)
    rounded = {k: w if w.ndim < 2 else w.half().float() for k, w in reference.items()}
    assert [k for k in reference if not torch.equal(weights[k], rounded[k])] == []
    agree = agreement(model, greedy_reference)
    parted = {i: int((~agree[i]).nonzero()[0]) for i in range(PROMPTS) if not agree[i].all()}
    assert len(parted) <= 2, parted
    assert all(greedy_reference["margin"][i, step] < NEAR_TIE for i, step in parted.items()), parted


@pytest.mark.slow
def test_transformers_reads_the_q8_0_file_within_the_formats_bound(smollm2_export, greedy_reference):
    """Weights: within Q8_0's own error bound of the trained model's. The trained model's greedy tokens on the
    held-out prompts: Q8_0 ranks at least Q8_0_AGREEMENT of them first, and ranks another first only where the
    trained model's two best logits are within Q8_0_FLIP_MARGIN."""
    model = from_gguf(smollm2_export["Q8_0"])
    weights, reference = model.state_dict(), greedy_reference["weights"]
    for key, w in reference.items():
        bound = q8_0_bound(w) if w.ndim == 2 else torch.zeros_like(w)
        assert ((weights[key] - w).abs() <= bound).all(), key
    agree = agreement(model, greedy_reference)
    valid = greedy_reference["valid"]
    assert (agree & valid).sum() / valid.sum() >= Q8_0_AGREEMENT
    assert (greedy_reference["margin"][~agree] < Q8_0_FLIP_MARGIN).all()


SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.mark.slow
def test_smollm2s_modelfile_is_ollamas_chatml_with_its_default_system_prompt(converted_smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_smollm2)
    assert modelfile_text("m.Q8_0.gguf", tokenizer, SAMPLING) == CHATML_MODELFILE % SMOLLM2_SYSTEM
