"""Who a kubelet plugin is: driver name, CDI kind, taint-key domain, API user agent and state file.

Every name that differs between dradriver's kubelet plugins (``gpu.nvidia.com`` now, ``compute-domain.nvidia.com``
next) is derived from one :class:`DriverIdentity`, so two plugins can run side by side, in one process in tests,
without sharing a file, a socket or a lock. Facts: the CDI kind and transient spec-file name follow
the CDI ``SPEC.md`` (``<vendor>/<class>``, ``<vendor>-<class>_<name>.yaml``, NVIDIA's suffix); NVIDIA's GPU plugin uses
vendor ``k8s.gpu.nvidia.com`` and class ``claim`` (NVIDIA's ``cmd/gpu-kubelet-plugin/cdi.go``); taint keys are
``<driver domain>/<name>`` (``DeviceTaint`` in kubernetes/api ``resource/v1/types.go``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dradriver.domain.cdi import CdiKind

__all__ = ["COMPUTE_DOMAIN_DRIVER", "GPU_DRIVER", "DriverIdentity"]

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
"""NVIDIA's GPU kubelet plugin, whose user-facing names dradriver keeps (NVIDIA's ``cmd/gpu-kubelet-plugin/main.go``,
``cdi.go``)."""

COMPUTE_DOMAIN_DRIVER = DriverIdentity(
    driver_name="compute-domain.nvidia.com",
    cdi=CdiKind(vendor="k8s.compute-domain.nvidia.com", cls="claim"),
    taint_domain="compute-domain.nvidia.com",
    user_agent="dradriver/compute-domain.nvidia.com",
)
"""NVIDIA's compute-domain kubelet plugin (NVIDIA's
``cmd/compute-domain-kubelet-plugin/main.go``, ``deviceinfo.go``, ``cdi.go``): IMEX channels and daemons."""
