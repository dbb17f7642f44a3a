"""NVIDIA's feature gates: their names, defaults and rules, the ``--feature-gates`` syntax, and what dradriver does
with each.

Source: NVIDIA's ``pkg/featuregates/featuregates.go`` (kubernetes-sigs/dra-driver-nvidia-gpu at v0.5.0 and on
main, commit 0807eed0) and its ``feature-gates.md`` page. NVIDIA's binaries take the gates as
``--feature-gates``/``FEATURE_GATES`` in Kubernetes component-base syntax: comma-separated ``Name=bool`` pairs,
blanks around them ignored, empty entries ignored (the chart renders ``Key=true,Key2=false,`` with a trailing
comma), a value parsed as Go's ``strconv.ParseBool`` parses it, an unknown name refused.

Every gate NVIDIA knows is accepted by name so that NVIDIA's manifests run unchanged. A gate dradriver does not
implement may be set to NVIDIA's default (that changes nothing) but setting it the other way is refused at start-up
with :class:`FeatureGateError`, never ignored: an operator who asked for a behaviour must not silently lose it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from dradriver.errors import DradriverError


class Support(enum.Enum):
    """What dradriver does with a gate."""

    IMPLEMENTED = "implemented"
    """Both values have NVIDIA's meaning."""
    NOT_IMPLEMENTED = "not implemented"
    """Only NVIDIA's default is accepted; the other value is a start-up error."""
    ALWAYS_ON = "always on"
    """dradriver always has this behaviour: ``true`` is accepted, ``false`` is a start-up error."""
    LOGGING = "logging"
    """A Kubernetes logging gate of component-base; accepted, it changes nothing in dradriver's logs."""


@dataclass(frozen=True, slots=True)
class Gate:
    """One feature gate.

    :param name: NVIDIA's spelling, e.g. ``DynamicMIG``.
    :param nvidia_default: NVIDIA's default value.
    :param stage: ``Alpha``, ``Beta`` or ``GA`` with the driver version that introduced it, e.g. ``Alpha (0.3)``.
    :param summary: what the gate enables in NVIDIA's driver.
    :param support: what dradriver does with it.
    :param default: dradriver's default when the gate is not given; NVIDIA's unless a note says otherwise.
    :param note: how dradriver differs, when it does.
    """

    name: str
    nvidia_default: bool
    stage: str
    summary: str
    support: Support
    default: bool | None = None
    note: str = ""

    @property
    def effective_default(self) -> bool:
        """dradriver's value when the gate is not set."""
        return self.nvidia_default if self.default is None else self.default


TIME_SLICING_SETTINGS = "TimeSlicingSettings"
MPS_SUPPORT = "MPSSupport"
IMEX_DAEMONS_WITH_DNS_NAMES = "IMEXDaemonsWithDNSNames"
PASSTHROUGH_SUPPORT = "PassthroughSupport"
DYNAMIC_MIG = "DynamicMIG"
NVML_DEVICE_HEALTH_CHECK = "NVMLDeviceHealthCheck"
COMPUTE_DOMAIN_CLIQUES = "ComputeDomainCliques"
CRASH_ON_NVLINK_FABRIC_ERRORS = "CrashOnNVLinkFabricErrors"
DEVICE_METADATA = "DeviceMetadata"
DRA_LIST_TYPE_ATTRIBUTES = "DRAListTypeAttributes"
FABRIC_MANAGER_PARTITIONING = "FabricManagerPartitioning"
HOST_MANAGED_IMEX_DAEMON = "HostManagedIMEXDaemon"
CONSUMABLE_SHARES = "ConsumableShares"
NODE_LOCAL_FABRIC_IPC = "NodeLocalFabricIPC"
PER_NODE_GPU_CONFIG = "PerNodeGPUConfig"
NODE_ALLOCATABLE_RESOURCES = "NodeAllocatableResources"

_NO = Support.NOT_IMPLEMENTED

