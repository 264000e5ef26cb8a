"""`validate`: check the train and eval splits before anything samples or trains on them.

Reads ``data.train_files`` / ``data.eval_files`` (or ``data.hub_dataset``), renames the configured
prompt/answer columns to ``prompt`` / ``answer``, and runs ``grpo_core.validation.validate_frames``
with the policy's tokenizer as token counter and the configured correctness rewards for the gold-answer
smoke test.

Always writes ``reports/validation.json`` and ``reports/validation.txt`` (rows named by split and row:
the 0-based record number for a single file, ``<file>:<record>`` across several files).
On success it also writes ``data/validated/{train,eval}.parquet`` - the only data the later stages read.
On failure it prints the report, writes **no** validated data, leaves the previous validated data as it
was (those outputs are ``persist: true`` in dvc.yaml, so DVC does not delete them before the stage
runs) and exits with code 3: ``dvc repro`` stops there, nothing downstream runs, and the report files
stay in the workspace (DVC removes a stage's non-persistent outputs *before* running it, never after a
failure). ``dvc status`` then shows validate as changed until the data is fixed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.stages.common import (
    VALIDATED_EVAL,
    VALIDATED_TRAIN,
    StageConfigError,
)
from flows.stages.runs import StageRun
from grpo_core.errors import ValidationFailure
from grpo_core.files import atomic_path, write_json_atomic, write_text_atomic
from grpo_core.rewards.judges import CORRECTNESS_FUNCTIONS

#: what validate reads of params.yaml (tests/test_dvc_params.py checks dvc.yaml lists each); its code is handed a
#: config holding only these sections
VALIDATE_SECTIONS = ("data", "rewards", "validate", "model")


@dataclass(frozen=True)
class ValidateInputs:
    data: Any
    rewards: list
    validate: Any
    model: Any


def stage_inputs(cfg) -> ValidateInputs:
    return ValidateInputs(*(getattr(cfg, name) for name in VALIDATE_SECTIONS))


REPORT_JSON = "reports/validation.json"
REPORT_TXT = "reports/validation.txt"


class ValidationFailed(ValidationFailure, RuntimeError):
    """The data failed validation (exit code 3); the message says where the report is."""


def _local_frame(ctx, files: list[str], key: str):
    import pandas as pd

    from grpo_core.data import read_table, resolve_data_paths

    if not files:
        raise StageConfigError(f"{key}: no files configured (or set data.hub_dataset)")
    paths = resolve_data_paths(files, key, ctx.root)
    frames = []
    for path in paths:
        frame = read_table(path)
        if len(paths) > 1:  # rows are named <file>:<record> so the report says where they are
            frame.index = [f"{_shown(ctx, path)}:{i}" for i in range(len(frame))]
        frames.append(frame)
    return pd.concat(frames) if len(frames) > 1 else frames[0]


def _shown(ctx, path: str) -> str:
    """A data file's path as the report shows it: relative to the repo when inside it."""
    try:
        return str(Path(path).resolve().relative_to(ctx.root.resolve()))
    except ValueError:
        return str(path)


def load_frames(ctx):
    """(train_df, eval_df, sources): the raw splits with canonical ``prompt`` / ``answer`` column names."""
    d = ctx.cfg.data
    if d.hub_dataset:
        from grpo_core.data import load_split

        train_df = load_split(d, "train", ctx.root).to_pandas()
        eval_df = load_split(d, "eval", ctx.root).to_pandas()
        sources = [f"{d.hub_dataset}[{d.train_split}]", f"{d.hub_dataset}[{d.eval_split}]"]
        return train_df, eval_df, sources  # load_split already renamed the columns
    train_df = _local_frame(ctx, d.paths("train"), "data.train_files")
    eval_df = _local_frame(ctx, d.paths("eval"), "data.eval_files")
    rename = {}
    if d.prompt_column != "prompt":
        rename[d.prompt_column] = "prompt"
    if d.answer_column != "answer":
        rename[d.answer_column] = "answer"
    if rename:
        train_df = train_df.drop(columns=[c for c in rename.values() if c in train_df.columns]).rename(columns=rename)
        eval_df = eval_df.drop(columns=[c for c in rename.values() if c in eval_df.columns]).rename(columns=rename)
    return train_df, eval_df, [*d.paths("train"), *d.paths("eval")]


def _to_parquet(df, path: Path) -> None:
    """Row order kept (calibration's prompt indices refer to it); gold answers stored as strings."""
    df = df.reset_index(drop=True).copy()
    if "answer" in df.columns:
        df["answer"] = [None if a is None else str(a) for a in df["answer"]]
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False)


