"""`validate`: check the train and eval splits before anything samples or trains on them.

Reads ``data.train_files`` / ``data.eval_files`` (files, folders, globs or lists of them, each split inside
the path ``data.train_dir`` / ``data.eval_dir`` that DVC hashes; or ``data.hub_dataset``), renames the
configured prompt/answer columns to ``prompt`` / ``answer``, and runs
``grpo_core.data.validation.validate_frames`` with the policy's tokenizer as token counter and the configured
correctness rewards for the gold-answer smoke test.

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

import os
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
from grpo_core.common.errors import ValidationFailure
from grpo_core.common.files import atomic_path, write_json_atomic, write_text_atomic
from grpo_core.rewards.judges import CORRECTNESS_FUNCTIONS

#: what validate reads of params.yaml (tests/test_dvc_params.py checks dvc.yaml lists each); its code is
#: handed a config holding only these sections, and the tool keys of train: (ToolUseOptions)
VALIDATE_SECTIONS = ("data", "rewards", "validate", "model")


@dataclass(frozen=True)
class ValidateInputs:
    data: Any
    rewards: list
    validate: Any
    model: Any
    tool_use: Any  # train.tools, environment_factory, ... (a ToolUseOptions group)


def stage_inputs(cfg) -> ValidateInputs:
    return ValidateInputs(*(getattr(cfg, name) for name in VALIDATE_SECTIONS), cfg.train.tool_use)


REPORT_JSON = "reports/validation.json"
REPORT_TXT = "reports/validation.txt"


class ValidationFailed(ValidationFailure, RuntimeError):
    """The data failed validation (exit code 3); the message says where the report is."""


def local_sources(ctx) -> dict[str, list[str]]:
    """{"train": files, "eval": files}: what data.train_files / data.eval_files name (files, folders, globs),
    resolved to files in a fixed order, each split's inside its DVC-tracked path (``_check_tracked``)."""
    from grpo_core.data.loading import resolve_data_paths

    sources = {}
    for split in ("train", "eval"):
        key = f"data.{split}_files"
        if not ctx.cfg.data.paths(split):
            raise StageConfigError(f"{key}: no files configured (or set data.hub_dataset)")
        sources[split] = resolve_data_paths(ctx.cfg.data.paths(split), key, ctx.root)
        _check_tracked(ctx, split, sources[split])
    return sources


def _check_tracked(ctx, split: str, files: list[str]) -> None:
    """Every file of the split lies in data.<split>_dir: dvc.yaml can hand DVC only one path per split as
    validate's dependency (it cannot interpolate a list, and knows no globs), so a file outside it would be
    read but not hashed, and editing it would not re-run validate."""
    key, tracked = f"data.{split}_dir", getattr(ctx.cfg.data, f"{split}_dir")
    if tracked is None:
        return  # no DVC (library use, tests): nothing hashes the files anyway
    dep = _abs(ctx, tracked)
    if not dep.exists():
        raise StageConfigError(f"{key}: {tracked}: no such file or folder; name the folder holding "
                               f"data.{split}_files")
    if _holds_outputs(ctx, dep):
        raise StageConfigError(f"{key}: {tracked} holds validate's own outputs ({VALIDATED_TRAIN}, "
                               f"{REPORT_JSON}), so DVC cannot depend on it; keep the data in a folder of "
                               "its own, e.g. data/raw")
    outside = [f for f in files if not _within(_abs(ctx, f), dep)]
    if outside:
        common = Path(os.path.commonpath([_abs(ctx, f).parent for f in files]))
        hint = (f"; {_shown(ctx, common)} holds them all" if not _holds_outputs(ctx, common) else
                "; the folder holding them all also holds validate's outputs: move them to a folder of their "
                "own")
        raise StageConfigError(
            f"{key}: {tracked} does not hold {_shown(ctx, outside[0])} (named by data.{split}_files); DVC "
            f"hashes {key} as validate's dependency (it cannot take a list or a glob), so set it to a folder "
            f"holding every {split} file{hint}")


def _abs(ctx, path: str | Path) -> Path:
    """Absolute, normalised, symlinks kept (DVC hashes a folder's links as the files they point to)."""
    return Path(os.path.abspath(ctx.path(path)))


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _holds_outputs(ctx, folder: Path) -> bool:
    return any(_within(_abs(ctx, out), folder)
               for out in (VALIDATED_TRAIN, VALIDATED_EVAL, REPORT_JSON, REPORT_TXT))


def _local_frame(ctx, paths: list[str]):
    import pandas as pd

    from grpo_core.data.loading import read_table

    frames = []
    for path in paths:
        frame = read_table(path)
        if len(paths) > 1:  # rows are named <file>:<record> so the report says where they are
            frame.index = [f"{_shown(ctx, path)}:{i}" for i in range(len(frame))]
        frames.append(frame)
    return pd.concat(frames) if len(frames) > 1 else frames[0]


