"""The trained policy as GGUF, the file llama.cpp, Ollama and LM Studio run, and a Modelfile for Ollama.

The inverse of ``grpo_core/model/gguf.py``, written with the ``gguf`` package alone (its ``GGUFWriter``, its
``TensorNameMap`` for the tensor names, its numpy quantizers) and llama.cpp's conventions
(convert_hf_to_gguf.py):

* tensors: Llama's q_proj / k_proj rows are permuted into llama.cpp's rotary layout (transformers' GGUF reader
  permutes them back); 1-D tensors and norms stay F32; a tensor whose rows do not split into the type's blocks
  falls back to F16; below 8 bits the output layer (the token embedding when tied) is Q8_0, as llama-quantize
  keeps it (its Q6_K falls back to Q8_0 on these widths, and gguf's numpy has no Q6_K writer);
* metadata: the architecture's hyperparameters from config.json; the tokenizer (tokens, token types, merges,
  special ids, add_bos/add_eos, pre-tokenizer), the chat template and ``general.*`` copied from the source
  GGUF when the model came from one, else built from the HF tokenizer as convert_hf_to_gguf builds a
  byte-level BPE vocabulary; ``general.sampling.*`` from the pipeline's sampling settings (llama.cpp's
  defaults for the file).

``plan_export`` reads and checks everything first: an architecture, rope scaling, tensor or tokenizer the
export cannot map is an error naming it before a byte is written. Each file is written to a temp path beside
its target and renamed into place. Ollama's Modelfile beside the files: ``grpo_core/model/modelfile.py``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.common.errors import ConfigurationError
from grpo_core.common.files import atomic_path
from grpo_core.common.options import ConfigError, Options, option

#: the types gguf's numpy quantizer writes (K-quants need llama.cpp's llama-quantize), best first
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
SOURCE_TYPE = "source"  # in export.gguf_types: the source GGUF's own type
SUB_8_BIT = ("Q5_1", "Q5_0", "Q4_1", "Q4_0")
#: HF model_type -> llama.cpp architecture, for the families whose tensors and keys this export writes
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
TYPE_SUFFIX = re.compile(r"(?i)(f32|f16|bf16|[it]?q\d\w*)")  # a GGUF file name's type: .Q4_1, .Q4_K_M, .f16


class GGUFExportError(ConfigurationError, ValueError):
    """The model cannot be written as GGUF; the message names what (architecture, tensor, tokenizer, type)."""


@dataclass
class ExportOptions(Options):
    """params.yaml `export:` (flows/stages/export.py)."""

    gguf_types: list[str] = option(["F16", "Q8_0"], "GGUF files written, one per type: F32, F16, BF16, Q8_0, "
                                   "Q5_1, Q5_0, Q4_1, Q4_0, or `source` (the type of the GGUF the model came "
                                   "from); the Modelfile runs the first")
    name: str | None = option(None, "file name stem, <name>.<type>.gguf (letters, digits, . _ -); null = the "
                              "source model's name + '-grpo'")
    modelfile: bool = option(True, "write an Ollama Modelfile beside the files")

    def check(self) -> None:
        if not self.gguf_types:
            raise ConfigError("gguf_types: empty; name at least one type (e.g. [F16, Q8_0]), or set "
                              "export: null")
        for t in self.gguf_types:
            if t not in (*GGUF_TYPES, SOURCE_TYPE):
                raise ConfigError(f"gguf_types: {t!r} is not a type this export writes; choose from "
                                  f"{', '.join(GGUF_TYPES)} or {SOURCE_TYPE} (K-quants: run llama.cpp's "
                                  "llama-quantize on the F16 file)")
        if len(set(self.gguf_types)) != len(self.gguf_types):
            raise ConfigError(f"gguf_types: {self.gguf_types} names a type twice")
        if self.name is not None and not NAME_PATTERN.fullmatch(self.name):
            raise ConfigError(f"name: {self.name!r} is not a file name stem (letters, digits, '.', '_', '-')")


@dataclass(frozen=True)
class Sampling:
    """How the policy was sampled in training: the file's and the Modelfile's defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0


@dataclass
class ExportPlan:
    """What every exported type shares, read and checked once, before anything is written."""

    model_dir: Path
    arch: str
    metadata: dict[str, Any]              # key -> gguf.GGUFValue; file type and quantization version aside
    tensors: list[tuple[Path, str, str]]  # (safetensors file, HF name, GGUF name)
    heads: tuple[int, int]                # attention heads, key/value heads (Llama's rotary permutation)
    source_type: str | None               # the source GGUF's type name