def check_prompts_render(encoder, train_df, cfg) -> None:
    """The first train prompt through the encoder every stage uses: a chat-format prompt with a tokenizer that
    has no chat template fails here, naming the keys, instead of at calibrate."""
    from grpo_core.data import DataError

    if train_df.empty or "prompt" not in train_df.columns:
        return  # the schema checks report it
    try:
        encoder.render(train_df["prompt"].iloc[0])
    except DataError as err:
        raise DataError(f"model.name_or_path '{cfg.model.name_or_path}' with data.prompt_format "
                        f"'{cfg.data.prompt_format}': the train prompts cannot be rendered: {err}") from err


def gold_parser(cfg):
    """The numbers and choice letters of ``parse_gold``, and under a math_verify reward whatever math-verify
    parses (LaTeX golds: ``\\frac{1}{2}``, intervals, sets)."""
    from grpo_core.rewards import parse_gold
    from grpo_core.rewards.math import parse_math_gold

    if not any(spec.function == "math_verify" for spec in cfg.rewards):
        return parse_gold
    return lambda raw: parse_gold(raw) or parse_math_gold(raw)


def run(ctx) -> int:
    from flows.stages.common import quiet_libraries
    from grpo_core.data import PromptEncoder
    from grpo_core.model.loading import check_model_folder, load_tokenizer
    from grpo_core.rewards import build_reward_functions
    from grpo_core.validation import validate_frames

    quiet_libraries()
    from grpo_core.config import only_sections

    cfg = only_sections(ctx.cfg, VALIDATE_SECTIONS)
    # fail fast on what would fail later: every reward must import (exit 2), the model folder must load (5)
    reward_fns = build_reward_functions(cfg.rewards)
    with StageRun(ctx) as run:
        model_checked = check_model_folder(cfg.model, ctx.root)
        train_df, eval_df, sources = load_frames(ctx)
        tokenizer = load_tokenizer(cfg.model, ctx.root)
        encoder = PromptEncoder.from_config(tokenizer, cfg.data, truncate=False)
        check_prompts_render(encoder, train_df, cfg)
        correctness = [fn for fn, spec in zip(reward_fns, cfg.rewards) if spec.function in CORRECTNESS_FUNCTIONS]
        gold_fns = correctness if cfg.validate.check_gold_reward and correctness else None
        report = validate_frames(
            train_df, eval_df, require_answer=bool(correctness), reward_fns_for_gold=gold_fns,
            count_tokens=lambda prompt: len(encoder.encode(prompt)),
            max_prompt_length=cfg.data.max_prompt_length, overlong_policy=cfg.data.overlong_prompt,
            max_report_rows=cfg.validate.max_report_rows, reward_fns_for_smoke=reward_fns,
            parse_gold=gold_parser(cfg) if correctness else None)

        n_train = len(cfg.data.paths("train")) or 1
        header = (f"model: {model_checked}\n"
                  f"sources: train = {', '.join(sources[:n_train])}; "
                  f"eval = {', '.join(sources[n_train:])} "
                  "(row = 0-based record number in the file; <file>:<record> when a split has several files)")
        text = report.to_text() + "\n" + header + "\n"
        write_json_atomic(ctx.path(REPORT_JSON), {**report.to_dict(), "sources": sources})
        write_text_atomic(ctx.path(REPORT_TXT), text)
        summary = report.summary
        run.log_metrics({"validation/failures": summary.get("total_failures", 0),
                         "validation/warnings": summary.get("total_warnings", 0),
                         "validation/train_rows": len(train_df), "validation/eval_rows": len(eval_df)})
        run.set_tags({"validation": "passed" if report.ok else "failed"})
        if not cfg.data.hub_dataset:
            run.log_data_hashes([*cfg.data.paths("train"), *cfg.data.paths("eval")])
        run.log_artifact(ctx.path(REPORT_JSON), "reports")
        run.log_artifact(ctx.path(REPORT_TXT), "reports")

        if not report.ok:
            print(text, file=sys.stderr)
            raise ValidationFailed(
                f"{summary.get('total_failures', 0)} validation failure(s); report in {REPORT_TXT} and "
                f"{REPORT_JSON}. No validated data was written, so no later stage runs until the data is fixed.")
        _to_parquet(train_df, ctx.path(VALIDATED_TRAIN))
        _to_parquet(eval_df, ctx.path(VALIDATED_EVAL))
        run.log_data_hashes([VALIDATED_TRAIN, VALIDATED_EVAL])
        print(text, file=sys.stderr)
    return 0
