r"""The calculator task: arithmetic the tiny model cannot do in its head, which the calculator tool does.

    prompt     [{"role": "user", "content": "What is 47 times 86?"}]                        answer "4042"
    tool path  assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "47*86"}}</tool_call>
               tool       4042
               assistant  <answer>\n4042\n</answer>
    guess      assistant  <answer>\n7315\n</answer>                     (no tool: a plausible wrong number)
    bad call   assistant  ... {"expression": "47 times 86"} ...;  tool  {'error': 'invalid expression'};
               assistant  <answer>\n7315\n</answer>                     (the call failed: a guess again)

Products of a 10..max_operand number and a 2..99 one, and sums of three 10..max_operand numbers: a
0.4M-parameter model learns to copy numbers, into the call and from the result, but not to multiply or carry.
Each template's demonstrations guess instead of calling the tool at a rate spread around `label_noise`
(tasks.template_noise), and a `format_noise` share of the calls are broken (the operator written as a word,
which the calculator rejects): greedy decoding calls the tool on the templates below 0.5 and guesses on the
others, so greedy accuracy starts low while sampling finds the tool path on every template - the headroom GRPO
closes by calling the tool, with a well-formed call, every time. The guess is fixed per problem: a random
number as long as the result, never it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar

from grpo_core.embedded.config import MIN_MAX_OPERAND, TOOL_TASK
from grpo_core.embedded.tasks import NAMES, OBJECTS, distinct_splits
from grpo_core.embedded.tools import calculator

TASK = TOOL_TASK
#: the `format_break` values of a demonstration: the call as written, or broken (the operator as a word)
CALL_BREAKS = ("none", "bad_call")


@dataclass(frozen=True)
class ToolTemplate:
    text: str  # placeholders {name} {obj} and, in this order, {a} {b} (products) or {a} {b} {c} (sums)
    op: str  # "*" (two operands) or "+" (three)


# The operations alternate, so the low- and high-rate ends of template_noise hold both. Numbers appear in the
# order the expression writes them: copying them in order is what a model this small learns in the warm-start
# budget.
TEMPLATES = (
    ToolTemplate("What is {a} times {b}?", "*"),
    ToolTemplate("What is {a} plus {b} plus {c}?", "+"),
    ToolTemplate("Multiply {a} by {b}.", "*"),
    ToolTemplate("Add {a}, {b} and {c}.", "+"),
    ToolTemplate("{name} packs {a} boxes of {b} {obj}. How many {obj} is that?", "*"),
    ToolTemplate("{name} has {a} {obj}, finds {b} more and then {c} more. How many {obj} now?", "+"),
    ToolTemplate("There are {a} crates of {b} {obj}. How many {obj} in all?", "*"),
    ToolTemplate("Three shelves hold {a}, {b} and {c} {obj}. How many {obj} in total?", "+"),
)
_OP_WORDS = {"*": " times ", "+": " plus "}


def tool_call(expression: str) -> dict:
    """An assistant message's tool call (transformers' / TRL's shape)."""
    return {"type": "function",
            "function": {"name": calculator.__name__, "arguments": {"expression": expression}}}


