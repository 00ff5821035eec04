"""The ``calculator`` tool: exact arithmetic on an expression a model writes.

Design decision: the expression is parsed with ``ast`` and only numbers, + - * / // % ** and
parentheses are evaluated — never ``eval`` — and exponents are bounded, so a policy cannot make the
driver compute 9**9**9 or run code through its calculator. Integers stay integers (Python's
arbitrary precision), so products of large numbers are exact.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import cast

__all__ = ["calculator", "calculator_tool"]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_POW = 64  # 10**64 is plenty for arithmetic and keeps a model from asking for 9**9**9


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return cast(int | float, node.value)  # bool excluded: type(), not isinstance
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POW:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_POW})")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay integers).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "347*58" or "(2+3)/4".
    """
    text = expression.strip().replace("×", "*").replace("^", "**")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    value = _evaluate(tree)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def calculator_tool() -> Callable[[str], str]:
    """The built-in ``{name: calculator}`` (no options)."""
    return calculator
