"""The patch formats: RFC 7386 JSON merge patch (also for strategic merge patch) and RFC 6902 JSON patch."""

from __future__ import annotations

import copy
from typing import Any

from dradriver.sandbox.apiserver.errors import ApiStatusError, bad_request

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _json_pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, test, move, copy)."""
    if not isinstance(ops, list):
        raise bad_request("json patch must be a list of operations")
    doc = copy.deepcopy(doc)

    def parent(tokens: list[str]) -> tuple[Any, str]:
        cur = doc
        for t in tokens[:-1]:
            cur = cur[int(t)] if isinstance(cur, list) else cur[t]
        return cur, tokens[-1]

    def get(tokens: list[str]) -> Any:
        cur = doc
        for t in tokens:
            cur = cur[int(t)] if isinstance(cur, list) else cur[t]
        return cur

    def remove(tokens: list[str]) -> Any:
        container, key = parent(tokens)
        return container.pop(int(key)) if isinstance(container, list) else container.pop(key)

    def add(tokens: list[str], value: Any) -> None:
        nonlocal doc
        if not tokens:
            doc = value
            return
        container, key = parent(tokens)
        if isinstance(container, list):
            container.insert(len(container) if key == "-" else int(key), value)
        else:
            container[key] = value

    try:
        for op in ops:
            kind = op["op"]
            tokens = _json_pointer(op["path"])
            if kind == "add":
                add(tokens, copy.deepcopy(op["value"]))
            elif kind == "remove":
                remove(tokens)
            elif kind == "replace":
                get(tokens)
                remove(tokens) if tokens else None
                add(tokens, copy.deepcopy(op["value"]))
            elif kind == "test":
                if get(tokens) != op["value"]:
                    raise ApiStatusError(422, "Invalid", f"the json patch test at {op['path']} failed")
            elif kind in ("move", "copy"):
                source = _json_pointer(op["from"])
                value = remove(source) if kind == "move" else copy.deepcopy(get(source))
                add(tokens, value)
            else:
                raise bad_request(f"unknown json patch operation {kind!r}")
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise ApiStatusError(422, "Invalid", f"the json patch could not be applied: {exc!r}") from exc
    return doc


def apply_patch(current: Any, patch: Any, content_type: str) -> Any:
    """Apply ``patch`` in the format its ``Content-Type`` names.

    :raises ApiStatusError: 415 for any other media type, as the server answers.
    """
    ctype = content_type.split(";")[0].strip()
    if ctype == JSON_PATCH:
        return json_patch(current, patch)
    if ctype in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):
        return merge_patch(current, patch)
    raise ApiStatusError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media "
        f"types include: application/json-patch+json, application/merge-patch+"
        f"json, application/strategic-merge-patch+json (got {ctype!r})",
    )
