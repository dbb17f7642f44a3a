"""NvmlSession.reinit: NVML enumerates the GPUs the nvidia driver holds at nvmlInit, so a GPU moved to vfio-pci
leaves the count only after a new initialisation, and comes back (same UUID) after the next one once rebound."""

from __future__ import annotations

from dradriver.nvml import session as nvml_session
from dradriver.sandbox.node import SandboxNode

GPU0 = "0000:18:00.0"


def test_reinit_enumerates_the_gpus_on_nvidia_anew() -> None:
    with SandboxNode(profile="dgx-h100", pci_tree=True) as node:
        host = node.pci_host(settle_s=5.0)
        session = nvml_session.open_session(mock_profile="dgx-h100")
        try:
            uuids = {session.call(nvml_session.pynvml.nvmlDeviceGetUUID, session.device(i))
                     for i in range(session.device_count())}
            assert len(uuids) == 8
            host.load_module("vfio-pci")
            host.set_driver_override(GPU0, "vfio-pci")
            host.unbind(GPU0)
            host.bind(GPU0, "vfio-pci")
            assert session.device_count() == 8  # the initialisation's list
            assert session.reinit() and session.device_count() == 7
            host.rebind_nvidia(GPU0)
            assert session.reinit()
            again = {session.call(nvml_session.pynvml.nvmlDeviceGetUUID, session.device(i))
                     for i in range(session.device_count())}
            assert again == uuids
        finally:
            session.close()
