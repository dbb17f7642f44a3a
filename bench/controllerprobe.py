"""``python -m bench.controllerprobe KUBECONFIG NAMESPACE MODE``: a ComputeDomain controller in a process of its
own (``User-Agent bench-controller``: the emulator's records count its writes), so the fleet benchmark
(:func:`bench.cdfleet.measure_controller`) reads the controller's CPU and memory apart from the API emulator's.

Protocol on stdin/stdout, one JSON object a line: after the imports and one warm-up round the probe prints
``{"ready": true, "imports_kib": ..., "rss_kib": ...}`` (RSS after the imports, and after the warm-up); then
for every line ``go`` it runs one status round and prints ``{"cpu_s": ..., "rss_kib": ..., "hwm_kib": ...}``
(CPU of this process, user + system, seconds; ``VmRSS`` and ``VmHWM`` of ``/proc/self/status``, KiB);
``quit`` ends it.

Modes: ``nvidia`` -- :func:`bench.cdprotocol.status_round` (NVIDIA's 2 s loop); ``dradriver`` -- the real
controller class :class:`dradriver.app.cdcontroller.ComputeDomainController`, its ``sync_all_status``.
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Callable


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _round_fn(mode: str, kubeconfig: str, namespace: str) -> Callable[[], object]:
    from dradriver.kube.client import open_client

    client = open_client(kubeconfig, user_agent="bench-controller", read_timeout_s=300.0)
    if mode == "nvidia":
        from bench import cdprotocol

        return lambda: cdprotocol.status_round(client, namespace)
    if mode == "dradriver":
        from dradriver.app.cdcontroller import ComputeDomainController
        from dradriver.domain.cdtemplates import ControllerSettings

        controller = ComputeDomainController(client, ControllerSettings(namespace=namespace, image="bench"))
        return controller.sync_all_status
    raise SystemExit(f"unknown mode {mode!r}: nvidia or dradriver")


def main(argv: list[str]) -> int:
    """Serve the stdin protocol (module docstring); returns the exit status."""
    if len(argv) != 3:
        raise SystemExit(__doc__.split("\n")[0])
    kubeconfig, namespace, mode = argv
    round_fn = _round_fn(mode, kubeconfig, namespace)
    imports_kib = _status_kib("VmRSS")
    round_fn()
    print(json.dumps({"ready": True, "imports_kib": imports_kib, "rss_kib": _status_kib("VmRSS")}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "go":
            raise SystemExit(f"unknown command {command!r}")
        before = _cpu_s()
        round_fn()
        print(json.dumps({"cpu_s": _cpu_s() - before, "rss_kib": _status_kib("VmRSS"),
                          "hwm_kib": _status_kib("VmHWM")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