GATES: tuple[Gate, ...] = (
    Gate(TIME_SLICING_SETTINGS, False, "Alpha (0.2)", "GpuConfig time-slice intervals; TimeSlicing validation",
         Support.IMPLEMENTED),
    Gate(MPS_SUPPORT, False, "Alpha (0.2)", "MPS sharing strategy and its control daemons", Support.IMPLEMENTED),
    Gate(IMEX_DAEMONS_WITH_DNS_NAMES, True, "Beta (0.2)", "DNS-named IMEX peers through /etc/hosts",
         Support.ALWAYS_ON,
         note="dradriver's IMEX daemons always use DNS names per domain (the legacy IP-list nodes.cfg with an IMEX "
              "restart per change is not implemented); =false is refused"),
    Gate(PASSTHROUGH_SUPPORT, False, "Alpha (0.3)", "VFIO passthrough devices", Support.IMPLEMENTED,
         note="gpu-vfio-<index> devices published next to their GPUs (the sibling withdrawn while one is prepared) "
              "and bound to vfio-pci at prepare; allowed with NVMLDeviceHealthCheck (always on in dradriver): a "
              "passed-through GPU is not polled through NVML and reports Unknown health"),
    Gate(DYNAMIC_MIG, False, "Alpha (0.3)", "MIG instances created at prepare; partitionable devices",
         Support.IMPLEMENTED),
    Gate(NVML_DEVICE_HEALTH_CHECK, False, "Alpha (0.3)", "NVML Xid monitoring and device taints",
         Support.ALWAYS_ON, default=True,
         note="always on in dradriver: device health (taints, the kubelet health stream, metrics) is part of the "
              "product; =false is refused"),
    Gate(COMPUTE_DOMAIN_CLIQUES, True, "Beta (0.3)", "ComputeDomainClique objects for daemon membership",
         Support.ALWAYS_ON,
         note="dradriver keeps daemon membership in ComputeDomainClique objects only (the legacy CD status.nodes "
              "written by daemons is not implemented); =false is refused"),
    Gate(CRASH_ON_NVLINK_FABRIC_ERRORS, True, "Beta (0.3)", "strict fabric checks at CD plugin start-up",
         Support.IMPLEMENTED),
    Gate(DEVICE_METADATA, False, "Alpha (0.4)", "KEP-5304 device metadata (VFIO attributes)",
         Support.IMPLEMENTED,
         note="dradriver writes KEP-5304 metadata for every device kind it prepares (full GPU, MIG, dynamic MIG, "
              "shares, IMEX channels and daemons), bind-mounted read-only by the claim's CDI spec; NVIDIA offers it "
              "for VFIO devices only and requires PassthroughSupport; dradriver does not, as its metadata is not "
              "about VFIO devices only"),
    Gate(DRA_LIST_TYPE_ATTRIBUTES, False, "Alpha (0.4)", "numaNode published as a list attribute", _NO),
    Gate(FABRIC_MANAGER_PARTITIONING, False, "Alpha (0.5)", "Fabric Manager partition attributes", Support.IMPLEMENTED,
         note="gpuModuleID and partition<size> on full GPUs and VFIO devices; a claim's GPUs must be one supported "
              "partition, activated at prepare and deactivated at unprepare"),
    Gate(HOST_MANAGED_IMEX_DAEMON, False, "Alpha (0.5)", "imex.mode=hostManaged", Support.IMPLEMENTED,
         note="the compute-domain kubelet plugin's side (allocated channel, readiness from nvidia-imex-ctl -q)"),
    Gate(CONSUMABLE_SHARES, False, "Alpha (0.5)", "--consumable-shares multi-allocation", Support.IMPLEMENTED,
         note="dradriver also enforces each claim's share on the node (MPS client limits from consumedCapacity)"),
    Gate(NODE_LOCAL_FABRIC_IPC, False, "Alpha (0.6)", "single-node IMEX channels without an MNNVL clique", _NO),
    Gate(PER_NODE_GPU_CONFIG, False, "Alpha (0.6)", "per-node device policy: the node label "
         "nvidia.com/dra-driver-gpu.config selects a profile of advertised device types", Support.IMPLEMENTED,
         note="dradriver applies a label or profile change without a restart (NVIDIA reads them once at start) and "
              "refuses new prepares on devices the profile does not advertise"),
    Gate(NODE_ALLOCATABLE_RESOURCES, False, "Alpha (proposed)", "KEP-5517 node-allocatable CPU/memory overhead of "
         "gpu and mig devices", Support.IMPLEMENTED,
         note="NVIDIA's draft PR #1329, not merged as last seen: names follow it (--node-allocatable-<class>-<resource>"
              "-overhead-per-<pod|container>); needs Kubernetes 1.37 with DRANodeAllocatableResources"),
    Gate("ContextualLogging", True, "Beta (k8s)", "component-base contextual logging", Support.LOGGING),
    Gate("LoggingAlphaOptions", False, "Alpha (k8s)", "component-base alpha logging options", Support.LOGGING),
    Gate("LoggingBetaOptions", True, "Beta (k8s)", "component-base beta logging options", Support.LOGGING),
)

