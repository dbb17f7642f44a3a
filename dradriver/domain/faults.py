"""Device health: NVML faults classified, scoped to devices, turned into DRA device taints, and recovered.

Facts (NVIDIA's ``cmd/gpu-kubelet-plugin/device_health.go``; KEP-4680, ``pkg/apis/dra-health/v1alpha1/api.proto`` in
kubernetes/kubelet; ``resource/v1/types.go`` in kubernetes/api):

* Application-level Xids that do not make a device unhealthy, by default 13, 31, 43, 45, 68 and 109
  (NVIDIA's driver), extended by ``--additional-xids-to-ignore``.
* Effect ``NoSchedule`` for faults, ``None`` for informational ones (``None`` is a valid DeviceTaint effect
  from Kubernetes 1.35; on older API servers informational taints are left out).
* A fault scoped to a MIG device (an event carrying a GPU instance and compute instance ID) affects that MIG
  device; a GPU-wide fault (no MIG scope, or an Xid whose recovery action is a GPU reset,
  :data:`GPU_RESET_XIDS`) affects the GPU and every MIG device on it: resetting the GPU ends them all.

Taint keys: one taint per health class and device, ``<domain>/<class>`` with the domain of the driver's
identity (``gpu.nvidia.com``). A new fault replaces the taint of its own class only, and only with one at
least as severe (effect first, then a GPU-reset Xid over another fatal Xid), so an informational Xid after a
fatal one never hides it:

* ``gpu.nvidia.com/xid``, NoSchedule: fatal and GPU-reset Xids (NVIDIA's key; value: the decimal Xid);
* ``gpu.nvidia.com/xid-informational``, None: ignored (application) Xids (value: the decimal Xid; only
  published from Kubernetes 1.35, and never touches the fatal class);
* ``gpu.nvidia.com/gpu-lost``, NoSchedule: fallen off the bus / GPU_IS_LOST (NVIDIA's key);
* ``gpu.nvidia.com/unmonitored``, None: NVML events cannot be registered (NVIDIA's key);
* ``gpu.nvidia.com/ecc-dbe``, NoSchedule: rising volatile double-bit ECC count;
* ``gpu.nvidia.com/retired-pages-pending`` and ``gpu.nvidia.com/row-remap-failure``, NoSchedule: memory
  that needs a reset or failed remapping;
* ``gpu.nvidia.com/fabric-unhealthy``, NoSchedule: the GPU's NVLink fabric is faulty (``nvmlDeviceGetGpuFabricInfoV``),
  value ``unhealthy`` (health summary UNHEALTHY, NVIDIA's #626) or ``registration-failed`` (registration completed
  with an error status); a GPU whose registration is still in progress is not tainted.

NVIDIA's driver keeps informational Xids on ``gpu.nvidia.com/xid`` too, where a later one overwrites a
fatal taint; here they have their own key. The device's health (health stream, message) follows its most
severe taint.

Unlike NVIDIA's driver, taints are removed again, each class on its own clock: a fault class clears when NVML
shows recovery (the GPU answers and reports no pending retirement or remap failure) and no new fault of that
class arrived during the quiet period; an informational class clears once it has been quiet that long.
Pure logic: the caller supplies the time (seconds, any monotonic clock).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from dradriver.domain.devices import GpuDevice, MigDevice, NodeInventory
from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.migplacements import MigPlacement, instance_ids, published_devices

DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
"""Xids NVIDIA's driver treats as application errors (no NoSchedule taint)."""

NO_MIG_SCOPE = 0xFFFFFFFF
"""GPU-instance / compute-instance ID of an event that is not scoped to a MIG device (nvml.h)."""

TAINT_DOMAIN = GPU_DRIVER.taint_domain
"""The GPU plugin's taint-key domain (its :class:`~dradriver.domain.identity.DriverIdentity`)."""

INFORMATIONAL_KINDS = frozenset({"unmonitored"})
"""Fault kinds (``FaultKind`` values) that only ever produce an effect-``None`` taint."""

GPU_RESET_XIDS: frozenset[int] = frozenset({48, 64, 74, 79, 95, 119, 120, 140})

RESET_RECOVERY_ACTIONS: frozenset[int] = frozenset({1, 2, 4})
"""``nvmlGpuRecoveryAction_t`` values that reset the GPU (or more): GPU_RESET 1, NODE_REBOOT 2, DRAIN_AND_RESET 4
(nvml.h); NONE 0 and DRAIN_P2P 3 leave the GPU's other MIG devices running."""
"""Xids whose recovery action is a GPU reset (NVIDIA's Xid catalogue, immediate action ``RESET_GPU``:
double-bit ECC 48, row-remap/page-retirement failure 64, NVLink 74, fallen off the bus 79, uncontained ECC
95, GSP RPC timeout 119 and GSP error 120, unrecovered ECC 140): GPU-wide even when MIG scoped."""

