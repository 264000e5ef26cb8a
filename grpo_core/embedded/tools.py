"""The embedded agentic recipe's tool: a calculator for integer + - * expressions
(configs/embedded-tools.yaml).

A plain function with type hints and a docstring, TRL's tool convention: transformers' ``get_json_schema``
reads its schema from them, the chat template shows it, and a rollout calls it with the arguments the model
wrote.

The expression is parsed with ``ast`` and walked, never ``eval``-ed: only integer literals, parentheses, unary
+/- and binary + - * are allowed, so nothing the model writes can name, call, import or exhaust anything (a
200-character limit bounds the numbers at 10**200 and the nesting depth at 100). A bad expression raises
ValueError; a rollout answers the model with its text (TRL: ``{'error': '...'}``) and counts a failed call.
"""

from __future__ import annotations

import ast

from grpo_core.common.expressions import construct_name, parse_expression

#: longest expression accepted, in characters
MAX_EXPRESSION_LENGTH = 200
#: what a syntactically broken expression is answered with (short: the tiny model reads it)
INVALID = "invalid expression"

_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
_UNARY = {ast.UAdd: lambda a: a, ast.USub: lambda a: -a}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression over integers.

    Args:
        expression: integers joined by +, - or * (parentheses allowed), e.g. "123*45" or "120+305+998".

    Returns:
        The value of the expression, as a decimal integer.
    """
    try:
        tree = parse_expression(expression, MAX_EXPRESSION_LENGTH)
    except SyntaxError:
        raise ValueError(INVALID) from None
    return str(_value(tree))


def _value(node: ast.AST) -> int:
    """The integer `node` denotes; ValueError naming the first construct outside integers and + - *."""
    if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is an int subclass: refused
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise ValueError(f"only integers and + - * are allowed, not {construct_name(node)}")
