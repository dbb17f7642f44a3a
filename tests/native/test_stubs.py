"""The ``.pyi`` stubs of the compiled modules describe both implementations: the twin and the extension.

For each module of :data:`dradriver._native.MODULES`: the stub, the twin and the compiled module export the
same public names; every function and method of the stub has the twin's parameters (names, kinds, which
have defaults, and the default values the stub spells out), and the compiled module's where Cython exposes a
signature (``binding=True``, the Cython 3 default, or an embedded signature); constants have the type the
stub declares and the same value in both implementations.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dradriver import _native

NATIVE_DIR = Path(_native.__file__).parent
COMPILED_WANTED = os.environ.get("DRADRIVER_NO_EXTENSIONS") != "1"

#: Dunder methods compared when the stub declares them (the rest of a class's dunders are object's).
DUNDERS = ("__init__", "__enter__", "__exit__", "__len__")

Params = tuple[tuple[str, inspect._ParameterKind, bool], ...]  # (name, kind, has default)


def _stub(name: str) -> ast.Module:
    return ast.parse((NATIVE_DIR / f"{name}.pyi").read_text(), filename=f"{name}.pyi")


def _twin(name: str) -> types.ModuleType:
    return importlib.import_module(f"dradriver._native.{name}_py")


def _compiled(name: str) -> types.ModuleType:
    module = importlib.import_module(f"dradriver._native.{name}")
    assert module.__file__ is not None and not module.__file__.endswith((".py", ".pyi")), module.__file__
    return module


def _implementations(name: str) -> Iterator[types.ModuleType]:
    yield _twin(name)
    if COMPILED_WANTED:
        yield _compiled(name)


# ---- what the stub declares ---------------------------------------------------------------------------


def _is_type_alias(node: ast.AnnAssign) -> bool:
    return isinstance(node.annotation, ast.Name) and node.annotation.id == "TypeAlias"


def _stub_names(tree: ast.Module) -> dict[str, ast.AST]:
    """Public top-level names of a stub: definitions, annotated constants, ``import X as X`` re-exports."""
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not _is_type_alias(node):
            out[node.target.id] = node
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname is not None and alias.asname == alias.name:  # explicit re-export
                    out[alias.name] = node
    return {k: v for k, v in out.items() if not k.startswith("_")}


def _stub_members(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    """Methods and properties of a stub class: public names and the dunders of :data:`DUNDERS`."""
    return {
        n.name: n
        for n in cls.body
        if isinstance(n, ast.FunctionDef) and (not n.name.startswith("_") or n.name in DUNDERS)
    }


def _is_property(node: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)


def _ast_params(args: ast.arguments) -> Params:
    """``(name, kind, has_default)`` of an ``ast.arguments``, in order."""
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    out: list[tuple[str, inspect._ParameterKind, bool]] = []
    for i, a in enumerate(positional):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        if i < len(args.posonlyargs):
            kind = inspect.Parameter.POSITIONAL_ONLY
        out.append((a.arg, kind, i >= first_default))
    if args.vararg is not None:
        out.append((args.vararg.arg, inspect.Parameter.VAR_POSITIONAL, False))
    for a, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append((a.arg, inspect.Parameter.KEYWORD_ONLY, default is not None))
    if args.kwarg is not None:
        out.append((args.kwarg.arg, inspect.Parameter.VAR_KEYWORD, False))
    return tuple(out)


def _ast_defaults(args: ast.arguments) -> dict[str, Any]:
    """Default values the stub spells out (``...`` means "has a default" and is left out)."""
    positional = [*args.posonlyargs, *args.args]
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
    out: dict[str, Any] = {}
    for a, d in pairs:
        if isinstance(d, ast.Constant) and d.value is Ellipsis:
            continue
        out[a.arg] = ast.literal_eval(d)
    return out


# ---- what an implementation has -----------------------------------------------------------------------


def _exported(module: types.ModuleType) -> dict[str, Any]:
    """Public names a module defines or re-exports from ``dradriver._native`` (not its other imports)."""
    out: dict[str, Any] = {}
    for key, value in vars(module).items():
        if key.startswith("_") or isinstance(value, types.ModuleType) or type(value).__module__ == "__future__":
            continue
        origin = getattr(value, "__module__", None) if callable(value) else None
        if origin is not None and not origin.startswith("dradriver._native"):
            continue  # typing helpers, DradriverError, ... imported for the module's own use
        out[key] = value
    return out


def _signature(obj: Any, name: str) -> inspect.Signature | None:
    """The signature of a Python or Cython callable, or ``None`` where none is exposed.

    Cython's ``binding=True`` functions answer :func:`inspect.signature`; slot wrappers (``__init__`` of a
    ``cdef class``) say ``(self, /, *args, **kwargs)``, in which case an embedded signature on the first
    docstring line (``name(args)``, ``embedsignature``) is used when there is one.
    """
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    generic = sig is not None and [p.kind for p in sig.parameters.values()][-2:] == [
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    ]
    if sig is not None and not generic:
        return sig
    return _embedded(obj, name)


def _embedded(obj: Any, name: str) -> inspect.Signature | None:
    doc = getattr(obj, "__doc__", None) or ""
    match = re.match(rf"(?:\w+\.)?{re.escape(name)}\((.*)\)\s*$", doc.splitlines()[0] if doc else "")
    if match is None:
        return None
    arglist = re.sub(r"\b(?:int|long|double|bint|Py_ssize_t|str|bytes|object)\s+(\w)", r"\1", match.group(1))
    tree = ast.parse(f"def f({arglist}): pass")
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    params = [
        inspect.Parameter(n, k, default=(None if d else inspect.Parameter.empty))
        for n, k, d in _ast_params(fn.args)
    ]
    return inspect.Signature(params)


def _sig_params(sig: inspect.Signature) -> Params:
    return tuple((p.name, p.kind, p.default is not inspect.Parameter.empty) for p in sig.parameters.values())


def _class_constructor_signature(cls: type, owner: str) -> inspect.Signature | None:
    """``__init__`` including ``self``: from ``cls.__init__``, else the signature embedded in the class doc."""
    init = cls.__dict__.get("__init__")
    if init is not None:
        sig = _signature(init, "__init__")
        if sig is not None:
            return sig
    embedded = _embedded(cls, owner)
    if embedded is None:
        return None
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return embedded.replace(parameters=[self_param, *embedded.parameters.values()])


def _instance_attributes(cls: type) -> set[str]:
    """Public ``self.X = ...`` targets in a Python class's source (attributes the stub types as properties)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return set()
    tree = ast.parse(textwrap.dedent(source))
    return {
        t.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        and not t.attr.startswith("_")
    }


