"""The sandbox driver root's ``nvidia-smi``: the subset of NVIDIA's tool that dradriver runs, over NVML.

:func:`dradriver.sandbox.node.install_driver_tools` writes this file, with a ``#!`` line naming the
interpreter, to ``<driver root>/usr/bin/nvidia-smi``. Like the real tool it is a client of
``libnvidia-ml.so.1``: it finds the library the way the real one does (the dynamic loader; dradriver runs
it with the driver root's copy in ``LD_PRELOAD``, the rule of NVIDIA's ``cmd/gpu-kubelet-plugin/sharing.go``), so the
mock library there applies the settings and shares them with every other process of the node through the
mock's control file (``ext/mocknvml/README.md``). It therefore imports nothing of dradriver: only the
standard library and pynvml.

Commands (the real tool's syntax; ``-i`` takes a GPU index, UUID or PCI bus id, comma separated):

* ``nvidia-smi --version``; ``nvidia-smi -L``;
* ``nvidia-smi [-i ID] -c MODE`` with MODE ``0|DEFAULT``, ``1|EXCLUSIVE_THREAD``, ``2|PROHIBITED``,
  ``3|EXCLUSIVE_PROCESS`` (``nvmlDeviceSetComputeMode``);
* ``nvidia-smi [-i ID] -pm MODE`` with MODE ``0|DISABLED``, ``1|ENABLED``: persistence mode. Where the
  ``nvidia-persistenced`` stand-in (:mod:`dradriver.sandbox.standins.nvidia_persistenced`) listens on
  ``run/nvidia-persistenced/socket`` of the root this tool is installed in (``<root>/usr/bin/nvidia-smi``; the
  real tool's ``/var/run/nvidia-persistenced/socket``), the daemon is asked to release or re-open the GPU; else
  the driver's legacy mode is set (``nvmlDeviceSetPersistenceMode``). The real tool's lines: ``Enabled
  persistence mode for GPU <bus id>.`` (``Enabled Legacy persistence mode ...`` without the daemon), ``Disabled
  persistence mode for GPU <bus id>.``, ``Persistence mode is already Enabled|Disabled for GPU <bus id>.``, then
  ``All done.``; a failure prints ``Unable to set persistence mode for GPU <bus id>: <reason>`` (exit status of
  the NVML code, e.g. 4 for "Insufficient Permissions");
* ``nvidia-smi compute-policy [-i ID] --set-timeslice N`` with N ``0..3`` (0=DEFAULT, 1=SHORT, 2=MEDIUM,
  3=LONG; through the mock's ``mocknvml_device_set_timeslice``, NVML having no public call) and
  ``nvidia-smi compute-policy [-i ID] -l``.

Exit codes are the real tool's (its manual, "RETURN VALUE"): 0 success, 2 invalid argument, 3 not supported,
4 no permission, 6 object not found (``No devices were found`` for an ``-i`` that names no GPU), 9 driver not
loaded, 12 NVML library not found, 13 function not found, 15 GPU lost, 255 anything else. The messages for a
missing library, a driver that does not answer, a missing device and a lost GPU are the real tool's; the
success lines of ``compute-policy`` and the ``-l`` table are this stand-in's own wording (not confirmed
against the real tool).
"""

from __future__ import annotations

import ctypes
import os
import socket
import stat
import sys
from collections.abc import Sequence
from typing import Any

import pynvml

COMPUTE_MODES = ("DEFAULT", "EXCLUSIVE_THREAD", "PROHIBITED", "EXCLUSIVE_PROCESS")
"""``nvmlComputeMode_t`` values 0-3 by the names ``nvidia-smi -c`` takes."""

PERSISTENCE_MODES = ("DISABLED", "ENABLED")
"""``nvmlEnableState_t`` values 0-1 by the names ``nvidia-smi -pm`` takes."""

PERSISTENCED_SOCKET = "run/nvidia-persistenced/socket"
"""The daemon's socket under the root the tool is installed in (``dradriver.host.persistenced.SOCKET``; this file
imports nothing of dradriver)."""

