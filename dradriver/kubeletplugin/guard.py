"""The device-plugin guard: never advertise a node's GPUs through both the NVIDIA device plugin and DRA.

If NVIDIA's device plugin (``k8s-device-plugin``) serves this node, the kubelet hands its GPUs to pods that
ask for the extended resource ``nvidia.com/gpu`` while the scheduler also allocates the same GPUs through
our ResourceSlices: two pods end up on one GPU. The kubelet plugin therefore calls
:func:`check_device_plugin` at start and publishes no GPUs when the verdict refuses, unless the operator
sets ``--ignore-device-plugin`` (env ``DRADRIVER_IGNORE_DEVICE_PLUGIN``).

Two signs of the device plugin, each enough on its own:

* its registration socket in the kubelet's device-plugins directory. NVIDIA's device plugin names it
  ``nvidia-<resource>.sock`` after the resource it serves: ``nvidia-gpu.sock`` for ``nvidia.com/gpu``,
  ``nvidia-mig-1g.10gb.sock`` for a MIG resource under the ``mixed`` strategy, ``nvidia-gpu.shared.sock``
  for a renamed shared resource (k8s-device-plugin ``internal/plugin/server.go``:
  ``DevicePluginPath + "nvidia-" + name + ".sock"``);
* a non-zero ``status.allocatable`` of ``nvidia.com/gpu``, ``nvidia.com/gpu.*`` or ``nvidia.com/mig-*`` on
  the Node object: the kubelet still offers device-plugin GPUs (even if the socket directory is not mounted
  into our container, or the plugin runs elsewhere with a non-default path). DRA-backed extended resources
  (``DeviceClass.spec.extendedResourceName``) never appear in Node allocatable, so our own mapping does
  not trip the guard.

The check itself does no Kubernetes I/O: the caller fetches the Node through ``dradriver.kube`` and passes
the object as a dict (the API's JSON shape), or ``None`` when it could not be read.
"""

from __future__ import annotations

import errno
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dradriver.config import PluginConfig

#: Glob of the NVIDIA device plugin's sockets in the kubelet's device-plugins directory.
DEVICE_PLUGIN_SOCKET_GLOB = "nvidia-*.sock"

#: The extended-resource names NVIDIA's device plugin advertises on a Node: ``nvidia.com/gpu`` and the
#: prefixes of its renamed shared (``nvidia.com/gpu.shared``) and MIG (``nvidia.com/mig-1g.10gb``) resources.
GPU_RESOURCE = "nvidia.com/gpu"
_RESOURCE_PREFIXES = ("nvidia.com/gpu.", "nvidia.com/mig-")

_CONNECT_TIMEOUT_S = 0.5


@dataclass(frozen=True, slots=True)
class GuardVerdict:
    """The outcome of :func:`check_device_plugin`.

    :param refuse: ``True`` means the plugin must publish no GPUs.
    :param reason: one line for the log and the Kubernetes Event; says what was found and how to proceed.
        Non-empty whenever something was found, even if the override lets the plugin go on.
    :param sockets: device-plugin sockets found (absolute paths inside the container).
    :param resources: Node allocatable entries that point at the device plugin, name -> quantity string.
    """

    refuse: bool
    reason: str
    sockets: tuple[Path, ...] = ()
    resources: Mapping[str, str] = field(default_factory=dict)

    @property
    def found(self) -> bool:
        """Whether any sign of the device plugin was seen (whatever the override says)."""
        return bool(self.sockets or self.resources)


def _socket_answers(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket ``path`` (a stale file does not)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_CONNECT_TIMEOUT_S)
    try:
        sock.connect(str(path))
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        # EACCES, a timeout, ...: something is there we may not talk to; count it as live.
        return True
    finally:
        sock.close()
    return True


