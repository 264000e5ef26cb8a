"""A GGUF file as a model source: converted once into a safetensors folder that every stage loads.

transformers dequantizes a GGUF checkpoint on load (``from_pretrained(folder, gguf_file=name)``) but marks the
result as quantized and refuses to save it, so the conversion rebuilds the model from its config, loads the
dequantized float32 state dict into it and saves that: weights, tokenizer (chat template included) and
generation config. The same GGUF gives the same bytes (tests/test_gguf.py). ``CONVERTED_MODEL_DIR`` holds the
result, with ``gguf_source.json`` naming the file it came from; ``resolve_model_path`` sends a ``*.gguf``
``model.name_or_path`` there.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from grpo_core.common.errors import InputUnreadable
from grpo_core.common.files import sha256_file, write_dir_atomic

CONVERTED_MODEL_DIR = "artifacts/converted_model"  # the convert stage's output (dvc.yaml)
SOURCE_FILE = "gguf_source.json"
GGUF_MAGIC = b"GGUF"


class GGUFError(InputUnreadable, ValueError):
    """A GGUF file cannot be converted; the message names the file and why."""


def is_gguf(name_or_path: str) -> bool:
    return str(name_or_path).lower().endswith(".gguf")


def read_architecture(path: Path) -> str:
    """The GGUF header's ``general.architecture``, after checking the file is a whole, readable GGUF.

    ``gguf.GGUFReader`` parses the header and maps every tensor's bytes, so a truncated file or a damaged
    header fails here, before transformers spends seconds on it."""
    if not path.is_file():
        raise GGUFError(f"model.name_or_path: GGUF file {path} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"model.name_or_path: {path} is not a GGUF file (no GGUF magic bytes at its "
                            "start)")
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise GGUFError(f"model.name_or_path: reading {path} needs the gguf package ({err}); "
                        "run `make setup`") from err
    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
    except (ValueError, KeyError, IndexError, OSError, UnicodeDecodeError) as err:
        raise GGUFError(f"model.name_or_path: {path} is a truncated or corrupt GGUF file: "
                        f"{type(err).__name__}: {err}") from err
    return arch


def convert_gguf(path: str | Path, out_dir: str | Path) -> dict:
    """Write ``path``'s model as a float32 safetensors folder at ``out_dir`` (atomically);
    returns its summary."""
    path = Path(path)
    arch = read_architecture(path)
    model, tokenizer = load_dequantized(path, arch)
    source = {"gguf_file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size,
              "architecture": arch, "model_type": model.config.model_type,
              "parameters": sum(p.numel() for p in model.parameters())}

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")

    write_dir_atomic(out_dir, fill)
    return source


def load_dequantized(path: Path, arch: str):
    """The GGUF's model as a plain (saveable) float32 model, and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise GGUFError(f"model.name_or_path: transformers cannot load the '{arch}' model in {path}: "
                        f"{type(err).__name__}: {err}") from err
    # The loaded model is flagged GGUF-quantized and will not save: a fresh one of the same config, without
    # the quantization entry (the saved folder is plain float32), takes its weights.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    return model.eval(), tokenizer


def converted_model_dir(gguf_name_or_path: str, root: str | Path = ".") -> Path:
    """The folder the convert stage made from ``gguf_name_or_path``; an error naming the stage when it is
    missing or came from another file."""
    folder = Path(root, CONVERTED_MODEL_DIR)
    marker = folder / SOURCE_FILE
    name = Path(gguf_name_or_path).name
    if not marker.is_file():
        raise GGUFError(f"model.name_or_path: {gguf_name_or_path} is a GGUF file and {folder} holds no "
                        "converted model; run the `convert` stage (dvc repro) first")
    made_from = json.loads(marker.read_text(encoding="utf-8")).get("gguf_file")
    if made_from != name:
        raise GGUFError(f"model.name_or_path: {folder} was converted from {made_from}, not {name}; "
                        "run the `convert` stage again (dvc repro)")
    return folder