def default_name(name_or_path: str) -> str:
    """The export's file name stem: the source model's name (a GGUF's file name less its type, a folder's or
    hub id's last part) + '-grpo'."""
    stem = Path(str(name_or_path).rstrip("/")).name
    if stem.lower().endswith(".gguf"):
        head, dot, tail = stem[:-len(".gguf")].rpartition(".")
        stem = head if dot and TYPE_SUFFIX.fullmatch(tail) else stem[:-len(".gguf")]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("._-")
    return f"{stem or 'model'}-grpo"


# --------------------------------------------------------------------------------------------------
# the plan


def plan_export(model_dir: str | Path, source_gguf: str | Path | None = None, *, name: str,
                sampling: Sampling | None = None) -> ExportPlan:
    """Read the model folder (and the source GGUF's metadata) and check the export can map all of it."""
    import gguf

    model_dir = Path(model_dir)
    config = read_config(model_dir)
    arch = architecture_of(config, model_dir)
    check_rope(config, model_dir)
    tensors = tensor_names(model_dir, arch, config)
    scratch = gguf.GGUFWriter(None, arch)  # collects the keys; written to no file
    add_hyperparameters(scratch, arch, config)
    source_type = None
    if source_gguf is not None:
        source_type = copy_source_metadata(scratch, Path(source_gguf), arch)
    else:
        add_hf_vocabulary(scratch, model_dir, config)
        add_general(scratch, tensors)
    scratch.add_name(name)
    add_sampling(scratch, sampling or Sampling())
    metadata = {k: v for k, v in scratch.kv_data[0].items() if k != gguf.Keys.General.ARCHITECTURE}
    n_head = config["num_attention_heads"]
    heads = (n_head, config.get("num_key_value_heads") or n_head)
    return ExportPlan(model_dir, arch, metadata, tensors, heads, source_type)


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise GGUFExportError(f"{model_dir}: no config.json; not a Hugging Face model folder")
    return json.loads(path.read_text(encoding="utf-8"))


def architecture_of(config: dict, model_dir: Path) -> str:
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise GGUFExportError(f"{model_dir}: model_type {model_type!r} has no GGUF mapping in this export "
                              f"(supported: {', '.join(ARCHITECTURES)}); set export: null, or convert with "
                              "llama.cpp's convert_hf_to_gguf.py")
    return ARCHITECTURES[model_type]


def check_rope(config: dict, model_dir: Path) -> None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        raise GGUFExportError(f"{model_dir}: rope scaling {kind!r} is not written by this export (only the "
                              "default rope); convert with llama.cpp's convert_hf_to_gguf.py")


def tensor_files(model_dir: Path) -> list[Path]:
    """The folder's own weights (a LoRA run's adapter/ subfolder is not read: the top level holds the merged
    model)."""
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise GGUFExportError(f"{model_dir}: no model*.safetensors weights to export")
    return files


def tensor_names(model_dir: Path, arch: str, config: dict) -> list[tuple[Path, str, str]]:
    """(file, HF name, GGUF name) for every tensor written; an unmapped tensor is an error naming it."""
    import gguf
    from safetensors import safe_open

    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])
    tied = config.get("tie_word_embeddings", False)
    mapped = []
    for file in tensor_files(model_dir):
        with safe_open(file, framework="pt") as f:
            keys = list(f.keys())
        for key in keys:
            if key.endswith("rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
                continue  # recomputed by the runtime / the embedding itself
            target = names.get_name(key, try_suffixes=(".weight", ".bias"))
            if target is None:
                raise GGUFExportError(f"{file}: tensor {key!r} has no GGUF name for architecture {arch!r}")
            mapped.append((file, key, target))
    return mapped


def add_hyperparameters(writer, arch: str, config: dict) -> None:
    """llama.cpp's keys for the architecture, from config.json (convert_hf_to_gguf's TextModel and
    LlamaModel)."""
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config.get("num_key_value_heads") or n_head)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def copy_source_metadata(writer, source: Path, arch: str) -> str:
    """The source GGUF's tokenizer.* and general.* keys (its own name aside: the base model's name is kept as
    general.base_model.0.name); returns the source's type name."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    source_arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    if source_arch != arch:
        raise GGUFExportError(f"{source}: a {source_arch!r} model, but the trained model is {arch!r}; "
                              "model.name_or_path must name the GGUF the model was trained from")
    skipped = (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE, gguf.Keys.General.NAME,
               gguf.Keys.General.QUANTIZATION_VERSION)
    for field in reader.fields.values():
        ours = field.name in skipped or field.name.startswith("general.sampling.")
        if ours or not field.name.startswith(("tokenizer.", "general.")):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    base = reader.get_field(gguf.Keys.General.NAME)
    if base is not None:
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, base.contents())
    file_type = reader.get_field(gguf.Keys.General.FILE_TYPE)
    return type_of_file(int(file_type.contents())) if file_type is not None else "F32"


def type_of_file(file_type: int) -> str:
    """llama.cpp's file type as its tensor type name (MOSTLY_Q4_1 -> Q4_1)."""
    import gguf

    name = gguf.LlamaFileType(file_type).name
    return "F32" if name == "ALL_F32" else name.removeprefix("MOSTLY_")


