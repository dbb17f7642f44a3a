"""``dradriver.preparers.fabricpartition``: the partition step against the FM stand-in over the mock libnvfm."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dradriver.domain.claims import ClaimError, ClaimRef
from dradriver.domain.ports import UndoRecord
from dradriver.host.fabricmanager import FabricManagerClient, FabricManagerError
from dradriver.preparers.fabricpartition import FabricPartitionStep
from dradriver.sandbox.standins.nv_fabricmanager import FabricManager
from tests.factories import gpu_device, mig_device

A = ClaimRef("ns", "a", "uid-a")
B = ClaimRef("ns", "b", "uid-b")


def gpus(*modules: int) -> list[object]:
    return [gpu_device(m - 1, module_id=m) for m in modules]


class Records:
    """What the batch runner's ``stored_records`` answers: other prepared claims' records of a kind."""

    def __init__(self) -> None:
        self.by_uid: dict[str, list[UndoRecord]] = {}

    def __call__(self, kind: str, exclude_uid: str) -> Sequence[tuple[str, UndoRecord]]:
        return [(uid, r) for uid, rs in self.by_uid.items() if uid != exclude_uid for r in rs if r.kind == kind]


@pytest.fixture
def step(client: FabricManagerClient) -> tuple[FabricPartitionStep, Records]:
    made, records = FabricPartitionStep(client), Records()
    made.bind_records(records)
    return made, records


def test_apply_activates_the_matching_partition_and_undo_deactivates(step: tuple[FabricPartitionStep, Records],
                                                                     fm: FabricManager) -> None:
    s, _ = step
    record = s.apply(A, gpus(5, 7))
    assert (record.kind, record.target) == ("fm-partition", "gpu-4,gpu-6")
    assert dict(record.data) == {"partitionId": 5, "moduleIds": [5, 7], "wasActive": False}
    assert fm.active == {5}
    s.undo(A, record)
    assert fm.active == set()
    s.undo(A, record)  # idempotent: inactive already


def test_an_active_partition_is_taken_as_is(step: tuple[FabricPartitionStep, Records], fm: FabricManager) -> None:
    s, _ = step
    fm.active.add(1)
    record = s.apply(A, gpus(1, 2, 3, 4))
    assert record.data["wasActive"] is True and record.data["partitionId"] == 1
    assert [c for c in fm.calls if c.startswith("ACTIVATE")] == []


def test_gpus_forming_no_partition_fail_naming_nearest_and_change_nothing(
        step: tuple[FabricPartitionStep, Records], fm: FabricManager) -> None:
    s, _ = step
    with pytest.raises(ClaimError, match=r"claim ns/a \(uid uid-a\): .*module IDs \{1, 2\}.*smallest partitions "
                                         r"containing them: 1 \{1, 2, 3, 4\}"):
        s.apply(A, gpus(1, 2))
    assert fm.active == set()
    assert not s.applies([mig_device(gpu_device(0, mig=True))])
    assert s.applies(gpus(1))


def test_a_partition_sharing_gpus_with_an_active_one_is_in_use(step: tuple[FabricPartitionStep, Records],
                                                               fm: FabricManager) -> None:
    s, _ = step
    s.apply(A, gpus(1, 2, 3, 4))
    with pytest.raises(ClaimError, match=r"claim ns/b .*GPUs gpu-0,gpu-2 .*activate of partition 3 failed: "
                                         r"FM_ST_IN_USE"):
        s.apply(B, gpus(1, 3))
    assert fm.active == {1}


def test_gpus_not_ready_fail_with_fms_error(step: tuple[FabricPartitionStep, Records], fm: FabricManager) -> None:
    s, _ = step
    fm.set_gpu_ready(8, False)
    with pytest.raises(ClaimError, match="activate of partition 14 failed: FM_ST_GENERIC_ERROR"):
        s.apply(A, gpus(8))


def test_fm_down_fails_the_claim_and_the_undo_is_retried(step: tuple[FabricPartitionStep, Records],
                                                         fm: FabricManager) -> None:
    s, _ = step
    record = s.apply(A, gpus(2, 4))
    fm.stop()
    with pytest.raises(ClaimError, match="FM_ST_CONNECTION_NOT_VALID"):
        s.apply(B, gpus(6))
    with pytest.raises(FabricManagerError, match="FM_ST_CONNECTION_NOT_VALID"):
        s.undo(A, record)
    fm.start()
    s.undo(A, record)
    assert fm.active == set()


def test_undo_keeps_the_partition_while_another_claim_holds_its_gpus(step: tuple[FabricPartitionStep, Records],
                                                                     fm: FabricManager) -> None:
    s, records = step
    ra = s.apply(A, gpus(6, 8))
    rb = s.apply(B, gpus(6, 8))  # a second claim on the same GPUs (shared): active already
    records.by_uid = {A.uid: [ra], B.uid: [rb]}
    s.undo(A, ra)
    assert fm.active == {6}
    records.by_uid = {B.uid: [rb]}
    s.undo(B, rb)
    assert fm.active == set()


def test_sweep_after_a_crash_deactivates_only_partitions_no_record_holds(
        step: tuple[FabricPartitionStep, Records], fm: FabricManager, client: FabricManagerClient) -> None:
    s, _ = step
    kept = s.apply(A, gpus(1, 3))
    s.apply(B, gpus(5, 6, 7, 8))  # "crash": activated, record never stored
    assert fm.active == {3, 2}
    fresh = FabricPartitionStep(client)  # the restarted plugin
    assert fresh.sweep([kept]) == ["partition 2 [5, 6, 7, 8]"]
    assert fm.active == {3}
    assert fresh.sweep([kept]) == []
    fm.stop()
    assert fresh.sweep([kept]) == []  # FM down at start: nothing swept, no failure
