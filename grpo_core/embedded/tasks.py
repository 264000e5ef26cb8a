r"""Synthetic verifiable tasks: one-step word problems (add or subtract), asked plain or as multiple choice.

    prompt      "Mia has 9 pens and gives away 3. How many pens are left?"
    completion  "<reasoning>\n9-3=6\n</reasoning>\n<answer>\n6\n</answer>"               answer "6"
    MC prompt   "...left?\nA) 12 B) 6 C) 7 D) 8"   completion "...<answer>\n\boxed{B}\n</answer>"  answer "B"

Why this task leaves GRPO the right headroom: the only hard decision is *which operation* the problem
asks for (the verb), one token early in the reasoning; the arithmetic itself (operands 1..max_operand)
is learnt from clean demonstrations. The warm start's demonstrations apply the wrong operation with a
per-template rate (`template_noise`) spread around `label_noise`: on templates above 0.5 the base
policy's greedy answer is wrong while T=1 samples are still often right — a mistake that sampling finds
and a verifiable reward can fix. The wrong answer is internally consistent (9+3=12 → 12, or its letter),
as a plausible misreading is. Multiple-choice options are listed sum, difference, near miss, near miss
unless `shuffle_options` (see `_options`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

P = TypeVar("P")

LETTERS = "ABCD"
NAMES = ("Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ivy", "Ben", "Amy", "Tom", "Eva", "Jay", "Kim", "Ray")
OBJECTS = ("apples", "pens", "coins", "books", "cards", "stamps", "marbles", "shells", "cookies", "eggs")


@dataclass(frozen=True)
class Template:
    text: str  # placeholders {name} {obj} {a} {b}
    op: str  # "+" or "-": the operation the problem asks for


# Pairs differ only in the verb phrase, so the operation must be read from it.
TEMPLATES = (
    Template("{name} has {a} {obj} and buys {b} more. How many {obj} does {name} have now?", "+"),
    Template("{name} has {a} {obj} and gives away {b}. How many {obj} are left?", "-"),
    Template("A box holds {a} {obj}. {name} puts in {b} more. How many {obj} are in the box?", "+"),
    Template("A box holds {a} {obj}. {name} takes out {b}. How many {obj} are in the box?", "-"),
    Template("{name} had {a} {obj} and found {b} more. How many {obj} does {name} have?", "+"),
    Template("{name} had {a} {obj} and lost {b}. How many {obj} does {name} have?", "-"),
    Template("{name} picked {a} {obj} and then {b} more. How many {obj} in total?", "+"),
    Template("{name} has {a} {obj} and eats {b}. How many {obj} remain?", "-"),
)

# generate_splits gives up after this many duplicate prompts in a row (the space is nearly exhausted).
MAX_CONSECUTIVE_DUPLICATES = 1000

# Format breaks a noisy demonstration may show (index into FORMAT_BREAKS; 0 = none).
FORMAT_BREAKS = ("none", "no_reasoning_close", "no_answer_tags", "trailing_text")


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b


def _flip(op: str) -> str:
    return "-" if op == "+" else "+"


@dataclass(frozen=True)
class Problem:
    """One word problem; `options` (4 numbers in letter order) only for multiple choice."""

    task: str
    template: int
    name: str
    obj: str
    a: int
    b: int
    options: tuple[int, ...] = ()

    #: the `format_break` values `completion` takes (the warm start draws them)
    format_breaks: ClassVar[tuple[str, ...]] = FORMAT_BREAKS

    @property
    def op(self) -> str:
        return TEMPLATES[self.template].op

    @property
    def result(self) -> int:
        return _apply(self.op, self.a, self.b)

    @property
    def prompt(self) -> str:
        t = TEMPLATES[self.template]
        text = t.text.format(name=self.name, obj=self.obj, a=self.a, b=self.b)
        if self.task == "multiple_choice":
            text += "\n" + " ".join(f"{LETTERS[i]}) {v}" for i, v in enumerate(self.options))
        return text

    @property
    def answer(self) -> str:
        """The gold answer column: the number, or the letter of the correct option."""
        if self.task == "multiple_choice":
            return LETTERS[self.options.index(self.result)]
        return str(self.result)

    def completion(self, wrong_op: bool = False, format_break: int = 0) -> str:
        """A demonstration: the correct one, or one that applies the other operation (consistently,
        to the end), with the tag layout intact (0) or broken as FORMAT_BREAKS[format_break]."""
        op = _flip(self.op) if wrong_op else self.op
        value = _apply(op, self.a, self.b)
        reasoning = f"{self.a}{op}{self.b}={value}"
        shown = f"\\boxed{{{LETTERS[self.options.index(value)]}}}" if self.options else str(value)
        kind = FORMAT_BREAKS[format_break]
        if kind == "no_reasoning_close":
            return f"<reasoning>\n{reasoning}\n<answer>\n{shown}\n</answer>"
        if kind == "no_answer_tags":
            return f"<reasoning>\n{reasoning}\n</reasoning>\n{shown}"
        text = f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{shown}\n</answer>"
        return text + f"\n{shown}" if kind == "trailing_text" else text

    def row(self) -> dict[str, str]:
        return {"prompt": self.prompt, "answer": self.answer, "task": self.task}


def template_noise(label_noise: float, spread: float, num_templates: int = len(TEMPLATES)) -> list[float]:
    """Per-template share of wrong-operation demonstrations: evenly spaced over label_noise ± spread
    (clipped to [0, 1]), in template order, so both operations get low- and high-noise templates."""
    lo, hi = label_noise - spread, label_noise + spread
    if num_templates == 1:
        return [min(1.0, max(0.0, label_noise))]
    return [min(1.0, max(0.0, lo + (hi - lo) * i / (num_templates - 1))) for i in range(num_templates)]


def _options(rng: random.Random, a: int, b: int, op: str, shuffle: bool) -> tuple[int, ...]:
    """4 distinct positive numbers: the sum, the difference and two near misses of the correct result.

    Unshuffled, A is always the sum and B the difference, so the letter follows from the operation the
    reasoning used; shuffled, the model must also look its result up among the options (a content lookup
    a model this small does not learn within the warm-start budget).
    """
    result = _apply(op, a, b)
    near = [result + d for d in (1, -1, 2, -2, 10, -10)]
    near = [v for v in near if v > 0 and v not in (a + b, a - b)]
    options = [a + b, a - b, *rng.sample(near, 2)]
    if shuffle:
        rng.shuffle(options)
    return tuple(options)


def sample_problem(rng: random.Random, task: str, max_operand: int, shuffle_options: bool = False) -> Problem:
    """One problem with 1 ≤ b < a ≤ max_operand, so both operations give a positive result."""
    template = rng.randrange(len(TEMPLATES))
    a = rng.randint(2, max_operand)
    b = rng.randint(1, a - 1)
    options = (
        _options(rng, a, b, TEMPLATES[template].op, shuffle_options) if task == "multiple_choice" else ()
    )
    return Problem(task, template, rng.choice(NAMES), rng.choice(OBJECTS), a, b, options)


def generate_splits(
    num_train: int,
    num_eval: int,
    tasks: Sequence[str],
    max_operand: int,
    seed: int,
    shuffle_options: bool = False,
) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) problems, deterministic in `seed`, with no prompt in both (nor twice in one);
    tasks alternate so each gets an equal share of both splits."""
    if not tasks:
        raise ValueError("embedded.tasks: at least one task is required")
    unknown = sorted(set(tasks) - {"arithmetic", "multiple_choice"})
    if unknown:
        raise ValueError(f"embedded.tasks: unknown task(s) {unknown}; choose arithmetic, multiple_choice")
    rng = random.Random(seed)
    return distinct_splits(
        lambda i: sample_problem(rng, tasks[i % len(tasks)], max_operand, shuffle_options),
        num_train,
        num_eval,
        key=lambda p: p.prompt,
    )


