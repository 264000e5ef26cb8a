"""Arithmetic expressions a model writes for a calculator tool, parsed safely: ``ast`` only, never ``eval``.

Shared by the hub recipe's calculator (grpo_core/tools/calculator.py) and the embedded task's
(grpo_core/embedded/tools.py), which walk the tree each with their own number type and operators.
"""

from __future__ import annotations

import ast


def parse_expression(expression: str, max_length: int) -> ast.expr:
    """The expression's tree; ValueError for a non-string or one longer than ``max_length`` characters (which
    bounds the numbers and the nesting depth), SyntaxError as Python raises it."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > max_length:
        raise ValueError(f"expression longer than {max_length} characters")
    return ast.parse(expression.strip(), mode="eval").body


def construct_name(node: ast.AST) -> str:
    """What a node outside arithmetic is, for an error message: its operator (``Pow``, ``Div``),
    ``a str literal``, or its node type (``Name``, ``Call``, ``Attribute``)."""
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        return type(node.op).__name__
    if isinstance(node, ast.Constant):
        return f"a {type(node.value).__name__} literal"
    return type(node).__name__