def _runtime_members(cls: type) -> set[str]:
    own = {k for k in vars(cls) if not k.startswith("_") or (k in DUNDERS and k != "__init__")}
    return own | _instance_attributes(cls)


# ---- the checks ---------------------------------------------------------------------------------------


def _check_params(
    where: str, stub_fn: ast.FunctionDef, sig: inspect.Signature | None, *, exact: bool, names_only: bool = False
) -> None:
    """``exact``: the twin (names, kinds, defaults); else a compiled callable (where it exposes a signature).

    ``names_only``: a C slot wrapper (``__len__`` of a ``cdef class``), whose parameters read positional-only.
    """
    if sig is None:
        assert not exact, f"{where}: the twin must have an inspectable signature"
        return
    if names_only and not exact:
        assert [p[0] for p in _ast_params(stub_fn.args)] == list(sig.parameters), f"{where}: stub vs {sig}"
        return
    assert _ast_params(stub_fn.args) == _sig_params(sig), f"{where}: stub {ast.unparse(stub_fn.args)} vs {sig}"
    for param, value in _ast_defaults(stub_fn.args).items():
        assert sig.parameters[param].default == value, f"{where}: default of {param!r}"


def _check_constant(where: str, node: ast.AnnAssign, value: object) -> None:
    annotation = ast.unparse(node.annotation)
    scalar = {"int": int, "str": str, "bytes": bytes, "float": float, "bool": bool}
    match = re.fullmatch(r"tuple\[(\w+), \.\.\.\]", annotation)
    if annotation in scalar:
        assert type(value) is scalar[annotation], f"{where}: {value!r} is not {annotation}"
    elif match is not None:
        assert isinstance(value, tuple), f"{where}: {value!r} is not a tuple"
        assert all(type(v) is scalar[match.group(1)] for v in value), f"{where}: {value!r} vs {annotation}"
    else:  # pragma: no cover - a new annotation shape: extend this check
        pytest.fail(f"{where}: cannot check the annotation {annotation!r}")


