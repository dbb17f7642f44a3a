"""Decoding API response bodies without depending on Python's recursion limit.

``json.loads`` recurses once per nesting level and raises :class:`RecursionError` near
``sys.getrecursionlimit()`` (1,000 by default, less on a deep stack): a ResourceClaim whose
``metadata.managedFields`` or opaque ``parameters`` nest that deep would make the GET fail with an
exception that is not a decoding error. :func:`decode` uses ``json.loads`` (C, fast) and, only when it
runs out of stack, an iterative decoder that gives the same result for any depth up to
:data:`MAX_DEPTH`, the limit of Go's ``encoding/json`` that the API server decodes with; deeper input is
a :class:`json.JSONDecodeError` like any other malformed body.

``json.loads`` is not even tried on a body that may nest deeper than :data:`LOADS_DEPTH`: running the
interpreter into its recursion limit is not harmless, since a garbage collection that happens at that depth
runs other objects' finalizers (``weakref.finalize``, ``__del__``) with no stack left, and they fail with a
``RecursionError`` of their own that is reported as unraisable. The depth is bounded from the brackets alone
(brackets inside strings can only make the bound wrong in a way the ``RecursionError`` fallback still covers).
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from json.decoder import scanstring  # type: ignore[attr-defined]  # public, not in typeshed
from typing import Any

MAX_DEPTH = 10_000
"""Deepest nesting of arrays and objects decoded (Go ``encoding/json``: ``maxNestingDepth``)."""

LOADS_DEPTH = 200
"""Deepest nesting handed to ``json.loads`` (C, one native frame per level): far below the default recursion
limit of 1,000 even on a deep stack. API objects nest about 10 levels (a ResourceSlice list about 12)."""

_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"{}[]")
_STEP = {ord("{"): 1, ord("["): 1, ord("}"): -1, ord("]"): -1}

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"(-?(?:0|[1-9]\d*))(\.\d+)?([eE][-+]?\d+)?")
_CONSTANTS: dict[str, Any] = {"null": None, "true": True, "false": False,
                              "NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def decode(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of ``data``, as ``json.loads`` gives it, for any nesting up to ``max_depth``.

    :raises json.JSONDecodeError: not JSON, or nested deeper than ``max_depth``.
    :raises UnicodeDecodeError: bytes that are not UTF-8 (a ``ValueError``).
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if nesting_bound(raw) <= LOADS_DEPTH:
        try:
            return json.loads(data)
        except RecursionError:
            pass
    text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
    return _decode_iteratively(text.removeprefix("\ufeff"), max_depth)


def nesting_bound(raw: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in ``raw`` counted from its brackets alone (strings not excluded).

    Cost: one C pass (``bytes.translate``) when the body has at most :data:`LOADS_DEPTH` opening brackets,
    as every single API object has; otherwise one pass over its brackets.
    """
    brackets = raw.translate(None, _NOT_BRACKETS)
    opening = brackets.count(b"{") + brackets.count(b"[")
    if opening <= LOADS_DEPTH:
        return opening
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _skip(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    return match.end() if match else pos


def _key(text: str, pos: int) -> tuple[str, int]:
    """An object key and the position after its ``:`` and the whitespace following it."""
    if text[pos:pos + 1] != '"':
        raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, pos)
    key, pos = scanstring(text, pos + 1, True)
    pos = _skip(text, pos)
    if text[pos:pos + 1] != ":":
        raise json.JSONDecodeError("Expecting ':' delimiter", text, pos)
    return key, _skip(text, pos + 1)


def _scalar(text: str, pos: int) -> tuple[Any, int]:
    if text[pos:pos + 1] == '"':
        return scanstring(text, pos + 1, True)
    number = _NUMBER.match(text, pos)
    if number:
        integer, fraction, exponent = number.groups()
        if fraction or exponent:
            return float(integer + (fraction or "") + (exponent or "")), number.end()
        return int(integer), number.end()
    for name, value in _CONSTANTS.items():
        if text.startswith(name, pos):
            return value, pos + len(name)
    raise json.JSONDecodeError("Expecting value", text, pos)


def _decode_iteratively(text: str, max_depth: int) -> Any:
    # Each open container is [container, pending key]; a value is parsed, then attached to the innermost one.
    stack: list[list[Any]] = []
    pos = _skip(text, 0)
    while True:
        char = text[pos:pos + 1]
        if char in ("{", "["):
            if len(stack) >= max_depth:
                raise json.JSONDecodeError(f"nested deeper than {max_depth} levels", text, pos)
            close = "}" if char == "{" else "]"
            container: Any = {} if char == "{" else []
            pos = _skip(text, pos + 1)
            if text[pos:pos + 1] == close:
                value, pos = container, pos + 1
            else:
                key = None
                if char == "{":
                    key, pos = _key(text, pos)
                stack.append([container, key])
                continue
        else:
            value, pos = _scalar(text, pos)
        while True:  # attach value; close every container that ends here
            if not stack:
                pos = _skip(text, pos)
                if pos != len(text):
                    raise json.JSONDecodeError("Extra data", text, pos)
                return value
            top = stack[-1]
            if isinstance(top[0], list):
                top[0].append(value)
            else:
                top[0][top[1]] = value
            pos = _skip(text, pos)
            char = text[pos:pos + 1]
            if char == ",":
                pos = _skip(text, pos + 1)
                if isinstance(top[0], dict):
                    top[1], pos = _key(text, pos)
                break
            if char == ("]" if isinstance(top[0], list) else "}"):
                value, pos = stack.pop()[0], pos + 1
                continue
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
