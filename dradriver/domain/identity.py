"""Who a kubelet plugin is: driver name, CDI kind, taint-key domain, API user agent and state file.

Every name that differs between dradriver's kubelet plugins (``gpu.nvidia.com`` now, ``compute-domain.nvidia.com``
next) is derived from one :class:`DriverIdentity`, so two plugins can run side by side, in one process in tests,
without sharing a file, a socket or a lock. Facts: the CDI kind and transient spec-file name follow
``cdi.md`` 2.5 (``<vendor>/<class>``, ``<vendor>-<class>_<name>.yaml``, NVIDIA's suffix); NVIDIA's GPU plugin uses
vendor ``k8s.gpu.nvidia.com`` and class ``claim`` (``nvidia-dra-driver.md`` 5.1); taint keys are
``<driver domain>/<name>`` (``kubelet-dra-protocol.md`` on DeviceTaint).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dradriver.domain.cdi import UID_PATTERN, check_claim_uid

__all__ = ["COMPUTE_DOMAIN_DRIVER", "GPU_DRIVER", "LEGACY_SPEC_SUFFIX", "SPEC_SUFFIX", "CdiKind", "DriverIdentity"]

SPEC_SUFFIX = ".yaml"
"""Suffix of a claim spec file: NVIDIA's (``nvidia-dra-driver.md`` 5.1), so either driver's unprepare removes it."""
LEGACY_SPEC_SUFFIX = ".json"
"""Suffix dradriver's claim specs had before 2026-12: still recognised, removed on write and delete."""

@dataclass(frozen=True, slots=True)
class CdiKind:
    """A CDI kind ``<vendor>/<class>`` and the names derived from it (``cdi.md`` 2.5).

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


@dataclass(frozen=True, slots=True)
class DriverIdentity:
    """The names one kubelet plugin is known by.

    :param driver_name: the DRA driver name: ``spec.driver`` of its ResourceSlices and allocation results,
        the registration ``PluginInfo.name``, the plugin directory ``<kubelet plugins dir>/<driver_name>``.
    :param cdi: the CDI kind of its per-claim specs.
    :param taint_domain: domain of its device-taint keys (``<domain>/xid``).
    :param user_agent: HTTP ``User-Agent`` towards the API server.
    :param state_file: file name of the claim state inside the plugin directory.
    :param event_component: ``source.component`` / ``reportingComponent`` of its Events.
    """

    driver_name: str
    cdi: CdiKind
    taint_domain: str
    user_agent: str
    state_file: str = "claims.state"
    event_component: str = ""

    @property
    def component(self) -> str:
        """The Event component: :attr:`event_component`, or ``<driver>-kubelet-plugin``."""
        return self.event_component or f"{self.driver_name}-kubelet-plugin"

    def taint_key(self, name: str) -> str:
        """A device-taint key ``<taint domain>/<name>``."""
        return f"{self.taint_domain}/{name}"


GPU_DRIVER = DriverIdentity(
    driver_name="gpu.nvidia.com",
    cdi=CdiKind(vendor="k8s.gpu.nvidia.com", cls="claim"),
    taint_domain="gpu.nvidia.com",
    user_agent="dradriver/gpu.nvidia.com",
)
"""NVIDIA's GPU kubelet plugin, whose user-facing names dradriver keeps (``nvidia-dra-driver.md`` 1.1, 5.1)."""

COMPUTE_DOMAIN_DRIVER = DriverIdentity(
    driver_name="compute-domain.nvidia.com",
    cdi=CdiKind(vendor="k8s.compute-domain.nvidia.com", cls="claim"),
    taint_domain="compute-domain.nvidia.com",
    user_agent="dradriver/compute-domain.nvidia.com",
)
"""NVIDIA's compute-domain kubelet plugin (``nvidia-dra-driver.md`` 1.2, 2.7, 5.2): IMEX channels and daemons."""