@pytest.mark.parametrize("name", _native.MODULES)
def test_stub_exists_for_every_extension(name: str) -> None:
    assert (NATIVE_DIR / f"{name}.pyi").is_file()
    assert (Path(__file__).parents[2] / "ext" / f"{name}.pyx").is_file()


@pytest.mark.parametrize("name", _native.MODULES)
def test_same_public_names(name: str) -> None:
    declared = set(_stub_names(_stub(name)))
    assert declared, f"{name}.pyi declares nothing"
    assert set(_exported(_twin(name))) == declared, "twin vs stub"
    if COMPILED_WANTED:
        assert set(_exported(_compiled(name))) == declared, "compiled vs stub"


@pytest.mark.parametrize("name", _native.MODULES)
def test_functions_match(name: str) -> None:
    for key, node in _stub_names(_stub(name)).items():
        if not isinstance(node, ast.FunctionDef):
            continue
        for module in _implementations(name):
            twin = module.__name__.endswith("_py")
            fn = getattr(module, key)
            _check_params(f"{module.__name__}.{key}", node, _signature(fn, key), exact=twin)


@pytest.mark.parametrize("name", _native.MODULES)
def test_classes_match(name: str) -> None:
    for key, node in _stub_names(_stub(name)).items():
        if not isinstance(node, ast.ClassDef):
            continue
        members = _stub_members(node)
        for module in _implementations(name):
            twin = module.__name__.endswith("_py")
            cls = getattr(module, key)
            where = f"{module.__name__}.{key}"
            assert isinstance(cls, type), where
            assert _runtime_members(cls) == set(members) - {"__init__"}, f"{where}: members vs stub"
            for member, fn in members.items():
                if _is_property(fn):
                    attr = inspect.getattr_static(cls, member, None)
                    assert attr is None or not callable(attr), f"{where}.{member} is a method, the stub says property"
                    continue
                if member == "__init__":
                    slot = False
                    sig = _class_constructor_signature(cls, key)
                    if sig is None and not twin and "__init__" not in cls.__dict__:
                        sig = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)])
                else:
                    attr = inspect.getattr_static(cls, member)
                    sig = _signature(attr, member)
                    slot = isinstance(attr, types.WrapperDescriptorType)
                _check_params(f"{where}.{member}", fn, sig, exact=twin, names_only=slot)


@pytest.mark.parametrize("name", _native.MODULES)
def test_constants_match(name: str) -> None:
    for key, node in _stub_names(_stub(name)).items():
        if not isinstance(node, ast.AnnAssign):
            continue
        values = [getattr(module, key) for module in _implementations(name)]
        for module, value in zip(_implementations(name), values, strict=True):
            _check_constant(f"{module.__name__}.{key}", node, value)
        assert all(v == values[0] for v in values), f"{name}.{key}: twin and compiled differ: {values}"


@pytest.mark.parametrize("name", _native.MODULES)
def test_reexports_are_the_same_objects(name: str) -> None:
    """``from X import Y as Y`` in a stub: both implementations hold that very object (one exception set)."""
    for key, node in _stub_names(_stub(name)).items():
        if not isinstance(node, ast.ImportFrom):
            continue
        assert node.module is not None
        source = getattr(importlib.import_module(node.module), key)
        for module in _implementations(name):
            assert getattr(module, key) is source, f"{module.__name__}.{key}"
