"""CEL selectors in words, and why a selector rejected a device, for people who never read CEL.

``describe(selector)`` turns the common selector shapes into words (``memory at least 40Gi``,
``type is "gpu"``, ``driverVersion greater than 550.0.0``); ``rejection(selector, device)`` names the first
false condition with the values it saw (``memory 24Gi < 40Gi``). Shapes it does not know fall back to the
CEL text of the condition.
"""

from __future__ import annotations

import functools
from typing import Any

import lark
from celpy import celtypes
from celpy.evaluation import CELEvalError

from dradriver.allocator.expression import Selector, format_value
from dradriver.allocator.quantity import Quantity
from dradriver.allocator.semver import Semver

_PASS_THROUGH = {
    "expr",
    "conditionalor",
    "conditionaland",
    "relation",
    "addition",
    "multiplication",
    "unary",
    "member",
    "primary",
}
_OPS = {
    "relation_lt": "<",
    "relation_le": "<=",
    "relation_gt": ">",
    "relation_ge": ">=",
    "relation_eq": "==",
    "relation_ne": "!=",
    "relation_in": "in",
}
_WORDS = {"<": "less than", "<=": "at most", ">": "greater than", ">=": "at least", "==": "is", "!=": "is not"}
_NEGATED = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}
_STRING_TESTS = {"startsWith": "start with", "endsWith": "end with", "contains": "contain", "matches": "match"}


def _unwrap(tree: Any) -> Any:
    while isinstance(tree, lark.Tree) and tree.data in _PASS_THROUGH and len(tree.children) == 1:
        tree = tree.children[0]
    return tree


def conjuncts(tree: lark.Tree) -> list[lark.Tree]:
    """The ``&&``-separated conditions of an expression, left to right."""
    node = _unwrap(tree)
    if isinstance(node, lark.Tree) and node.data == "conditionaland" and len(node.children) == 2:
        return conjuncts(node.children[0]) + conjuncts(node.children[1])
    return [node]


def _name(selector: Selector, tree: Any) -> str:
    """``memory`` for ``device.capacity['gpu.nvidia.com'].memory``; the source text otherwise."""
    node = _unwrap(tree)
    if isinstance(node, lark.Tree) and node.data == "member_dot":
        return str(node.children[1])
    if isinstance(node, lark.Tree) and node.data == "member_index":
        index = _unwrap(node.children[1])
        if isinstance(index, lark.Tree) and index.data == "literal":
            return str(index.children[0]).strip("'\"")
    return selector.source(node) if isinstance(node, lark.Tree) else str(node)


def _constant(selector: Selector, tree: Any) -> str:
    """A constant operand (``quantity('40Gi')``) shown by value; other operands by source text."""
    node = _unwrap(tree)
    if isinstance(node, lark.Tree) and not any(
        isinstance(t, lark.Tree) and t.data == "ident" for t in node.iter_subtrees()
    ):
        value = selector.evaluate_part(tree, celtypes.MapType({}))
        if not isinstance(value, CELEvalError):
            return format_value(value)
    return selector.source(node) if isinstance(node, lark.Tree) else str(node)


def _shape(node: Any) -> tuple[str, Any, Any, str] | None:
    """Classify a condition as ``(op, left, right, kind)``; kind ``cmp`` (compareTo / isGreaterThan ...),
    ``rel`` (plain relation) or ``str`` (string test); ``None`` if unknown."""
    if not isinstance(node, lark.Tree):
        return None
    if node.data == "relation" and len(node.children) == 2:
        op = _OPS[node.children[0].data]
        left, right = node.children[0].children[0], node.children[1]
        call = _unwrap(left)
        literal = _unwrap(right)
        if (
            isinstance(call, lark.Tree)
            and call.data == "member_dot_arg"
            and str(call.children[1]) == "compareTo"
            and isinstance(literal, lark.Tree)
            and literal.data == "literal"
            and str(literal.children[0]) == "0"
            and len(call.children) > 2
        ):
            return op, call.children[0], call.children[2].children[0], "cmp"
        return op, left, right, "rel"
    if node.data == "member_dot_arg" and len(node.children) > 2:
        method = str(node.children[1])
        if method in ("isGreaterThan", "isLessThan"):
            return (">" if method == "isGreaterThan" else "<"), node.children[0], node.children[2].children[0], "cmp"
        if method in _STRING_TESTS:
            return method, node.children[0], node.children[2].children[0], "str"
    return None


@functools.lru_cache(maxsize=1024)
def describe(selector: Selector) -> str:
    """The selector in words, condition by condition (``type is "gpu" and memory at least 40Gi``); computed once
    per selector (``explain`` prints it for every node)."""
    parts = []
    for condition in conjuncts(selector.tree):
        shape = _shape(condition)
        if shape is None:
            parts.append(f"`{selector.source(condition)}`")
            continue
        op, left, right, kind = shape
        name, value = _name(selector, left), _constant(selector, right)
        if kind == "str":
            parts.append(
                f"{name} {_STRING_TESTS[op].replace('start', 'starts').replace('end ', 'ends ')} {value}".replace(
                    "contain ", "contains "
                ).replace("match ", "matches ")
            )
        elif op == "in":
            parts.append(f"{name} is one of {value}")
        else:
            parts.append(f"{name} {_WORDS[op]} {value}")
    return " and ".join(parts)


def _relation_symbol(a: Any, b: Any) -> str | None:
    if isinstance(a, Quantity) and isinstance(b, Quantity):
        c = a.compare(b)
    elif isinstance(a, Semver) and isinstance(b, Semver):
        c = a.compare(b)
    else:
        try:
            c = (a > b) - (a < b)
        except TypeError:
            return None
    return "<" if c < 0 else ">" if c > 0 else "=="


def rejection(selector: Selector, device: Any) -> str:
    """Why ``selector`` is false for ``device`` (the CEL ``device`` value): first false condition, values seen."""
    for condition in conjuncts(selector.tree):
        value = selector.evaluate_part(condition, device)
        if isinstance(value, CELEvalError) or value is True or (isinstance(value, celtypes.BoolType) and value):
            continue
        shape = _shape(condition)
        if shape is None:
            return f"`{selector.source(condition)}` is false"
        op, left, right, kind = shape
        name = _name(selector, left)
        seen = selector.evaluate_part(left, device)
        wanted = selector.evaluate_part(right, device)
        if kind == "str":
            return f"{name} {format_value(seen)} does not {_STRING_TESTS[op]} {format_value(wanted)}"
        if op == "in":
            return f"{name} {format_value(seen)} is not one of {format_value(wanted)}"
        if op in ("==", "!="):
            return f"{name} {format_value(seen)} {_NEGATED[op]} {format_value(wanted)}"
        symbol = _relation_symbol(seen, wanted)
        if symbol is None:
            return f"{name} {format_value(seen)} is not {op} {format_value(wanted)}"
        return f"{name} {format_value(seen)} {symbol} {format_value(wanted)}"
    return f"`{selector.expression}` is false"
