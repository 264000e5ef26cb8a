"""Prompts: reading (the one reader of local jsonl / json / parquet / csv files, or a hub dataset) and
encoding (chat templates, truncation).

Rows keep every column: the ones other than ``prompt`` reach reward functions as keyword arguments.
The configured ``prompt_column`` / ``answer_column`` are renamed to ``prompt`` / ``answer`` so rewards
see one convention whatever the source.
"""

from __future__ import annotations

import glob
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from grpo_core.common.errors import InputUnreadable
from grpo_core.common.options import ConfigError, Options, option

log = logging.getLogger(__name__)

#: What data.train_files / data.eval_files accept; every error about their values repeats it.
DATA_FILES_FORMS = ("a path or a list of paths, each a file, a folder (its jsonl / json / parquet / csv "
                    "files, recursively, in name order) or a glob such as data/raw/train-*.parquet (its "
                    "matches in name order); relative to the repo root")


def _files_field(help: str) -> Any:
    """train_files / eval_files: a wrong type is reported with the accepted forms."""
    return option([], help, expected=DATA_FILES_FORMS)


@dataclass
class DataConfig(Options):
    train_files: str | list[str] = _files_field(
        "local train data: a file, a folder, a glob or a list of these (jsonl / json / parquet / csv); "
        "ignored when hub_dataset is set")
    eval_files: str | list[str] = _files_field("local held-out data, as train_files")
    # DVC cannot take a list or a glob as a dependency (dvc.yaml can only interpolate one path), so validate's
    # dependency is one path per split that holds the files; validate refuses files outside it.
    train_dir: str | None = option(None, "the folder (or the one file) DVC hashes as validate's dependency "
                               "for train_files: it must hold every file they name, so editing, adding or "
                               "removing one re-runs validate; null: not checked (no DVC)")
    eval_dir: str | None = option(None, "as train_dir, for eval_files (may be the same folder)")
    hub_dataset: str | None = option(None, "a dataset id for datasets.load_dataset (e.g. openai/gsm8k)")
    hub_config: str | None = option(None, "the dataset's configuration name (e.g. main)")
    train_split: str = option("train", "split of hub_dataset used for training")
    eval_split: str = option("test", "split of hub_dataset held out for evaluation")
    prompt_column: str = option("prompt", "column holding the prompt (a string or chat messages)")
    answer_column: str = option("answer", "column holding the gold answer, passed to rewards as `answer`")
    system_prompt: str | None = option(None, "system message prepended to every prompt (chat template)")
    chat_template_kwargs: dict = option({}, "extra keyword arguments for the tokenizer's chat template "
                                    "(TRL's name), e.g. {enable_thinking: false}")
    prompt_format: Literal["auto", "chat"] = option(
        "auto",
        "auto: chat messages use the chat template, strings stay plain text; "
        "chat: wrap strings as a user message")
    max_prompt_length: int | None = option(512, "prompt tokens kept (left-truncated, as overlong_prompt "
                                       "says) or allowed; None = any length (TRL's name)", ge=1)
    overlong_prompt: Literal["truncate", "error"] = option(
        "truncate", "a prompt over max_prompt_length: left-truncate with a counted warning, or error")

    def paths(self, split: Literal["train", "eval"]) -> list[str]:
        """The configured paths of one split as a list (a single path is a one-element list)."""
        spec = self.train_files if split == "train" else self.eval_files
        return [spec] if isinstance(spec, str) else list(spec)

    def check(self) -> None:
        for split in ("train", "eval"):
            spec = self.train_files if split == "train" else self.eval_files
            for i, entry in enumerate(self.paths(split)):
                if not isinstance(entry, str) or not entry.strip():
                    key = f"{split}_files" + ("" if isinstance(spec, str) else f"[{i}]")
                    raise ConfigError(f"{key}: {entry!r} is not a path; expected {DATA_FILES_FORMS}")

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(InputUnreadable, ValueError):
    """A dataset problem; the message names the file, split or column."""


class DataFileError(DataError):
    """A data file that cannot be read; the message names the file (and line for jsonl)."""


def is_glob(entry: str) -> bool:
    """Whether a data path has pattern characters (``*``, ``?`` or ``[``): unless it exists, we expand it."""
    return glob.has_magic(entry)


def _expand(entry: str, key: str, root: str | Path) -> list[str]:
    """The files one entry names: a file; a folder's data files; a glob's matching files. Sorted, so the row
    order (which calibration's prompt indices refer to) is the same on every machine."""
    path = Path(entry) if Path(entry).is_absolute() else Path(root, entry)
    # a path that exists is itself, even with [ in its name; root_dir:
    if is_glob(entry) and not path.exists():
        # the root's own name is never read as a pattern
        base = None if Path(entry).is_absolute() else root
        matches = (Path(base or "", m) for m in glob.glob(entry, root_dir=base, recursive=True))
        found = sorted(m for m in matches if m.is_file())
        if not found:
            raise DataError(f"{key}: the glob {entry!r} matches no file (looked for {path}); "
                            f"expected {DATA_FILES_FORMS}")
    elif path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _FORMATS)
        if not found:
            raise DataError(f"{key}: {path} is a folder with no {', '.join(_FORMATS)} files; "
                            f"expected {DATA_FILES_FORMS}")
    elif path.is_file():
        found = [path]
    else:
        raise DataError(f"{key}: {path}: no such data file or folder; expected {DATA_FILES_FORMS}")
    return [str(p) for p in found]


