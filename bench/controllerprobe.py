"""``python -m bench.controllerprobe KUBECONFIG NAMESPACE MODE``: a ComputeDomain controller in a process of its
own (``User-Agent bench-controller``: the emulator's records count its writes), so the fleet benchmark
(:func:`bench.cdfleet.measure_controller`) reads the controller's CPU and memory apart from the API emulator's.

``python -m bench.controllerprobe KUBECONFIG NAMESPACE serve PROTOCOL SCALE``: the controller side of a membership
protocol of :mod:`bench.cdfleet` (``nvidia``: NVIDIA's 2 s status loop; ``dradriver``: the real controller's
``run``), periods times ``SCALE``, running until the line ``quit`` (or the end of stdin), for
:func:`bench.cdfleet.run_domain` (:class:`bench.cdfleet.ControllerProcess`): off the GIL of the emulator and the
node agents, as a controller runs in its own pod. It prints ``{"ready": true}`` once the controller runs, and
``{"cpu_s": ..., "rounds": ...}`` after it stopped (``rounds``: NVIDIA's status rounds done). With
``BENCH_CONTROLLER_LOG=<file>`` the controller logs there (debug, with times).

Protocol on stdin/stdout, one JSON object a line: after the imports and one warm-up round the probe prints
``{"ready": true, "imports_kib": ..., "rss_kib": ...}`` (RSS after the imports, and after the warm-up); then
for every line ``go SINCE UNTIL`` (the resourceVersions before and of the bench's last membership event) it runs
one round and prints ``{"cpu_s": ..., "rss_kib": ..., "hwm_kib": ...}``
(CPU of this process, user + system, seconds; ``VmRSS`` and ``VmHWM`` of ``/proc/self/status``, KiB);
``quit`` ends it.

Modes: ``nvidia`` -- :func:`bench.cdprotocol.status_round` (NVIDIA's 2 s loop: it lists everything whatever
happened); ``dradriver`` -- the real controller class
:class:`dradriver.computedomain.controller.ComputeDomainController` in its event-driven mode: its ComputeDomain
watch runs in a thread (as in ``run``: it keeps the domain keys a membership pass reads by), and a round does what
its clique watch and membership worker do for one burst, in
this thread so the round's end is known: watch the cliques from ``SINCE`` to ``UNTIL``, mark the owner of each
event, then one :meth:`~dradriver.computedomain.controller.ComputeDomainController.reconcile_membership` of the marked
domains. The warm-up round is a full pass (``sync_all_status``). Before each round, unmeasured, the node check
the running controller does every 10 s (``failed_nodes``: it lists every Node and Lease, a cost of the fleet per
period, not per event), so the round's pass finds its result fresh as it would in ``run``.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import threading
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


def _round_fn(mode: str, kubeconfig: str, namespace: str) -> tuple[Callable[[], object],
                                                                   Callable[[int, int], object],
                                                                   Callable[[], object]]:
    """(warm-up round, measured round ``(since, until)``, what runs between rounds, unmeasured) of ``mode``."""
    from dradriver.computedomain.controller import CLIENT_POOL_SIZE
    from dradriver.kube.client import open_client

    client = open_client(kubeconfig, user_agent="bench-controller", read_timeout_s=300.0, pool_size=CLIENT_POOL_SIZE)
    if mode == "nvidia":
        from bench import cdprotocol

        def nvidia_round() -> object:
            return cdprotocol.status_round(client, namespace)

        return nvidia_round, lambda since, until: nvidia_round(), lambda: None
    if mode == "dradriver":
        from dradriver.computedomain.controller import ComputeDomainController
        from dradriver.domain.cdtemplates import ControllerSettings, owner_of
        from dradriver.domain.computedomains import LABEL_COMPUTE_DOMAIN
        from dradriver.kube import computedomains as kcd

        controller = ComputeDomainController(client, ControllerSettings(namespace=namespace, image="bench"))
        stop = threading.Event()
        threading.Thread(target=controller._watch_loop, args=(stop,), name="cd-watch", daemon=True).start()

        def burst(since: int, until: int) -> object:
            marked: set[str] = set()
            for event in kcd.watch_cliques(client, namespace, LABEL_COMPUTE_DOMAIN, str(since), 60.0):
                obj = event.get("object") or {}
                marked.add(owner_of(obj))
                if int((obj.get("metadata") or {}).get("resourceVersion") or 0) >= until:
                    break
            marked.discard("")
            controller.reconcile_membership(marked)
            return marked

        def node_check() -> object:  # the controller's periodic node check (every node_grace_s / 4, 10 s)
            return controller.failed_nodes(fresh=True)

        return controller.sync_all_status, burst, node_check
    raise SystemExit(f"unknown mode {mode!r}: nvidia or dradriver")


def serve(kubeconfig: str, namespace: str, protocol: str, scale: float) -> int:
    """Run ``protocol``'s controller side until ``quit`` (module docstring); returns the exit status."""
    from bench import cdfleet

    if protocol not in cdfleet.MEMBERSHIPS:
        raise SystemExit(f"unknown protocol {protocol!r}: {' or '.join(sorted(cdfleet.MEMBERSHIPS))}")
    log_file = os.environ.get("BENCH_CONTROLLER_LOG", "")
    if log_file:  # where a run's time goes: the controller's log, with times
        logging.basicConfig(filename=log_file, level=logging.DEBUG,
                            format="%(asctime)s.%(msecs)03d %(threadName)s %(name)s %(message)s", datefmt="%H:%M:%S")
        logging.getLogger("urllib3").setLevel(logging.INFO)
    membership = cdfleet.MEMBERSHIPS[protocol]()
    from dradriver.computedomain.controller import CLIENT_POOL_SIZE

    client = cdfleet.bench_client(kubeconfig, cdfleet.CONTROLLER_AGENT, pool_size=CLIENT_POOL_SIZE)
    stop = threading.Event()
    before = _cpu_s()
    thread = threading.Thread(target=membership.controller, args=(namespace, client, cdfleet.Timing(scale=scale),
                                                                  stop), name="bench-controller", daemon=True)
    thread.start()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    stop.set()
    thread.join(timeout=30)
    client.close()
    print(json.dumps({"cpu_s": _cpu_s() - before, "rounds": int(getattr(membership, "rounds", 0))}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    """Serve the stdin protocol (module docstring); returns the exit status."""
    if len(argv) == 5 and argv[2] == "serve":
        return serve(argv[0], argv[1], argv[3], float(argv[4]))
    if len(argv) != 3:
        raise SystemExit(__doc__.split("\n")[0])
    kubeconfig, namespace, mode = argv
    warm_up, round_fn, between = _round_fn(mode, kubeconfig, namespace)
    imports_kib = _status_kib("VmRSS")
    warm_up()
    print(json.dumps({"ready": True, "imports_kib": imports_kib, "rss_kib": _status_kib("VmRSS")}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        words = command.split()
        if len(words) != 3 or words[0] != "go":
            raise SystemExit(f"unknown command {command!r}: go SINCE UNTIL or quit")
        between()
        before = _cpu_s()
        round_fn(int(words[1]), int(words[2]))
        print(json.dumps({"cpu_s": _cpu_s() - before, "rss_kib": _status_kib("VmRSS"),
                          "hwm_kib": _status_kib("VmHWM")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
