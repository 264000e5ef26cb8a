"""A calculator tool for word problems (configs/gsm8k-qwen2.5-0.5b-tools.yaml): exact arithmetic on decimals.

    calculator("48/2 + 7")      -> "31"
    calculator("12.50 * 3")     -> "37.5"
    calculator("10 / 3")        -> "3.333333"   (rounded to DECIMALS places, trailing zeros dropped)
    calculator("(5 - 8) % 4")   -> "1"

A plain function with type hints and a docstring (TRL's tool convention): ``get_json_schema`` reads its
schema, the chat template shows it to the model, a rollout calls it with the arguments the model wrote.

Why not ``eval`` or a float evaluator: the expression is parsed with ``ast`` and walked over
``fractions.Fraction``, so nothing the model writes can name, call, import or exhaust anything, and money sums
come out exact (a float evaluator such as simpleeval answers 0.1 + 0.2 with 0.30000000000000004, and by
default also takes strings, comparisons and a few functions). Bounds: 200 characters (nesting depth 100),
``**`` with an integer exponent of at most MAX_EXPONENT in size and a result of at most MAX_POWER_BITS bits. A
bad expression raises ValueError naming what is wrong; a rollout answers the model with that text and counts a
failed call.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

from grpo_core.common.expressions import construct_name, parse_expression

#: longest expression accepted, in characters
MAX_EXPRESSION_LENGTH = 200
#: largest |exponent| of ``**``
MAX_EXPONENT = 64
#: largest size of a power's result, in bits of its numerator or denominator (nested powers grow doubly
#: exponentially: (9**64)**64 is refused before it is computed)
MAX_POWER_BITS = 4096
#: decimal places of a result that does not terminate sooner
DECIMALS = 6

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers (decimals allowed) joined by +, -, *, /, //, % or ** with parentheses,
            e.g. "48/2 + 7" or "(12.5 * 4) - 3". Thousands separators are not allowed: write 1200, not 1,200.

    Returns:
        The value, as a decimal number (rounded to 6 decimal places when it does not terminate sooner).
    """
    try:
        tree = parse_expression(expression, MAX_EXPRESSION_LENGTH)
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    return decimal_text(_value(tree))


def decimal_text(value: Fraction) -> str:
    """``value`` as a decimal: exact when it terminates within DECIMALS places, else rounded half to even."""
    rounded = round(value, DECIMALS)
    sign = "-" if rounded < 0 else ""
    whole, part = divmod(abs(rounded.numerator) * 10**DECIMALS // rounded.denominator, 10**DECIMALS)
    digits = f"{part:0{DECIMALS}d}".rstrip("0")
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


def _value(node: ast.AST) -> Fraction:
    """The number ``node`` denotes; ValueError naming the first construct outside numbers and the
    operators."""
    # bool is an int subclass: refused
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if node.value in (math.inf, -math.inf):
            raise ValueError(f"{ast.unparse(node)} is too large a number")
        return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if right == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
            raise ValueError("division by zero")
        return Fraction(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    what = "a comma (write 1200, not 1,200)" if isinstance(node, ast.Tuple) else construct_name(node)
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {what}")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"** takes an integer exponent of at most {MAX_EXPONENT}, not "
                         f"{decimal_text(exponent)}")
    if base == 0 and exponent < 0:
        raise ValueError("division by zero")
    if max(base.numerator.bit_length(), base.denominator.bit_length()) * abs(int(exponent)) > MAX_POWER_BITS:
        raise ValueError(f"the power's result would pass {MAX_POWER_BITS} bits")
    return base ** int(exponent)
