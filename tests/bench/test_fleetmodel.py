"""The fleet model (``bench/fleetmodel.py``) and its report (``bench/fleet.py``, ``python -m bench fleet``) at tiny
sizes. Times here are simulated seconds of a seeded model, so their bounds are the model's arithmetic, not the
machine's speed: a latency or a back-off is the least a step takes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench import fleet, fleetmodel
from bench.fleetmodel import Api, PodStart, Sim
from dradriver.sandbox.apiserver.flowcontrol import FlowControlSettings, Latency


def _finish(sim: Sim, api: Api, client: fleetmodel.Client, verb: str, done: list[float]) -> fleetmodel.Process:
    yield from api.request(client, verb)
    done.append(sim.now)


def test_a_write_latency_is_what_a_simulated_write_takes_and_a_read_its_own() -> None:
    sim = Sim()
    api = Api(sim, Latency(read_s=0.004, write_s=0.05), None)
    client = api.client("c", "node-a", "dradriver")
    writes: list[float] = []
    reads: list[float] = []
    sim.spawn(_finish(sim, api, client, "update", writes))
    sim.spawn(_finish(sim, api, client, "get", reads))
    sim.run(lambda: False, 10)
    assert writes == [pytest.approx(0.05)] and reads == [pytest.approx(0.004)]
    assert api.requests["node-a"] == 2


def test_past_the_seats_a_simulated_request_gets_429_and_its_client_retries_after_retry_after() -> None:
    sim = Sim()
    api = Api(sim, Latency(write_s=0.5), FlowControlSettings(seats=1, queue_length=0, retry_after_s=1))
    done: list[float] = []
    for name in ("a", "b"):
        sim.spawn(_finish(sim, api, api.client(name, name, "kubelet"), "update", done))
    sim.run(lambda: False, 10)
    assert api.throttled == 1 and api.requests["b"] == 2  # the 429 and its retry
    assert done[0] == pytest.approx(0.5) and done[1] >= 1.0 + 0.5  # Retry-After, then its own latency


def test_a_client_token_bucket_spaces_requests_past_its_burst_at_its_qps() -> None:
    sim = Sim()
    api = Api(sim, Latency(), None)
    client = api.client("nvidia-daemon", "node-a", "nvidia")  # 5 qps, burst 10
    done: list[float] = []

    def twelve() -> fleetmodel.Process:
        for _ in range(12):
            yield from _finish(sim, api, client, "get", done)

    sim.spawn(twelve())
    sim.run(lambda: False, 10)
    assert done[9] == pytest.approx(0.0) and done[10] >= 0.2 - 1e-9 and done[11] >= 0.4 - 1e-9


def test_a_higher_write_latency_makes_a_one_node_domain_start_later() -> None:
    for protocol in ("nvidia", "driver-managed", "pre-warmed", "floor"):
        fast = fleetmodel.run(protocol, 1, latency=Latency())
        slow = fleetmodel.run(protocol, 1, latency=Latency(write_s=0.03))
        assert slow.seconds >= fast.seconds + 4 * 0.03, protocol  # claim, pod status, allocation, binding at least


def test_a_prepare_that_outlasts_its_deadline_is_called_again_after_the_kubelets_back_off() -> None:
    slow_daemon = replace(PodStart(), container_start_s=60.0)  # ready well after the first call's deadline
    for protocol in ("nvidia", "driver-managed"):
        result = fleetmodel.run(protocol, 1, pod=slow_daemon)
        assert result.prepare_calls >= 2, protocol
        assert result.seconds >= 60.0, protocol
        assert result.driver_s >= 40.0 + PodStart().kubelet_backoff_s, protocol  # a failed call, then 10-15 s


def test_nvidias_daemons_conflict_on_their_shared_clique_and_driver_managed_never_does() -> None:
    latency = Latency(read_s=0.005, write_s=0.03, watch_s=0.005)
    assert fleetmodel.run("nvidia", 72, latency=latency).conflicts > 0
    assert fleetmodel.run("driver-managed", 72, latency=latency).conflicts == 0


def test_the_floor_sends_no_driver_request_and_starts_no_daemon() -> None:
    floor = fleetmodel.run("floor", 4, latency=Latency(write_s=0.01))
    assert floor.node_requests == 1.0  # the kubelet's read of the claim, nothing of a driver
    assert floor.seconds <= fleetmodel.run("driver-managed", 4, latency=Latency(write_s=0.01)).seconds


def test_racks_hold_at_most_18_nodes_as_evenly_as_possible() -> None:
    assert fleetmodel.racks_for(256) == [18] + [17] * 14
    assert fleetmodel.racks_for(72) == [18] * 4 and fleetmodel.racks_for(1) == [1]
    with pytest.raises(ValueError, match="at least one node"):
        fleetmodel.racks_for(0)


def test_an_unbuilt_protocol_is_refused_by_name() -> None:
    with pytest.raises(KeyError, match="'host-managed' is not built; built: driver-managed, floor, nvidia, pre-warmed"):
        fleetmodel.run("host-managed", 2)


def _model(protocol: str, nodes: int, latency: Latency) -> fleetmodel.Model:
    """A run's cluster, kept to look at what happened on its nodes (what :func:`fleetmodel.run` does)."""
    model = fleetmodel.Model(fleetmodel.PROTOCOLS[protocol](), nodes, latency, fleetmodel.APF_WORKLOAD_LOW,
                             PodStart(), 35)
    model.start()
    model.sim.run(model.done, 3600.0)
    assert model.done()
    return model


