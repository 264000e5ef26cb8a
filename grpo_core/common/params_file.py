"""params.yaml as a file: its text, its YAML, and a dotted key set in it. One reader for the config loader and
the flow's overrides alike.

Parsed as YAML 1.2, the way DVC reads and writes it: ``dvc exp run -S`` rewrites params.yaml and drops the
quotes of ``mixed_precision: "no"``, which a YAML 1.1 parser would read as ``false`` (and YAML 1.1 reads
``5e-4`` as a string).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from grpo_core.common.options import ConfigError


def read_params_text(path: Path) -> str:
    """The parameters file's text; a ConfigError naming it when it is missing, unreadable or not UTF-8."""
    try:
        if not path.is_file():
            raise ConfigError(f"{path}: no such parameters file")
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: the parameters file cannot be read: {err.strerror or err}; check the "
                          "permissions of the file and its folders") from err
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{path}: not UTF-8 text: byte 0x{data[err.start]:02x} at byte offset {err.start} "
                          f"(line {line}): {err.reason}; save the file as UTF-8") from err


def read_params(path: Path) -> dict:
    """The parameters file's sections (YAML 1.2); a ConfigError naming the file when it is not YAML or not a
    mapping."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    try:
        raw = YAML(typ="safe", pure=True).load(read_params_text(path)) or {}
    except YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return raw


def set_dotted(mapping: MutableMapping, dotted: str, value: Any) -> None:
    """``set_dotted(raw, "train.learning_rate", 1e-4)``: raw["train"]["learning_rate"] = 1e-4, making the
    sections on the way that are missing or null; a ConfigError when one on the way holds a value."""
    parts = dotted.split(".")
    node = mapping
    for part in parts[:-1]:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, MutableMapping):
            raise ConfigError(f"{dotted}: cannot override inside a non-mapping value")
    node[parts[-1]] = value
