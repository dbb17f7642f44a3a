"""Claims as the kubelet plugin sees them: references, allocation results, and what preparing returns.

Field names follow ``resource.k8s.io/v1`` (``ResourceClaim.status.allocation.devices.results[]``) and the
DRA node API (``NodePrepareResourcesResponse.claims[uid].devices[]``); reference
``kubelet-dra-protocol.md`` sections 2.1 and 5.3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dradriver.errors import DradriverError


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """The claim identity the kubelet sends: ``Claim{namespace, uid, name}``."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


@dataclass(frozen=True, slots=True)
class AllocationResult:
    """One entry of ``status.allocation.devices.results[]``.

    :param request: request name, ``"<request>"`` or ``"<request>/<subrequest>"``.
    :param admin_access: ``adminAccess``; admin-access results may share a device with another claim.
    """

    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim, as returned to the kubelet (DRA ``Device`` message).

    :param request_names: requests this device serves, with any ``/<subrequest>`` suffix removed.
    :param cdi_device_ids: fully-qualified CDI device names, e.g. ``k8s.gpu.nvidia.com/claim=<uid>-gpu-0``.
    """

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """Outcome of preparing one claim: devices, or an error string naming the claim and the cause."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""

    @property
    def ok(self) -> bool:
        """True when the claim was prepared."""
        return not self.error


@dataclass(frozen=True, slots=True)
class Claim:
    """A claim fetched from the API server, reduced to what node preparation needs.

    :param results: only the allocation results whose driver is ours and whose pool is this node.
    :param configs: opaque device configs for our driver (``status.allocation.devices.config[]``), raw.
    """

    ref: ClaimRef
    results: tuple[AllocationResult, ...]
    configs: tuple[dict[str, object], ...] = field(default_factory=tuple)


class ClaimError(DradriverError):
    """A claim cannot be prepared; the message names the claim and the field at fault."""

    def __init__(self, ref: ClaimRef | str, cause: str) -> None:
        super().__init__(f"claim {ref}: {cause}")
        self.ref = ref
        self.cause = cause


def base_request_name(request: str) -> str:
    """Strip a ``/<subrequest>`` suffix: containers reference the parent request (``firstAvailable``)."""
    return request.split("/", 1)[0]