GATES_BY_NAME: Mapping[str, Gate] = {gate.name: gate for gate in GATES}

# ValidateFeatureGates in NVIDIA's featuregates.go at its newest release (updates section 1.2).
MUTUALLY_EXCLUSIVE: tuple[tuple[str, str], ...] = (
    (DYNAMIC_MIG, PASSTHROUGH_SUPPORT),
    (DYNAMIC_MIG, MPS_SUPPORT),
    # NVIDIA's (PASSTHROUGH_SUPPORT, NVML_DEVICE_HEALTH_CHECK) is not kept: dradriver's device health is always on
    # (NVMLDeviceHealthCheck=false is refused), so keeping it would make PassthroughSupport unusable; a GPU passed
    # through is kept out of NVML polling and reported Unknown in the kubelet health stream instead.
)
REQUIRES: tuple[tuple[str, str], ...] = (
    (COMPUTE_DOMAIN_CLIQUES, IMEX_DAEMONS_WITH_DNS_NAMES),
    # NVIDIA's (DEVICE_METADATA, PASSTHROUGH_SUPPORT) is not kept: dradriver's metadata covers every device kind,
    # not VFIO devices only, so it needs no passthrough.
)

_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


class FeatureGateError(DradriverError, ValueError):
    """A ``--feature-gates`` value that cannot be honoured: bad syntax, an unknown gate, a gate dradriver does not
    implement set away from NVIDIA's default, or a combination NVIDIA's rules forbid."""


@dataclass(frozen=True, slots=True)
class FeatureGates(Mapping[str, bool]):
    """The gates in force: every known gate maps to its value (explicit or default).

    :param explicit: the gates the operator set, by name.
    """

    explicit: Mapping[str, bool] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "explicit", dict(self.explicit or {}))
        for name in self.explicit:
            if name not in GATES_BY_NAME:
                raise FeatureGateError(_unknown(name))

    def __getitem__(self, name: str) -> bool:
        if name not in GATES_BY_NAME:
            raise KeyError(name)
        value = self.explicit.get(name)
        return GATES_BY_NAME[name].effective_default if value is None else value

    def __iter__(self) -> Iterator[str]:
        return iter(GATES_BY_NAME)

    def __len__(self) -> int:
        return len(GATES_BY_NAME)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.explicit.items())))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FeatureGates):
            return NotImplemented
        return dict(self.items()) == dict(other.items())

    def with_gates(self, **values: bool) -> FeatureGates:
        """A copy with ``values`` (gate names as keywords) set explicitly."""
        return FeatureGates({**self.explicit, **values})

    @property
    def time_slicing_settings(self) -> bool:
        """``TimeSlicingSettings``."""
        return self[TIME_SLICING_SETTINGS]

    @property
    def mps_support(self) -> bool:
        """``MPSSupport``."""
        return self[MPS_SUPPORT]

    @property
    def dynamic_mig(self) -> bool:
        """``DynamicMIG``."""
        return self[DYNAMIC_MIG]

    @property
    def consumable_shares(self) -> bool:
        """``ConsumableShares``."""
        return self[CONSUMABLE_SHARES]

    @property
    def passthrough_support(self) -> bool:
        """``PassthroughSupport``: VFIO passthrough devices (:mod:`dradriver.domain.passthrough`)."""
        return self[PASSTHROUGH_SUPPORT]

    @property
    def fabric_manager_partitioning(self) -> bool:
        """``FabricManagerPartitioning``: Fabric Manager partition attributes and activation."""
        return self[FABRIC_MANAGER_PARTITIONING]

    @property
    def device_metadata(self) -> bool:
        """``DeviceMetadata``: KEP-5304 device metadata files for containers."""
        return self[DEVICE_METADATA]

    @property
    def per_node_gpu_config(self) -> bool:
        """``PerNodeGPUConfig``."""
        return self[PER_NODE_GPU_CONFIG]

    @property
    def nvml_device_health_check(self) -> bool:
        """``NVMLDeviceHealthCheck`` (on by default in dradriver)."""
        return self[NVML_DEVICE_HEALTH_CHECK]

    @property
    def node_allocatable_resources(self) -> bool:
        """``NodeAllocatableResources`` (KEP-5517 overhead, :mod:`dradriver.domain.nodeallocatable`)."""
        return self[NODE_ALLOCATABLE_RESOURCES]

    def render(self) -> str:
        """The explicit gates in NVIDIA's syntax, sorted by name: ``A=true,B=false`` (empty when none is set)."""
        return ",".join(f"{name}={'true' if value else 'false'}" for name, value in sorted(self.explicit.items()))


