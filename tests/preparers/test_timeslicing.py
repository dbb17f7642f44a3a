"""The time-slicing step's undo edge cases against the mock NVML and the sandbox's ``nvidia-smi``: records of an
older release, GPUs that fell off the bus, records of a newer release."""

from __future__ import annotations

from collections.abc import Iterator

import pynvml
import pytest

from dradriver.domain.claims import ClaimRef
from dradriver.domain.ports import SharingStep, UndoRecord, UndoRecordFactError, UndoRecordTooNew
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


def test_a_newer_layout_with_more_facts_is_undone_from_the_facts_it_knows(
        step: tuple[SandboxNode, NvmlSession, TimeSlicing]) -> None:
    node, session, ts = step
    uuid = _uuid(session, 0)
    find_nvidia_smi(node.driver_root).set_timeslice(uuid, 2)
    record = UndoRecord.from_json({"kind": "timeslicing", "v": 9, "target": "gpu-0", "unknownKey": True, "data": {
        "gpus": [{"uuid": uuid, "computeMode": 0, "timesliceSet": True, "newFact": "x"}], "timeslice": 2,
        "anotherNewFact": [1, 2]}})
    ts.undo(REF, record)
    assert settings.compute_timeslice(session, uuid) == 0


def test_a_record_without_a_fact_its_undo_needs_is_a_clear_error(
        step: tuple[SandboxNode, NvmlSession, TimeSlicing]) -> None:
    _, _, ts = step
    with pytest.raises(UndoRecordFactError, match="lacks the fact 'uuid' its undo needs"):
        ts.undo(REF, UndoRecord("timeslicing", 2, "gpu-0", {"gpus": [{"gpuUUID": "GPU-1"}], "timeslice": 2}))


def test_a_record_declaring_a_newer_reader_is_refused_with_what_to_do() -> None:
    record = UndoRecord.from_json({"kind": "timeslicing", "v": 3, "reader": 2, "target": "gpu-0", "data": {}})
    assert record.to_json()["reader"] == 2
    with pytest.raises(UndoRecordTooNew, match=r"needs a reader of layout 2 or newer.*Run that release"):
        record.check_readable()
    record.check_readable(2)
    # what this release writes stays what older releases read: no "reader" key while it is 1
    assert UndoRecord("timeslicing", 1, "gpu-0", {"gpus": []}).to_json() == {
        "kind": "timeslicing", "v": 1, "target": "gpu-0", "data": {"gpus": []}}
