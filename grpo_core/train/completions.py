"""Completions you can read: every ``train.log_completions_steps`` steps, the round's samples - prompt,
completion, each reward, advantage - as lines of ``<step log>.completions.jsonl`` (beside the step log) and as
a table of the tracker (MLflow ``log_table`` format, ``completions/step_<n>.json``).

The file is append-only like the step log, and cut back to the resume step when a run resumes, so a resumed
run never shows a step twice.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from grpo_core.common.files import atomic_path
from grpo_core.common.options import Options, option
from grpo_core.train.round import Round


@dataclass
class CompletionLogOptions(Options):
    """params.yaml `train:` keys of the completions log."""

    log_completions_steps: int = option(
        0, "every this many steps, the round's samples (prompt, completion, each reward, advantage) go to "
        "<step log>.completions.jsonl and the tracker's tables (0 = never)", ge=0)
    num_completions_to_log: int | None = option(
        None, "log_completions_steps: rows per table (None = the whole round)", ge=1)


def completion_rows(round_: Round, tokenizer, reward_names: list[str], step: int,
                    limit: int | None) -> list[dict]:
    """One dict per row of the round (the first ``limit``): step, prompt and completion text (special tokens
    kept out; with tools the completion holds the tool results between the model's turns), each reward (None
    where the function gave none), advantage; with tools the row's tool calls, failed calls and assistant
    turns."""
    n = len(round_) if limit is None else min(limit, len(round_))
    rows = []
    for i in range(n):
        prompt = round_.prompt_ids[i][round_.prompt_mask[i].bool()].tolist()
        completion = round_.completion_ids[i][round_.completion_mask[i].bool()].tolist()
        row = {"step": step, "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
               "completion": tokenizer.decode(completion, skip_special_tokens=True)}
        for k, name in enumerate(reward_names):
            value = None if round_.rewards is None else float(round_.rewards[i, k])
            row[f"reward/{name}"] = None if value is None or math.isnan(value) else value
        row["advantage"] = float(round_.advantages[i])
        if round_.tool_counts is not None:
            row.update(zip(("tool_calls", "tool_failures", "turns"), map(int, round_.tool_counts[i])))
        rows.append(row)
    return rows


def as_table(rows: list[dict]) -> dict[str, list]:
    """Rows -> columns, the dict ``mlflow.log_table`` takes."""
    return {key: [r[key] for r in rows] for key in rows[0]} if rows else {}


class CompletionLog:
    """``path`` (jsonl), opened at ``resume_step``: the lines of later steps are dropped (they are about to be
    redone)."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if resume_step > 0 and path.exists():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
        with atomic_path(path) as tmp:
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def append(self, rows: list[dict]) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