def distinct_splits(
    sample: Callable[[int], P], num_train: int, num_eval: int, key: Callable[[P], str]
) -> tuple[list[P], list[P]]:
    """(train, eval) from `sample(i)` (i = problems kept so far), redrawing a problem whose `key` (its prompt
    text) was seen, so no prompt is in both splits nor twice in one. Eval is the first `num_eval` kept."""
    total, problems, seen = num_train + num_eval, [], set()
    misses = 0  # consecutive duplicates: many in a row means the prompt space is nearly exhausted
    while len(problems) < total and misses < MAX_CONSECUTIVE_DUPLICATES:
        problem = sample(len(problems))
        if key(problem) in seen:
            misses += 1
            continue
        misses = 0
        seen.add(key(problem))
        problems.append(problem)
    if len(problems) < total:
        raise ValueError(
            f"only {len(problems)} distinct prompts for {total} requested: raise embedded.max_operand"
        )
    # Tasks alternate along the list, so both slices keep equal task shares.
    return problems[num_eval:], problems[:num_eval]


def vocabulary_words() -> list[str]:
    """Every word the tasks can write (templates, names, objects, option letters): the tokenizer's words."""
    words: set[str] = set(NAMES) | set(OBJECTS) | set(LETTERS)
    for t in TEMPLATES:
        text = t.text.format(name="", obj="", a="", b="")
        words.update("".join(ch if ch.isalpha() else " " for ch in text).split())
    return sorted(words)