def _shown(ctx, path: str | Path) -> str:
    """A data file's path as the report shows it: relative to the repo when inside it."""
    try:
        return str(_abs(ctx, path).relative_to(_abs(ctx, ctx.root)))
    except ValueError:
        return str(path)


def load_frames(ctx, sources: dict[str, list[str]] | None):
    """(train_df, eval_df): the raw splits with canonical ``prompt`` / ``answer`` column names; ``sources``
    from ``local_sources`` (None: data.hub_dataset)."""
    d = ctx.cfg.data
    if sources is None:
        from grpo_core.data.loading import load_split

        # load_split already renames the columns
        return load_split(d, "train", ctx.root).to_pandas(), load_split(d, "eval", ctx.root).to_pandas()
    train_df = _local_frame(ctx, sources["train"])
    eval_df = _local_frame(ctx, sources["eval"])
    rename = {}
    if d.prompt_column != "prompt":
        rename[d.prompt_column] = "prompt"
    if d.answer_column != "answer":
        rename[d.answer_column] = "answer"
    if rename:
        train_df = train_df.drop(columns=[c for c in rename.values()
                                          if c in train_df.columns]).rename(columns=rename)
        eval_df = eval_df.drop(columns=[c for c in rename.values()
                                        if c in eval_df.columns]).rename(columns=rename)
    return train_df, eval_df


def source_names(ctx, sources: dict[str, list[str]] | None) -> dict[str, list[str]]:
    """What the report names as each split's source: the files read (repo-relative), or the hub split."""
    d = ctx.cfg.data
    if sources is None:
        return {"train": [f"{d.hub_dataset}[{d.train_split}]"], "eval": [f"{d.hub_dataset}[{d.eval_split}]"]}
    return {split: [_shown(ctx, f) for f in files] for split, files in sources.items()}


def _to_parquet(df, path: Path) -> None:
    """Row order kept (calibration's prompt indices refer to it); gold answers stored as strings."""
    df = df.reset_index(drop=True).copy()
    if "answer" in df.columns:
        df["answer"] = [None if a is None else str(a) for a in df["answer"]]
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False)


def check_prompts_render(encoder, train_df, cfg, tools: list | None = None) -> None:
    """The first train prompt through the encoder every stage uses (with the tools' schemas when there are
    tools): a chat-format prompt with a tokenizer that has no chat template, or a plain-text prompt with
    tools, fails here, naming the keys, instead of at calibrate."""
    from grpo_core.data.loading import DataError

    if train_df.empty or "prompt" not in train_df.columns:
        return  # the schema checks report it
    try:
        encoder.render(train_df["prompt"].iloc[0], tools)
    except DataError as err:
        raise DataError(f"model.name_or_path '{cfg.model.name_or_path}' with data.prompt_format "
                        f"'{cfg.data.prompt_format}': the train prompts cannot be rendered: {err}") from err


def smoke_environments(toolbox, train_df) -> list:
    """With environments, one reset for each train row the reward smoke test calls the rewards on (so rewards
    that read ``environments`` are called as training calls them); none when a row names no known environment
    (the report lists it)."""
    from grpo_core.data.validation import SMOKE_ROWS
    from grpo_core.tools import EnvironmentFailure

    if toolbox is None or toolbox.factories is None:
        return []
    rows = train_df.head(SMOKE_ROWS).to_dict("records")
    try:
        return toolbox.open(rows, [f"train row {i}" for i in train_df.index[:SMOKE_ROWS]])
    except EnvironmentFailure:
        return []


def check_tools(toolbox, tokenizer, train_df, cfg) -> list | None:
    """Tools against the model and the data, before anything samples: the chat template can show tool calls
    and their results and writes calls in a format with a parser (``ToolChat``), and each environment resets
    on a train row of its own (its columns taken, None or text returned). Returns every tool a prompt may show
    (for the prompt-length checks); None without tools. Raises ToolConfigError (exit 2) naming what is
    wrong."""
    from grpo_core.tools import ToolChat, ToolConfigError

    if toolbox is None:
        return None
    try:
        ToolChat.for_tokenizer(tokenizer, cfg.data.chat_template_kwargs)
    except ToolConfigError as err:
        raise ToolConfigError(f"model.name_or_path '{cfg.model.name_or_path}' with train.tools / "
                              f"environment_factory: {err}") from err
    if toolbox.factories is not None and not train_df.empty:
        first = {}  # one train row per environment it names (known names only: the report lists the others)
        for idx, row in zip(train_df.index, train_df.to_dict("records")):
            name = row.get("environment") if toolbox.multi_environment else None
            if name not in first and (name in toolbox.factories):
                first[name] = (f"train row {idx}", row)
        toolbox.check_reset([row for _, row in first.values()], [label for label, _ in first.values()])
    return toolbox.all_tools()


