"""CDI specs for prepared claims: container edits, names, and the spec content (pure; no I/O).

Facts (the CDI ``SPEC.md`` and its library's ``specs-go/version.go`` and ``pkg/cdi/spec.go``; NVIDIA's
``cmd/gpu-kubelet-plugin/cdi.go``; NVIDIA's MIG User Guide, "Device Nodes and Capabilities"; NVIDIA's
``cmd/compute-domain-kubelet-plugin/nvlib.go``; nvidia-container-toolkit's ``internal/info/proc/devices``):

* one transient spec per claim, of the plugin's CDI kind (:class:`CdiKind`,
  ``k8s.gpu.nvidia.com/claim`` for the GPU plugin), file ``<cdiRoot>/<vendor>-<class>_<claimUID>.json``;
* one CDI device per prepared device, named ``<claimUID>-<device name>``; the kubelet receives the
  fully-qualified ID ``<vendor>/<class>=<claimUID>-<device name>``;
* every node is fully specified (``type: c``, major, minor, fileMode) so the runtime can create it even
  where the host node is missing; ``hostPath`` is written only when the host root is not ``/``;
* ``cdiVersion`` is the lowest the content needs (computed by the renderer, the CDI library's ``specs-go/version.go``).

What a device's edits are is each device preparer's business (``dradriver.preparers``); device numbers are
read from the host by :mod:`dradriver.host.devicenodes`, and spec files are written by
:mod:`dradriver.host.cdifiles`. Rendering goes through ``dradriver._native.load("cdispec")`` (the compiled
renderer, or its pure-Python twin under ``DRADRIVER_NO_EXTENSIONS=1``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dradriver import _native
from dradriver.errors import DradriverError

__all__ = [
    "DEFAULT_CAP_MODE",
    "DEFAULT_NODE_MODE",
    "LEGACY_SPEC_SUFFIX",
    "SPEC_FILE_MODE",
    "SPEC_SUFFIX",
    "UID_PATTERN",
    "VISIBLE_DEVICES_VOID",
    "CdiKind",
    "CdiSpecError",
    "ContainerEdits",
    "DeviceNode",
    "DeviceNodeError",
    "Hook",
    "Mount",
    "check_claim_uid",
    "render_claim_spec",
    "render_imex_channel_spec",
]

#: What NVIDIA's driver sets so the legacy runtime hook injects nothing itself (nvidia-container-toolkit's ``pkg/nvcdi``
#: in nvml mode; NVIDIA's ``cmd/gpu-kubelet-plugin/cdi.go``).
VISIBLE_DEVICES_VOID = "NVIDIA_VISIBLE_DEVICES=void"
SPEC_FILE_MODE = 0o644
#: Mode of ``/dev/nvidia*`` nodes as the driver creates them, used when the host node cannot be stat'ed.
DEFAULT_NODE_MODE = 0o666
#: Mode of MIG access capability nodes (``DeviceFileMode`` 292) when no capability file says otherwise.
DEFAULT_CAP_MODE = 0o444

UID_PATTERN = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]*")
"""Claim UIDs usable in CDI device and file names."""


class CdiSpecError(DradriverError):
    """A claim's CDI spec cannot be built or written; the message names the claim and the cause."""


def check_claim_uid(claim_uid: str) -> str:
    """Return ``claim_uid`` if it is safe in file and device names (``[0-9A-Za-z][0-9A-Za-z._-]*``).

    :raises CdiSpecError: otherwise.
    """
    if not isinstance(claim_uid, str) or not UID_PATTERN.fullmatch(claim_uid):
        raise CdiSpecError(f"claim UID {claim_uid!r} is not usable in CDI names")
    return claim_uid


SPEC_SUFFIX = ".yaml"
"""Suffix of a claim spec file: NVIDIA's (``cmd/gpu-kubelet-plugin/cdi.go``), so either driver's unprepare removes
it."""
LEGACY_SPEC_SUFFIX = ".json"
"""Suffix dradriver's claim specs had before 2026-12: still recognised, removed on write and delete."""