def resolve_data_paths(spec: list[str], key: str, root: str | Path = ".") -> list[str]:
    """The files one split names, in order: each entry a file, a folder (its jsonl / json / parquet / csv
    files in name order, recursively) or a glob (its matches in name order). Relative entries resolve against
    ``root``. A file named twice (say, by a glob and by name) is an error: its rows would count twice. Errors
    name ``key``, the entry and the accepted forms."""
    out: dict[str, None] = {}  # ordered, with O(1) membership
    for entry in spec:
        for path in _expand(entry, key, root):
            if path in out:
                raise DataError(f"{key}: {path} is named twice (again by {entry!r}); "
                                "each file may appear once")
            out[path] = None
    return list(out)


def _check_one_format(paths: list[str]) -> None:
    """Every file of a split is a known type, and all of one format (jsonl and json count as one)."""
    kinds = set()
    for p in paths:
        suffix = Path(p).suffix.lower()
        if suffix not in _FORMATS:
            raise DataError(f"{p}: unsupported file type '{suffix}'; use one of {', '.join(_FORMATS)}")
        kinds.add(_FORMATS[suffix])
    if len(kinds) != 1:
        raise DataError(f"data files of mixed formats in one split: {paths}")


def _read_jsonl(path: Path) -> pd.DataFrame:
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFileError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column "
                                    f"{exc.colno})") from exc
            if not isinstance(obj, dict):
                raise DataFileError(f"{path}:{lineno}: expected a JSON object per line, got "
                                    f"{type(obj).__name__}")
            records.append(obj)
    # object dtype keeps strings, lists and numbers as written (no dtype inference on answers)
    return pd.DataFrame.from_records(records).astype(object) if records else pd.DataFrame()