def gold_parser(cfg):
    """The numbers and choice letters of ``parse_gold``, under a math_verify reward whatever math-verify
    parses (LaTeX golds: ``\\frac{1}{2}``, intervals, sets), and under a reasoning_gym reward any text (its
    task's scorer reads the gold; the gold check asks it)."""
    from grpo_core.rewards import parse_gold
    from grpo_core.rewards.math import parse_math_gold

    functions = {spec.function for spec in cfg.rewards}
    parsers = [parse_gold, *([parse_math_gold] if "math_verify" in functions else []),
               *([lambda raw: raw if isinstance(raw, str) and raw.strip() else None]
                 if "reasoning_gym" in functions else [])]
    if len(parsers) == 1:
        return parse_gold
    return lambda raw: next((parsed for parse in parsers if (parsed := parse(raw))), None)


def run(ctx) -> int:
    from flows.stages.common import quiet_libraries
    from grpo_core.data.loading import PromptEncoder
    from grpo_core.data.validation import ValidationRules, validate_frames
    from grpo_core.model.loading import check_model_folder, load_tokenizer
    from grpo_core.rewards import build_reward_functions

    quiet_libraries()
    from grpo_core.config import only_sections
    from grpo_core.tools import build_toolbox, close_all, load_rollout_func

    tool_use = ctx.cfg.train.tool_use
    cfg = only_sections(ctx.cfg, VALIDATE_SECTIONS)
    # fail fast on what would fail later: every reward and tool must import (exit 2),
    # the model folder must load (5)
    reward_fns = build_reward_functions(cfg.rewards)
    toolbox = build_toolbox(tool_use)
    load_rollout_func(tool_use)  # imports, and takes (prompts, trainer)
    sources = None if cfg.data.hub_dataset else local_sources(ctx)  # and every data path resolves
                                                                    # (exit 2 / 5)
    names = source_names(ctx, sources)
    with StageRun(ctx) as run:
        model_checked = check_model_folder(cfg.model, ctx.root)
        train_df, eval_df = load_frames(ctx, sources)
        tokenizer = load_tokenizer(cfg.model, ctx.root)
        encoder = PromptEncoder.from_config(tokenizer, cfg.data, truncate=False)
        tools = check_tools(toolbox, tokenizer, train_df, cfg)
        check_prompts_render(encoder, train_df, cfg, tools)
        correctness = [fn for fn, spec in zip(reward_fns, cfg.rewards)
                       if spec.function in CORRECTNESS_FUNCTIONS]
        gold_fns = correctness if cfg.validate.check_gold_reward and correctness else None
        smoke_envs = smoke_environments(toolbox, train_df)
        try:
            report = validate_frames(train_df, eval_df, ValidationRules(
                require_answer=bool(correctness), reward_fns_for_gold=gold_fns,
                count_tokens=lambda prompt: len(encoder.encode(prompt, tools=tools)),
                max_prompt_length=cfg.data.max_prompt_length, overlong_policy=cfg.data.overlong_prompt,
                max_report_rows=cfg.validate.max_report_rows, reward_fns_for_smoke=reward_fns,
                parse_gold=gold_parser(cfg) if correctness else None,
                environments=toolbox.environment_names if toolbox is not None else None,
                smoke_columns={"environments": [t.environment for t in smoke_envs]} if smoke_envs else None))
        finally:
            close_all(smoke_envs)

        header = (f"model: {model_checked}\n"
                  f"sources: train = {', '.join(names['train'])}; eval = {', '.join(names['eval'])} "
                  "(row = 0-based record number in the file; <file>:<record> when a split has several files)")
        text = report.to_text() + "\n" + header + "\n"
        write_json_atomic(ctx.path(REPORT_JSON), {**report.to_dict(), "sources": names})
        write_text_atomic(ctx.path(REPORT_TXT), text)
        summary = report.summary
        run.log_metrics({"validation/failures": summary.get("total_failures", 0),
                         "validation/warnings": summary.get("total_warnings", 0),
                         "validation/train_rows": len(train_df), "validation/eval_rows": len(eval_df)})
        run.set_tags({"validation": "passed" if report.ok else "failed"})
        if sources is not None:
            run.log_data_hashes([*sources["train"], *sources["eval"]])
        run.log_artifact(ctx.path(REPORT_JSON), "reports")
        run.log_artifact(ctx.path(REPORT_TXT), "reports")

        if not report.ok:
            print(text, file=sys.stderr)
            raise ValidationFailed(
                f"{summary.get('total_failures', 0)} validation failure(s); report in {REPORT_TXT} and "
                f"{REPORT_JSON}. No validated data was written, "
                "so no later stage runs until the data is fixed.")
        _to_parquet(train_df, ctx.path(VALIDATED_TRAIN))
        _to_parquet(eval_df, ctx.path(VALIDATED_EVAL))
        run.log_data_hashes([VALIDATED_TRAIN, VALIDATED_EVAL])
        print(text, file=sys.stderr)
    return 0