@dataclass(frozen=True, slots=True)
class CdiKind:
    """A CDI kind ``<vendor>/<class>`` and the names derived from it (the CDI ``SPEC.md``).

    :param vendor: e.g. ``k8s.gpu.nvidia.com``.
    :param cls: e.g. ``claim``.
    """

    vendor: str
    cls: str = "claim"

    @property
    def kind(self) -> str:
        """``<vendor>/<class>``, the spec's ``kind`` field."""
        return f"{self.vendor}/{self.cls}"

    @property
    def spec_prefix(self) -> str:
        """``<vendor>-<class>_``: every transient claim spec file of this kind starts with it."""
        return f"{self.vendor}-{self.cls}_"

    def device_name(self, claim_uid: str, device: str) -> str:
        """Unqualified CDI device name ``<claimUID>-<device name>``."""
        return f"{claim_uid}-{device}"

    def device_id(self, claim_uid: str, device: str) -> str:
        """Fully-qualified CDI device ID ``<vendor>/<class>=<claimUID>-<device name>``."""
        return f"{self.kind}={claim_uid}-{device}"

    def spec_name(self, claim_uid: str) -> str:
        """Spec file name ``<vendor>-<class>_<claimUID>.yaml`` (``GenerateTransientSpecName``), NVIDIA's own name
        for the claim's spec: its unprepare deletes only that name, so after a rollback to NVIDIA's driver it
        removes dradriver's spec, and a re-prepare by NVIDIA replaces it instead of adding a second file that
        defines the same CDI device. The content is JSON, which is YAML (CDI reads ``.yaml`` files as YAML).

        :raises CdiSpecError: the claim UID is not usable in names.
        """
        return f"{self.spec_prefix}{check_claim_uid(claim_uid)}{SPEC_SUFFIX}"

    def spec_path(self, cdi_root: Path | str, claim_uid: str) -> Path:
        """``<cdi_root>/<vendor>-<class>_<claimUID>.yaml`` (a path; nothing is read)."""
        return Path(cdi_root) / self.spec_name(claim_uid)

    def spec_uid(self, file_name: str) -> str | None:
        """The claim UID of a spec file name of this kind (``.yaml``, or the ``.json`` of releases before
        2026-12), or ``None`` for any other name."""
        if not file_name.startswith(self.spec_prefix):
            return None
        for suffix in (SPEC_SUFFIX, LEGACY_SPEC_SUFFIX):
            if file_name.endswith(suffix):
                uid = file_name[len(self.spec_prefix):-len(suffix)]
                return uid if UID_PATTERN.fullmatch(uid) else None
        return None


class DeviceNodeError(CdiSpecError):
    """A device node's major or minor number cannot be found (``/proc/devices``, mig-minors, stat)."""


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """One CDI ``DeviceNode`` (the CDI ``SPEC.md``). ``""``/``0``/``None`` leave a field out of the JSON.

    :param file_mode: permission bits, e.g. ``0o666``.
    """

    path: str
    host_path: str = ""
    type: str = ""
    major: int = 0
    minor: int = 0
    file_mode: int | None = None
    permissions: str = ""
    uid: int | None = None
    gid: int | None = None

    def record(self) -> tuple[object, ...]:
        """The renderer's record ``(path, hostPath, type, major, minor, fileMode, permissions, uid, gid)``."""
        return (
            self.path,
            self.host_path,
            self.type,
            self.major,
            self.minor,
            self.file_mode,
            self.permissions,
            self.uid,
            self.gid,
        )


@dataclass(frozen=True, slots=True)
class Mount:
    """One CDI ``Mount``: ``host_path`` into the container at ``container_path``."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = ()
    type: str = ""

    def record(self) -> tuple[object, ...]:
        """The renderer's record ``(hostPath, containerPath, options, type)``."""
        return (self.host_path, self.container_path, self.options, self.type)


@dataclass(frozen=True, slots=True)
class Hook:
    """One CDI ``Hook``; ``timeout`` in seconds."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None

    def record(self) -> tuple[object, ...]:
        """The renderer's record ``(hookName, path, args, env, timeout)``."""
        return (self.hook_name, self.path, self.args, self.env, self.timeout)


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    """CDI ``containerEdits`` (the subset NVIDIA GPU specs use, plus ``additionalGids``)."""

    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    hooks: tuple[Hook, ...] = ()
    mounts: tuple[Mount, ...] = ()
    additional_gids: tuple[int, ...] = ()

    def __add__(self, other: ContainerEdits) -> ContainerEdits:
        return ContainerEdits(
            self.env + other.env,
            self.device_nodes + other.device_nodes,
            self.hooks + other.hooks,
            self.mounts + other.mounts,
            self.additional_gids + other.additional_gids,
        )

    def record(self) -> tuple[object, ...]:
        """The renderer's record ``(env, deviceNodes, netDevices, hooks, mounts, additionalGids)``."""
        return (
            self.env,
            tuple(n.record() for n in self.device_nodes),
            (),
            tuple(h.record() for h in self.hooks),
            tuple(m.record() for m in self.mounts),
            self.additional_gids,
        )


