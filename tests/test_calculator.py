"""The hub tools recipe's calculator (grpo_core/tools/calculator.py): exact decimal arithmetic, values worked
out by hand, and every construct outside arithmetic refused with a message naming it."""

from __future__ import annotations

import pytest

from grpo_core.tools import tool_schema
from grpo_core.tools.calculator import MAX_EXPRESSION_LENGTH, calculator


@pytest.mark.parametrize("expression, value", [
    ("48/2 + 7", "31"),
    ("12.50 * 3", "37.5"),
    ("0.1 + 0.2", "0.3"),            # exact: a float evaluator says 0.30000000000000004
    ("10 / 3", "3.333333"),          # 3.3333333... rounded to 6 places
    ("-2/3", "-0.666667"),
    ("2/3 * 3", "2"),                # exact rationals: no 1.999999
    ("(5 - 8) % 4", "1"),            # Python's modulo: -3 mod 4 = 1
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),
    ("1.5e3 - 1", "1499"),
    (" 3*(4+5) ", "27"),
    ("0.0000004", "0"),
    ("-0.0000006", "-0.000001"),
])
def test_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("1,200 + 5", "not a comma (write 1200, not 1,200)"),
    ("x + 1", "not Name"),
    ("__import__('os').system('id')", "not Call"),
    ("(1).__class__", "not Attribute"),
    ("'a' * 3", "not a str literal"),
    ("True + 1", "not a bool literal"),
    ("1 < 2", "not Compare"),
    ("~5", "not Invert"),
    ("2 ** 0.5", "integer exponent of at most 64, not 0.5"),
    ("2 ** 65", "integer exponent of at most 64, not 65"),
    ("(9 ** 64) ** 64", "would pass 4096 bits"),
    ("1e400", "too large a number"),
    ("3 +", "not an arithmetic expression"),
    ("1" * (MAX_EXPRESSION_LENGTH + 1), f"longer than {MAX_EXPRESSION_LENGTH} characters"),
])
def test_refusals_name_what_is_wrong(expression, message):
    with pytest.raises(ValueError) as info:
        calculator(expression)
    assert message in str(info.value)


def test_a_non_string_is_refused():
    with pytest.raises(ValueError, match="expression must be a string, got int"):
        calculator(12)


def test_schema_is_what_the_model_is_shown():
    schema = tool_schema(calculator, "train.tools[0]")["function"]
    assert schema["name"] == "calculator"
    assert schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert "1,200" in schema["parameters"]["properties"]["expression"]["description"]
