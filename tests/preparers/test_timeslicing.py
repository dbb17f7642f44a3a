"""The time-slicing step's undo edge cases against the mock NVML and the sandbox's ``nvidia-smi``: records of an
older release, GPUs that fell off the bus, unknown record versions."""

from __future__ import annotations

from collections.abc import Iterator

import pynvml
import pytest

from dradriver.domain.claims import ClaimRef
from dradriver.domain.ports import SharingStep, UndoRecord
from dradriver.errors import DradriverError
from dradriver.host.nvidiasmi import find_nvidia_smi
from dradriver.nvml import settings
from dradriver.nvml.session import NvmlSession, open_session
from dradriver.preparers.sharing import TimeSlicing
from dradriver.sandbox.node import SandboxNode

REF = ClaimRef("team-a", "train", "5d0f3c1e-0000-4000-8000-000000000001")


@pytest.fixture
def step() -> Iterator[tuple[SandboxNode, NvmlSession, TimeSlicing]]:
    with SandboxNode(profile="dgx-h100") as node:
        session = open_session(mock_profile=node.profile)
        try:
            yield node, session, TimeSlicing(session, lambda: find_nvidia_smi(node.driver_root))
        finally:
            session.close()


def _uuid(session: NvmlSession, index: int) -> str:
    value = pynvml.nvmlDeviceGetUUID(session.device(index))
    return value.decode() if isinstance(value, bytes) else value


def test_step_satisfies_the_port(step: tuple[SandboxNode, NvmlSession, TimeSlicing]) -> None:
    assert isinstance(step[2], SharingStep)


def test_older_mig_record_is_a_no_op(step: tuple[SandboxNode, NvmlSession, TimeSlicing]) -> None:
    node, _, ts = step
    ts.undo(REF, UndoRecord("mig-timeslicing", 1, "gpu-0-mig-1g.10gb-19-0", {}))
    assert node.nvml_control.read_text() == ""


def test_lost_gpu_counts_as_reset_and_others_are_still_reset(
        step: tuple[SandboxNode, NvmlSession, TimeSlicing]) -> None:
    node, session, ts = step
    lost, kept = _uuid(session, 1), _uuid(session, 2)
    tool = find_nvidia_smi(node.driver_root)
    for uuid in (lost, kept):
        tool.set_timeslice(uuid, 2)
    settings.set_compute_mode(session, kept, settings.ComputeMode.DEFAULT)
    with node.nvml_control.open("a") as control:
        control.write("lost 1 1\n")
    record = UndoRecord("timeslicing", 1, "gpu-1,gpu-2", {
        "gpus": [{"uuid": lost, "computeMode": 0, "timesliceSet": True},
                 {"uuid": kept, "computeMode": 3, "timesliceSet": True}], "timeslice": 2})
    ts.undo(REF, record)
    assert settings.compute_timeslice(session, kept) == 0
    assert settings.compute_mode(session, kept) is settings.ComputeMode.EXCLUSIVE_PROCESS
    ts.undo(REF, record)  # idempotent


def test_unknown_record_version_is_refused(step: tuple[SandboxNode, NvmlSession, TimeSlicing]) -> None:
    _, _, ts = step
    with pytest.raises(DradriverError, match="version 9"):
        ts.undo(REF, UndoRecord("timeslicing", 9, "gpu-0", {"gpus": []}))
