"""Per-node device policy: which device types the GPU plugin advertises on this node (NVIDIA's ``DriverConfig``).

Contract (NVIDIA's ``PerNodeGPUConfig`` gate, kubernetes-sigs/dra-driver-nvidia-gpu
``cmd/gpu-kubelet-plugin/driverconfig.go``, issue ksigs#1067 and its proposal "Per-node GPU publication
profiles"), kept name for name so NVIDIA's profiles and labels carry over:

* named profiles are files of one directory (NVIDIA mounts a ConfigMap at ``/available-configs``, one key per
  profile); the node label :data:`NODE_LABEL` (``nvidia.com/dra-driver-gpu.config``) names the profile of this
  node, and ``--default-config`` (``DEFAULT_CONFIG``) the profile of a node without the label. No label and no
  default: no policy, every device is advertised. A label set to ``""`` is an error.
* a profile name is a ConfigMap key: ``[-._a-zA-Z0-9]+``, at most 253 characters, not ``.`` or ``..``.
* the file, strictly decoded (unknown and duplicate fields refused, with their field path)::

      version: v1alpha1
      gpu:
        advertisedDeviceTypes: [gpu, mig]      # non-empty, no duplicates, each one of gpu | mig | vfio

  ``mig`` covers static MIG devices and dynamic-MIG placements alike (both publish ``type=mig``); ``vfio`` the
  VFIO passthrough devices of the ``PassthroughSupport`` gate (``type=vfio``).

This module is pure: it decodes text and selects a profile from labels; reading the file is
:mod:`dradriver.host.driverconfigs`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from dradriver.errors import DradriverError

VERSION = "v1alpha1"
"""The only ``version`` a profile may have."""
NODE_LABEL = "nvidia.com/dra-driver-gpu.config"
"""The node label naming this node's profile (NVIDIA's ``driverConfigNodeLabel``)."""
DEFAULT_DIRECTORY = "/available-configs"
"""Where NVIDIA's chart mounts the profiles' ConfigMap (``driverConfigDirectory``)."""
GPU, MIG, VFIO = "gpu", "mig", "vfio"
DEVICE_TYPES: tuple[str, ...] = (GPU, MIG, VFIO)
"""The values ``gpu.advertisedDeviceTypes`` accepts. ``vfio`` devices (``gpu-vfio-<index>``) exist only with the
``PassthroughSupport`` gate: without it a profile advertising only ``vfio`` publishes an empty pool."""

_CONFIG_MAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_MAX_KEY_LENGTH = 253


class DriverConfigError(DradriverError, ValueError):
    """A profile that cannot be used: unknown, unreadable, or not a valid ``v1alpha1`` file.

    :param where: what was read, e.g. ``driver config profile "full-gpu" (/available-configs/full-gpu)``.
    :param field: the field path inside the file (``gpu.advertisedDeviceTypes[1]``), ``""`` for the whole file.
    :param problem: what is wrong.
    """

    def __init__(self, where: str, field: str, problem: str) -> None:
        super().__init__(f"{where}: {field}: {problem}" if field else f"{where}: {problem}")
        self.where = where
        self.field = field
        self.problem = problem


@dataclass(frozen=True, slots=True)
class DriverConfig:
    """A decoded profile: ``version`` and ``gpu.advertisedDeviceTypes`` (in the file's order)."""

    advertised_device_types: tuple[str, ...]
    version: str = VERSION


@dataclass(frozen=True, slots=True)
class NodePolicy:
    """The device policy in force on this node.

    :param advertised: the device types published and prepared; ``None``: every type (no profile selected).
    :param profile: the selected profile's name (``""`` when none).
    :param source: ``label``, ``default`` (``--default-config``), ``none``, or ``fail-closed`` (no valid profile
        was ever read while one was asked for: nothing is advertised).
    :param reason: for ``fail-closed``, why.
    """

    advertised: frozenset[str] | None = None
    profile: str = ""
    source: str = "none"
    reason: str = ""

    def advertises(self, device_type: str) -> bool:
        """Whether devices of ``device_type`` are published and prepared under this policy."""
        return self.advertised is None or device_type in self.advertised

    def describe(self) -> str:
        """One line for logs and Events, e.g. ``profile "full-gpu" (node label ...): advertising gpu``."""
        if self.source == "fail-closed":
            return f"no device advertised ({self.reason})"
        if self.advertised is None:
            return "no driver config profile selected: advertising every device type"
        origin = f"node label {NODE_LABEL}" if self.source == "label" else "--default-config (env DEFAULT_CONFIG)"
        types = ", ".join(t for t in DEVICE_TYPES if t in self.advertised)
        return f"driver config profile {self.profile!r} ({origin}): advertising {types}"


EVERYTHING = NodePolicy()
"""No profile: every device type advertised (the behaviour without the ``PerNodeGPUConfig`` gate)."""


def fail_closed(reason: str) -> NodePolicy:
    """The policy when a profile was asked for but none could ever be used: nothing advertised."""
    return NodePolicy(advertised=frozenset(), source="fail-closed", reason=reason)


def policy_of(profile: str, source: str, config: DriverConfig) -> NodePolicy:
    """The :class:`NodePolicy` of a decoded profile."""
    return NodePolicy(advertised=frozenset(config.advertised_device_types), profile=profile, source=source)


def select_profile(labels: Mapping[str, str], default: str) -> tuple[str, str]:
    """The profile this node asks for and where the name came from: ``(name, "label")``, ``(default,
    "default")``, or ``("", "none")`` when neither names one.

    :raises DriverConfigError: the label is set to ``""``, or the name is not a ConfigMap key.
    """
    if NODE_LABEL in labels:
        name, source = labels[NODE_LABEL], "label"
        if not name:
            raise DriverConfigError(f"node label {NODE_LABEL}", "", "must not be empty (remove the label to use "
                                    "--default-config)")
    elif default:
        name, source = default, "default"
    else:
        return "", "none"
    where = f"node label {NODE_LABEL}" if source == "label" else "--default-config (env DEFAULT_CONFIG)"
    if len(name) > _MAX_KEY_LENGTH or not _CONFIG_MAP_KEY.match(name) or name in (".", ".."):
        raise DriverConfigError(where, "", f"{name!r} is not a profile name (a ConfigMap key: letters, digits, "
                                           f"'-', '_', '.', at most {_MAX_KEY_LENGTH} characters)")
    return name, source


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` refusing a key given twice in one mapping (as sigs.k8s.io/yaml's strict mode does)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate field {key!r}", key_node.start_mark)
        seen.add(key)
    return dict(loader.construct_mapping(node, deep=deep))


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _fields(value: object, where: str, path: str, allowed: tuple[str, ...]) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise DriverConfigError(where, path, f"must be an object, got {type(value).__name__}")
    for key in value:
        if key not in allowed:
            field = f"{path}.{key}" if path else str(key)
            raise DriverConfigError(where, field, f"unknown field (known fields: {', '.join(allowed)})")
    return value


def decode_driver_config(text: str | bytes, where: str) -> DriverConfig:
    """Decode and validate one profile file strictly.

    :param where: what the text is, for errors (``driver config profile "x" (<path>)``).
    :raises DriverConfigError: not YAML, a duplicate or unknown field, ``version`` other than ``v1alpha1``, no
        ``gpu``, or ``gpu.advertisedDeviceTypes`` empty, not a list of strings, with a duplicate or an unknown
        type; the error names the field path.
    """
    try:
        doc = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise DriverConfigError(where, "", f"not valid YAML: {' '.join(str(exc).split())}") from None
    if doc is None:
        doc = {}
    top = _fields(doc, where, "", ("version", "gpu"))
    version = top.get("version")
    if version != VERSION:
        problem = "required" if version is None else f"unsupported version {version!r}"
        raise DriverConfigError(where, "version", f"{problem}, expected {VERSION!r}")
    if top.get("gpu") is None:
        raise DriverConfigError(where, "gpu", "required (gpu.advertisedDeviceTypes lists the device types to "
                                              "advertise)")
    gpu = _fields(top["gpu"], where, "gpu", ("advertisedDeviceTypes",))
    types = gpu.get("advertisedDeviceTypes")
    field = "gpu.advertisedDeviceTypes"
    if not isinstance(types, list):
        got = "nothing" if types is None else type(types).__name__
        raise DriverConfigError(where, field, f"must be a list of device types ({', '.join(DEVICE_TYPES)}), got "
                                              f"{got}")
    if not types:
        raise DriverConfigError(where, field, "must not be empty")
    out: list[str] = []
    for i, item in enumerate(types):
        if item not in DEVICE_TYPES:
            raise DriverConfigError(where, f"{field}[{i}]", f"unsupported device type {item!r} (supported: "
                                                            f"{', '.join(DEVICE_TYPES)})")
        if item in out:
            raise DriverConfigError(where, f"{field}[{i}]", f"duplicate device type {item!r}")
        out.append(str(item))
    return DriverConfig(advertised_device_types=tuple(out))
