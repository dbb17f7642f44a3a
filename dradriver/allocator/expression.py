"""CEL device selectors with the Kubernetes environment, on top of ``cel-python`` (``celpy``).

The environment mirrors ``k8s.io/dynamic-resource-allocation/cel/compile.go`` (reference
``cel/compile.go`` in k8s.io/dynamic-resource-allocation): one variable ``device`` with ``driver`` (string),
``attributes`` and ``capacity`` (maps from domain to maps from unqualified name to value) and
``allowMultipleAllocations`` (bool). Version attributes are :class:`~dradriver.allocator.semver.Semver` values,
capacities are :class:`~dradriver.allocator.quantity.Quantity` values. An unknown domain yields an empty map; an unknown
name inside a domain is a runtime error (``no attribute gpu.nvidia.com/productName``) that makes the device
not match. The result must be a bool.

Kubernetes libraries provided: quantity (``quantity``, ``isQuantity``, ``compareTo``, ``isGreaterThan``,
``isLessThan``, ``add``, ``sub``, ``asInteger``, ``asApproximateFloat``, ``sign``, ``isInteger``), semver
(``semver(s[, normalize])``, ``isSemver``, ``major``/``minor``/``patch``, comparisons), ext.Strings
(``charAt``, ``indexOf``, ``lastIndexOf``, ``lowerAscii``, ``upperAscii``, ``replace``, ``split``,
``substring``, ``trim``, ``join``), lists (``sum``, ``min``, ``max``, ``indexOf``, ``lastIndexOf``,
``isSorted``), ext.Sets (``sets.contains``, ``sets.intersects``, ``sets.equivalent``), ``cel.bind``, and
cross-type numeric comparisons. Not provided: regex beyond ``matches``, URLs, IP/CIDR, authz, format, the
runtime cost limit.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, cast

import celpy
import lark
from celpy import celtypes
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError, base_functions

from dradriver.allocator.quantity import Quantity, QuantityError
from dradriver.allocator.semver import Semver, SemverError
from dradriver.errors import DradriverError

AttributeValue = int | bool | str | Semver


class CelCompileError(DradriverError):
    """A CEL expression does not parse or calls an unknown function.

    :param expression: the CEL source.
    :param line/column: 1-based position of the problem.
    :param problem: what is wrong, in words.
    """

    def __init__(self, expression: str, line: int, column: int, problem: str) -> None:
        self.expression = expression
        self.line = line
        self.column = column
        self.problem = problem
        super().__init__(self.render())

    def render(self) -> str:
        """``problem at line L, column C`` followed by the offending line and a caret under the column."""
        lines = self.expression.splitlines() or [""]
        source = lines[min(self.line, len(lines)) - 1]
        return f"{self.problem} at line {self.line}, column {self.column}\n  | {source}\n  | {' ' * (self.column - 1)}^"


class _Fault(Exception):
    """Raised inside library functions; turned into a CEL error value with this message."""


class Namespace:
    """Receiver object for namespaced functions (``sets.contains(...)``, ``cel.bind(...)``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


SETS = Namespace("sets")
CEL = Namespace("cel")


def _error(message: str) -> CELEvalError:
    return CELEvalError(message, KeyError, None)


class DomainMap(celtypes.MapType):
    """Attributes or capacities of one domain; a missing name is the error ``no attribute <domain>/<name>``."""

    def __init__(self, domain: str, kind: str, items: Mapping[Any, Any] | None = None) -> None:
        super().__init__(items or {})
        self.domain = domain
        self.kind = kind

    def __getitem__(self, key: Any) -> Any:
        if not dict.__contains__(self, key):
            return _error(f"no {self.kind} {self.domain}/{key}")
        return dict.__getitem__(self, key)


class DomainsMap(celtypes.MapType):
    """``device.attributes`` / ``device.capacity``: an unknown domain yields an empty map."""

    def __init__(self, kind: str, items: Mapping[Any, Any]) -> None:
        super().__init__(items)
        self.kind = kind

    def __getitem__(self, key: Any) -> Any:
        if not dict.__contains__(self, key):
            return DomainMap(str(key), self.kind)
        return dict.__getitem__(self, key)


def _to_cel(value: AttributeValue | Quantity) -> Any:
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    return value


def device_variable(
    driver: str,
    attributes: Mapping[tuple[str, str], AttributeValue],
    capacity: Mapping[tuple[str, str], Quantity],
    allow_multiple_allocations: bool = False,
) -> celtypes.MapType:
    """Build the CEL ``device`` value.

    :param attributes: ``(domain, name) -> value``; unqualified names already resolved to the driver domain.
    :param capacity: ``(domain, name) -> Quantity``.
    """
    domains: dict[str, dict[Any, Any]] = {}
    for (domain, name), value in attributes.items():
        domains.setdefault(domain, {})[celtypes.StringType(name)] = _to_cel(value)
    caps: dict[str, dict[Any, Any]] = {}
    for (domain, name), quantity in capacity.items():
        caps.setdefault(domain, {})[celtypes.StringType(name)] = quantity
    return celtypes.MapType(
        {
            celtypes.StringType("driver"): celtypes.StringType(driver),
            celtypes.StringType("attributes"): DomainsMap(
                "attribute",
                {celtypes.StringType(d): DomainMap(d, "attribute", v) for d, v in domains.items()},
            ),
            celtypes.StringType("capacity"): DomainsMap(
                "capacity",
                {celtypes.StringType(d): DomainMap(d, "capacity", v) for d, v in caps.items()},
            ),
            celtypes.StringType("allowMultipleAllocations"): celtypes.BoolType(allow_multiple_allocations),
        }
    )


# ---------------------------------------------------------------------------------------------- library


def _guard(function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        for arg in args:
            if isinstance(arg, CELEvalError):
                return arg
        try:
            return function(*args)
        except (_Fault, QuantityError, SemverError) as exc:
            return _error(str(exc))

    call.__name__ = function.__name__
    return call


def _type_name(value: Any) -> str:
    if isinstance(value, Quantity):
        return "Quantity"
    if isinstance(value, Semver):
        return "Semver"
    if isinstance(value, bool | celtypes.BoolType):
        return "bool"
    if isinstance(value, celtypes.UintType):
        return "uint"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "map"
    return type(value).__name__


def _overload(name: str, *args: Any) -> _Fault:
    return _Fault(f"no such overload: {name}({', '.join(_type_name(a) for a in args)})")


def _quantity(text: Any) -> Quantity:
    if not isinstance(text, str):
        raise _overload("quantity", text)
    return Quantity.parse(str(text))


def _is_quantity(text: Any) -> celtypes.BoolType:
    try:
        Quantity.parse(str(text))
    except QuantityError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _semver(text: Any, normalize: Any = False) -> Semver:
    if not isinstance(text, str):
        raise _overload("semver", text)
    return Semver.parse(str(text), bool(normalize))


def _is_semver(text: Any, normalize: Any = False) -> celtypes.BoolType:
    try:
        Semver.parse(str(text), bool(normalize))
    except SemverError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _compare(name: str, a: Any, b: Any) -> int:
    if isinstance(a, Quantity) and isinstance(b, Quantity):
        return a.compare(b)
    if isinstance(a, Semver) and isinstance(b, Semver):
        return a.compare(b)
    raise _overload(name, a, b)


def _compare_to(a: Any, b: Any) -> celtypes.IntType:
    return celtypes.IntType(_compare("compareTo", a, b))


def _is_greater_than(a: Any, b: Any) -> celtypes.BoolType:
    return celtypes.BoolType(_compare("isGreaterThan", a, b) > 0)


def _is_less_than(a: Any, b: Any) -> celtypes.BoolType:
    return celtypes.BoolType(_compare("isLessThan", a, b) < 0)


def _as_quantity(name: str, a: Any, b: Any) -> tuple[Quantity, Quantity]:
    if isinstance(a, Quantity) and isinstance(b, Quantity):
        return a, b
    if isinstance(a, Quantity) and isinstance(b, int) and not isinstance(b, bool):
        return a, Quantity.of(int(b))
    raise _overload(name, a, b)


def _add(a: Any, b: Any) -> Quantity:
    x, y = _as_quantity("add", a, b)
    return x.add(y)


def _sub(a: Any, b: Any) -> Quantity:
    x, y = _as_quantity("sub", a, b)
    return x.sub(y)


def _sign(a: Any) -> celtypes.IntType:
    if not isinstance(a, Quantity):
        raise _overload("sign", a)
    return celtypes.IntType(a.sign())


def _is_integer(a: Any) -> celtypes.BoolType:
    if not isinstance(a, Quantity):
        raise _overload("isInteger", a)
    return celtypes.BoolType(a.is_integer())


def _as_integer(a: Any) -> celtypes.IntType:
    if not isinstance(a, Quantity):
        raise _overload("asInteger", a)
    if not a.is_integer():
        raise _Fault(f"cannot convert value {a} to integer")
    return celtypes.IntType(int(a.value))


def _as_approximate_float(a: Any) -> celtypes.DoubleType:
    if not isinstance(a, Quantity):
        raise _overload("asApproximateFloat", a)
    return celtypes.DoubleType(float(a.value))


def _semver_part(name: str, index: int) -> Callable[[Any], celtypes.IntType]:
    def part(v: Any) -> celtypes.IntType:
        if not isinstance(v, Semver):
            raise _overload(name, v)
        return celtypes.IntType((v.major, v.minor, v.patch)[index])

    part.__name__ = name
    return part


def _string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _overload(name, value)
    return str(value)


def _lower_ascii(s: Any) -> celtypes.StringType:
    text = _string("lowerAscii", s)
    return celtypes.StringType("".join(c.lower() if c.isascii() else c for c in text))


def _upper_ascii(s: Any) -> celtypes.StringType:
    text = _string("upperAscii", s)
    return celtypes.StringType("".join(c.upper() if c.isascii() else c for c in text))


def _trim(s: Any) -> celtypes.StringType:
    return celtypes.StringType(_string("trim", s).strip())


def _char_at(s: Any, i: Any) -> celtypes.StringType:
    text = _string("charAt", s)
    if not 0 <= int(i) <= len(text):
        raise _Fault(f"index out of range: {int(i)}")
    return celtypes.StringType(text[int(i) : int(i) + 1])


def _substring(s: Any, start: Any, end: Any = None) -> celtypes.StringType:
    text = _string("substring", s)
    stop = len(text) if end is None else int(end)
    if not 0 <= int(start) <= stop <= len(text):
        raise _Fault(f"index out of range: substring({int(start)}, {stop}) of {len(text)} characters")
    return celtypes.StringType(text[int(start) : stop])


def _replace(s: Any, old: Any, new: Any, n: Any = -1) -> celtypes.StringType:
    return celtypes.StringType(_string("replace", s).replace(str(old), str(new), int(n)))


def _split(s: Any, sep: Any, n: Any = -1) -> celtypes.ListType:
    text, limit = _string("split", s), int(n)
    if limit == 0:
        return celtypes.ListType([])
    parts = text.split(str(sep), limit - 1) if limit > 0 else text.split(str(sep)) if sep else list(text)
    return celtypes.ListType([celtypes.StringType(p) for p in parts])


def _join(items: Any, sep: Any = "") -> celtypes.StringType:
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise _overload("join", items)
    return celtypes.StringType(str(sep).join(str(x) for x in items))


def _index_of(container: Any, item: Any, start: Any = 0) -> celtypes.IntType:
    if isinstance(container, str):
        return celtypes.IntType(str(container).find(_string("indexOf", item), int(start)))
    if isinstance(container, list):
        for index, element in enumerate(container):
            if _equal(element, item):
                return celtypes.IntType(index)
        return celtypes.IntType(-1)
    raise _overload("indexOf", container, item)


def _last_index_of(container: Any, item: Any) -> celtypes.IntType:
    if isinstance(container, str):
        return celtypes.IntType(str(container).rfind(_string("lastIndexOf", item)))
    if isinstance(container, list):
        for index in range(len(container) - 1, -1, -1):
            if _equal(container[index], item):
                return celtypes.IntType(index)
        return celtypes.IntType(-1)
    raise _overload("lastIndexOf", container, item)


def _list(name: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise _overload(name, value)
    return cast(list[Any], value)


def _sum(items: Any) -> Any:
    values = _list("sum", items)
    if not values:
        return celtypes.IntType(0)
    total = values[0]
    for value in values[1:]:
        total = total.add(value) if isinstance(total, Quantity) else total + value
    return total


def _max(items: Any) -> Any:
    values = _list("max", items)
    if not values:
        raise _Fault("max called on empty list")
    best = values[0]
    for value in values[1:]:
        if _order(value, best) > 0:
            best = value
    return best


def _min(items: Any) -> Any:
    values = _list("min", items)
    if not values:
        raise _Fault("min called on empty list")
    best = values[0]
    for value in values[1:]:
        if _order(value, best) < 0:
            best = value
    return best


def _is_sorted(items: Any) -> celtypes.BoolType:
    values = _list("isSorted", items)
    return celtypes.BoolType(all(_order(a, b) <= 0 for a, b in zip(values, values[1:], strict=False)))  # noqa: RUF007


def _contains(container: Any, *args: Any) -> Any:
    if container is SETS:
        if len(args) != 2:
            raise _overload("sets.contains", *args)
        a, b = (_list("sets.contains", x) for x in args)
        return celtypes.BoolType(all(any(_equal(x, y) for y in a) for x in b))
    if len(args) != 1:
        raise _overload("contains", container, *args)
    return base_functions["contains"](container, args[0])


def _intersects(ns: Any, a: Any, b: Any) -> celtypes.BoolType:
    if ns is not SETS:
        raise _overload("intersects", ns, a, b)
    left, right = _list("sets.intersects", a), _list("sets.intersects", b)
    return celtypes.BoolType(any(_equal(x, y) for x in left for y in right))


def _equivalent(ns: Any, a: Any, b: Any) -> celtypes.BoolType:
    if ns is not SETS:
        raise _overload("equivalent", ns, a, b)
    left, right = _list("sets.equivalent", a), _list("sets.equivalent", b)
    return celtypes.BoolType(
        all(any(_equal(x, y) for y in right) for x in left) and all(any(_equal(x, y) for y in left) for x in right)
    )


def _numeric(value: Any) -> Fraction | float | None:
    if isinstance(value, bool | celtypes.BoolType):
        return None
    if isinstance(value, int):
        return Fraction(int(value))
    if isinstance(value, float):
        return float(value) if math.isnan(value) or math.isinf(value) else Fraction(float(value))
    return None


def _equal(a: Any, b: Any) -> bool:
    x, y = _numeric(a), _numeric(b)
    if x is not None and y is not None:
        return x == y
    if type(a) is not type(b) and not (isinstance(a, str) and isinstance(b, str)):
        if isinstance(a, list | dict) and isinstance(b, list | dict):
            return bool(a == b)
        if isinstance(a, bool | celtypes.BoolType) != isinstance(b, bool | celtypes.BoolType):
            return False
    return bool(a == b)


def _order(a: Any, b: Any) -> int:
    x, y = _numeric(a), _numeric(b)
    if x is not None and y is not None:
        return (x > y) - (x < y)
    if isinstance(a, Quantity) and isinstance(b, Quantity):
        return a.compare(b)
    if isinstance(a, Semver) and isinstance(b, Semver):
        return a.compare(b)
    if type(a) is not type(b):
        raise _overload("_<_", a, b)
    return (a > b) - (a < b)


def _relation(op: str, test: Callable[[int], bool]) -> Callable[[Any, Any], Any]:
    def compare(a: Any, b: Any) -> Any:
        x, y = _numeric(a), _numeric(b)
        if x is not None and y is not None and type(a) is not type(b):
            return celtypes.BoolType(test((x > y) - (x < y)))
        if isinstance(a, Quantity | Semver) or isinstance(b, Quantity | Semver):
            raise _overload(op, a, b)
        return base_functions[op](a, b)

    compare.__name__ = op
    return compare


def _eq(a: Any, b: Any) -> celtypes.BoolType:
    if isinstance(a, Quantity | Semver) or isinstance(b, Quantity | Semver):
        return celtypes.BoolType(type(a) is type(b) and a == b)
    x, y = _numeric(a), _numeric(b)
    if x is not None and y is not None:
        return celtypes.BoolType(x == y)
    return cast(celtypes.BoolType, base_functions["_==_"](a, b))


def _ne(a: Any, b: Any) -> Any:
    result = _eq(a, b)
    return celtypes.BoolType(not result)


def _index(container: Any, key: Any) -> Any:
    """``container[key]``; through :func:`_guard` an error operand is the result (celpy reports it as a type
    mismatch of ``_[_]`` naming its own classes, hiding the error that came first, e.g.
    ``no such member in mapping: 'atributes'``)."""
    try:
        return operator.getitem(container, key)
    except TypeError:
        raise _overload("_[_]", container, key) from None


_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {
    "_[_]": _index,
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "semver": _semver,
    "isSemver": _is_semver,
    "compareTo": _compare_to,
    "isGreaterThan": _is_greater_than,
    "isLessThan": _is_less_than,
    "add": _add,
    "sub": _sub,
    "sign": _sign,
    "isInteger": _is_integer,
    "asInteger": _as_integer,
    "asApproximateFloat": _as_approximate_float,
    "major": _semver_part("major", 0),
    "minor": _semver_part("minor", 1),
    "patch": _semver_part("patch", 2),
    "lowerAscii": _lower_ascii,
    "upperAscii": _upper_ascii,
    "trim": _trim,
    "charAt": _char_at,
    "substring": _substring,
    "replace": _replace,
    "split": _split,
    "join": _join,
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    "sum": _sum,
    "max": _max,
    "isSorted": _is_sorted,
    "contains": _contains,
    "intersects": _intersects,
    "equivalent": _equivalent,
    "_==_": _eq,
    "_!=_": _ne,
    "_<_": _relation("_<_", lambda c: c < 0),
    "_<=_": _relation("_<=_", lambda c: c <= 0),
    "_>_": _relation("_>_", lambda c: c > 0),
    "_>=_": _relation("_>=_", lambda c: c >= 0),
}
LIBRARY: dict[str, Callable[..., Any]] = {name: _guard(f) for name, f in _IMPLEMENTATIONS.items()}
# ``min`` on a list is a celpy macro; keep ours for lists of quantities too.
LIBRARY["min"] = _guard(_min)

_MACROS = {
    "has",
    "dyn",
    "map",
    "filter",
    "all",
    "exists",
    "exists_one",
    "bind",
    "size",
    "type",
    "min",
    "int",
    "uint",
    "double",
    "string",
    "bytes",
    "bool",
    "duration",
    "timestamp",
    "matches",
    "startsWith",
    "endsWith",
    "getDate",
    "getDayOfMonth",
    "getDayOfWeek",
    "getDayOfYear",
    "getFullYear",
    "getMonth",
    "getHours",
    "getMilliseconds",
    "getMinutes",
    "getSeconds",
}
KNOWN_FUNCTIONS = frozenset(LIBRARY) | _MACROS


# ---------------------------------------------------------------------------------------------- compile

_ENVIRONMENT: celpy.Environment | None = None


def _environment() -> celpy.Environment:
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        _ENVIRONMENT = celpy.Environment()
    return _ENVIRONMENT


def _rewrite_bind(tree: lark.Tree) -> None:
    """Rewrite ``cel.bind(x, init, body)`` into the equivalent ``[init].map(x, body)[0]`` in place."""
    for node in list(tree.iter_subtrees()):
        for position, child in enumerate(node.children):
            if not (isinstance(child, lark.Tree) and child.data == "member_dot_arg"):
                continue
            receiver, method = child.children[0], child.children[1]
            if not (isinstance(method, lark.Token) and method.value == "bind" and _ident(receiver) == "cel"):
                continue
            args = child.children[2].children if len(child.children) > 2 else []
            if len(args) != 3:
                continue
            meta = child.meta
            variable, init, body = args
            listed = lark.Tree(
                "member",
                [lark.Tree("primary", [lark.Tree("list_lit", [lark.Tree("exprlist", [init], meta)], meta)], meta)],
                meta,
            )
            mapped = lark.Tree(
                "member_dot_arg",
                [listed, lark.Token("IDENT", "map"), lark.Tree("exprlist", [variable, body], meta)],
                meta,
            )
            zero = lark.Tree(
                "expr",
                [
                    lark.Tree(
                        "conditionalor",
                        [
                            lark.Tree(
                                "conditionaland",
                                [
                                    lark.Tree(
                                        "relation",
                                        [
                                            lark.Tree(
                                                "addition",
                                                [
                                                    lark.Tree(
                                                        "multiplication",
                                                        [
                                                            lark.Tree(
                                                                "unary",
                                                                [
                                                                    lark.Tree(
                                                                        "member",
                                                                        [
                                                                            lark.Tree(
                                                                                "primary",
                                                                                [
                                                                                    lark.Tree(
                                                                                        "literal",
                                                                                        [lark.Token("INT_LIT", "0")],
                                                                                        meta,
                                                                                    )
                                                                                ],
                                                                                meta,
                                                                            )
                                                                        ],
                                                                        meta,
                                                                    )
                                                                ],
                                                                meta,
                                                            )
                                                        ],
                                                        meta,
                                                    )
                                                ],
                                                meta,
                                            )
                                        ],
                                        meta,
                                    )
                                ],
                                meta,
                            )
                        ],
                        meta,
                    )
                ],
                meta,
            )
            node.children[position] = lark.Tree("member_index", [lark.Tree("member", [mapped], meta), zero], meta)


def _ident(tree: Any) -> str | None:
    """The identifier if ``tree`` is just a bare identifier (``member -> primary -> ident``)."""
    while isinstance(tree, lark.Tree) and tree.data in {"member", "primary"} and len(tree.children) == 1:
        tree = tree.children[0]
    if isinstance(tree, lark.Tree) and tree.data == "ident":
        return str(tree.children[0])
    return None


def _check_functions(expression: str, tree: lark.Tree) -> None:
    for node in tree.iter_subtrees_topdown():
        token: Any = None
        if node.data == "member_dot_arg":
            token = node.children[1]
        elif node.data == "ident_arg":
            token = node.children[0]
        if isinstance(token, lark.Token) and token.value not in KNOWN_FUNCTIONS:
            raise CelCompileError(
                expression, token.line or 1, token.column or 1, f"undeclared reference to '{token.value}'"
            )


DEVICE_FIELDS = ("driver", "attributes", "capacity", "allowMultipleAllocations")
"""The fields of the ``device`` variable (``k8s.io/dynamic-resource-allocation/cel/compile.go``)."""

_COMPREHENSIONS = frozenset({"all", "exists", "exists_one", "map", "filter", "bind"})
# Identifiers CEL itself declares (type denotations), beside the device variable and the library namespaces.
_DECLARED = frozenset({"device", "sets", "cel", "int", "uint", "double", "bool", "string", "bytes", "list", "map",
                       "null_type", "type", "dyn"})


def _bare_ident(tree: Any) -> str | None:
    """The identifier if ``tree`` is only a bare identifier, at any depth of one-child nodes."""
    while isinstance(tree, lark.Tree) and tree.data != "ident" and len(tree.children) == 1:
        tree = tree.children[0]
    if isinstance(tree, lark.Tree) and tree.data == "ident":
        return str(tree.children[0])
    return None


def _check_references(expression: str, tree: lark.Tree) -> None:
    """Refuse what the API server's type check refuses when the claim is created: a variable that is not
    declared (``devise``) and a field the ``device`` variable does not have (``device.atributes``), with the
    position of the name, as cel-go words them (``undeclared reference to 'devise'``, ``undefined field
    'atributes'``). A comprehension's or ``cel.bind``'s variable is declared inside the whole expression."""
    bound: set[str] = set()
    for node in tree.iter_subtrees():
        method = node.children[1] if node.data == "member_dot_arg" and len(node.children) > 2 else None
        if isinstance(method, lark.Token) and method.value in _COMPREHENSIONS:
            args = node.children[2].children if isinstance(node.children[2], lark.Tree) else []
            if args and (name := _bare_ident(args[0])):
                bound.add(name)
    for node in tree.iter_subtrees_topdown():
        if node.data == "ident":
            token = node.children[0]
            if isinstance(token, lark.Token) and token.value not in _DECLARED | bound:
                raise CelCompileError(expression, token.line or 1, token.column or 1,
                                      f"undeclared reference to '{token.value}' (the variable is 'device')")
        elif node.data == "member_dot" and _bare_ident(node.children[0]) == "device" and "device" not in bound:
            field_token = node.children[1]
            if isinstance(field_token, lark.Token) and field_token.value not in DEVICE_FIELDS:
                raise CelCompileError(expression, field_token.line or 1, field_token.column or 1,
                                      f"undefined field '{field_token.value}' (device has {', '.join(DEVICE_FIELDS)})")


DevicePath = tuple[str, ...]
"""A part of the ``device`` variable: ``("driver",)``, ``("allowMultipleAllocations",)``, ``("attributes",
domain)`` or ``("capacity", domain)`` (a whole domain), ``("attributes", domain, name)`` or ``("capacity", domain,
name)`` (one value)."""

_WRAPPERS = frozenset({"member", "primary"})


def _string_key(tree: Any) -> str | None:
    """The text of a plain quoted string literal (``'gpu.nvidia.com'``), else ``None`` (escapes, raw and
    triple-quoted strings and computed keys are not resolved)."""
    while isinstance(tree, lark.Tree) and tree.data != "literal" and len(tree.children) == 1:
        tree = tree.children[0]
    if not (isinstance(tree, lark.Tree) and tree.data == "literal" and len(tree.children) == 1):
        return None
    token = tree.children[0]
    if not isinstance(token, lark.Token) or token.type != "STRING_LIT":
        return None
    text = str(token)
    if len(text) < 2 or text[0] not in "'\"" or text[-1] != text[0] or "\\" in text or text.startswith(text[0] * 3):
        return None
    return text[1:-1]


def device_reads(tree: lark.Tree) -> tuple[DevicePath, ...] | None:
    """Every part of ``device`` the expression ``tree`` reads, found in the parse tree: ``device.driver``,
    ``device.allowMultipleAllocations``, ``device.attributes[<domain>].<name>`` (or ``[<name>]``, or a domain
    read whole: ``'x' in device.attributes[<domain>]``) and the same under ``device.capacity``. CEL has no side
    effects, so two devices that agree on these parts get the same result, error text included.

    :returns: the paths, each once; ``None`` when the expression reads the device in a way not
        resolved here (``device`` or ``device.attributes`` used whole, a computed key, ``device`` rebound by a
        comprehension): the caller evaluates per device.
    """
    parents: dict[int, lark.Tree] = {}
    idents: list[lark.Tree] = []
    for node in tree.iter_subtrees():
        for child in node.children:
            if isinstance(child, lark.Tree):
                parents[id(child)] = node
        if node.data == "ident" and node.children and str(node.children[0]) == "device":
            idents.append(node)
        method = node.children[1] if node.data == "member_dot_arg" and len(node.children) > 2 else None
        if isinstance(method, lark.Token) and method.value in _COMPREHENSIONS:
            args = node.children[2].children if isinstance(node.children[2], lark.Tree) else []
            if args and _bare_ident(args[0]) == "device":
                return None
    paths: list[DevicePath] = []
    for ident in idents:
        path: list[str] = []
        current: lark.Tree = ident
        while len(path) < 3:
            parent = parents.get(id(current))
            if parent is None:
                break
            if parent.data in _WRAPPERS and len(parent.children) == 1:
                current = parent
                continue
            if parent.children[0] is not current:
                break
            if parent.data == "member_dot" and isinstance(parent.children[1], lark.Token):
                key: str | None = str(parent.children[1])
            elif parent.data == "member_index":
                key = _string_key(parent.children[1])
                if key is None:
                    return None
            else:
                break
            path.append(str(key))
            current = parent
            if path[0] in ("driver", "allowMultipleAllocations"):
                break
        if not path or (path[0] in ("attributes", "capacity") and len(path) < 2):
            return None
        if tuple(path) not in paths:
            paths.append(tuple(path))
    return tuple(paths)


@dataclass(frozen=True)
class Outcome:
    """Result of evaluating a selector on one device: ``matched`` or an ``error`` text (never both)."""

    matched: bool
    error: str | None = None


class Selector:
    """A compiled CEL device selector.

    :param expression: CEL source; must evaluate to a bool.
    :raises CelCompileError: syntax error, unknown function, undeclared variable or a field ``device`` does not
        have, with line/column and caret.
    """

    def __init__(self, expression: str) -> None:
        self.expression = expression
        environment = _environment()
        try:
            self.tree = environment.compile(expression)
        except CELParseError as exc:
            raise CelCompileError(expression, exc.line or 1, exc.column or 1, "syntax error") from None
        _check_functions(expression, self.tree)
        _check_references(expression, self.tree)
        _rewrite_bind(self.tree)
        self._program = environment.program(self.tree, LIBRARY)
        self.reads = device_reads(self.tree)
        """What of the device the result depends on (:func:`device_reads`); ``None``: not known statically."""

    def evaluate(self, device: celtypes.MapType) -> Outcome:
        """Evaluate on ``device`` (from :func:`device_variable`): matched, not matched, or a runtime error."""
        value = self.value(self._program, device)
        if isinstance(value, CELEvalError):
            return Outcome(False, error_text(value))
        if not isinstance(value, bool | celtypes.BoolType):
            return Outcome(False, f"selector returned {_type_name(value)} {format_value(value)}, not bool")
        return Outcome(bool(value))

    @staticmethod
    def value(program: Any, device: celtypes.MapType) -> Any:
        """Evaluate ``program``; a CEL error comes back as the :class:`CELEvalError` value, not raised."""
        try:
            return program.evaluate({"device": device, "sets": SETS, "cel": CEL})
        except CELEvalError as exc:
            return exc
        except RecursionError:
            return _error("expression nests too deeply")

    def evaluate_part(self, tree: lark.Tree, device: celtypes.MapType) -> Any:
        """Evaluate a sub-expression ``tree`` of this selector on ``device`` (value or CELEvalError)."""
        return self.value(_environment().program(tree, LIBRARY), device)

    def source(self, tree: lark.Tree) -> str:
        """The source text of sub-expression ``tree``."""
        meta = tree.meta
        if getattr(meta, "empty", True):
            return self.expression
        return self.expression[meta.start_pos : meta.end_pos].strip()


def error_text(error: CELEvalError) -> str:
    """A one-line message for a CEL runtime error (celpy's long activation dumps trimmed)."""
    message = str(error.args[0]) if error.args else "evaluation error"
    if message.startswith("undeclared reference to"):
        message = message.split(" (in activation", 1)[0]
    if message == "no such key" and len(error.args) > 2 and error.args[2]:
        key = error.args[2][0]  # cel-go's wording: the key as text (``no such key: atributes``)
        message = f"no such key: {key if isinstance(key, str) else format_value(key)}"
    if message == "no such overload" and len(error.args) > 2 and error.args[2]:
        message = f"no such overload: {error.args[2][0]}"
    return message


def format_value(value: Any) -> str:
    """Show a CEL value as a person reads it: strings quoted, quantities and versions in canonical text."""
    if isinstance(value, bool | celtypes.BoolType):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + str(value) + '"'
    if isinstance(value, Quantity | Semver):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{format_value(k)}: {format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, CELEvalError):
        return f"<error: {error_text(value)}>"
    return str(value)
