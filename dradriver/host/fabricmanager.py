"""Fabric Manager client: NVIDIA's Fabric Manager SDK (``libnvfm.so.1``) through ctypes, for the gate
``FabricManagerPartitioning``.

Facts (NVIDIA Fabric Manager SDK headers ``nv_fm_agent.h`` and ``nv_fm_types.h`` as packaged in libnvfm-dev, e.g.
github.com/pexip/os-nvidia-fabricmanager ``include/``; NVIDIA Fabric Manager User Guide, "Fabric Manager SDK" and
"Shared NVSwitch Virtualization Model"; kubernetes-sigs/dra-driver-nvidia-gpu ``pkg/fabricmanager/``):

* the library is ``libnvfm.so.1``, looked for in the driver root's library directories as NVML is
  (:func:`find_fm_library`), or a configured path;
* the FM instance is reached on the Unix socket ``<driver root>/run/nvidia-fabricmanager/socket`` by default
  (NVIDIA: ``/driver-root/run/nvidia-fabricmanager/socket``); env ``NVIDIA_FABRICMANAGER_UNIX_SOCKET`` names
  another socket, ``NVIDIA_FABRICMANAGER_ADDRESS`` a TCP address (``a.b.c.d[:port]``, FM's default port 6666)
  used when no socket is named (:func:`address_from_environment`);
* every operation opens a fresh connection (``fmLibInit``, ``fmConnect``, the call, ``fmDisconnect``,
  ``fmLibShutdown``), as NVIDIA's client does, so an FM restart between two operations is harmless;
* structs carry ``version = sizeof(struct) | 1 << 24`` (``MAKE_FM_PARAM_VERSION``); a GPU of a partition is named
  by ``physicalId``, "same value as GPU Module ID" (NVML ``nvmlDeviceGetModuleId``);
* the feature applies only on a node with an NVSwitch fabric: ``<proc>/driver/nvidia-nvswitch/devices`` not
  empty, or (NVLink 5, switches outside the node) an InfiniBand device whose ``vpd`` holds ``SW_MNG``
  (:func:`has_nvswitch_fabric`).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dradriver.domain.passthrough import FabricPartition
from dradriver.errors import DradriverError
from dradriver.host.driverfiles import find_driver_library

FM_LIBRARY = "libnvfm.so.1"
DEFAULT_SOCKET = "run/nvidia-fabricmanager/socket"
"""Relative to the driver root (NVIDIA: ``/driver-root/run/nvidia-fabricmanager/socket``)."""
ENV_UNIX_SOCKET = "NVIDIA_FABRICMANAGER_UNIX_SOCKET"
ENV_ADDRESS = "NVIDIA_FABRICMANAGER_ADDRESS"
DEFAULT_TIMEOUT_MS = 5000

FM_RETURN_NAMES: dict[int, str] = {
    0: "FM_ST_SUCCESS",
    -1: "FM_ST_BADPARAM",
    -2: "FM_ST_GENERIC_ERROR",
    -3: "FM_ST_NOT_SUPPORTED",
    -4: "FM_ST_UNINITIALIZED",
    -5: "FM_ST_TIMEOUT",
    -6: "FM_ST_VERSION_MISMATCH",
    -7: "FM_ST_IN_USE",
    -8: "FM_ST_NOT_CONFIGURED",
    -9: "FM_ST_CONNECTION_NOT_VALID",
    -10: "FM_ST_NVLINK_ERROR",
}
"""``fmReturn_t`` (``nv_fm_types.h``)."""
FM_ST_SUCCESS, FM_ST_BADPARAM, FM_ST_IN_USE, FM_ST_UNINITIALIZED, FM_ST_CONNECTION_NOT_VALID = 0, -1, -7, -4, -9

FM_MAX_STR_LENGTH = 256
FM_UUID_BUFFER_SIZE = 80
FM_DEVICE_PCI_BUS_ID_BUFFER_SIZE = 32
FM_MAX_NUM_GPUS = 16
FM_MAX_FABRIC_PARTITIONS = 64


class FmConnectParams(ctypes.Structure):
    """``fmConnectParams_v1``."""

    _fields_ = [("version", ctypes.c_uint), ("addressInfo", ctypes.c_char * FM_MAX_STR_LENGTH),
                ("timeoutMs", ctypes.c_uint), ("addressIsUnixSocket", ctypes.c_uint)]


class FmFabricPartitionGpuInfo(ctypes.Structure):
    """``fmFabricPartitionGpuInfo_t``."""

    _fields_ = [("physicalId", ctypes.c_uint), ("uuid", ctypes.c_char * FM_UUID_BUFFER_SIZE),
                ("pciBusId", ctypes.c_char * FM_DEVICE_PCI_BUS_ID_BUFFER_SIZE),
                ("numNvLinksAvailable", ctypes.c_uint), ("maxNumNvLinks", ctypes.c_uint),
                ("nvlinkLineRateMBps", ctypes.c_uint)]


class FmFabricPartitionInfo(ctypes.Structure):
    """``fmFabricPartitionInfo_t``."""

    _fields_ = [("partitionId", ctypes.c_uint), ("isActive", ctypes.c_uint), ("numGpus", ctypes.c_uint),
                ("gpuInfo", FmFabricPartitionGpuInfo * FM_MAX_NUM_GPUS)]


class FmFabricPartitionList(ctypes.Structure):
    """``fmFabricPartitionList_v2`` (``fmFabricPartitionList_t``)."""

    _fields_ = [("version", ctypes.c_uint), ("numPartitions", ctypes.c_uint), ("maxNumPartitions", ctypes.c_uint),
                ("partitionInfo", FmFabricPartitionInfo * FM_MAX_FABRIC_PARTITIONS)]


def param_version(struct: type[ctypes.Structure], version: int = 1) -> int:
    """``MAKE_FM_PARAM_VERSION(type, version)``: ``sizeof(type) | version << 24``."""
    return ctypes.sizeof(struct) | (version << 24)


class FabricManagerError(DradriverError):
    """A Fabric Manager call failed.

    :param operation: what was attempted (``"activate"``, ``"deactivate"``, ``"list partitions"``, ``"connect"``).
    :param code: the ``fmReturn_t``; :attr:`code_name` its name.
    :param partition_id: the partition concerned, when any.
    """

    def __init__(self, operation: str, code: int, partition_id: int | None = None, where: str = "") -> None:
        self.operation, self.code, self.partition_id = operation, code, partition_id
        self.code_name = FM_RETURN_NAMES.get(code, f"fmReturn_t {code}")
        subject = f" of partition {partition_id}" if partition_id is not None else ""
        at = f" (Fabric Manager at {where})" if where else ""
        super().__init__(f"Fabric Manager: {operation}{subject} failed: {self.code_name}{at}")


@dataclass(frozen=True, slots=True)
class FmAddress:
    """Where the FM instance listens: a Unix socket path (``unix`` True) or a TCP ``a.b.c.d[:port]``."""

    address: str
    unix: bool = True


def find_fm_library(driver_root: Path | str) -> Path | None:
    """``libnvfm.so.1`` under ``driver_root`` in the directories NVML is looked for in, links followed inside the
    root; ``None`` when absent."""
    return find_driver_library(driver_root, FM_LIBRARY)


def address_from_environment(driver_root: Path | str, environ: Mapping[str, str] | None = None) -> FmAddress:
    """The FM address: ``NVIDIA_FABRICMANAGER_UNIX_SOCKET`` (a socket path, taken as given), else
    ``NVIDIA_FABRICMANAGER_ADDRESS`` (TCP), else ``<driver_root>/run/nvidia-fabricmanager/socket``."""
    env = os.environ if environ is None else environ
    socket_path = env.get(ENV_UNIX_SOCKET, "").strip()
    if socket_path:
        return FmAddress(socket_path, unix=True)
    address = env.get(ENV_ADDRESS, "").strip()
    if address:
        return FmAddress(address, unix=False)
    return FmAddress(os.path.join(os.fspath(driver_root), DEFAULT_SOCKET), unix=True)


def has_nvswitch_fabric(proc_root: Path | str = "/proc", sysfs_root: Path | str = "/sys") -> bool:
    """The node has an NVSwitch fabric: ``<proc_root>/driver/nvidia-nvswitch/devices`` has an entry, or an
    InfiniBand device's ``<sysfs_root>/class/infiniband/<dev>/device/vpd`` contains ``SW_MNG`` (NVLink 5 switch
    management). Unreadable paths count as absent."""
    devices = Path(proc_root) / "driver" / "nvidia-nvswitch" / "devices"
    try:
        if any(devices.iterdir()):
            return True
    except OSError:
        pass
    try:
        ib_devices = list((Path(sysfs_root) / "class" / "infiniband").iterdir())
    except OSError:
        return False
    for dev in ib_devices:
        try:
            if b"SW_MNG" in (dev / "device" / "vpd").read_bytes():
                return True
        except OSError:
            continue
    return False


T = TypeVar("T")


class FabricManagerClient:
    """Partition operations over ``libnvfm.so.1``, one fresh connection each.

    :param library: path of ``libnvfm.so.1`` (see :func:`find_fm_library`).
    :param address: the FM instance (see :func:`address_from_environment`).
    :param timeout_ms: ``fmConnectParams_t.timeoutMs``.
    :raises FabricManagerError: (operation ``"load library"``) the library cannot be loaded.
    """

    _lock = threading.Lock()  # the SDK's init/shutdown is process-wide: one operation at a time in a process

    def __init__(self, library: Path | str, address: FmAddress, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        self.address, self.timeout_ms = address, timeout_ms
        try:
            lib = ctypes.CDLL(os.fspath(library))
        except OSError as exc:
            raise FabricManagerError(f"load library {library} ({exc})", -2) from exc
        lib.fmConnect.argtypes = [ctypes.POINTER(FmConnectParams), ctypes.POINTER(ctypes.c_void_p)]
        lib.fmDisconnect.argtypes = [ctypes.c_void_p]
        lib.fmGetSupportedFabricPartitions.argtypes = [ctypes.c_void_p, ctypes.POINTER(FmFabricPartitionList)]
        lib.fmActivateFabricPartition.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.fmDeactivateFabricPartition.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        for fn in ("fmLibInit", "fmLibShutdown", "fmConnect", "fmDisconnect", "fmGetSupportedFabricPartitions",
                   "fmActivateFabricPartition", "fmDeactivateFabricPartition"):
            getattr(lib, fn).restype = ctypes.c_int
        self._lib = lib

    def _session(self, operation: str, partition_id: int | None, body: Callable[[ctypes.c_void_p], T]) -> T:
        lib, where = self._lib, self.address.address
        if len(where.encode()) >= FM_MAX_STR_LENGTH:  # fmConnectParams_t.addressInfo holds 255 bytes and a NUL
            raise FabricManagerError(f"{operation}: connect", FM_ST_BADPARAM, partition_id, where)
        with self._lock:
            rc = lib.fmLibInit()
            if rc not in (FM_ST_SUCCESS, FM_ST_IN_USE):
                raise FabricManagerError(f"{operation}: fmLibInit", rc, partition_id, where)
            try:
                params = FmConnectParams(version=param_version(FmConnectParams), addressInfo=where.encode(),
                                         timeoutMs=self.timeout_ms, addressIsUnixSocket=int(self.address.unix))
                handle = ctypes.c_void_p()
                rc = lib.fmConnect(ctypes.byref(params), ctypes.byref(handle))
                if rc != FM_ST_SUCCESS:
                    raise FabricManagerError(f"{operation}: connect", rc, partition_id, where)
                try:
                    return body(handle)
                finally:
                    lib.fmDisconnect(handle)
            finally:
                lib.fmLibShutdown()

    def partitions(self) -> list[FabricPartition]:
        """Every supported partition, by ID, with its GPUs' module IDs sorted and ``active``.

        :raises FabricManagerError: operation ``"list partitions"``.
        """

        def body(handle: ctypes.c_void_p) -> list[FabricPartition]:
            out = FmFabricPartitionList(version=param_version(FmFabricPartitionList))
            rc = self._lib.fmGetSupportedFabricPartitions(handle, ctypes.byref(out))
            if rc != FM_ST_SUCCESS:
                raise FabricManagerError("list partitions", rc, None, self.address.address)
            result = []
            for i in range(min(out.numPartitions, FM_MAX_FABRIC_PARTITIONS)):
                info = out.partitionInfo[i]
                gpus = sorted((info.gpuInfo[j] for j in range(min(info.numGpus, FM_MAX_NUM_GPUS))),
                              key=lambda g: g.physicalId)
                result.append(FabricPartition(
                    partition_id=int(info.partitionId), module_ids=tuple(int(g.physicalId) for g in gpus),
                    active=bool(info.isActive), pci_bus_ids=tuple(_text(g.pciBusId) for g in gpus)))
            return sorted(result, key=lambda p: p.partition_id)

        return self._session("list partitions", None, body)

    def activate(self, partition_id: int) -> None:
        """``fmActivateFabricPartition``.

        :raises FabricManagerError: operation ``"activate"`` (``FM_ST_IN_USE``: active already or a GPU is in
            another active partition; ``FM_ST_BADPARAM``: unknown ID; others as FM answers).
        """
        self._call("activate", partition_id, self._lib.fmActivateFabricPartition)

    def deactivate(self, partition_id: int) -> None:
        """``fmDeactivateFabricPartition``.

        :raises FabricManagerError: operation ``"deactivate"`` (``FM_ST_UNINITIALIZED``: not active).
        """
        self._call("deactivate", partition_id, self._lib.fmDeactivateFabricPartition)

    def _call(self, operation: str, partition_id: int, fn: Any) -> None:
        def body(handle: ctypes.c_void_p) -> None:
            rc = fn(handle, partition_id)
            if rc != FM_ST_SUCCESS:
                raise FabricManagerError(operation, rc, partition_id, self.address.address)

        self._session(operation, partition_id, body)


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def open_client(driver_root: Path | str, *, library: Path | str | None = None, proc_root: Path | str = "/proc",
                sysfs_root: Path | str = "/sys", environ: Mapping[str, str] | None = None,
                timeout_ms: int = DEFAULT_TIMEOUT_MS) -> FabricManagerClient | None:
    """A client when Fabric Manager partitioning applies to this node, else ``None``: the node has an NVSwitch
    fabric (:func:`has_nvswitch_fabric`) and ``libnvfm.so.1`` is present (``library`` or
    :func:`find_fm_library` in ``driver_root``), as NVIDIA enables it.

    :raises FabricManagerError: the library exists but cannot be loaded.
    """
    if not has_nvswitch_fabric(proc_root, sysfs_root):
        return None
    path = Path(library) if library is not None else find_fm_library(driver_root)
    if path is None or not path.is_file():
        return None
    return FabricManagerClient(path, address_from_environment(driver_root, environ), timeout_ms)