PERSISTENCED_TIMEOUT_S = 60.0
"""How long an answer of the daemon is waited for (seconds)."""

TIMESLICES = ("DEFAULT", "SHORT", "MEDIUM", "LONG")
"""``compute-policy --set-timeslice`` values 0-3."""

USAGE_ERROR = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
NO_LIBRARY = ("NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the "
              "NVIDIA Display Driver is properly installed and present in your system.\nPlease also try adding "
              "directory that contains libnvidia-ml.so to your system PATH.")
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
             "latest NVIDIA driver is installed and running.")
NO_DEVICES = "No devices were found"


class Failure(Exception):
    """End the command: print ``message`` and exit with ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def exit_code(nvml_code: int) -> int:
    """The real tool's exit status for an ``nvmlReturn_t``: the same number for 2-4, 6, 8, 9, 12-15; 10 for an
    interrupt issue (NVML 11); 255 for the rest."""
    if nvml_code in (2, 3, 4, 6, 8, 9, 12, 13, 14, 15):
        return nvml_code
    return 10 if nvml_code == 11 else 255


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _error_string(exc: pynvml.NVMLError) -> str:
    try:
        return str(exc)
    except Exception:
        return f"NVML error {exc.value}"


def _init() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
            raise Failure(12, NO_LIBRARY) from None
        if exc.value == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
            raise Failure(9, NO_DRIVER) from None
        raise Failure(exit_code(exc.value), f"Failed to initialize NVML: {_error_string(exc)}") from None


def _handles(ids: str | None) -> list[tuple[str, Any]]:
    """``-i`` value -> [(how the GPU is named in messages, handle)]; every GPU without ``-i``."""
    if ids is None:
        count = int(pynvml.nvmlDeviceGetCount())
        wanted = [str(i) for i in range(count)]
    else:
        wanted = [part.strip() for part in ids.split(",") if part.strip()]
        if not wanted:
            raise Failure(2, USAGE_ERROR)
    out = []
    for ident in wanted:
        try:
            if ident.isdigit():
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(ident))
            elif ident.upper().startswith(("GPU-", "MIG-")):
                handle = pynvml.nvmlDeviceGetHandleByUUID(ident)
            else:
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(ident)
        except pynvml.NVMLError as exc:
            if exc.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                raise Failure(6, NO_DEVICES) from None
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise Failure(15, f"Unable to determine the device handle for GPU {ident}: GPU is lost.  "
                                  "Reboot the system to recover this GPU") from None
            raise Failure(exit_code(exc.value),
                          f"Unable to determine the device handle for GPU {ident}: {_error_string(exc)}") from None
        out.append((_bus_id(handle, ident), handle))
    return out


def _bus_id(handle: Any, fallback: str) -> str:
    try:
        return _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
    except pynvml.NVMLError:
        return fallback


def _choice(value: str, names: Sequence[str]) -> int:
    upper = value.strip().upper()
    if upper.isdigit() and int(upper) < len(names):
        return int(upper)
    if upper in names:
        return names.index(upper)
    raise Failure(2, USAGE_ERROR)


def set_compute_mode(ids: str | None, mode_arg: str) -> list[str]:
    """``-c MODE``: ``nvmlDeviceSetComputeMode`` on each selected GPU; the lines to print."""
    mode = _choice(mode_arg, COMPUTE_MODES)
    lines = []
    for bus_id, handle in _handles(ids):
        try:
            pynvml.nvmlDeviceSetComputeMode(handle, mode)
        except pynvml.NVMLError as exc:
            lines.append(f"Unable to set compute mode for GPU {bus_id}: {_error_string(exc)}")
            lines.append("Terminating early due to previous errors.")
            raise Failure(exit_code(exc.value), "\n".join(lines)) from None
        lines.append(f"Set compute mode to {COMPUTE_MODES[mode]} for GPU {bus_id}.")
    lines.append("All done.")
    return lines


def installed_root() -> str:
    """The root this tool is installed in: ``<root>/usr/bin/nvidia-smi``."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _daemon_socket() -> str | None:
    """The daemon's socket path when a socket is there, else ``None``."""
    path = os.path.join(installed_root(), PERSISTENCED_SOCKET)
    try:
        return path if stat.S_ISSOCK(os.stat(path).st_mode) else None
    except OSError:
        return None