def find_device_plugin_sockets(directory: Path) -> tuple[Path, ...]:
    """Unix sockets named like NVIDIA's device plugin's in ``directory``, sorted.

    A missing or unreadable directory yields ``()``: that node has no device plugins to find.
    Regular files with a matching name (a leftover copy, a test fixture) do not count.
    """
    try:
        candidates = sorted(directory.glob(DEVICE_PLUGIN_SOCKET_GLOB))
    except OSError:
        return ()
    found: list[Path] = []
    for path in candidates:
        try:
            mode = path.lstat().st_mode
        except OSError:
            continue
        if stat.S_ISSOCK(mode):
            found.append(path)
    return tuple(found)


def _parse_count(quantity: object) -> int | None:
    """A device count from a Kubernetes quantity string (``"8"``, ``"0"``, ``"1k"``); ``None`` if unreadable."""
    text = str(quantity).strip()
    suffixes = {"k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix, factor in suffixes.items():
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * factor
    try:
        return int(text)
    except ValueError:
        return None


def device_plugin_resources(node: Mapping[str, Any] | None) -> dict[str, str]:
    """Node ``status.allocatable`` entries that NVIDIA's device plugin advertises, non-zero ones only.

    :param node: a Node object in the API's JSON shape, or ``None``.
    :returns: resource name -> the quantity string as the API gave it. An unparseable quantity counts
        as non-zero (better a false refusal the operator can override than two owners of one GPU).
    """
    if not node:
        return {}
    status = node.get("status") or {}
    allocatable = status.get("allocatable") or {}
    out: dict[str, str] = {}
    for name, quantity in allocatable.items():
        if name != GPU_RESOURCE and not name.startswith(_RESOURCE_PREFIXES):
            continue
        count = _parse_count(quantity)
        if count is None or count > 0:
            out[name] = str(quantity)
    return out


def check_device_plugin(config: PluginConfig, node: Mapping[str, Any] | None) -> GuardVerdict:
    """Decide whether this node's GPUs may be published through DRA.

    :param config: the plugin's settings; reads ``kubelet_device_plugins_directory_path`` (a path inside
        the plugin's container, where the DaemonSet mounts the host's ``/var/lib/kubelet/device-plugins``
        read-only), ``ignore_device_plugin`` and ``node_name``.
    :param node: this plugin's Node object (``GET /api/v1/nodes/<node_name>`` as a dict), or ``None``
        when the caller could not read it; then only the socket check applies.
    :returns: a :class:`GuardVerdict`. ``refuse`` is ``True`` when a sign was found and the override is
        off. With the override on, ``refuse`` is ``False`` but ``reason`` still says what was found, so
        the caller can log a warning. Never raises for a missing directory or a malformed Node.
    """
    directory = config.kubelet_device_plugins_directory_path
    sockets = find_device_plugin_sockets(directory)
    resources = device_plugin_resources(node)
    if not sockets and not resources:
        return GuardVerdict(refuse=False, reason="")

    signs: list[str] = []
    for path in sockets:
        state = "serving" if _socket_answers(path) else "not answering (stale socket file?)"
        signs.append(f"socket {path} ({state})")
    if resources:
        listed = ", ".join(f"{name}={qty}" for name, qty in sorted(resources.items()))
        signs.append(f"Node {config.node_name} allocatable {listed}")
    found = "; ".join(signs)

    if config.ignore_device_plugin:
        reason = (
            f"NVIDIA device plugin found on node {config.node_name}: {found}. Publishing GPUs anyway because "
            "--ignore-device-plugin (DRADRIVER_IGNORE_DEVICE_PLUGIN) is set; the same GPUs may be handed out "
            "twice unless the device plugin no longer allocates them."
        )
        return GuardVerdict(refuse=False, reason=reason, sockets=sockets, resources=resources)
    reason = (
        f"NVIDIA device plugin found on node {config.node_name}: {found}. Publishing no GPUs, so that no GPU "
        "is allocated through both the device plugin and DRA. Remove the device plugin from this node "
        "(or delete a stale socket file), or set --ignore-device-plugin (DRADRIVER_IGNORE_DEVICE_PLUGIN=true) "
        "to publish anyway."
    )
    return GuardVerdict(refuse=True, reason=reason, sockets=sockets, resources=resources)