def read_table(path: str | Path) -> pd.DataFrame:
    """Read a jsonl / json / parquet / csv data file into a DataFrame (RangeIndex = record number).

    Raises FileNotFoundError for a missing file and DataFileError naming the file (and the line, for
    jsonl) when it cannot be parsed. CSV reads ``prompt`` and ``answer`` as text.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}")
    suffix = p.suffix.lower()
    try:
        if suffix == ".jsonl":
            return _read_jsonl(p)
        if suffix == ".json":
            text = p.read_text(encoding="utf-8")
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                return _read_jsonl(p)  # .json files are often JSON lines
            if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
                raise DataFileError(f"{p}: expected a JSON array of objects (or JSON lines)")
            return pd.DataFrame.from_records(data).astype(object) if data else pd.DataFrame()
        if suffix == ".parquet":
            return pd.read_parquet(p)
        if suffix == ".csv":
            return pd.read_csv(p, dtype={"prompt": str, "answer": str})
    except DataFileError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise DataFileError(f"{p}: cannot read as {suffix.lstrip('.')}: {type(exc).__name__}: {exc}") from exc
    raise DataFileError(f"{p}: unsupported file type {suffix!r} (expected .jsonl, .json, .parquet or .csv)")


def load_split(cfg: DataConfig, split: Literal["train", "eval"], root: str | Path = "."):
    """Load one split as a ``datasets.Dataset`` with ``prompt`` (and ``answer`` if present) columns.

    Local files are read by ``read_table`` (the reader validate uses too, so both see the same rows and
    types) into a ``datasets.Dataset``; a hub dataset through ``datasets.load_dataset``. Relative paths
    resolve against ``root`` (the repo root), so
    the stage works from any working directory (``dvc exp run --temp`` runs elsewhere).
    """
    import datasets

    if cfg.hub_dataset:
        hub_split = cfg.train_split if split == "train" else cfg.eval_split
        try:
            ds = datasets.load_dataset(cfg.hub_dataset, cfg.hub_config, split=hub_split)
        except Exception as err:  # the hub raises many types; the message is what matters
            raise DataError(f"data.hub_dataset: could not load '{cfg.hub_dataset}' "
                            f"(config {cfg.hub_config!r}, split {hub_split!r}): {err}") from err
        where = f"{cfg.hub_dataset}[{hub_split}]"
    else:
        key = "data.train_files" if split == "train" else "data.eval_files"
        if not cfg.paths(split):
            raise DataError(f"{key}: no files configured")
        paths = resolve_data_paths(cfg.paths(split), key, root)
        _check_one_format(paths)
        frames = [read_table(path) for path in paths]
        if all(len(f) == 0 for f in frames):
            raise DataError(f"{key}: {paths}: the {split} split is empty")
        frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        try:
            ds = datasets.Dataset.from_pandas(frame, preserve_index=False)
        except Exception as err:  # pyarrow cannot type a column (e.g. numbers and strings mixed)
            raise DataError(f"{key}: could not read {paths}: {err}") from err
        where = ", ".join(paths)

    if cfg.prompt_column not in ds.column_names:
        raise DataError(f"{where}: no '{cfg.prompt_column}' column (data.prompt_column); "
                        f"columns are {ds.column_names}")
    if cfg.prompt_column != "prompt":
        if "prompt" in ds.column_names:
            ds = ds.remove_columns("prompt")
        ds = ds.rename_column(cfg.prompt_column, "prompt")
    if cfg.answer_column in ds.column_names and cfg.answer_column != "answer":
        if "answer" in ds.column_names:
            ds = ds.remove_columns("answer")
        ds = ds.rename_column(cfg.answer_column, "answer")
    if len(ds) == 0:
        raise DataError(f"{where}: the {split} split is empty")
    return ds


def is_conversational(prompt: Any) -> bool:
    """A chat prompt is a list of {"role", "content"} messages (TRL's convention)."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


@dataclass
class PromptEncoder:
    """Turns a dataset prompt into token ids: chat template for messages, left truncation when too long.

    Left truncation keeps the end of the prompt, where the question usually is. ``truncated_count``
    counts truncations so the trainer can report them.
    """

    tokenizer: Any
    max_prompt_length: int | None
    system_prompt: str | None = None
    overlong: Literal["truncate", "error"] = "truncate"
    prompt_format: Literal["auto", "chat"] = "auto"
    chat_template_kwargs: dict = field(default_factory=dict)
    truncated_count: int = field(default=0, init=False)

    @classmethod
    def from_config(cls, tokenizer, data: DataConfig, *, truncate: bool = True) -> PromptEncoder:
        """The one way every stage builds its encoder: ``data.*`` says how a row becomes a prompt, and how
        long it may be (``data.max_prompt_length``). truncate=False: whole prompts (validate counts them and
        judges the lengths itself)."""
        return cls(tokenizer, data.max_prompt_length if truncate else None, data.system_prompt,
                   data.overlong_prompt, data.prompt_format, dict(data.chat_template_kwargs))

    def messages(self, prompt: Any) -> Any:
        """The prompt as the chat template gets it (a string under prompt_format chat becomes a user message),
        or the plain string."""
        if self.prompt_format == "chat" and isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return prompt

    def render(self, prompt: Any, tools: list | None = None) -> str:
        """tools: functions whose schemas the chat template shows (train.tools; chat prompts only)."""
        prompt = self.messages(prompt)
        if is_conversational(prompt):
            messages = list(prompt)
            if self.system_prompt and not any(m["role"] == "system" for m in messages):
                messages = [{"role": "system", "content": self.system_prompt}] + messages
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise DataError("a chat-format prompt needs a tokenizer with a chat template "
                                f"({type(self.tokenizer).__name__} has none)")
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      # None: Llama renders tool text for []
                                                      tools=tools or None,
                                                      **self.chat_template_kwargs)
        if not isinstance(prompt, str):
            raise DataError("prompt must be a string or a list of chat messages, got "
                            f"{type(prompt).__name__}")
        if tools:
            raise DataError("tools (train.tools / environment_factory) need chat prompts, rendered with the "
                            "chat template that shows the tools: this prompt is plain text; set "
                            "data.prompt_format: chat or give chat messages")
        if self.system_prompt:
            return self.system_prompt + "\n" + prompt
        return prompt

    def encode(self, prompt: Any, row: int | None = None, tools: list | None = None) -> list[int]:
        text = self.render(prompt, tools)
        # A chat template already wrote its special tokens; plain text gets the tokenizer's own (e.g. BOS).
        templated = is_conversational(prompt) or (self.prompt_format == "chat" and isinstance(prompt, str))
        ids = self.tokenizer(text, add_special_tokens=not templated)["input_ids"]
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            if self.overlong == "error":
                raise DataError(f"prompt{'' if row is None else f' in row {row}'} has {len(ids)} tokens, "
                                f"over data.max_prompt_length={self.max_prompt_length} "
                                "(data.overlong_prompt: error)")
            self.truncated_count += 1
            if self.truncated_count in (1, 10, 100, 1000):
                log.warning("%d prompt(s) left-truncated to max_prompt_length=%d so far",
                            self.truncated_count, self.max_prompt_length)
            ids = ids[-self.max_prompt_length:]
        return ids


def completion_for_reward(text: str, prompt: Any) -> Any:
    """TRL's convention: chat prompts get completions as a one-message list, plain prompts a string."""
    if is_conversational(prompt):
        return [{"role": "assistant", "content": text}]
    return text