def _ask_daemon(path: str, bus_id: str, mode: int) -> str | None:
    """Send ``pm <bus id> <mode>`` to the daemon; its answer line (``ok changed``, ``ok already``, ``error <text>``),
    or ``None`` when nothing listens on the socket (the legacy mode is set then, as the real tool does)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(PERSISTENCED_TIMEOUT_S)
        try:
            conn.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        conn.sendall(f"pm {bus_id} {mode}\n".encode())
        answer = b""
        while not answer.endswith(b"\n"):
            try:
                chunk = conn.recv(4096)
            except TimeoutError:
                return "error no answer from nvidia-persistenced"
            if not chunk:
                return "error nvidia-persistenced closed the connection"
            answer += chunk
    return answer.decode().strip()


def set_persistence_mode(ids: str | None, mode_arg: str) -> list[str]:
    """``-pm MODE`` on each selected GPU, through the daemon where it listens; the lines to print."""
    mode = _choice(mode_arg, PERSISTENCE_MODES)
    name = PERSISTENCE_MODES[mode].capitalize()
    daemon = _daemon_socket()
    lines = []
    for bus_id, handle in _handles(ids):
        answer = _ask_daemon(daemon, bus_id, mode) if daemon is not None else None
        if answer is not None:
            if answer.startswith("error"):
                lines.append(f"Unable to set persistence mode for GPU {bus_id}: {answer[len('error'):].strip()}")
                raise Failure(255, "\n".join(lines))
            if answer == "ok already":
                lines.append(f"Persistence mode is already {name} for GPU {bus_id}.")
            else:
                lines.append(f"{name} persistence mode for GPU {bus_id}.")
            continue
        try:
            if int(pynvml.nvmlDeviceGetPersistenceMode(handle)) == mode:
                lines.append(f"Persistence mode is already {name} for GPU {bus_id}.")
                continue
            pynvml.nvmlDeviceSetPersistenceMode(handle, mode)
        except pynvml.NVMLError as exc:
            lines.append(f"Unable to set persistence mode for GPU {bus_id}: {_error_string(exc)}")
            raise Failure(exit_code(exc.value), "\n".join(lines)) from None
        lines.append(f"{name} Legacy persistence mode for GPU {bus_id}." if mode else
                     f"Disabled persistence mode for GPU {bus_id}.")
    lines.append("All done.")
    return lines


def _timeslice_call(name: str) -> Any:
    library = pynvml.nvmlLib
    fn = getattr(library, name, None) if library is not None else None
    if fn is None:
        raise Failure(13, f"Setting the compute time-slice is not supported by this driver ({name} missing)")
    return fn


def set_timeslice(ids: str | None, value_arg: str) -> list[str]:
    """``compute-policy --set-timeslice N`` on each selected GPU; the lines to print."""
    value = _choice(value_arg, TIMESLICES)
    fn = _timeslice_call("mocknvml_device_set_timeslice")
    lines = []
    for bus_id, handle in _handles(ids):
        code = int(fn(handle, ctypes.c_uint(value)))
        if code != 0:
            text = _text(pynvml.nvmlErrorString(code))
            raise Failure(exit_code(code), f"Failed to set timeslice config for GPU {bus_id}: {text}")
        lines.append(f"Successfully set timeslice config to {TIMESLICES[value]} for GPU {bus_id}.")
    return lines


def list_policies(ids: str | None) -> list[str]:
    """``compute-policy -l``: the time-slice setting of each selected GPU."""
    fn = _timeslice_call("mocknvml_device_get_timeslice")
    lines = []
    for bus_id, handle in _handles(ids):
        value = ctypes.c_uint(0)
        code = int(fn(handle, ctypes.byref(value)))
        if code != 0:
            text = _text(pynvml.nvmlErrorString(code))
            raise Failure(exit_code(code), f"Failed to read timeslice config for GPU {bus_id}: {text}")
        lines.append(f"GPU {bus_id}: Timeslice: {TIMESLICES[value.value]} ({value.value})")
    return lines


def list_gpus() -> list[str]:
    """``-L``: one line per GPU, and one indented line per MIG device under it."""
    lines = []
    for index in range(int(pynvml.nvmlDeviceGetCount())):
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            lines.append(f"Unable to determine the device handle for GPU {index}: {_error_string(exc)}")
            continue
        name, uuid = _text(pynvml.nvmlDeviceGetName(handle)), _text(pynvml.nvmlDeviceGetUUID(handle))
        lines.append(f"GPU {index}: {name} (UUID: {uuid})")
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
            slots = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)) if current else 0
        except pynvml.NVMLError:
            slots = 0
        shown = 0
        for slot in range(slots):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError:
                continue
            mig_name = _text(pynvml.nvmlDeviceGetName(mig))
            profile = mig_name.split(" MIG ", 1)[1] if " MIG " in mig_name else mig_name
            lines.append(f"  MIG {profile:<12} Device {shown:>2}: (UUID: {_text(pynvml.nvmlDeviceGetUUID(mig))})")
            shown += 1
    return lines


def version() -> list[str]:
    """``--version``: the tool's, NVML's, the driver's and CUDA's versions."""
    driver = _text(pynvml.nvmlSystemGetDriverVersion())
    cuda = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
    return [f"NVIDIA-SMI version  : {driver}",
            f"NVML version        : {'.'.join(driver.split('.')[:2])}",
            f"DRIVER version      : {driver}",
            f"CUDA Version        : {cuda // 1000}.{cuda % 1000 // 10}"]


def _option(args: list[str], short: str, long: str) -> tuple[str | None, bool]:
    """Remove ``-x V``, ``-x=V``, ``--long V`` or ``--long=V`` from ``args``; (value, present)."""
    for k, arg in enumerate(args):
        for flag in (short, long):
            if flag and arg == flag:
                if k + 1 >= len(args):
                    raise Failure(2, USAGE_ERROR)
                value = args[k + 1]
                del args[k:k + 2]
                return value, True
            if flag and arg.startswith(flag + "="):
                del args[k]
                return arg[len(flag) + 1:], True
    return None, False


def _flag(args: list[str], *names: str) -> bool:
    for name in names:
        if name in args:
            args.remove(name)
            return True
    return False


def run(argv: Sequence[str]) -> list[str]:
    """Run one command line (without the program name); the lines to print. Raises :class:`Failure`."""
    args = list(argv)
    if args and args[0] == "compute-policy":
        args = args[1:]
        ids, _ = _option(args, "-i", "--id")
        value, setting = _option(args, "", "--set-timeslice")
        listing = _flag(args, "-l", "--list")
        if args or setting == listing:
            raise Failure(2, USAGE_ERROR)
        _init()
        try:
            return set_timeslice(ids, value or "") if setting else list_policies(ids)
        finally:
            pynvml.nvmlShutdown()
    if _flag(args, "--version"):
        if args:
            raise Failure(2, USAGE_ERROR)
        _init()
        try:
            return version()
        finally:
            pynvml.nvmlShutdown()
    ids, _ = _option(args, "-i", "--id")
    mode, has_mode = _option(args, "-c", "--compute-mode")
    persistence, has_persistence = _option(args, "-pm", "--persistence-mode")
    listing = _flag(args, "-L", "--list-gpus")
    if args or [has_mode, has_persistence, listing].count(True) != 1:
        raise Failure(2, USAGE_ERROR)
    _init()
    try:
        if has_persistence:
            return set_persistence_mode(ids, persistence or "")
        return set_compute_mode(ids, mode or "") if has_mode else list_gpus()
    finally:
        pynvml.nvmlShutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: print the command's output; return its exit status."""
    try:
        lines = run(sys.argv[1:] if argv is None else argv)
    except Failure as failure:
        print(failure.message, flush=True)
        return failure.code
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