XID_INFORMATIONAL = "xid-informational"
"""Name part of the informational-Xid taint key (``gpu.nvidia.com/xid-informational``)."""

PERSISTENT_KINDS = frozenset({"unmonitored"})
"""Fault kinds whose taint stays until :meth:`HealthTracker.clear` removes it (no recovery by quiet period)."""


class FaultKind(str, Enum):
    """What went wrong; the value is the taint key's name part (``gpu.nvidia.com/<value>``)."""

    XID = "xid"
    DOUBLE_BIT_ECC = "ecc-dbe"
    GPU_LOST = "gpu-lost"
    RETIRED_PAGES_PENDING = "retired-pages-pending"
    ROW_REMAP_FAILURE = "row-remap-failure"
    FABRIC_UNHEALTHY = "fabric-unhealthy"
    UNMONITORED = "unmonitored"
    """NVML events cannot be registered for the GPU (informational, reference 6.1)."""


class Effect(str, Enum):
    """DRA device taint effects (``resource.k8s.io/v1`` DeviceTaint.effect)."""

    NONE = "None"
    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """One fault observed through NVML.

    :param gpu_uuid: the physical GPU the event came from.
    :param time: when it was observed, seconds on the caller's clock.
    :param xid: the Xid for ``FaultKind.XID``.
    :param gi_id: GPU instance ID, or ``None``/``NO_MIG_SCOPE`` when the event is not MIG scoped.
    :param ci_id: compute instance ID, likewise.
    :param recovery_action: for an Xid, the GPU's ``nvmlGpuRecoveryAction_t`` read with it (NVML field
        ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and
        reset), or ``None`` when NVML could not say (then :data:`GPU_RESET_XIDS` decides).
    """

    gpu_uuid: str
    kind: FaultKind
    time: float
    xid: int | None = None
    gi_id: int | None = None
    ci_id: int | None = None
    detail: str = ""
    recovery_action: int | None = None
    value: str = ""
    """The taint's value for a fault other than an Xid (e.g. ``registration-failed`` for ``fabric-unhealthy``)."""

    @property
    def mig_scoped(self) -> bool:
        """True when the event names a GPU instance and compute instance."""
        return self.gi_id not in (None, NO_MIG_SCOPE) and self.ci_id not in (None, NO_MIG_SCOPE)


@dataclass(frozen=True, slots=True)
class DeviceTaint:
    """A ``resource.k8s.io/v1`` DeviceTaint (``timeAdded`` is left to the API server)."""

    key: str
    value: str
    effect: Effect

    def to_api(self) -> dict[str, str]:
        """The taint as it appears in ``spec.devices[].taints[]``."""
        out = {"key": self.key, "effect": self.effect.value}
        if self.value:
            out["value"] = self.value
        return out


@dataclass(frozen=True, slots=True)
class DeviceHealthReport:
    """One device's health as the DRA health stream carries it (``v1alpha1.DeviceHealth``,
    KEP-4680, ``pkg/apis/dra-health/v1alpha1/api.proto`` in kubernetes/kubelet): what the plugin sends and what the
    kubelet reads.

    :param health: ``"Healthy"``, ``"Unhealthy"`` or ``"Unknown"`` (the kubelet's words).
    :param last_updated: Unix seconds when the plugin determined it.
    :param timeout_seconds: ``health_check_timeout_seconds``; 0 means the kubelet default (30 s).
    :param message: why, for people (at most 1024 characters reach the pod status).
    """

    pool_name: str
    device_name: str
    health: str
    last_updated: int
    timeout_seconds: int
    message: str


@dataclass(slots=True)
class DeviceHealth:
    """Health of one published device.

    :param last_fault: time of the newest fault (caller's clock), 0 when none.
    :param recovered: NVML has shown recovery since the last fault.
    """

    name: str
    taints: dict[str, DeviceTaint] = field(default_factory=dict)
    message: str = ""
    last_fault: float = 0.0
    last_change: float = 0.0
    recovered: bool = True
    last_event: float = 0.0
    """Time of the newest recorded event of any effect."""
    since: dict[str, float] = field(default_factory=dict)
    """Taint key -> time of the newest event of that class (its quiet period runs from it)."""
    messages: dict[str, str] = field(default_factory=dict)
    """Taint key -> description of the event behind that taint."""

    def worst(self) -> DeviceTaint | None:
        """The most severe taint (newest among equals), or ``None``."""
        if not self.taints:
            return None
        return max(self.taints.values(), key=lambda t: (severity(t), self.since.get(t.key, 0.0)))

    def refresh_message(self) -> None:
        """``message`` follows the most severe taint."""
        worst = self.worst()
        if worst is not None:
            self.message = self.messages.get(worst.key, self.message)

    @property
    def healthy(self) -> bool:
        """No taint with an effect other than ``None``."""
        return all(t.effect is Effect.NONE for t in self.taints.values())