# The last spec-level edits rendered and their record: a plugin renders every claim spec with the same
# ContainerEdits object (immutable: frozen dataclasses of tuples), so its record is built once and the renderer
# sees the same record object each time, which lets it reuse that part of the JSON.
_spec_record: tuple[ContainerEdits, tuple[object, ...]] | None = None


def _spec_edits_record(edits: ContainerEdits) -> tuple[object, ...]:
    global _spec_record
    cached = _spec_record
    if cached is not None and cached[0] is edits:
        return cached[1]
    record = edits.record()
    _spec_record = (edits, record)
    return record


def render_claim_spec(
    kind: CdiKind,
    claim_uid: str,
    devices: Sequence[tuple[str, ContainerEdits]],
    spec_edits: ContainerEdits,
) -> bytes:
    """The claim's spec as compact JSON bytes (deterministic for the same inputs).

    :param kind: the CDI kind (``<vendor>/<class>``) of the plugin.
    :param devices: (DRA device name, that device's container edits), in the order the allocation result
        lists them; each becomes the CDI device ``<claimUID>-<device name>``.
    :param spec_edits: the spec-level edits (control nodes, driver user space, ``NVIDIA_VISIBLE_DEVICES=void``).
    :raises CdiSpecError: bad claim UID, duplicate device, or content the CDI rules reject; the message names
        the claim.
    """
    try:
        check_claim_uid(claim_uid)
        records = [(kind.device_name(claim_uid, name), edits.record()) for name, edits in devices]
        renderer = _native.load("cdispec")
        data: bytes = renderer.render_spec(kind.kind, records, _spec_edits_record(spec_edits))
        return data
    except CdiSpecError:
        raise
    except (TypeError, ValueError) as exc:
        raise CdiSpecError(f"claim {claim_uid}: CDI spec: {exc}") from exc


def render_imex_channel_spec(
    major: int,
    channels: Sequence[int] | range = range(2048),
    *,
    kind: str = "nvidia.com/imex-channel",
    name_prefix: str = "",
    host_root: str = "",
    file_mode: int | None = DEFAULT_NODE_MODE,
    common: ContainerEdits | None = None,
    device_name: str | None = None,
) -> bytes:
    """A bulk spec with one device per IMEX channel (nvidia-container-toolkit's ``pkg/nvcdi`` in imex mode; NVIDIA's
    ``cmd/compute-domain-kubelet-plugin/cdi.go``, ``nvlib.go``), or with one device holding every channel's node.

    The defaults give the toolkit's ``nvidia.com/imex-channel`` spec with bare channel numbers as names. The
    compute-domain plugin's claim spec is ``kind="k8s.compute-domain.nvidia.com/claim"``,
    ``device_name="<claimUID>-channel-0"``: NVIDIA's claim device ``<claimUID>-<allocated device>`` whose
    ``deviceNodes`` are ``channel0 .. channel<n-1>`` for an ``allocationMode: All`` claim (NVIDIA's
    ``cmd/compute-domain-kubelet-plugin/cdi.go``).

    :param major: the ``nvidia-caps-imex-channels`` line of ``/proc/devices``.
    :param common: the spec-level edits; ``None``: ``NVIDIA_VISIBLE_DEVICES=void`` only.
    :param device_name: ``None``: one device ``<name_prefix><N>`` per channel; else the one device (no
        ``name_prefix`` then).
    :raises CdiSpecError: a channel outside ``[0, 2047]``, a duplicate, or an invalid kind or name.
    """
    renderer = _native.load("cdispec")
    try:
        data: bytes = renderer.render_channel_spec(
            kind,
            channels,
            major,
            name_prefix,
            file_mode,
            host_root,
            ((VISIBLE_DEVICES_VOID,), (), (), (), (), ()) if common is None else common.record(),
            None,
            device_name,
        )
        return data
    except (TypeError, ValueError) as exc:
        raise CdiSpecError(f"IMEX channel spec: {exc}") from exc


