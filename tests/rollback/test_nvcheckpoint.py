"""NVIDIA's checkpoint format (:mod:`dradriver.domain.nvcheckpoint`): byte for byte as NVIDIA's plugin writes it,
checked against the checkpoint NVIDIA's own binary writes (skipped with the reason where it is absent); a damaged
or unknown file is refused with an error that says what is wrong, never guessed at."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import random
from pathlib import Path

import pytest

from dradriver.domain.nvcheckpoint import (
    CD_CLAIM,
    Checkpoint,
    CheckpointEntry,
    CheckpointError,
    CheckpointState,
    ConfigState,
    DeviceGroup,
    KubeletDevice,
    MigConcrete,
    PreparedDevice,
    checksum,
    decode,
    encode,
)
from dradriver.host.nvcheckpointfile import CHECKPOINT_FILE, read_checkpoint, write_checkpoint
from dradriver.sandbox.node import SandboxNode
from tests.rollback.peers import claim, kubelet_for, needs_nvidia, nvidia_process, use_this_boot

UID = "0b9f1c0e-5f1a-4c4e-9d65-1c2f3a4b5c6d"
EMPTY_V1_CHECKSUM = 1083090442
"""NVIDIA's top-level checksum of a checkpoint without completed claims (``"v1": {}``), as its plugin writes it."""


def _entry(device: PreparedDevice, **status: object) -> CheckpointEntry:
    allocation = {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a",
                                           "device": device.device.device_name if device.device else ""}]}}
    return CheckpointEntry(CheckpointState.PREPARE_COMPLETED, {"allocation": allocation, **status},
                           (DeviceGroup((device,)),))


def _gpu(uid: str = UID) -> PreparedDevice:
    return PreparedDevice("gpu", KubeletDevice(("gpu",), "node-a", "gpu-0", (f"k8s.gpu.nvidia.com/claim={uid}-gpu-0",)),
                          uuid="GPU-01000100-0000-0000-0000-000000000000")


def test_checksum_is_fnv32a_of_the_go_spew_rendering_of_the_bytes() -> None:
    assert checksum(b"") == checksum(b"") and checksum(b"{}") != checksum(b"{ }")
    h = 0x811C9DC5
    for byte in b"([]uint8)[123 125]":
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    assert checksum(b"{}") == h
    assert encode(Checkpoint({}, "boot")).startswith(b'{"checksum":%d,"v1":{},"v2":{' % EMPTY_V1_CHECKSUM)


def test_a_checkpoint_reads_back_as_written_with_go_field_order_and_omitempty() -> None:
    mig = PreparedDevice("mig", KubeletDevice(("mig",), "node-a", "gpu-1-mig-1g10gb-0", ("k8s.gpu.nvidia.com/claim=x",),
                                              share_id=None),
                         mig=MigConcrete(1, 7, 0, "MIG-1234", "GPU-5678", "0000:0A:00.0"))
    started = CheckpointEntry(CheckpointState.PREPARE_STARTED, {"allocation": {"devices": {}}}, (),
                              name="c", namespace="ns")
    cp = Checkpoint({UID: _entry(_gpu(), reservedFor=[{"resource": "pods", "name": "p", "uid": "u"}]),
                     "a" + UID[1:]: _entry(mig), "c" + UID[1:]: started}, "boot")
    data = encode(cp)
    assert decode(data) == cp
    top = json.loads(data)
    assert list(top) == ["checksum", "v1", "v2"]
    assert list(top["v2"]) == ["checksum", "preparedClaims", "nodeBootID"]
    assert list(top["v2"]["preparedClaims"]) == sorted(top["v2"]["preparedClaims"])  # Go sorts map keys
    assert "c" + UID[1:] not in top["v1"]["preparedClaims"]  # the V1 view holds completed claims only
    entry = top["v2"]["preparedClaims"][UID]
    assert list(entry) == ["checkpointState", "status", "preparedDevices"]  # empty name/namespace left out
    assert list(entry["status"]) == ["allocation", "reservedFor"]
    assert entry["status"]["reservedFor"] == [{"resource": "pods", "name": "p", "uid": "u"}]  # apiGroup omitted
    device = entry["preparedDevices"][0]["devices"][0]
    assert device == {"gpu": {"info": {"uuid": "GPU-01000100-0000-0000-0000-000000000000"},
                              "device": {"Requests": ["gpu"], "PoolName": "node-a", "DeviceName": "gpu-0",
                                         "CDIDeviceIDs": [f"k8s.gpu.nvidia.com/claim={UID}-gpu-0"]}},
                      "mig": None}
    assert top["v2"]["preparedClaims"]["a" + UID[1:]]["preparedDevices"][0]["devices"][0]["mig"]["concrete"] == {
        "parentMinor": 1, "giId": 7, "ciId": 0, "migUUID": "MIG-1234", "parentUUID": "GPU-5678",
        "parentPCIBusID": "0000:0A:00.0"}


