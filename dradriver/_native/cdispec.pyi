"""Types of the compiled CDI spec renderer ``ext/cdispec.pyx`` (twin: ``dradriver/_native/cdispec_py.py``).

Record shapes are documented in the twin's module docstring. Records are checked at run time (a wrong
shape or type is a :class:`TypeError` naming the field), so they are typed as sequences of objects here.
"""

from collections.abc import Sequence

KNOWN_VERSIONS: tuple[str, ...]
HOOK_NAMES: tuple[str, ...]
NODE_TYPES: tuple[str, ...]
MAX_MAJOR: int
MAX_MINOR: int
MAX_FILE_MODE: int
MAX_UINT32: int
IMEX_CHANNEL_COUNT: int
IMEX_CHANNEL_DIR: str
MAX_ANNOTATIONS_SIZE: int

def render_spec(
    kind: str,
    devices: Sequence[Sequence[object]],
    common: Sequence[object] | None = None,
    annotations: Sequence[tuple[str, str]] = (),
    cdi_version: str | None = None,
) -> bytes:
    """Render one CDI spec as compact JSON bytes.

    :raises TypeError: a field has the wrong type or a record the wrong number of fields.
    :raises ValueError: a value breaks a CDI rule; the message names the field.
    """

def render_channel_spec(
    kind: str,
    channels: Sequence[int] | range,
    major: int,
    name_prefix: str = "",
    file_mode: int | None = 0o666,
    host_root: str = "",
    common: Sequence[object] | None = None,
    cdi_version: str | None = None,
    device_name: str | None = None,
) -> bytes:
    """Render a bulk IMEX-channel spec: one device per channel, one char node each (``device_name``: one device
    holding every channel's node)."""