def _unknown(name: str) -> str:
    return f"unrecognized feature gate: {name} (known: {', '.join(GATES_BY_NAME)})"


def parse_feature_gates(text: str, *, where: str = "--feature-gates") -> FeatureGates:
    """Parse NVIDIA's ``--feature-gates`` syntax into the gates in force, and check them.

    :param text: e.g. ``"DynamicMIG=true,MPSSupport=false,"``; empty means all defaults.
    :param where: how the value was given, for error messages (``--feature-gates`` or ``FEATURE_GATES``).
    :raises FeatureGateError: a malformed pair, an unknown name, a value that is not a boolean, a gate dradriver
        does not implement set away from NVIDIA's default, or a combination :func:`check_gates` refuses.
    """
    values: dict[str, bool] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, raw = part.partition("=")
        name, raw = name.strip(), raw.strip()
        if not sep or not name:
            raise FeatureGateError(f"{where}: missing bool value for {part!r} (expected Name=true|false)")
        if name not in GATES_BY_NAME:
            raise FeatureGateError(f"{where}: {_unknown(name)}")
        if raw in _TRUE:
            values[name] = True
        elif raw in _FALSE:
            values[name] = False
        else:
            raise FeatureGateError(f"{where}: invalid value of {name}={raw}, err: strconv.ParseBool: parsing "
                                   f"{raw!r}: invalid syntax")
    gates = FeatureGates(values)
    check_gates(gates, where=where)
    return gates


def check_gates(gates: FeatureGates, *, where: str = "--feature-gates") -> None:
    """Refuse what dradriver cannot honour and what NVIDIA's ``ValidateFeatureGates`` refuses.

    :raises FeatureGateError: naming the gate and why.
    """
    for name, value in gates.explicit.items():
        gate = GATES_BY_NAME[name]
        if gate.support is Support.NOT_IMPLEMENTED and value != gate.nvidia_default:
            raise FeatureGateError(
                f"{where}: {name}={'true' if value else 'false'} is not implemented by dradriver ({gate.summary}); "
                f"remove it or set it to NVIDIA's default {'true' if gate.nvidia_default else 'false'}")
        if gate.support is Support.ALWAYS_ON and not value:
            raise FeatureGateError(f"{where}: {name}=false is not supported: {gate.note}")
    for first, second in MUTUALLY_EXCLUSIVE:
        if gates[first] and gates[second]:
            raise FeatureGateError(f"{where}: feature gates {first} and {second} are mutually exclusive")
    for gate_name, needed in REQUIRES:
        if gates[gate_name] and not gates[needed]:
            raise FeatureGateError(f"{where}: feature gate {gate_name} requires {needed}")


DEFAULT_GATES = FeatureGates()
"""Every gate at dradriver's default."""
