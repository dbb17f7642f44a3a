"""ComputeDomains in the allocation simulator: NVIDIA's example manifests (``fixtures/nvidia/imex-*.yaml``, copied
with their provenance) allocate as they mean on GB200 nodes whose ResourceSlices are what our plugins publish (the
GPU plugin's through ``dradriver inspect``, the compute-domain plugin's from the function it publishes with), and
``explain`` says why a domain's Pod stays pending."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from dradriver.allocator.simulation import InputError, explain, load, simulate
from dradriver.domain.cdtemplates import ControllerSettings, daemon_claim_template, workload_claim_template
from dradriver.domain.computedomains import COMPUTE_DOMAIN_KIND as KIND
from dradriver.domain.computedomains import ComputeDomain, plugin_resource_slices
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER
from tests.allocator.nvidia_examples import CLASSES, example, inspected


@pytest.fixture
def gpu_slices() -> dict[str, list[dict[str, Any]]]:
    """Node name -> the GPU plugin's slices of a GB200 NVL72 compute tray (4 GPUs), as ``dradriver inspect`` prints."""
    return {node: inspected("--mock-profile", "gb200-nvl72-node", "--node-name", node)
            for node in ("gb-a", "gb-b", "gb-c", "gb-d")}


def cluster(gpu_slices: dict[str, list[dict[str, Any]]], nodes: int, *extra: dict[str, Any]) -> list[str]:
    """DeviceClasses, then for each of ``nodes`` nodes its GPU slices and the compute-domain plugin's slices."""
    objects: list[dict[str, Any]] = []
    for node in sorted(gpu_slices)[:nodes]:
        for i, s in enumerate([*copy.deepcopy(gpu_slices[node]),
                               *plugin_resource_slices(node, COMPUTE_DOMAIN_DRIVER.driver_name, daemon=True)]):
            s["metadata"] = {"name": f"{node}-{s['spec']['driver']}-{i}"}
            objects.append(s)
    return [CLASSES, yaml.safe_dump_all([*objects, *extra])]


def allocated(outcome: Any) -> dict[str, list[tuple[str, str]]]:
    return {f"{c['metadata']['namespace']}/{c['metadata']['name']}":
            [(r["pool"], r["device"]) for r in c["status"]["allocation"]["devices"]["results"]]
            for c in outcome.claims}


def test_channel_injection_pod_gets_channel_0_and_its_node_an_imex_daemon_claim(
        gpu_slices: dict[str, list[dict[str, Any]]]) -> None:
    inputs = load([*cluster(gpu_slices, 1), example("imex-channel-injection.yaml")])
    assert not inputs.warnings  # the ComputeDomain is read, not "a kind the simulator does not read"
    outcome = simulate(inputs)
    assert not outcome.failures
    assert outcome.pod_nodes == {"default/imex-channel-injection": "gb-a"}
    claims = allocated(outcome)
    [channel] = [v for k, v in claims.items() if "imex-channel-0" in k]
    [daemon] = [v for k, v in claims.items() if "/computedomain-daemon-" in k]
    assert channel == [("gb-a", "channel-0")] and daemon == [("gb-a", "daemon-0")]
    text, code = explain(inputs)
    assert code == 0
    assert "ComputeDomain default/imex-channel-injection: ResourceClaimTemplate default/imex-channel-0" in text
    assert "IMEX daemon pod computedomain-daemon-" in text


def test_channel_claims_carry_the_controllers_template(gpu_slices: dict[str, list[dict[str, Any]]]) -> None:
    """The claims come from the very templates the controller creates (allocationMode All kept in the config)."""
    inputs = load([*cluster(gpu_slices, 1), example("imex-channel-injection-all.yaml")])
    outcome = simulate(inputs)
    assert not outcome.failures
    [domain] = [d for d in yaml.safe_load_all(example("imex-channel-injection-all.yaml"))
                if d and d["kind"] == "ComputeDomain"]
    uid = next(iter(inputs.domains.domains))
    cd = ComputeDomain.from_object({**domain, "metadata": {**domain["metadata"], "namespace": "default", "uid": uid}})
    expected = workload_claim_template(cd, ControllerSettings())
    [channel] = [c for c in outcome.claims if c["metadata"]["name"].startswith("imex-channel-injection-all-")]
    assert channel["spec"] == expected["spec"]["spec"]
    assert channel["spec"]["devices"]["config"][0]["opaque"]["parameters"]["allocationMode"] == "All"
    [daemon] = [c for c in outcome.claims if c["metadata"]["name"].startswith("computedomain-daemon-")]
    assert daemon["spec"] == daemon_claim_template(cd, ControllerSettings())["spec"]["spec"]