@dataclass(frozen=True)
class CalculatorProblem:
    template: int
    name: str
    obj: str
    operands: tuple[int, ...]
    guess: int  # the wrong number a demonstration without the tool answers

    task: ClassVar[str] = TASK
    format_breaks: ClassVar[tuple[str, ...]] = CALL_BREAKS

    @property
    def op(self) -> str:
        return TEMPLATES[self.template].op

    @property
    def expression(self) -> str:
        return self.op.join(str(v) for v in self.operands)

    @property
    def result(self) -> int:
        return _apply(self.op, self.operands)

    @property
    def text(self) -> str:
        fields = dict(zip("abc", self.operands))
        return TEMPLATES[self.template].text.format(name=self.name, obj=self.obj, **fields)

    @property
    def prompt(self) -> list[dict]:
        return [{"role": "user", "content": self.text}]

    @property
    def answer(self) -> str:
        return str(self.result)

    def completion(self, guess: bool = False, format_break: int = 0) -> list[dict]:
        """A demonstration's messages after the prompt: the tool path; with `guess`, a direct wrong answer;
        with format_break 1 (CALL_BREAKS), a call the calculator rejects, its error, then the guess."""
        if guess:
            return [_answer(self.guess)]
        expression = self.expression
        if CALL_BREAKS[format_break] == "bad_call":
            expression = _OP_WORDS[self.op].join(str(v) for v in self.operands)
        try:  # what a rollout answers the call with: the value, or the error as TRL writes it
            result = calculator(expression)
            final = int(result)
        except ValueError as exc:
            result, final = str({"error": str(exc)}), self.guess  # the call failed: the model still guesses
        return [
            {"role": "assistant", "content": "", "tool_calls": [tool_call(expression)]},
            {"role": "tool", "name": calculator.__name__, "content": result},
            _answer(final),
        ]

    def row(self) -> dict:
        return {"prompt": self.prompt, "answer": self.answer, "task": self.task}


def _apply(op: str, operands: tuple[int, ...]) -> int:
    return math.prod(operands) if op == "*" else sum(operands)


def _answer(value: int) -> dict:
    return {"role": "assistant", "content": f"<answer>\n{value}\n</answer>"}


def _guess(rng: random.Random, result: int) -> int:
    """A number with as many digits as the result, drawn uniformly, never the result: plausible, and unrelated
    to the operands. (A guess near the result - off by a few percent - taught the model to approximate the
    product in the answer, which fought copying the tool's result there: the warm start then copied it half as
    often.)"""
    digits = len(str(result))
    while True:
        guess = rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)
        if guess != result:
            return guess


def sample_problem(rng: random.Random, max_operand: int) -> CalculatorProblem:
    template = rng.randrange(len(TEMPLATES))
    if TEMPLATES[template].op == "*":
        operands = (rng.randint(10, max_operand), rng.randint(2, 99))
    else:
        operands = tuple(rng.randint(10, max_operand) for _ in range(3))
    guess = _guess(rng, _apply(TEMPLATES[template].op, operands))
    return CalculatorProblem(template, rng.choice(NAMES), rng.choice(OBJECTS), operands, guess)


def generate_splits(
    num_train: int, num_eval: int, max_operand: int, seed: int
) -> tuple[list[CalculatorProblem], list[CalculatorProblem]]:
    """(train, eval) calculator problems, deterministic in `seed`, no prompt in both nor twice in one."""
    if max_operand < MIN_MAX_OPERAND:
        raise ValueError(f"embedded.max_operand: {max_operand}; the calculator task "
                         f"needs >= {MIN_MAX_OPERAND}")
    rng = random.Random(seed)
    return distinct_splits(lambda i: sample_problem(rng, max_operand), num_train, num_eval,
                           key=lambda p: p.text)


def vocabulary_words() -> list[str]:
    """The words the calculator transcripts write (templates, names, objects, the operators as words)."""
    words: set[str] = set(NAMES) | set(OBJECTS) | {w.strip() for w in _OP_WORDS.values()}
    for t in TEMPLATES:
        text = t.text.format(name="", obj="", a="", b="", c="")
        words.update("".join(ch if ch.isalpha() else " " for ch in text).split())
    return sorted(words)


def scaffold_conversations() -> list[list[dict]]:
    """One conversation per template and demonstration kind: the texts the tokenizer's merges are learnt from
    besides the words (the JSON of a call, an error, the tools line), so each scaffold piece is one token."""
    conversations = []
    for template, t in enumerate(TEMPLATES):
        operands = (123, 45) if t.op == "*" else (123, 456, 789)
        p = CalculatorProblem(template, NAMES[0], OBJECTS[0], operands, guess=1)
        conversations += [p.prompt + p.completion(g, f) for g in (False, True)
                          for f in range(len(CALL_BREAKS))]
    return conversations