_EFFECT_RANK = {Effect.NONE: 0, Effect.NO_SCHEDULE: 1, Effect.NO_EXECUTE: 2}


def severity(taint: DeviceTaint, reset_xids: Iterable[int] = GPU_RESET_XIDS) -> tuple[int, int]:
    """Order of taints: effect first, then a GPU-reset Xid above any other Xid of the same effect."""
    reset = taint.key.rsplit("/", 1)[-1] == FaultKind.XID.value and taint.value.isdigit() and (
        int(taint.value) in set(reset_xids)
    )
    return _EFFECT_RANK[taint.effect], int(reset)


def classify(event: HealthEvent, ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS, *,
             taint_domain: str = TAINT_DOMAIN) -> DeviceTaint:
    """The taint an event produces: informational Xids get effect ``None`` on their own key
    (``<domain>/xid-informational``), every other fault NoSchedule on its class's key.

    :param taint_domain: the plugin's taint-key domain (keys ``<domain>/xid``, ``<domain>/gpu-lost``, ...).
    """
    key = f"{taint_domain}/{event.kind.value}"
    if event.kind is FaultKind.XID:
        xid = event.xid if event.xid is not None else 0
        if xid in set(ignored_xids):
            return DeviceTaint(f"{taint_domain}/{XID_INFORMATIONAL}", str(xid), Effect.NONE)
        return DeviceTaint(key, str(xid), Effect.NO_SCHEDULE)
    if event.kind.value in INFORMATIONAL_KINDS:
        return DeviceTaint(key, event.value, Effect.NONE)
    return DeviceTaint(key, event.value, Effect.NO_SCHEDULE)


def describe(event: HealthEvent) -> str:
    """One line for humans (the kubelet health stream's message, logs)."""
    what = {
        FaultKind.XID: f"Xid {event.xid}",
        FaultKind.DOUBLE_BIT_ECC: "double-bit ECC error",
        FaultKind.GPU_LOST: "GPU is lost (fell off the bus)",
        FaultKind.RETIRED_PAGES_PENDING: "pages pending retirement (reset needed)",
        FaultKind.ROW_REMAP_FAILURE: "row remapping failed",
        FaultKind.FABRIC_UNHEALTHY: "NVLink fabric fault",
        FaultKind.UNMONITORED: "health events cannot be monitored",
    }[event.kind]
    scope = f" on GPU instance {event.gi_id} compute instance {event.ci_id}" if event.mig_scoped else ""
    detail = f": {event.detail}" if event.detail else ""
    return f"{what}{scope} of {event.gpu_uuid}{detail}"