def test_nvbandwidth_job_runs_one_worker_per_node_with_a_channel_daemon_and_two_gpus(
        gpu_slices: dict[str, list[dict[str, Any]]]) -> None:
    inputs = load([*cluster(gpu_slices, 4), example("imex-nvbandwidth-test-job.yaml")])
    outcome = simulate(inputs)
    assert not outcome.failures
    workers = {pod: node for pod, node in outcome.pod_nodes.items() if "-worker-" in pod}
    # numNodes 4: one worker per node
    assert sorted(str(node) for node in workers.values()) == ["gb-a", "gb-b", "gb-c", "gb-d"]
    for pod, node in workers.items():
        name = pod.split("/")[1]
        devices = [d for k, v in allocated(outcome).items() if name in k for d in v]
        assert (node, "channel-0") in devices
        assert sum(1 for pool, device in devices if pool == node and device.startswith("gpu-")) == 2


def test_explain_names_the_taken_channel_when_the_domain_has_more_pods_than_nodes(
        gpu_slices: dict[str, list[dict[str, Any]]]) -> None:
    inputs = load([*cluster(gpu_slices, 3), example("imex-nvbandwidth-test-job.yaml")])
    outcome = simulate(inputs)
    assert len(outcome.failures) == 1 and "nvbandwidth-test-worker-3" in outcome.failures[0]
    text, code = explain(inputs)
    assert code != 0
    section = text[text.index("claim default/nvbandwidth-test-worker-3-compute-domain-channel"):]
    assert "channel-0  already allocated to default/nvbandwidth-test-worker-" in section


def test_two_domains_share_no_node_and_explain_names_the_other_domains_daemon(
        gpu_slices: dict[str, list[dict[str, Any]]]) -> None:
    first = load([*cluster(gpu_slices, 2), example("imex-nvbandwidth-test-job-1.yaml")])
    done = simulate(first)
    assert not done.failures
    # The first job runs (its claims allocated, as a dump shows them); only its daemon on gb-a is kept, as if its
    # worker there had finished but the daemon were still up: channel-0 of gb-a is free, daemon-0 is not.
    [kept] = [c for c in done.claims if c["metadata"]["name"].startswith("computedomain-daemon-")
              and c["status"]["allocation"]["devices"]["results"][0]["pool"] == "gb-a"]
    second = load([*cluster(gpu_slices, 1, kept), example("imex-channel-injection.yaml")])
    outcome = simulate(second)
    assert len(outcome.failures) == 1
    text, code = explain(second)
    assert code != 0
    section = text[text.index("claim default/computedomain-daemon-"):]
    assert f"daemon-0   already allocated to default/{kept['metadata']['name']}" in section


def test_a_compute_domain_without_its_template_name_is_refused_with_the_field() -> None:
    broken = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
              "metadata": {"name": "cd", "namespace": "team"}, "spec": {"numNodes": 1, "channel": {}}}
    with pytest.raises(InputError, match=r"^cd.yaml: ComputeDomain team/cd: spec.channel.resourceClaimTemplate.name "
                                         "is required"):
        load([CLASSES, yaml.safe_dump(broken)], ["deviceclasses.yaml", "cd.yaml"])


def test_nvbandwidth_job_without_a_compute_domain_gets_gpus_and_no_channel(
        gpu_slices: dict[str, list[dict[str, Any]]]) -> None:
    inputs = load([*cluster(gpu_slices, 2), example("imex-nvbandwidth-test-no-compute-domain-job.yaml")])
    assert not inputs.warnings and not inputs.domains.workload
    outcome = simulate(inputs)
    assert not outcome.failures
    devices = [d for v in allocated(outcome).values() for d in v]
    assert len(devices) == 8 and all(device.startswith("gpu-") for _, device in devices)  # 4 workers, 2 GPUs each


def test_a_cluster_dump_with_the_controllers_templates_allocates_the_same_claims(
        gpu_slices: dict[str, list[dict[str, Any]]]) -> None:
    """A dump holds the ComputeDomain (with its UID) and the templates the controller made: they are used as given,
    and the daemon template is claimed only by the daemon pods, never alone."""
    [domain] = [d for d in yaml.safe_load_all(example("imex-channel-injection.yaml")) if d and d["kind"] == KIND]
    domain["metadata"].update(namespace="default", uid="0c3f1a52-7d1e-4c53-9f43-1b1d6f0c9a11")
    cd = ComputeDomain.from_object(domain)
    pod = next(d for d in yaml.safe_load_all(example("imex-channel-injection.yaml")) if d and d["kind"] == "Pod")
    settings = ControllerSettings(namespace="nvidia-dra-driver-gpu")
    dump = [domain, workload_claim_template(cd, settings), daemon_claim_template(cd, settings), pod]
    inputs = load([*cluster(gpu_slices, 1), yaml.safe_dump_all(dump)])
    outcome = simulate(inputs)
    assert not outcome.failures
    names = sorted(f"{c['metadata']['namespace']}/{c['metadata']['name']}" for c in outcome.claims)
    assert len(names) == 2  # the pod's channel claim and its node's daemon claim, nothing else
    assert names[0].startswith("default/imex-channel-injection-imex-channel-0-")
    assert names[1].startswith(f"nvidia-dra-driver-gpu/computedomain-daemon-{cd.uid}"[:40])
