"""Generate the API emulator's OpenAPI schemas from ``kubernetes-validate``'s bundled Kubernetes definitions.

``kubernetes-validate`` ships each Kubernetes release's API definitions as JSON Schema (``_definitions.json``,
converted from the release's ``api/openapi-spec/swagger.json``). This tool takes the definitions of every kind
the emulator serves (:data:`dradriver.sandbox.apiserver.RESOURCE_TYPES`, their ``List`` kinds and the
``meta/v1`` kinds the server answers with) plus everything they reference, turns them back into OpenAPI
schema objects as kube-apiserver publishes them (``"type": "string"`` instead of ``["string", "null"]``,
references wrapped in ``allOf`` beside their description, ``Quantity`` and ``IntOrString`` as strings with
their ``format``) and writes ``dradriver/sandbox/apiserver/openapi-schemas.json``.

Usage::

    python tools/gen_openapi.py            # rewrite the file
    python tools/gen_openapi.py --check    # exit 1 when the committed file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
OUTPUT = REPO_ROOT / "dradriver" / "sandbox" / "apiserver" / "openapi-schemas.json"
KUBERNETES_VERSION = "1.34.0"  # the release the emulator answers as on /version (routes.SERVER_VERSION)
META = "io.k8s.apimachinery.pkg.apis.meta.v1."
EXTRA_ROOTS = (f"{META}Status", f"{META}DeleteOptions", f"{META}WatchEvent", f"{META}APIResourceList",
               f"{META}APIGroupList", f"{META}APIVersions", f"{META}Patch")
# Definitions kube-apiserver publishes in their own shape (kube-openapi's OpenAPIDefinition overrides).
SPECIAL: dict[str, dict[str, Any]] = {
    "io.k8s.apimachinery.pkg.api.resource.Quantity": {"type": "string", "format": "quantity"},
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString": {"type": "string", "format": "int-or-string"},
}


def _source() -> dict[str, Any]:
    import kubernetes_validate

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{KUBERNETES_VERSION}-local"
    defs: dict[str, Any] = json.loads((root / "_definitions.json").read_text())["$defs"]
    return defs


def _openapi(schema: Any) -> Any:
    """One JSON Schema node as an OpenAPI schema node (refs to ``#/components/schemas/``)."""
    if isinstance(schema, list):
        return [_openapi(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref":
            continue
        if key == "type" and isinstance(value, list):
            kinds = [v for v in value if v != "null"]
            out["type"] = kinds[0] if len(kinds) == 1 else kinds
        elif key == "properties":
            out[key] = {name: _openapi(prop) for name, prop in value.items()}
            for name in ("apiVersion", "kind"):  # kubernetes-validate pins these; the API does not
                if name in out[key]:
                    out[key][name].pop("enum", None)
        elif key in ("items", "additionalProperties", "allOf", "oneOf", "anyOf", "not"):
            out[key] = _openapi(value)
        else:
            out[key] = value
    if "$ref" in schema:
        ref = {"$ref": "#/components/schemas/" + schema["$ref"].rsplit("/", 1)[-1]}
        if out:
            out["allOf"] = [ref]
        else:
            out = ref
    return out


def _refs(schema: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(schema, dict):
        if isinstance(schema.get("$ref"), str):
            found.add(schema["$ref"].rsplit("/", 1)[-1])
        for value in schema.values():
            found |= _refs(value)
    elif isinstance(schema, list):
        for value in schema:
            found |= _refs(value)
    return found


def generate() -> str:
    """The file's text: ``{"kubernetesVersion", "schemas": {name: OpenAPI schema}}``, sorted, one line each."""
    sys.path.insert(0, str(REPO_ROOT))
    from dradriver.sandbox.apiserver.resources import RESOURCE_TYPES

    defs = _source()
    wanted = {(rt.group, rt.version, kind) for rt in RESOURCE_TYPES if not rt.custom
              for kind in (rt.kind, f"{rt.kind}List")}
    roots = {name for name, d in defs.items() for gvk in d.get("x-kubernetes-group-version-kind", [])
             if (gvk["group"], gvk["version"], gvk["kind"]) in wanted} | set(EXTRA_ROOTS)
    missing = {f"{g}/{v} {k}" for g, v, k in wanted} - {
        f"{gvk['group']}/{gvk['version']} {gvk['kind']}" for n in roots for gvk in
        defs.get(n, {}).get("x-kubernetes-group-version-kind", [])}
    if missing:
        raise SystemExit(f"kubernetes-validate {KUBERNETES_VERSION} has no definition for {sorted(missing)}")
    closure: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        todo.extend(_refs(defs[name]) - closure)
    schemas = {}
    for name in sorted(closure):
        if name in SPECIAL:
            schemas[name] = {"description": defs[name].get("description", ""), **SPECIAL[name]}
        else:
            schemas[name] = _openapi(defs[name])
    lines = [f"  {json.dumps(name)}: {json.dumps(schemas[name], sort_keys=True)}" for name in sorted(schemas)]
    head = {"kubernetesVersion": KUBERNETES_VERSION,
            "source": f"kubernetes-validate v{KUBERNETES_VERSION}-local/_definitions.json (Apache-2.0)"}
    return json.dumps(head)[:-1] + ',\n "schemas": {\n' + ",\n".join(lines) + "\n}}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file is stale")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(REPO_ROOT)} is stale: run python tools/gen_openapi.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