class HealthTracker:
    """Keeps every published device's health and answers which devices changed.

    :param inventory: the node's devices (names are the published device names).
    :param ignored_xids: Xids that only produce an informational taint.
    :param quiet_period_s: seconds without a new fault, after NVML shows recovery, before taints go.
    :param informational_taints: publish effect-``None`` taints (Kubernetes >= 1.35); when false, an
        informational Xid changes nothing.
    :param reset_xids: Xids that need a GPU reset: GPU-wide even when the event is MIG scoped.
    """

    def __init__(
        self,
        inventory: NodeInventory,
        *,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        quiet_period_s: float = 60.0,
        informational_taints: bool = True,
        taint_domain: str = TAINT_DOMAIN,
        reset_xids: Iterable[int] = GPU_RESET_XIDS,
    ) -> None:
        self.ignored_xids = frozenset(ignored_xids)
        self.reset_xids = frozenset(reset_xids)
        self.quiet_period_s = quiet_period_s
        self.informational_taints = informational_taints
        self.taint_domain = taint_domain
        self._devices: dict[str, DeviceHealth] = {}
        self._by_gpu: dict[str, list[GpuDevice | MigDevice | MigPlacement]] = {}
        self._instance_of: dict[str, tuple[int, int]] = {}
        self.replace_inventory(inventory)

    def replace_inventory(self, inventory: NodeInventory) -> None:
        """Track the devices of ``inventory``: known names keep their health, new ones start healthy, gone
        ones are forgotten (the device registry replaced the snapshot)."""
        devices: dict[str, DeviceHealth] = {}
        by_gpu: dict[str, list[GpuDevice | MigDevice | MigPlacement]] = {}
        for dev in published_devices(inventory):
            devices[dev.name] = self._devices.get(dev.name) or DeviceHealth(dev.name)
            gpu_uuid = dev.uuid if isinstance(dev, GpuDevice) else dev.parent.uuid
            by_gpu.setdefault(gpu_uuid, []).append(dev)
        self._devices, self._by_gpu = devices, by_gpu
        # dynamic MIG: a placement's GI/CI ids are those of the instance created on it (none: no MIG event)
        self._instance_of = {name: (gi, ci) for name, (_, gi, ci, _) in instance_ids(inventory).items()}

    def needs_gpu_reset(self, event: HealthEvent) -> bool:
        """A fatal Xid whose recovery action is a GPU reset (it ends every MIG device of the GPU): the recovery
        action NVML reported with the event (GPU reset, node reboot, drain and reset), else :data:`GPU_RESET_XIDS`."""
        if event.kind is not FaultKind.XID or event.xid in self.ignored_xids:
            return False
        if event.recovery_action is not None:
            return event.recovery_action in RESET_RECOVERY_ACTIONS
        return event.xid in self.reset_xids

    def devices_for(self, event: HealthEvent) -> list[str]:
        """Names of the published devices an event affects (empty for an unknown GPU): the MIG device of a
        MIG-scoped event, else (unscoped, or a GPU-reset Xid) every device of the GPU."""
        devices = self._by_gpu.get(event.gpu_uuid, [])
        if event.mig_scoped and not self.needs_gpu_reset(event):
            return [
                d.name
                for d in devices
                if (isinstance(d, MigDevice) and d.gi_id == event.gi_id and d.ci_id == event.ci_id)
                or (isinstance(d, MigPlacement) and self._instance_of.get(d.name) == (event.gi_id, event.ci_id))
            ]
        return [d.name for d in devices]

    def record(self, event: HealthEvent) -> set[str]:
        """Apply one fault; returns the names of devices whose taints or health changed."""
        taint = classify(event, self.ignored_xids, taint_domain=self.taint_domain)
        if taint.effect is Effect.NONE and not self.informational_taints:
            return set()
        changed: set[str] = set()
        for name in self.devices_for(event):
            state = self._devices[name]
            if taint.effect is not Effect.NONE:
                state.last_fault = event.time
                state.recovered = False
            state.last_event = max(state.last_event, event.time)
            state.since[taint.key] = max(state.since.get(taint.key, 0.0), event.time)
            current = state.taints.get(taint.key)
            if current == taint:
                continue
            if current is not None and severity(current, self.reset_xids) > severity(taint, self.reset_xids):
                continue  # the class keeps its more severe taint (the event still restarts its quiet period)
            state.taints[taint.key] = taint
            state.messages[taint.key] = describe(event)
            state.refresh_message()
            state.last_change = event.time
            changed.add(name)
        return changed

    def observe_recovery(self, gpu_uuid: str, now: float, *, observed_at: float | None = None) -> set[str]:
        """NVML shows the GPU healthy again; devices clear once the quiet period has passed.

        :param observed_at: when NVML was read (same clock); a device whose last fault is newer than that
            reading is not marked recovered (the reading predates the fault). ``None``: ``now``.
        """
        seen = now if observed_at is None else observed_at
        for dev in self._by_gpu.get(gpu_uuid, []):
            state = self._devices[dev.name]
            if state.last_fault <= seen:
                state.recovered = True
        return self.tick(now)

    def clear(self, gpu_uuid: str, kind: FaultKind, now: float) -> set[str]:
        """Remove the ``kind`` taint from every device of a GPU at once (e.g. monitoring works again)."""
        key = f"{self.taint_domain}/{kind.value}"
        changed: set[str] = set()
        for dev in self._by_gpu.get(gpu_uuid, []):
            state = self._devices[dev.name]
            if state.taints.pop(key, None) is not None:
                state.since.pop(key, None)
                state.messages.pop(key, None)
                state.message = "" if not state.taints else state.message
                state.refresh_message()
                state.last_change = now
                changed.add(dev.name)
        return changed

    def tick(self, now: float) -> set[str]:
        """Clear taint classes whose quiet period is over (fault classes only once NVML showed recovery);
        returns the changed names."""
        changed: set[str] = set()
        for state in self._devices.values():
            clearable = [
                key
                for key, taint in state.taints.items()
                if key.rsplit("/", 1)[-1] not in PERSISTENT_KINDS
                and (state.recovered or taint.effect is Effect.NONE)
                and now - state.since.get(key, max(state.last_fault, state.last_event)) >= self.quiet_period_s
            ]
            if clearable:
                for key in clearable:
                    del state.taints[key]
                    state.since.pop(key, None)
                    state.messages.pop(key, None)
                state.message = "recovered"
                state.refresh_message()
                state.last_change = now
                changed.add(state.name)
        return changed

    def taints(self) -> dict[str, list[dict[str, str]]]:
        """``{device name: [taint, ...]}`` for devices with taints, ready for the ResourceSlice builder."""
        return {
            name: [t.to_api() for t in sorted(s.taints.values(), key=lambda t: t.key)]
            for name, s in self._devices.items()
            if s.taints
        }

    def states(self) -> Mapping[str, DeviceHealth]:
        """Every device's health, by device name."""
        return self._devices