def test_one_wrong_byte_is_refused_with_the_checksum_named(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    write_checkpoint(path, encode(Checkpoint({UID: _entry(_gpu())}, "boot")))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert read_checkpoint(path) is not None
    data = bytearray(path.read_bytes())
    data[data.index(b"gpu-0", data.index(b'"v2"')) + 4] = ord("1")  # in the V2 entry: the V2 checksum catches it
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"v2\.checksum \d+ does not match the content's checksum \d+"):
        read_checkpoint(path)
    data = bytearray(encode(Checkpoint({UID: _entry(_gpu())}, "boot")))
    data[data.index(b"gpu-0") + 4] = ord("1")  # in the V1 view: the top-level checksum catches it
    with pytest.raises(CheckpointError, match=r"^x: checksum \d+ does not match"):
        decode(bytes(data), source="x")


@pytest.mark.parametrize(("data", "message"), [
    (b"", "not JSON"),
    (b"[]", "must be a JSON object, got list"),
    (b'{"checksum":1,"v3":{}}', r"unknown checkpoint version \(top-level fields \['v3'\]"),
    (b'{"checksum":1}', "neither v1 nor v2 present"),
])
def test_an_unknown_or_damaged_file_is_never_guessed_at(data: bytes, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        decode(data)


def test_a_v1_only_checkpoint_reads_as_completed_claims() -> None:
    """Older releases wrote only ``v1``; NVIDIA reads its claims as ``PrepareCompleted``."""
    full = json.loads(encode(Checkpoint({UID: _entry(_gpu())}, "")))
    del full["v2"]
    data = json.dumps(full, separators=(",", ":")).encode()
    read = decode(data)
    assert read.claims[UID].state is CheckpointState.PREPARE_COMPLETED and read.node_boot_id == ""


@needs_nvidia
def test_nvidia_plugins_own_checkpoint_is_read_and_written_back_byte_for_byte(sandbox: SandboxNode,
                                                                             tmp_path: Path) -> None:
    """NVIDIA's plugin prepares claims (one with admin access, an opaque config and a consumer); its checkpoint
    verifies here and re-encodes to the same bytes, both checksums included."""
    use_this_boot(sandbox)
    api = sandbox.api
    assert api is not None
    config = sandbox.config()
    plugin_dir = Path(config.kubelet_plugins_directory_path) / "gpu.nvidia.com"

    async def body() -> bytes:
        with nvidia_process(sandbox, tmp_path) as (proc, registrar):
            async with kubelet_for(registrar, proc, tmp_path / "nvidia.log") as kubelet:
                plain = claim(sandbox, "plain", "gpu-0",
                              reservedFor=[{"resource": "pods", "name": "pod-<&>", "uid": "4f1c"}])
                rich = claim(sandbox, "rich", "gpu-1")
                stored = api.get("ResourceClaim", rich.name, rich.namespace)
                assert stored is not None
                devices = stored["status"]["allocation"]["devices"]
                devices["results"][0]["adminAccess"] = True
                devices["config"] = [{"source": "FromClaim", "requests": ["gpu"], "opaque": {
                    "driver": "gpu.nvidia.com",
                    "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}}}]
                api.update(stored, subresource="status")
                answers = await kubelet.prepare([plain, rich])
                assert all(not a.error for a in answers.values()), answers
        return (plugin_dir / CHECKPOINT_FILE).read_bytes()

    theirs = asyncio.run(body())
    read = decode(theirs)
    assert len(read.claims) == 2 and read.node_boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert encode(read) == theirs


def test_the_compiled_checksum_equals_the_twin() -> None:
    """``ext/kubeletchecksum.pyx`` and its pure-Python twin agree on every byte value and length."""
    if os.environ.get("DRADRIVER_NO_EXTENSIONS") == "1":
        pytest.skip("compiled modules not built (DRADRIVER_NO_EXTENSIONS=1)")
    twin = importlib.import_module("dradriver._native.kubeletchecksum_py")
    compiled = importlib.import_module("dradriver._native.kubeletchecksum")
    rng = random.Random(33)
    samples = [b"", bytes(range(256)), *(rng.randbytes(rng.randrange(1, 3000)) for _ in range(20))]
    for data in samples:
        assert compiled.checksum(data) == twin.checksum(data) == checksum(data)


def test_the_compute_domain_plugins_aborted_entries_read_back() -> None:
    """NVIDIA's compute-domain plugin adds ``PrepareAborted`` with ``abortedAt``, channel/daemon devices and its
    own ``configState``; they read back as written, and an aborted claim is not in the V1 view."""
    channel = PreparedDevice("channel", KubeletDevice(("channel",), "node-a", "channel-0", ("k8s.x/claim=c",)), id=0)
    aborted = CheckpointEntry(CheckpointState.PREPARE_ABORTED, {"allocation": {"devices": {}}},
                              (DeviceGroup((channel,), ConfigState(type="channel", compute_domain="cd-uid")),),
                              name="c", namespace="ns", aborted_at="2026-12-04T21:00:00Z")
    cp = Checkpoint({UID: aborted}, "boot")
    data = encode(cp, CD_CLAIM)
    assert decode(data, CD_CLAIM) == cp
    top = json.loads(data)
    assert top["v1"] == {} and top["v2"]["preparedClaims"][UID]["abortedAt"] == "2026-12-04T21:00:00Z"
    assert top["v2"]["preparedClaims"][UID]["preparedDevices"][0]["configState"] == {
        "Type": "channel", "ComputeDomain": "cd-uid"}
