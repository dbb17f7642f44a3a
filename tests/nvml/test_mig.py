"""The NVML boundary for dynamic MIG (``dradriver/nvml/mig.py``) against the C mock: MIG mode, instances by
placement, create/destroy, idempotence, pending mode changes."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dradriver.domain.migplacements import MigPlacement
from dradriver.nvml import discovery, mock
from dradriver.nvml.errors import NvmlInsufficientResources, NvmlInUse
from dradriver.nvml.mig import MigControl, MigModeError
from dradriver.nvml.session import NvmlSession


@pytest.fixture
def mig_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(mock.STATE_ENV, str(tmp_path / "state"))
    monkeypatch.setenv(mock.PROC_ROOT_ENV, str(tmp_path / "proc"))
    yield tmp_path


def _control(command: str) -> None:
    lib = ctypes.CDLL(str(mock.library_path()), mode=ctypes.RTLD_GLOBAL)
    lib.mocknvml_control.argtypes = [ctypes.c_char_p]
    assert lib.mocknvml_control(command.encode()) == 0


def _placement(session: NvmlSession, gpu_index: int, name: str) -> MigPlacement:
    inventory = discovery.discover(session, dynamic_mig=True)
    return next(p for p in inventory.placements if p.parent.index == gpu_index and p.name == name)


def test_create_find_destroy_on_hopper(nvml: Callable[[str], NvmlSession], mig_env: Path) -> None:
    session = nvml("dgx-h200")
    control = MigControl(session)
    one = _placement(session, 0, "gpu-0-mig-1g18gb-19-5")
    gpu = one.parent
    assert control.ensure_mig_enabled(gpu.uuid) is True
    assert control.ensure_mig_enabled(gpu.uuid) is False  # already on
    gi = control.create_gpu_instance(one)
    [bare] = control.instances(gpu)
    assert (bare.gi_id, bare.ci_id, bare.placement_start, bare.mig_uuid) == (gi, None, 5, "")
    ci, uuid = control.create_compute_instance(one, gi)
    assert control.create_compute_instance(one, gi) == (ci, uuid)  # an existing CI is returned, not a second one
    [inst] = control.instances(gpu)
    assert (inst.ci_id, inst.mig_uuid, inst.processes) == (ci, uuid, 0)
    assert [i.gi_id for i in control.find_gpu_instance(gpu, 4, 4)] == [gi]  # overlaps 4..7
    assert control.find_gpu_instance(gpu, 0, 4) == []
    with pytest.raises(NvmlInsufficientResources):
        control.create_gpu_instance(one)  # occupied
    _control(f"procs {gpu.index} {gi} {ci} 1")
    assert control.instances(gpu)[0].processes == 1 and control.gpu_processes(gpu) == 1
    with pytest.raises(NvmlInUse):
        control.destroy(gpu, gi, ci)
    _control(f"procs {gpu.index} {gi} {ci} 0")
    assert control.destroy(gpu, gi, ci) is True
    assert control.destroy(gpu, gi, ci) is False  # idempotent
    assert control.disable_mig_if_unused(gpu) is True
    assert control.mig_mode(gpu.uuid) == (0, 0)
    assert control.destroy(gpu, gi) is False  # MIG mode off: nothing to destroy


def test_ampere_stays_in_mig_mode_and_cannot_enter_it(nvml: Callable[[str], NvmlSession], mig_env: Path) -> None:
    session = nvml("dgx-a100")
    control = MigControl(session)
    inventory = discovery.discover(session, dynamic_mig=True)
    on = next(g for g in inventory.gpus if g.mig_enabled)
    off = next(g for g in inventory.gpus if not g.mig_enabled)
    assert {p.parent.uuid for p in inventory.placements} == {g.uuid for g in inventory.gpus if g.mig_enabled}
    for inst in control.instances(on):  # the profile's static instances
        control.destroy(on, inst.gi_id)
    assert control.disable_mig_if_unused(on) is False and control.mig_mode(on.uuid) == (1, 1)
    with pytest.raises(MigModeError, match="pending 1: the change needs the GPU idle or reset"):
        control.ensure_mig_enabled(off.uuid)
    assert control.mig_mode(off.uuid) == (0, 0)  # the pending change was withdrawn