def test_a_pre_warmed_domain_is_the_floor_plus_the_controllers_three_writes_before_its_workload_template() -> None:
    latency = Latency(write_s=0.03)  # reads and watch events free: only the writes on the path count
    floor = fleetmodel.run("floor", 1, latency=latency)
    pre = fleetmodel.run("pre-warmed", 1, latency=latency)
    # finalizer, channel annotation, template create; then the floor's claim, pod status, allocation, binding
    assert pre.seconds == pytest.approx(floor.seconds + 3 * 0.03)
    assert pre.prepare_calls == 1.0 and pre.driver_s == pytest.approx(0.0)  # prepared at its first call, at once
    # the kubelet's read and the plugin's two (claim, domain); cluster-wide the controller's watch, its pass's 8
    # requests and the 3 reads of the pass its own updates queue (no claim allocated yet: no Node list, no patch)
    assert pre.node_requests == 3.0 and pre.all_requests == floor.all_requests + 2 + 1 + 8 + 3


def test_a_pre_warmed_domain_starts_no_daemon_pod_labels_no_node_and_needs_fewer_requests_than_driver_managed(
) -> None:
    latency = Latency(read_s=0.002, write_s=0.010, watch_s=0.002)
    pre = _model("pre-warmed", 36, latency)
    assert not any(n.daemon_pod or n.labelled or n.container_started is not None for n in pre.nodes)
    assert pre.api.by_verb["patch"] == 1  # the domain's status, no label, no clique write
    managed = _model("driver-managed", 36, latency)
    assert all(n.daemon_pod and n.labelled for n in managed.nodes)
    for node in pre.nodes:
        assert pre.api.requests[node.name] < managed.api.requests[node.name]
    assert sum(pre.api.requests.values()) < sum(managed.api.requests.values())
    assert max(n.prepared_at or 0.0 for n in pre.nodes) < max(n.prepared_at or 0.0 for n in managed.nodes)


def test_the_fleet_report_has_every_size_latency_and_protocol_and_the_first_pod(tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture[str]
                                                                                ) -> None:
    out = tmp_path / "fleet.json"
    assert fleet.main(["--nodes", "2,3", "--workers", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    built = sorted(fleetmodel.PROTOCOLS)
    keys = {(r["protocol"], r["nodes"], r["latency"]["write_s"]) for r in data["runs"]}
    assert keys == {(p, n, lat.write_s) for p in built for n in (2, 3) for lat in fleet.LATENCIES}
    assert {(r["protocol"], r["write_ms"]) for r in data["first_pod"]} == {
        (p, round(lat.write_s * 1e3)) for p in built for lat in fleet.LATENCIES}
    assert {(r["protocol"], r["nodes"]) for r in data["ratios"]} == {(p, n) for p in built if p != "nvidia"
                                                                      for n in (2, 3)}
    assert {r["protocol"]: r["target"] for r in data["ratios"] if r["nodes"] == 3} == {
        "driver-managed": 2.0, "pre-warmed": 10.0, "floor": None}
    assert data["not_built"] == [] and built == sorted(fleet.PROTOCOL_COLUMNS)
    assert {r["protocol"] for r in data["first_pod"] if r["target"] == fleet.FIRST_POD_TARGET_S} == {"pre-warmed"}
    for r in data["runs"]:
        assert r["seconds"] >= r["first_s"] > 0 and r["node_requests"] > 0 and r["all_requests"] >= r["node_requests"]
    table = capsys.readouterr().out
    assert "not built yet" not in table and "first pod on a fresh node" in table and "NVIDIA / pre-warmed" in table
    assert len([line for line in table.splitlines() if line.startswith("| 3 |")]) == len(fleet.LATENCIES)


def test_python_m_bench_fleet_refuses_sizes_that_are_not_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert fleet.main(["--nodes", "many"]) == 2
    assert "--nodes 'many' is not a list of numbers" in capsys.readouterr().err


def test_a_client_limit_can_be_replaced_for_a_sensitivity_run(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    assert fleet.main(["--nodes", "3", "--workers", "1", "--client", "kube-controller-manager=1/1",
                       "--json", str(out)]) == 0
    slow = {r["protocol"]: r["seconds"] for r in json.loads(out.read_text())["runs"] if r["latency"]["write_s"] == 0}
    shipped = {p: fleetmodel.run(p, 3).seconds for p in slow}
    assert all(slow[p] >= shipped[p] + 4.0 for p in slow)  # 1 write/s: 3 pods' claims and statuses, at least


def test_python_m_bench_fleet_refuses_an_unknown_client_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert fleet.main(["--nodes", "2", "--client", "etcd=1/1"]) == 2
    assert "--client 'etcd=1/1': no client kind 'etcd'" in capsys.readouterr().err
