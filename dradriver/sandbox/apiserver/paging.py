"""LIST in chunks: the ``limit`` and ``continue`` query parameters ("Retrieving large results sets in chunks",
Kubernetes API concepts).

What the emulator does, as the API server does:

* ``limit=N`` (N > 0) returns at most N items, sorted by namespace and name (the storage key order), and, when
  more match, ``metadata.continue``: an opaque token (base64 of ``{"v": "meta.k8s.io/v1", "rv": <list RV>,
  "start": "<namespace>/<name>\\x00"}``, the API server's own layout) that the next request sends as
  ``continue=<token>`` with the same selectors;
* ``metadata.remainingItemCount`` is set only for a list without label or field selectors (the API server
  cannot count what a selector would skip);
* ``limit=0`` or no ``limit`` is one whole list; a negative or non-integer ``limit``, a malformed token or
  ``resourceVersion`` together with ``continue`` is 400 ``BadRequest``;
* every page of one list reports the first page's ``resourceVersion``.

One deviation: the API server serves every page from the snapshot at the first page's resourceVersion (etcd
history; 410 ``Expired`` once compacted); the emulator keeps no history, so a later page is cut from the live
store after the last key sent: an object created meanwhile after that key is in a later page, one deleted
meanwhile is not, a later page shows the objects as they are when it is served, and no object is sent twice.
No token expires.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence

from dradriver.sandbox.apiserver.errors import JSONDict, bad_request

TOKEN_VERSION = "meta.k8s.io/v1"


def _key(obj: JSONDict) -> tuple[str, str]:
    meta = obj["metadata"]
    return str(meta.get("namespace", "")), str(meta["name"])


def encode_token(resource_version: int, last_key: tuple[str, str]) -> str:
    """The continue token after ``last_key`` (namespace, name) of a list at ``resource_version``."""
    raw = json.dumps({"v": TOKEN_VERSION, "rv": resource_version, "start": "/".join(last_key) + "\x00"},
                     separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_token(token: str) -> tuple[int, tuple[str, str]]:
    """``(resource version, last key sent)`` of a continue token (the key as (namespace, name)).

    :raises ApiStatusError: 400 for a token that is not one of ours.
    """
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        rv, start = data["rv"], data["start"]
        if (data.get("v") != TOKEN_VERSION or not isinstance(rv, int) or not isinstance(start, str)
                or not start.endswith("\x00") or "/" not in start):
            raise ValueError(data)
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise bad_request(f"continue key is not valid: {token!r}") from None
    namespace, _, name = start[:-1].partition("/")  # neither a namespace nor a name holds a "/"
    return rv, (namespace, name)


def page(items: Sequence[JSONDict], params: Mapping[str, str], current_rv: int,
         *, selected: bool) -> tuple[list[JSONDict], JSONDict]:
    """The items of this request's page (``items`` sorted by key) and the list's ``metadata``.

    :param current_rv: the storage's resourceVersion now (the list's, on a first page).
    :param selected: the request has a label or field selector (no ``remainingItemCount``).
    :raises ApiStatusError: 400 for a bad ``limit`` or ``continue``, or ``continue`` with ``resourceVersion``.
    """
    text = params.get("limit", "")
    try:
        limit = int(text) if text else 0
    except ValueError:
        raise bad_request(f"limit: invalid value {text!r}: must be an integer") from None
    if limit < 0:
        raise bad_request(f"limit: invalid value {limit}: must be greater than or equal to 0")
    token = params.get("continue", "")
    rv = current_rv
    chosen = list(items)
    if token:
        if params.get("resourceVersion"):
            raise bad_request("specifying resource version is not allowed when using continue")
        rv, last = decode_token(token)
        chosen = [o for o in chosen if _key(o) > last]
    meta: JSONDict = {"resourceVersion": str(rv)}
    if limit and len(chosen) > limit:
        rest = len(chosen) - limit
        chosen = chosen[:limit]
        meta["continue"] = encode_token(rv, _key(chosen[-1]))
        if not selected:
            meta["remainingItemCount"] = rest
    return chosen, meta
