"""reasoning-gym's own scorers as a reward: each row names its task, and the task's ``score_answer`` scores
the answer read from the completion, partial credit kept as the task defines it.

A row of a reasoning-gym split (``grpo_core/data/reasoning_gym.py`` writes and decodes them) carries what
scoring needs:

    task         the reasoning-gym dataset name, e.g. chain_sum
    task_config  the generator's config as JSON (the scorer of some tasks reads its dataset's config)
    metadata     the entry's metadata as JSON, tuples and non-string keys kept (``decode_value``)
    answer       the reference answer, as reasoning-gym wrote it

The scorer is strict (``chain_sum``'s gives "The answer is -4" 0.125 where "-4" is 1.0), so the answer is
extracted first: the first of ``extract``'s ways that finds one, in order. A completion in which none finds an
answer scores 0, as reasoning-gym scores a missing answer; a row with no task gets None (does not apply).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from grpo_core.data.reasoning_gym import (
    CONFIG_COLUMN,
    METADATA_COLUMN,
    TASK_COLUMN,
    decode_value,
    require_reasoning_gym,
)
from grpo_core.rewards.base import RewardFunction, RewardValue, named, texts
from grpo_core.rewards.parsing import extract_boxed, extract_section, last_number_text

# "The answer is 12", "the final answer is: **12**." - the rest of that line
_ANSWER_IS = re.compile(r"answer\s+is\s*:?[ \t]*([^\n]*)", re.IGNORECASE)


@functools.lru_cache(maxsize=64)
def task_dataset(name: str, config_json: str):
    """The dataset whose ``score_answer`` scores rows of task ``name`` generated under ``config_json``; one
    per (task, config) a process meets. Its seed and size do not matter to the scorer."""
    rg = require_reasoning_gym()
    return rg.create_dataset(name, size=1, seed=0, **json.loads(config_json))


def _answer_is(text: str) -> str | None:
    found = _ANSWER_IS.findall(text)
    if not found:
        return None
    # markdown bold and math dollars around it, and the sentence's one full stop (after them or inside), are
    # not part of the answer
    answer = found[-1].strip()
    stopped = answer.endswith(".")
    answer = answer.removesuffix(".").strip().strip("*$").strip()
    return answer if stopped else answer.removesuffix(".").rstrip()


#: the ways an answer is read from a completion: each gives the answer text, or None when it finds none
EXTRACTORS: dict[str, Callable[[str, str], str | None]] = {
    "answer_tag": lambda text, tag: extract_section(text, tag),  # reasoning-gym's <answer>…</answer>
    "boxed": lambda text, tag: extract_boxed(text),
    "answer_is": lambda text, tag: _answer_is(text),
    "last_number": lambda text, tag: last_number_text(text),
    "whole": lambda text, tag: text.strip(),
}
# how a completion that states `answer` reads under each way: validate's gold check writes the first one
_STATED: dict[str, Callable[[str, str], str]] = {
    "answer_tag": lambda answer, tag: f"<{tag}>{answer}</{tag}>",
    "boxed": lambda answer, tag: f"\\boxed{{{answer}}}",
    "answer_is": lambda answer, tag: f"The answer is {answer}.",
    "last_number": lambda answer, tag: answer,
    "whole": lambda answer, tag: answer,
}


def extract_answer(text: str, extract: Sequence[str], answer_tag: str = "answer") -> str | None:
    """The answer of a completion: the first of ``extract``'s ways that finds one, None when none does."""
    for way in extract:
        found = EXTRACTORS[way](text, answer_tag)
        if found is not None:
            return found
    return None


def _question(prompt: Any) -> str:
    """The entry's question: the prompt, or a chat prompt's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return users[-1] if users else ""


def names_task(row: dict[str, Any]) -> bool:
    """Whether a row's columns name a reasoning-gym task and carry its entry's metadata."""
    task = row.get(TASK_COLUMN)
    return isinstance(task, str) and bool(task) and isinstance(row.get(METADATA_COLUMN), str)


def score_row(answer: str | None, row: dict[str, Any], question: str = "") -> float:
    """The task's own score of ``answer`` for one row's columns (``names_task``). A scorer that raises on what
    a model wrote scores it 0: that answer is not one the task can read."""
    dataset = task_dataset(row[TASK_COLUMN], row.get(CONFIG_COLUMN) or "{}")
    entry = {"question": question, "answer": row.get("answer"),
             "metadata": decode_value(json.loads(row[METADATA_COLUMN]))}
    try:
        return float(dataset.score_answer(answer, entry))
    except Exception:  # noqa: BLE001 - the task's parser failing on a model's text is a wrong answer
        return 0.0


def reasoning_gym(extract: Sequence[str] = ("answer_tag", "boxed", "answer_is"),
                  answer_tag: str = "answer") -> RewardFunction:
    """The score the row's reasoning-gym task gives the answer read from the completion (``extract``: the
    ways tried in order, of answer_tag (``<answer_tag>…</answer_tag>``), boxed (the last ``\\boxed{}``),
    answer_is ("The answer is N"), last_number, whole (the whole completion)); 0 when none finds an answer;
    None for a row with no task."""
    extract = [extract] if isinstance(extract, str) else list(extract)
    unknown = [w for w in extract if w not in EXTRACTORS]
    if not extract or unknown:
        raise ValueError(f"extract: {unknown or extract!r}; choose from {', '.join(EXTRACTORS)}, in the "
                         "order they are tried")
    require_reasoning_gym()  # fails when the reward is built, not in the middle of a run

    def reward(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        missing = [c for c in (TASK_COLUMN, METADATA_COLUMN, "answer") if c not in kwargs]
        if missing:
            raise KeyError(f"reasoning_gym: no {missing} among the reward columns {sorted(kwargs)}; the rows "
                           "come from params.yaml's reasoning_gym: section (the prepare stage)")
        columns = (TASK_COLUMN, CONFIG_COLUMN, METADATA_COLUMN, "answer")
        out: list[RewardValue] = []
        for i, text in enumerate(texts(completions)):
            row = {c: kwargs[c][i] for c in columns if c in kwargs}
            answer = extract_answer(text, extract, answer_tag)
            if not names_task(row):
                out.append(None)
            else:
                out.append(0.0 if answer is None else score_row(answer, row, _question(prompts[i])))
        return out

    def gold_completion(answer: Any) -> str:
        """What validate's gold check scores: the gold answer stated the way the first extractor reads it."""
        return _STATED[extract[0]](str(answer), answer_tag)

    reward.gold_completion = gold_completion  # type: ignore[attr-defined]
    return named(reward, "reasoning_gym")


def reasoning_gym_answered(extract: Sequence[str] = ("answer_tag", "boxed", "answer_is"),
                           answer_tag: str = "answer") -> RewardFunction:
    """1.0 when ``extract``'s ways (as the ``reasoning_gym`` reward reads them) find an answer in the
    completion, else 0.0: the format judge beside that reward, so evaluation tells a wrong answer from
    none."""
    extract = [extract] if isinstance(extract, str) else list(extract)
    unknown = [w for w in extract if w not in EXTRACTORS]
    if not extract or unknown:
        raise ValueError(f"extract: {unknown or extract!r}; choose from {', '.join(EXTRACTORS)}")

    def reward(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        return [float(extract_answer(t, extract, answer_tag) is not None) for t in texts(completions)]

    return named(reward, "reasoning_gym_answered")
