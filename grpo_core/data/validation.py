"""Data validation for the train and eval splits: pandera schemas plus cross-row / cross-frame checks.

Every failure is collected (pandera ``lazy=True`` plus the checks below), never just the first, into a
``ValidationReport`` whose rows name split, row (the frame's index label - the 0-based record number for
frames from ``load_frame``), column, check and value.

Checks
  schema (pandera ``DataFrameModel``)
    ``prompt`` present, not null; a string non-empty after stripping (pandera's ``str`` accepts "") or a
    list of chat messages, each a dict with a known ``role`` and non-empty ``content``;
    ``answer`` (only when a correctness reward is configured) present, not null, non-empty.
  rows
    ``gold_parseable``   the gold answer parses with the verifier's ``parse_gold``;
    ``gold_reward:<fn>`` reward smoke test - the completion
                         ``<reasoning>\\n...\\n</reasoning>\\n<answer>\\n{gold}\\n</answer>`` (a choice as
                         ``\\boxed{X}``; a reward with a ``gold_completion(answer)`` attribute writes its own)
                         must score exactly 1.0 under each correctness reward. A published
                         trainer returns 1.0 when the gold cannot be parsed, which hides broken data;
    ``duplicate_prompt`` no prompt twice within a split (normalised text: case-folded, whitespace collapsed);
    ``train_eval_overlap`` no eval prompt that is also a train prompt;
    ``prompt_length``    tokens <= max_prompt_length: a warning when overlong prompts are truncated
                         (``overlong_policy="truncate"``), a failure when ``"error"``;
    ``split_not_empty``  a split has at least one row.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import numpy as np
import pandas as pd
from pandera.typing import Series

from grpo_core.common.errors import ValidationFailure
from grpo_core.common.options import Options, option
from grpo_core.common.text import text_key
from grpo_core.rewards.scoring import call_reward

try:
    import pandera.pandas as pa
except ImportError:  # pandera < 0.24 has no pandera.pandas
    import pandera as pa

KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
OVERLONG_POLICIES = ("truncate", "error")
VALUE_CHARS = 200  # report values are truncated to this many characters
GOLD_REASONING = "Reasoning omitted: validating the gold answer."


@dataclass
class ValidateConfig(Options):
    check_gold_reward: bool = option(True,
                                     "the gold answer must score the maximum under each correctness reward")
    max_report_rows: int = option(1000, "failures listed in the report at most", ge=1)


class DataValidationError(ValidationFailure, ValueError):
    """Raised by ``ValidationReport.raise_for_failures``; the message is the text report."""


# --------------------------------------------------------------------------------------------------
# element predicates (shared by the pandera checks and the row checks)


def _as_messages(prompt: Any) -> list | None:
    """A chat prompt as a list of messages (parquet gives numpy arrays of dicts), else None."""
    if isinstance(prompt, list | tuple | np.ndarray):
        return list(prompt)
    return None


def _content_ok(content: Any) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    parts = _as_messages(content)  # multimodal parts: [{"type": "text", "text": ...}, ...]
    return bool(parts) and all(isinstance(p, Mapping) for p in parts)


def _message_ok(message: Any) -> bool:
    return (isinstance(message, Mapping) and message.get("role") in KNOWN_ROLES
            and _content_ok(message.get("content")))


def prompt_text(prompt: Any) -> str | None:
    """Plain text of a prompt (chat: "role: content" lines), None when malformed."""
    if isinstance(prompt, str):
        return prompt
    messages = _as_messages(prompt)
    if messages is None or not all(_message_ok(m) for m in messages):
        return None
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def normalise_prompt(prompt: Any) -> str | None:
    """Key for duplicate / overlap detection: case-folded, whitespace runs collapsed, stripped."""
    text = prompt_text(prompt)
    return None if text is None else text_key(text)


def _is_missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return type(value).__name__ in {"NAType", "NaTType"}


def _short(value: Any, limit: int = VALUE_CHARS) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------------
# pandera schemas


class PromptSchema(pa.DataFrameModel):
    """Rows of a prompt dataset; extra columns are allowed (they reach the reward functions).

    A check is named by its method (the report's ``check``): pandera drops a ``name=`` argument once it has
    built one schema from it, so PromptAnswerSchema, which inherits these, would report the method name after
    PromptSchema had been built in the same process."""

    # Any dtype: strings (object or pandas' str dtype) and chat lists (object) are both legal.
    prompt: Series[Any] = pa.Field(nullable=False)

    @pa.check("prompt", element_wise=True)
    def prompt_type(cls, x: Any) -> bool:
        return isinstance(x, str) or _as_messages(x) is not None

    @pa.check("prompt", element_wise=True)
    def prompt_not_empty(cls, x: Any) -> bool:
        if isinstance(x, str):
            return bool(x.strip())
        messages = _as_messages(x)
        return messages is None or len(messages) > 0  # wrong types are prompt_type's failure

    @pa.check("prompt", element_wise=True)
    def chat_messages_well_formed(cls, x: Any) -> bool:
        messages = _as_messages(x)
        return messages is None or all(_message_ok(m) for m in messages)

    class Config:
        strict = False


class PromptAnswerSchema(PromptSchema):
    """Prompt rows with a gold ``answer`` (required when a correctness reward is configured)."""

    answer: Series[Any] = pa.Field(nullable=False)

    @pa.check("answer", element_wise=True)
    def answer_not_empty(cls, x: Any) -> bool:
        if isinstance(x, str):
            return bool(x.strip())
        # numbers are fine (csv/jsonl readers turn "42" into 42); bools are not answers
        return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool | np.bool_) \
            and math.isfinite(float(x))


def schema_failures(df: pd.DataFrame, split: str, require_answer: bool) -> list[dict[str, Any]]:
    """Run the pandera schema lazily; every failure case as a report row."""
    schema = PromptAnswerSchema if require_answer else PromptSchema
    try:
        schema.validate(df, lazy=True)
    except pa.errors.SchemaErrors as err:
        rows = []
        for case in err.failure_cases.to_dict("records"):
            index = case.get("index")
            column = case.get("column")
            check = str(case.get("check"))
            if check == "column_in_dataframe":  # the missing column is the failure case
                column, value = case.get("failure_case"), "column missing"
            else:
                value = case.get("failure_case")
            rows.append(_row(split, None if _is_missing(index) else index, column, check, value))
        return rows
    return []


# --------------------------------------------------------------------------------------------------
# the report


def _row(split: str, row: Any, column: Any, check: str, value: Any) -> dict[str, Any]:
    if isinstance(row, np.integer) or (isinstance(row, float) and row.is_integer()):
        row = int(row)  # pandera gives float labels when a failure table mixes rows and None
    elif row is not None and not isinstance(row, int | str):
        row = str(row)
    return {"split": split, "row": row, "column": None if column is None else str(column),
            "check": check, "value": _short(value)}


@dataclass
class ValidationReport:
    """All failures and warnings of one validation; ``ok`` when there are no failures.

    ``failures`` / ``warnings``: dicts {split, row, column, check, value}, at most ``max_report_rows``
    each (``summary`` always has the full counts).
    """

    ok: bool
    failures: list[dict[str, Any]]
    warnings: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary, "failures": self.failures, "warnings": self.warnings}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def to_text(self) -> str:
        s = self.summary
        lines = [f"data validation: {'OK' if self.ok else 'FAILED'} - {s.get('total_failures', 0)} "
                 f"failure(s), {s.get('total_warnings', 0)} warning(s)"]
        for split, info in s.get("splits", {}).items():
            lines.append(f"  {split}: {info['rows']} rows, {info['failures']} failures, "
                         f"{info['warnings']} warnings")
            for check, n in info.get("failures_by_check", {}).items():
                lines.append(f"    failure {check}: {n}")
            for check, n in info.get("warnings_by_check", {}).items():
                lines.append(f"    warning {check}: {n}")
        for title, rows, total in (("failures", self.failures, s.get("total_failures", 0)),
                                   ("warnings", self.warnings, s.get("total_warnings", 0))):
            if not rows:
                continue
            shown = f" (first {len(rows)} of {total})" if len(rows) < total else ""
            lines.append(f"{title}{shown}:")
            for r in rows:
                lines.append(f"  [{r['split']}] row={r['row']} column={r['column']} check={r['check']}: "
                             f"{r['value']}")
        for note in s.get("notes", []):
            lines.append(f"note: {note}")
        return "\n".join(lines)

    def raise_for_failures(self) -> None:
        if not self.ok:
            raise DataValidationError(self.to_text())


# --------------------------------------------------------------------------------------------------
# row and cross-frame checks


def _default_parse_gold() -> Callable[[Any], Any]:
    try:
        from grpo_core.rewards import parse_gold
    except ImportError:  # package __init__ not exporting it (yet): the parser lives in rewards.parsing
        from grpo_core.rewards.parsing import parse_gold
    return parse_gold


def _format_number(value: Fraction) -> str:
    """An exact number as the text a model would write: 42, -0.25, 1/3 (non-terminating decimals)."""
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d == 1:  # terminating decimal
        digits = 0
        while (value * 10**digits).denominator != 1:
            digits += 1
        return f"{float(value):.{digits}f}" if digits < 16 else str(value)
    return str(value)


def gold_completion_text(answer: Any, parsed: Any, task: Any = None) -> str:
    """The completion a perfect policy would write for this gold answer."""
    kind = getattr(parsed, "kind", None)
    value = getattr(parsed, "value", None)
    if kind == "choice" or task == "multiple_choice":
        letter = value if kind == "choice" else str(answer).strip()
        body = f"\\boxed{{{letter}}}"
    elif kind == "number" and isinstance(value, Fraction):
        body = _format_number(value)
    else:
        body = str(answer).strip()
    return f"<reasoning>\n{GOLD_REASONING}\n</reasoning>\n<answer>\n{body}\n</answer>"


def _gold_reward_checks(df: pd.DataFrame, split: str, rows: list[Any], parsed: dict[Any, Any],
                        reward_fns: Sequence[Callable[..., list]], answer_column: str,
                        prompt_column: str) -> tuple[list[dict], Counter]:
    """Score the gold completion of ``rows`` under each reward; anything but 1.0 is a failure."""
    failures: list[dict] = []
    not_applicable: Counter = Counter()
    if not rows:
        return failures, not_applicable
    sub = df.loc[rows]
    prompts = sub[prompt_column].tolist()
    tasks = sub["task"].tolist() if "task" in sub.columns else [None] * len(rows)
    default = [gold_completion_text(a, parsed[r], t) for r, a, t in zip(rows, sub[answer_column], tasks)]
    # TRL passes every non-prompt column as a keyword list aligned with completions
    columns = {c: sub[c].tolist() for c in sub.columns if c != prompt_column}
    for fn in reward_fns:
        name = getattr(fn, "__name__", repr(fn))
        check = f"gold_reward:{name}"
        # a reward that reads its answer its own way says how a perfect completion states it
        own = getattr(fn, "gold_completion", None)
        texts = default if own is None else [own(a) for a in sub[answer_column]]
        completions = [[{"role": "assistant", "content": t}] if _as_messages(p) is not None else t
                       for p, t in zip(prompts, texts)]
        try:
            values = list(call_reward(fn, prompts, completions, **columns))
            if len(values) != len(rows):
                raise ValueError(f"returned {len(values)} values for {len(rows)} completions")
        except Exception as exc:  # noqa: BLE001 - a reward that crashes on gold data is a finding
            failures.append(_row(split, None, answer_column, check,
                                 f"reward raised {type(exc).__name__}: {exc}"))
            continue
        for r, v, text in zip(rows, values, texts):
            if v is None or (isinstance(v, float) and math.isnan(v)):
                not_applicable[name] += 1
            elif abs(float(v) - 1.0) > 1e-9:
                answer = text.rsplit("<answer>\n", 1)[-1].removesuffix("\n</answer>") if own is None else text
                failures.append(_row(split, r, answer_column, check,
                                     f"gold completion scored {float(v):g}, expected 1.0 (answer: {answer})"))
    return failures, not_applicable


SMOKE_ROWS = 4  # train rows every reward is called on once (reward_smoke_failures)


def reward_smoke_failures(df: pd.DataFrame, reward_fns: Sequence[Callable[..., list]],
                          num_rows: int = SMOKE_ROWS, prompt_column: str = "prompt",
                          answer_column: str = "answer",
                          extra_columns: Mapping[str, list] | None = None) -> list[dict]:
    """Call every reward function once on the first ``num_rows`` rows, the way training will (the TRL
    signature, every other column as a keyword list), with a gold-style completion; a reward that raises,
    or returns the wrong number of values or something other than numbers and None, is a failure here
    rather than a crash at calibrate or in the middle of training. ``extra_columns``: more keyword lists, one
    value per row (``environments``: each row's environment, just reset)."""
    sub = df.head(num_rows)
    if sub.empty:
        return []
    prompts = sub[prompt_column].tolist()
    answers = sub[answer_column].tolist() if answer_column in sub.columns else [""] * len(sub)
    texts = [gold_completion_text(a, None) for a in answers]
    completions = [[{"role": "assistant", "content": t}] if _as_messages(p) is not None else t
                   for p, t in zip(prompts, texts)]
    columns = {c: sub[c].tolist() for c in sub.columns if c != prompt_column}
    columns["completion_ids"] = [[] for _ in texts]
    columns.update({k: list(v)[:len(texts)] for k, v in (extra_columns or {}).items()})
    failures = []
    for fn in reward_fns:
        name = getattr(fn, "__name__", repr(fn))
        try:
            values = list(call_reward(fn, prompts, completions, **columns))
            if len(values) != len(texts):
                raise ValueError(f"returned {len(values)} values for {len(texts)} completions")
            bad = [v for v in values if v is not None and not isinstance(v, (int, float))]
            if bad:
                raise TypeError(f"returned {type(bad[0]).__name__} {bad[0]!r}; expected float or None")
        except Exception as exc:  # noqa: BLE001 - any error of the reward is the finding
            failures.append(_row("train", None, "rewards", f"reward_smoke:{name}",
                                 f"reward {name!r} failed on the first {len(texts)} rows: "
                                 f"{type(exc).__name__}: {exc}"))
    return failures


@dataclass(frozen=True)
class ValidationRules:
    """What ``validate_frames`` checks beyond the schema, with what, and how much of it the report lists."""

    require_answer: bool  # a correctness reward is configured: every row needs a parseable gold answer
    # The correctness rewards (TRL signature) the gold completion must max out; None or [] skips that check.
    reward_fns_for_gold: list | None = None
    parse_gold: Callable[[Any], Any] | None = None  # the verifier's; None = grpo_core.rewards.parse_gold
    # Called with the raw prompt - a string, or the chat messages, so the caller can apply the chat template.
    count_tokens: Callable[[Any], int] | None = None
    max_prompt_length: int | None = None  # with count_tokens: longer prompts are reported
    overlong_policy: str = "truncate"  # an overlong prompt is a warning ("truncate") or a failure ("error")
    max_report_rows: int = 1000  # failures and warnings listed at most (the summary counts them all)
    prompt_column: str = "prompt"  # the frames' column names; the report names them prompt / answer
    answer_column: str = "answer"
    reward_fns_for_smoke: list | None = None  # every configured reward, called once on a few train rows
    # The names of train.environment_factory's mapping: each row's ``environment`` column must be one of them.
    environments: Sequence[str] | None = None
    smoke_columns: Mapping[str, list] | None = None  # more reward keyword lists for the smoke call


def _split_checks(df: pd.DataFrame, split: str, rules: ValidationRules
                  ) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """One split's row checks under ``rules`` (its canonical column names and gold parser already set)."""
    prompt_column, answer_column = rules.prompt_column, rules.answer_column
    count_tokens, max_prompt_length, overlong_policy = (rules.count_tokens, rules.max_prompt_length,
                                                        rules.overlong_policy)
    failures: list[dict] = []
    warnings: list[dict] = []
    notes: dict[str, Any] = {}
    if len(df) == 0:
        failures.append(_row(split, None, None, "split_not_empty", "the split has no rows"))
        return failures, warnings, notes
    has_prompt = prompt_column in df.columns
    prompts = df[prompt_column] if has_prompt else pd.Series(dtype=object)

    # duplicates within the split
    first_seen: dict[str, Any] = {}
    for idx, p in prompts.items():
        key = normalise_prompt(p) if not _is_missing(p) else None
        if not key:
            continue
        if key in first_seen:
            failures.append(_row(split, idx, prompt_column, "duplicate_prompt",
                                 f"same prompt as row {first_seen[key]}: {_short(prompt_text(p), 80)}"))
        else:
            first_seen[key] = idx

    # prompt length
    if count_tokens is not None and max_prompt_length is not None and has_prompt:
        for idx, p in prompts.items():
            if _is_missing(p) or prompt_text(p) is None:
                continue
            n = int(count_tokens(p))
            if n > max_prompt_length:
                entry = _row(split, idx, prompt_column, "prompt_length",
                             f"{n} tokens > max_prompt_length={max_prompt_length}"
                             + (" (will be left-truncated)" if overlong_policy == "truncate" else ""))
                (warnings if overlong_policy == "truncate" else failures).append(entry)

    # gold answers: parseable, and scoring the maximum under each correctness reward
    if rules.require_answer and answer_column in df.columns:
        parsed: dict[Any, Any] = {}
        for idx, a in df[answer_column].items():
            if _is_missing(a) or (isinstance(a, str) and not a.strip()):
                continue  # the schema reports missing answers
            value = rules.parse_gold(a)
            if value is None:
                failures.append(_row(split, idx, answer_column, "gold_parseable",
                                     f"the verifier cannot parse the gold answer {_short(a, 80)!r}"))
            elif has_prompt and prompt_text(df.at[idx, prompt_column]) is not None:
                parsed[idx] = value
        if rules.reward_fns_for_gold:
            more, na = _gold_reward_checks(df, split, list(parsed), parsed, rules.reward_fns_for_gold,
                                           answer_column, prompt_column)
            failures.extend(more)
            if na:
                notes["gold_reward_not_applicable"] = dict(na)
    return failures, warnings, notes


def _overlap_failures(train_df: pd.DataFrame, eval_df: pd.DataFrame, prompt_column: str) -> list[dict]:
    if prompt_column not in train_df.columns or prompt_column not in eval_df.columns:
        return []
    train_keys: dict[str, Any] = {}
    for idx, p in train_df[prompt_column].items():
        key = normalise_prompt(p) if not _is_missing(p) else None
        if key:
            train_keys.setdefault(key, idx)
    out = []
    for idx, p in eval_df[prompt_column].items():
        key = normalise_prompt(p) if not _is_missing(p) else None
        if key and key in train_keys:
            out.append(_row("eval", idx, prompt_column, "train_eval_overlap",
                            f"same prompt as train row {train_keys[key]}: {_short(prompt_text(p), 80)}"))
    return out


def environment_failures(df: pd.DataFrame, split: str, names: Sequence[str]) -> list[dict[str, Any]]:
    """With ``train.environment_factory`` a mapping, every row's ``environment`` column names one of ``names``
    (TRL's routing column): a row naming none would stop sampling midway."""
    if "environment" not in df.columns:
        return [_row(split, None, "environment", "environment_column",
                     f"column missing: train.environment_factory maps {sorted(names)}, and each row must "
                     "name its environment")]
    return [_row(split, idx, "environment", "environment_unknown",
                 f"{value!r} is not one of train.environment_factory's {sorted(names)}")
            for idx, value in df["environment"].items() if value not in names]


def validate_frames(train_df: pd.DataFrame, eval_df: pd.DataFrame | None, rules: ValidationRules
                    ) -> ValidationReport:
    """Validate both splits under ``rules``, collecting every failure (the module docstring lists the checks).

    ``eval_df`` may be None. ``rules.reward_fns_for_smoke`` are called by ``reward_smoke_failures``.
    """
    if rules.overlong_policy not in OVERLONG_POLICIES:
        raise ValueError(f"overlong_policy must be one of {OVERLONG_POLICIES}, got {rules.overlong_policy!r}")
    max_report_rows, require_answer = rules.max_report_rows, rules.require_answer
    if max_report_rows < 0:
        raise ValueError(f"max_report_rows must be >= 0, got {max_report_rows}")
    if (rules.prompt_column, rules.answer_column) != ("prompt", "answer"):  # the schemas' canonical names
        rename = {rules.prompt_column: "prompt", rules.answer_column: "answer"}
        train_df = train_df.rename(columns=rename)
        eval_df = None if eval_df is None else eval_df.rename(columns=rename)
    parse_gold = _default_parse_gold() if require_answer and rules.parse_gold is None else rules.parse_gold
    split_rules = replace(rules, parse_gold=parse_gold, prompt_column="prompt", answer_column="answer")

    splits = {"train": train_df} if eval_df is None else {"train": train_df, "eval": eval_df}
    failures: list[dict] = []
    warnings: list[dict] = []
    notes: list[str] = []
    for split, df in splits.items():
        if not isinstance(df, pd.DataFrame):
            raise TypeError(f"validate_frames: {split}_df must be a pandas DataFrame, "
                            f"got {type(df).__name__}")
        failures += schema_failures(df, split, require_answer)
        f, w, n = _split_checks(df, split, split_rules)
        failures += f
        warnings += w
        if rules.environments is not None:
            failures += environment_failures(df, split, rules.environments)
        for fn_name, count in n.get("gold_reward_not_applicable", {}).items():
            notes.append(f"{split}: reward '{fn_name}' returned None (does not apply) for {count} gold "
                         "completion(s); those rows were not smoke-tested")
    if eval_df is not None:
        failures += _overlap_failures(train_df, eval_df, "prompt")
    if rules.reward_fns_for_smoke:
        failures += reward_smoke_failures(train_df, rules.reward_fns_for_smoke,
                                          extra_columns=rules.smoke_columns)

    summary: dict[str, Any] = {
        "total_failures": len(failures),
        "total_warnings": len(warnings),
        "failures_listed": min(len(failures), max_report_rows),
        "warnings_listed": min(len(warnings), max_report_rows),
        "splits": {
            split: {
                "rows": int(len(df)),
                "failures": sum(r["split"] == split for r in failures),
                "warnings": sum(r["split"] == split for r in warnings),
                "failures_by_check": dict(Counter(r["check"] for r in failures if r["split"] == split)),
                "warnings_by_check": dict(Counter(r["check"] for r in warnings if r["split"] == split)),
            }
            for split, df in splits.items()
        },
        "notes": notes,
    }
    return ValidationReport(ok=not failures, failures=failures[:max_report_rows],
                            warnings=warnings[:max_report_rows], summary=summary)
