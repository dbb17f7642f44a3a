"""Response bodies decode to what ``json.loads`` gives, at any depth up to Go's limit, recursion limit aside."""

from __future__ import annotations

import json
import sys

import pytest

from dradriver.kube import jsonbody
from dradriver.kube.jsonbody import MAX_DEPTH, _decode_iteratively

DOCS = [
    '{"a": [1, -2, 3.5, -0.25e3, 1E2, true, false, null, "x\\u00e9\\n\\"", {}, []], "b": {"c": {"d": [[[]]]}}}',
    ' [ {"k" : "v" , "n" : [ 0 , 1 ] } , "" ] ',
    '"just a string"', "12", "null", "[]", "{}", '{"dup": 1, "dup": 2}', '{"nan": NaN, "inf": [Infinity, -Infinity]}',
]


@pytest.mark.parametrize("text", DOCS)
def test_iterative_decoder_matches_json_loads(text: str) -> None:
    expected = json.loads(text)
    got = _decode_iteratively(text, MAX_DEPTH)
    assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)


@pytest.mark.parametrize("text", ["", "[1,]", '{"a" 1}', '{"a": 1,}', "[1 2]", "[", '{"a": 1}x', "tru", "{'a': 1}"])
def test_iterative_decoder_rejects_what_json_loads_rejects(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        _decode_iteratively(text, MAX_DEPTH)


def test_nesting_beyond_the_recursion_limit_decodes() -> None:
    depth = sys.getrecursionlimit() * 3
    value = jsonbody.decode(("[" * depth + "]" * depth).encode())
    for _ in range(depth - 1):
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert value == []


def test_nesting_beyond_max_depth_is_a_decode_error() -> None:
    depth = MAX_DEPTH + 1
    with pytest.raises(json.JSONDecodeError, match=f"nested deeper than {MAX_DEPTH} levels"):
        jsonbody.decode('{"a":' * depth + "1" + "}" * depth)
    assert jsonbody.decode("[" * 20 + "]" * 20, max_depth=20) is not None



def test_deep_body_is_never_handed_to_json_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body nested past the recursion limit goes straight to the iterative decoder: running ``json.loads``
    into the limit lets a garbage collection at that depth run other objects' finalizers with no stack left
    (an unraisable ``RecursionError``, seen failing an unrelated test under load)."""
    calls: list[int] = []
    loads = json.loads

    def counting_loads(data: str | bytes) -> object:
        calls.append(len(data))
        return loads(data)

    monkeypatch.setattr(json, "loads", counting_loads)
    depth = sys.getrecursionlimit() * 3
    value = jsonbody.decode(("[" * depth + "]" * depth).encode())
    assert calls == []
    assert isinstance(value, list) and len(value) == 1
    assert jsonbody.decode(b'{"a": [1, {"b": []}]}') == {"a": [1, {"b": []}]}
    assert len(calls) == 1


@pytest.mark.parametrize("depth", [0, 1, 5, jsonbody.LOADS_DEPTH, jsonbody.LOADS_DEPTH + 1, 3_000])
def test_nesting_bound_is_the_depth_of_a_body_without_brackets_in_strings(depth: int) -> None:
    # Many shallow siblings first, so the bound cannot be read off the count of opening brackets.
    siblings = ",".join(['{"k": [1]}'] * 150)
    body = f'[{siblings},' + '{"a":' * depth + '"x"' + "}" * depth + "]"
    assert jsonbody.nesting_bound(body.encode()) == max(depth + 1, 3)


def test_brackets_inside_strings_still_decode_exactly() -> None:
    body = '{"a": "' + "]" * 500 + '", "b": [' + "[" * 5 + "]" * 5 + "]}"
    assert jsonbody.decode(body.encode()) == json.loads(body)
    body = '{"a": "' + "{" * 500 + '"}'
    assert jsonbody.decode(body) == json.loads(body)
