"""Text parsing shared by the rewards: tagged sections, `\\boxed{}`, numbers, and gold answers.

Numbers are parsed to exact `Fraction`s so that numeric equivalence is equality:
0.5 == 1/2 == .50 == 0.50, "1,234" == 1234, "-3" == -3.0, "\\frac{3}{4}" == 0.75.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

DEFAULT_LETTERS = "ABCD"

# A number as written in text: optional sign (only where it cannot be a binary minus, e.g. not in "45-23"),
# digits with optional thousands separators, optional decimals; or a bare ".5"; optional "/denominator".
_NUMBER_RE = re.compile(
    r"(?:(?<![\w).])-)?"
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/\d+(?!\d|\.\d))?"
)
_FRAC_RE = re.compile(r"\\d?frac\{\s*(-?[\d.,]+)\s*\}\{\s*(-?[\d.,]+)\s*\}")
_CLEAN_NUMBER_RE = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def extract_section(text: str, tag: str, *, last: bool = True) -> str | None:
    """The content between `<tag>` and the next `</tag>` (to the end of `text` if unclosed), or None.

    `last=True` takes the last opening tag (models sometimes restate an answer), else the first.
    Surrounding whitespace is stripped.
    """
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    start = text.rfind(open_tag) if last else text.find(open_tag)
    if start < 0:
        return None
    body = text[start + len(open_tag) :]
    end = body.find(close_tag)
    return (body if end < 0 else body[:end]).strip()


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced: not a finished box


def _normalise(text: str) -> str:
    # Unicode minus, LaTeX thin spaces and the currency/percent signs that do not change the value.
    text = text.replace("\u2212", "-").replace("\\,", "").replace("\\!", "").replace("\\$", "")
    text = text.replace("$", "").replace("\\%", "").replace("%", "")
    return _FRAC_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text)


def parse_number(text: str) -> Fraction | None:
    """`text` as one exact number, or None when it is not just a number.

    Accepts signs, thousands separators ("1,234"), decimals (".5", "0.50"), exponents ("1e3"), fractions
    ("1/2", "\\frac{1}{2}"), and ignores "$", "%" and surrounding whitespace or a final period.
    """
    s = _normalise(text).strip().rstrip(".").strip()
    if not s:
        return None
    if "/" in s:
        num, _, den = s.partition("/")
        n, d = parse_number(num), parse_number(den)
        if n is None or d is None or d == 0:
            return None
        return n / d
    if not _CLEAN_NUMBER_RE.fullmatch(s):
        return None
    return Fraction(s.replace(",", ""))


def last_number(text: str) -> Fraction | None:
    """The last number written in free text (e.g. "so the total is 1,234 apples." → 1234), or None."""
    matches = _NUMBER_RE.findall(_normalise(text))
    for m in reversed(matches):
        value = parse_number(m)
        if value is not None:
            return value
    return None


def last_number_text(text: str) -> str | None:
    """The last number written in free text as it is written there (sign and separators kept), or None."""
    matches = _NUMBER_RE.findall(_normalise(text))
    return matches[-1] if matches else None


def extract_number(text: str) -> Fraction | None:
    """The number a model answered: the content of the last `\\boxed{}` if any, else the last number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        value = parse_number(boxed)
        return value if value is not None else last_number(boxed)
    return last_number(text)


def extract_choice(text: str, letters: str = DEFAULT_LETTERS, *, require_boxed: bool = True) -> str | None:
    """The letter a model chose: `\\boxed{X}` (last box) with X in `letters`; with `require_boxed=False`
    also a bare letter such as "B", "(B)" or "B)". Case-sensitive (a lowercase "a" is a word, not a
    choice)."""
    boxed = extract_boxed(text)
    candidate = boxed if boxed is not None else (None if require_boxed else text)
    if candidate is None:
        return None
    candidate = candidate.strip().strip("().").strip()
    return candidate if len(candidate) == 1 and candidate in letters else None


@dataclass(frozen=True)
class ParsedGold:
    """A gold answer: a choice letter or an exact number."""

    kind: Literal["choice", "number"]
    value: str | Fraction


def is_missing(value: Any) -> bool:
    """True for None, NaN, pandas NA and empty/whitespace strings: rows with no gold answer."""
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    if isinstance(value, str) and not value.strip():
        return True
    return type(value).__name__ in {"NAType", "NaTType"}


def parse_gold(answer: Any, letters: str = DEFAULT_LETTERS) -> ParsedGold | None:
    """A dataset's gold answer, parsed; None when missing or unparseable (data validation reports those).

    Letters: "B", "(B)", "\\boxed{B}" with B in `letters` → choice. Numbers: ints/floats, or strings that
    `parse_number` accepts, optionally after a GSM8K-style "#### " marker or inside `\\boxed{}`.
    """
    if is_missing(answer) or isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return ParsedGold("number", Fraction(answer))
    if isinstance(answer, float):
        # repr, not the binary value: gold 0.1 is 1/10, as the text "0.1" is.
        return None if math.isinf(answer) else ParsedGold("number", Fraction(repr(answer)))
    text = str(answer)
    if "####" in text:  # GSM8K solutions end with "#### <answer>"
        text = text.rsplit("####", 1)[1]
    boxed = extract_boxed(text)
    if boxed is not None:
        text = boxed
    text = text.strip()
    letter = text.strip("().").strip()
    if len(letter) == 1 and letter in letters:
        return ParsedGold("choice", letter)
    number = parse_number(text)
    return None if number is None else ParsedGold("number", number)