def file_type_of(gguf_type: str) -> int:
    import gguf

    kinds = gguf.LlamaFileType
    return int(kinds.ALL_F32 if gguf_type == "F32" else kinds[f"MOSTLY_{gguf_type}"])


def add_general(writer, tensors: list[tuple[Path, str, str]]) -> None:
    """general.type and the size label, as convert_hf_to_gguf writes them."""
    import gguf
    from safetensors import safe_open

    total = 0
    for file in sorted({f for f, _, _ in tensors}):
        with safe_open(file, framework="pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for path, key, _ in tensors if path == file)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_size_label(gguf.size_label(total, 0, 0, 0))


def add_sampling(writer, sampling: Sampling) -> None:
    writer.add_sampling_temp(sampling.temperature)
    writer.add_sampling_top_p(sampling.top_p)
    writer.add_sampling_top_k(sampling.top_k)
    writer.add_sampling_min_p(sampling.min_p)
    writer.add_sampling_penalty_repeat(sampling.repeat_penalty)


# --------------------------------------------------------------------------------------------------
# the tokenizer, when no source GGUF holds it


def add_hf_vocabulary(writer, model_dir: Path, config: dict) -> None:
    """A byte-level BPE tokenizer as convert_hf_to_gguf writes one (its get_vocab_base and gguf's
    SpecialVocab: merges, special ids, add_bos/add_eos, the chat template)."""
    import gguf
    from transformers import AutoTokenizer

    spec = read_tokenizer_json(model_dir)
    pre = pre_tokenizer_name(spec, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens, token_types = vocabulary(tokenizer, config["vocab_size"], model_dir)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    added = added_specials(tokenizer)
    for kind, adds in added.items():  # what the tokenizer does, where tokenizer_config.json does not say
        special.add_special_token.setdefault(kind, adds)
    special.add_to_gguf(writer, quiet=True)


def read_tokenizer_json(model_dir: Path) -> dict:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise GGUFExportError(f"{model_dir}: no tokenizer.json; this export writes byte-level BPE tokenizers "
                              "(a fast tokenizer's tokenizer.json)")
    spec = json.loads(path.read_text(encoding="utf-8"))
    kind = (spec.get("model") or {}).get("type")
    if kind != "BPE":
        raise GGUFExportError(f"{path}: a {kind} tokenizer; this export writes byte-level BPE tokenizers "
                              "only")
    return spec


def pre_tokenizer_name(spec: dict, model_dir: Path) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer (tokenizer.ggml.pre), by its split regex: the names
    transformers' GGUF reader rebuilds each regex from, so the file reads back to the same splits."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # GPT-2's own regex inside ByteLevel
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if [s.get("type") for s in steps] == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        for name, split in GGUF_PRE_TOKENIZER_SPLITS.items():
            if split == regex:
                return name
    raise GGUFExportError(f"{model_dir}/tokenizer.json: its pre-tokenizer has no llama.cpp name this export "
                          f"knows ({json.dumps(pre)[:200]}); export from the GGUF the model came from "
                          "(model.name_or_path), or convert with llama.cpp's convert_hf_to_gguf.py")


def vocabulary(tokenizer, size: int, model_dir: Path) -> tuple[list[str], list[int]]:
    """Tokens and token types by id as get_vocab_base writes them: ids the tokenizer lacks are [PAD<i>]
    (UNUSED), added tokens CONTROL when special (or special-looking), else USER_DEFINED."""
    import gguf

    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    if max(by_id) >= size:
        raise GGUFExportError(f"{model_dir}: the tokenizer has id {max(by_id)}, past the model's vocab_size "
                              f"{size}")
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if i in added:
            special = added[i].special or looks_special(token)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def looks_special(token: str) -> bool:
    """convert_hf_to_gguf's does_token_look_special: control tokens some tokenizers leave unmarked."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def added_specials(tokenizer) -> dict[str, bool]:
    """Whether encoding adds BOS / EOS (GGUF's add_bos_token / add_eos_token), by encoding a word."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a")
    adds = full != plain
    return {"bos": adds and tokenizer.bos_token_id is not None and full[0] == tokenizer.bos_token_id,
            "eos": adds and tokenizer.eos_token_id is not None and full[-1] == tokenizer.eos_token_id}


# --------------------------------------------------------------------------------------------------
# writing


def resolve_types(requested: list[str], plan: ExportPlan, where: str) -> list[str]:
    """export.gguf_types with `source` replaced by the source GGUF's type (each type once, in order)."""
    types: list[str] = []
    for t in requested:
        if t == SOURCE_TYPE:
            if plan.source_type is None:
                raise GGUFExportError(f"export.gguf_types: `{SOURCE_TYPE}` is the type of the GGUF the model "
                                      f"came from, but {where} is not a GGUF file")
            if plan.source_type not in GGUF_TYPES:
                raise GGUFExportError(f"export.gguf_types: `{SOURCE_TYPE}` is {plan.source_type}, which "
                                      "gguf's numpy quantizer does not write ("
                                      f"{', '.join(GGUF_TYPES)}); name a type, or quantize the F16 file "
                                      "with llama.cpp's llama-quantize")
            t = plan.source_type
        if t not in types:
            types.append(t)
    return types


def export_gguf(model_dir: str | Path, out_path: str | Path, gguf_type: str,
                source_gguf: str | Path | None = None, *, name: str | None = None,
                sampling: Sampling | None = None) -> dict[str, Any]:
    """One file: ``model_dir`` (a safetensors folder) as ``out_path`` in ``gguf_type`` (or `source`)."""
    if gguf_type not in (*GGUF_TYPES, SOURCE_TYPE):
        raise GGUFExportError(f"GGUF type {gguf_type!r}: choose from {', '.join(GGUF_TYPES)} or "
                              f"{SOURCE_TYPE}")
    stem = Path(out_path).name.removesuffix(".gguf").removesuffix(f".{gguf_type}")
    plan = plan_export(model_dir, source_gguf, name=name or stem, sampling=sampling)
    (resolved,) = resolve_types([gguf_type], plan, str(source_gguf or model_dir))
    return write_gguf(plan, out_path, resolved)


def write_gguf(plan: ExportPlan, out_path: str | Path, gguf_type: str) -> dict[str, Any]:
    """The planned model as one GGUF of ``gguf_type``, written to a temp path then renamed; its summary."""
    import gguf

    out_path = Path(out_path)
    counts: dict[str, int] = {}
    with atomic_path(out_path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), plan.arch)
        try:
            for key, value in plan.metadata.items():
                writer.add_key_value(key, value.value, value.type, sub_type=value.sub_type)
            writer.add_file_type(file_type_of(gguf_type))
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            for target, data, qtype in quantized_tensors(plan, gguf_type):
                writer.add_tensor(target, data, raw_dtype=qtype)
                counts[qtype.name] = counts.get(qtype.name, 0) + 1
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return {"file": out_path.name, "type": gguf_type, "bytes": out_path.stat().st_size,
            "tensors": len(plan.tensors), "tensor_types": counts}


def quantized_tensors(plan: ExportPlan, gguf_type: str):
    """(GGUF name, data, type) of every tensor: read in float32, rotary rows permuted for Llama, converted."""
    import gguf
    import torch
    from safetensors import safe_open

    targets = {t for _, _, t in plan.tensors}
    output_layer = "output.weight" if "output.weight" in targets else "token_embd.weight"
    for file in sorted({f for f, _, _ in plan.tensors}):
        with safe_open(file, framework="pt") as f:
            for path, key, target in plan.tensors:
                if path != file:
                    continue
                data = f.get_tensor(key).to(torch.float32).numpy()
                data = rotary_layout(plan, target, data)
                qtype = gguf.GGMLQuantizationType[tensor_type(target, data.ndim, gguf_type, output_layer)]
                try:
                    converted = gguf.quants.quantize(data, qtype)
                except gguf.QuantError:  # rows that do not split into the type's blocks: F16, as convert does
                    qtype = gguf.GGMLQuantizationType.F16
                    converted = gguf.quants.quantize(data, qtype)
                yield target, converted, qtype


def tensor_type(target: str, ndim: int, gguf_type: str, output_layer: str) -> str:
    if ndim <= 1 or target.endswith("_norm.weight"):
        return "F32"
    if gguf_type in SUB_8_BIT and target == output_layer:
        return "Q8_0"
    return gguf_type


def rotary_layout(plan: ExportPlan, target: str, data):
    """Llama's q/k rows reordered as convert_hf_to_gguf's LlamaModel.permute does (the halves of each head's
    rotary dimensions interleaved, llama.cpp's rope layout); other tensors as they are."""
    if plan.arch != "llama" or not (".attn_q." in target or ".attn_k." in target):
        return data
    n_head, n_kv_head = plan.heads
    heads = n_head if ".attn_q." in target else n_kv_head
    return (data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:])
            .swapaxes(1, 2).reshape(data.shape))
