"""Content negotiation: which media type a response is written in and how a request body is read.

JSON always; Kubernetes protobuf for the kinds in :data:`.protobuf.MESSAGES`, in ``Accept`` order
(client-go sends ``application/vnd.kubernetes.protobuf,application/json``, so other kinds fall back to JSON);
a DELETE's ``DeleteOptions`` body in protobuf for every built-in resource (:func:`decode_delete_body`).
Watch streams are JSON only: a watch that accepts nothing else is answered 406.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from dradriver.sandbox.apiserver import protobuf
from dradriver.sandbox.apiserver.errors import ApiStatusError, JSONDict, bad_request

JSON = "application/json"
PROTOBUF = protobuf.MEDIA_TYPE
_JSON_ALIASES = (JSON, "*/*", "application/*")
APPLY_PATCH = "application/apply-patch+yaml"
"""A server-side apply's body: YAML (JSON is YAML)."""


def _media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


def negotiate(accept: str, api_version: str | None, kind: str | None) -> str:
    """:data:`JSON` or :data:`PROTOBUF` for a response of this kind (None: JSON only, e.g. a watch).

    :raises ApiStatusError: 406 ``NotAcceptable`` when ``Accept`` names nothing the emulator writes.
    """
    if not accept.strip():
        return JSON
    for item in accept.split(","):
        media = _media_type(item)
        if media == PROTOBUF and api_version and kind and protobuf.supports(api_version, kind):
            return PROTOBUF
        if media in _JSON_ALIASES:
            return JSON
    raise ApiStatusError(
        406,
        "NotAcceptable",
        "only the following media types are accepted: application/json, application/yaml, "
        "application/vnd.kubernetes.protobuf",
    )


def decode_body(body: bytes, content_type: str, api_version: str, kind: str) -> Any:
    """The request body as JSON data (``None`` when empty).

    :raises ApiStatusError: 400 for a malformed body; 415 for a protobuf body of a kind without protobuf.
    """
    if _media_type(content_type) == PROTOBUF:
        if not protobuf.supports(api_version, kind):
            raise protobuf.unsupported_media_type()
        return protobuf.decode(body) if body else None
    if _media_type(content_type) == APPLY_PATCH:
        try:
            return yaml.safe_load(body) if body else None
        except yaml.YAMLError as exc:
            raise bad_request(f"error decoding YAML: {exc}") from exc
    try:
        return json.loads(body or b"null")
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc


def decode_delete_body(body: bytes, content_type: str, *, custom: bool) -> Any:
    """A DELETE's body (``DeleteOptions``) as JSON data (``None`` when empty): protobuf for a built-in resource
    (client-go's ``Delete`` sends it so), JSON or YAML for any.

    :param custom: the resource is a custom resource (no protobuf, as the real server).
    :raises ApiStatusError: 400 for a malformed body; 415 for a protobuf body on a custom resource.
    """
    if _media_type(content_type) == PROTOBUF:
        if custom:
            raise protobuf.unsupported_media_type()
        return protobuf.decode_delete_options(body) if body else None
    return decode_body(body, content_type, "", "")


def encode_body(payload: JSONDict, media: str, api_version: str, kind: str) -> tuple[bytes, str]:
    """``payload`` in ``media`` (JSON for a payload of a kind without protobuf); returns the bytes and the
    ``Content-Type``."""
    api_version, kind = payload.get("apiVersion") or api_version, payload.get("kind") or kind
    if media == PROTOBUF and protobuf.supports(api_version, kind):
        return protobuf.encode(payload, api_version, kind), PROTOBUF
    return json.dumps(payload).encode(), JSON
