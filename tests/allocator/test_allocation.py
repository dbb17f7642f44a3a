"""The structured allocator and the ``allocate``/``explain`` commands on realistic ResourceSlices."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.allocator.simulation import InputError, explain, load, load_objects, simulate
from dradriver.cli import main

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SEED = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"


def fixture(*names: str) -> list[str]:
    return [(FIXTURES / f"{n}.yaml").read_text() for n in ("deviceclasses", *names)]


def request(name: str, device_class: str = "gpu.nvidia.com", *selectors: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": device_class, **extra}
    if selectors:
        body["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": body}


def claim(name: str, *requests: dict[str, Any], constraints: list[Any] | None = None, **meta: Any) -> str:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", **meta},
        "spec": {"devices": devices},
    }
    return yaml.safe_dump(obj)


def results(texts: list[str]) -> dict[str, list[tuple[str, str, str]]]:
    outcome = simulate(load(texts))
    assert not outcome.failures, outcome.failures
    return {
        c["metadata"]["name"]: [
            (r["request"], r["pool"], r["device"]) for r in c["status"]["allocation"]["devices"]["results"]
        ]
        for c in outcome.claims
    }


@pytest.mark.parametrize(
    ("profile", "node", "matches"),
    [
        ("l4", "l4-node", []),
        ("a100-mig", "a100-node", ["gpu-0"]),  # A100-SXM4-40GB: 40960 MiB = 40Gi exactly
        ("h100", "h100-node", ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]),
        ("gb200", "gb200-tray-0", ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]),
    ],
)
def test_seed_selector_on_each_profile(profile: str, node: str, matches: list[str]) -> None:
    texts = [*fixture(profile), claim("big", request("gpu", "gpu.nvidia.com", SEED, allocationMode="All"))]
    outcome = simulate(load(texts))
    if not matches:
        assert outcome.failures == [
            "cannot allocate claim default/big: request 'gpu' needs all matching devices, 0 of 1 devices on node "
            "l4-node qualify (1 rejected by the request selector)"
        ]
        return
    (allocated,) = outcome.claims
    allocation = allocated["status"]["allocation"]
    assert [r["device"] for r in allocation["devices"]["results"]] == matches
    assert allocation["nodeSelector"] == {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
    }


def test_seed_example_picks_the_big_gpu_across_nodes_and_explains_the_l4() -> None:
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "big-gpu", "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [request("gpu", "gpu.nvidia.com", SEED)]}}},
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "dra-gpu-pod", "namespace": "default"},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "big-gpu"}]},
    }
    texts = [*fixture("l4", "a100-mig"), yaml.safe_dump_all([template, pod])]
    # The ResourceClaim controller's name: generateName <pod>-<pod claim name>- plus five characters.
    assert results(texts) == {"dra-gpu-pod-gpu-j9dzc": [("gpu", "a100-node", "gpu-0")]}
    text, code = explain(load([*fixture("l4"), yaml.safe_dump_all([template, pod])]))
    assert code == 1
    assert text.splitlines() == [
        "claim default/dra-gpu-pod-gpu-j9dzc (from template big-gpu for pod dra-gpu-pod): CANNOT ALLOCATE",
        "  cannot allocate claim default/dra-gpu-pod-gpu-j9dzc: request 'gpu' needs 1 device, 0 of 1 devices on node "
        "l4-node qualify (1 rejected by the request selector)",
        "  on node l4-node:",
        '  request \'gpu\': 1 device of class gpu.nvidia.com (driver is "gpu.nvidia.com" and type is "gpu") '
        "where memory at least 40Gi",
        "    pool l4-node (driver gpu.nvidia.com):",
        "      gpu-0  rejected by request selector #1: memory 23034Mi < 40Gi",
        "",
        "pod default/dra-gpu-pod: PENDING: claim(s) default/dra-gpu-pod-gpu-j9dzc cannot be allocated (see above)",
    ]


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100 80GB HBM3'", "h100-node"),
        ("device.attributes['gpu.nvidia.com'].architecture == 'Blackwell'", "gb200-tray-0"),
        ("device.attributes['gpu.nvidia.com'].architecture == 'Ada Lovelace'", "l4-node"),
        ("device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('580.150.0'))", "gb200-tray-0"),
        ("device.attributes['gpu.nvidia.com'].driverVersion.isLessThan(semver('550.0.0'))", "l4-node"),
        ("device.attributes['gpu.nvidia.com'].cudaComputeCapability.compareTo(semver('10.0.0')) >= 0", "gb200-tray-0"),
        (
            "device.attributes['gpu.nvidia.com'].cudaComputeCapability == semver('8.0.0') && "
            "device.attributes['gpu.nvidia.com'].type == 'gpu'",
            "a100-node",
        ),
    ],
)
def test_attribute_selectors_choose_the_node(selector: str, expected: str) -> None:
    texts = [*fixture("l4", "a100-mig", "h100", "gb200"), claim("c", request("gpu", "gpu.nvidia.com", selector))]
    outcome = simulate(load(texts))
    assert not outcome.failures
    assert outcome.nodes == {"default/c": expected}


def test_driver_version_semver_rejection_is_explained() -> None:
    selector = "device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('550.0.0'))"
    text, code = explain(load([*fixture("l4"), claim("c", request("gpu", "gpu.nvidia.com", selector))]))
    assert code == 1
    assert "where driverVersion greater than 550.0.0" in text
    assert "gpu-0  rejected by request selector #1: driverVersion 535.183.1 < 550.0.0" in text


def test_missing_attribute_is_an_error_reported_by_explain() -> None:
    selector = "device.attributes['gpu.nvidia.com'].partition8 == 1"
    text, code = explain(load([*fixture("l4"), claim("c", request("gpu", "gpu.nvidia.com", selector))]))
    assert code == 1
    assert (
        "gpu-0  rejected by request selector #1: error: the selector reads attribute gpu.nvidia.com/partition8, "
        "which this device does not publish"
    ) in text


def test_match_attribute_across_two_requests_keeps_one_pcie_root() -> None:
    # h100: gpu-0/gpu-1 under pci0000:15, gpu-2/gpu-3 under pci0000:97. gpu-1 is taken, so the pair under
    # one root complex must be gpu-2 + gpu-3.
    taken = claim("taken", request("gpu", "gpu.nvidia.com", "device.attributes['gpu.nvidia.com'].uuid != ''"))
    allocated = yaml.safe_load(taken)
    allocated["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "h100-node", "device": "gpu-1"}]
            }
        }
    }
    pair = claim(
        "pair",
        request("a"),
        request("b"),
        constraints=[{"requests": ["a", "b"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}],
    )
    got = results([*fixture("h100"), yaml.safe_dump(allocated), pair])
    assert got["pair"] == [("a", "h100-node", "gpu-2"), ("b", "h100-node", "gpu-3")]
    assert got["taken"] == [("gpu", "h100-node", "gpu-1")]
    text, _ = explain(load([*fixture("h100"), yaml.safe_dump(allocated), pair]))
    assert "constraint: same resource.kubernetes.io/pcieRoot for a, b" in text
    assert 'gpu-0  rejected by constraint #1: pcieRoot "pci0000:15" differs from "pci0000:97"' in text
    assert "gpu-1  already allocated to default/taken" in text


def test_match_attribute_on_mig_parent_uuid() -> None:
    mig_pair = claim(
        "two-migs",
        request("x", "mig.nvidia.com"),
        request("y", "mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile == '3g.20gb'"),
        constraints=[{"matchAttribute": "gpu.nvidia.com/parentUUID"}],
    )
    assert results([*fixture("a100-mig"), mig_pair]) == {
        "two-migs": [("x", "a100-node", "gpu-1-mig-1g5gb-19-0"), ("y", "a100-node", "gpu-1-mig-3g20gb-9-4")]
    }


def test_impossible_constraint_says_so() -> None:
    pair = claim(
        "pair",
        request("a"),
        request("b"),
        constraints=[{"requests": ["a", "b"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}],
    )
    outcome = simulate(load([*fixture("gb200"), pair]))  # four GPUs, four different root complexes
    assert outcome.failures == [
        "cannot allocate claim default/pair: no devices on node gb200-tray-0 share the same "
        "resource.kubernetes.io/pcieRoot across a, b"
    ]


FIRST_AVAILABLE = {
    "name": "gpu",
    "firstAvailable": [
        {"name": "full", "deviceClassName": "gpu.nvidia.com"},
        {
            "name": "mig",
            "deviceClassName": "mig.nvidia.com",
            "selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].profile == '2g.10gb'"}}],
        },
    ],
}


def test_first_available_falls_back_from_a_full_gpu_to_a_mig_device() -> None:
    texts = [*fixture("a100-mig"), claim("one", FIRST_AVAILABLE), claim("two", FIRST_AVAILABLE)]
    assert results(texts) == {
        "one": [("gpu/full", "a100-node", "gpu-0")],
        "two": [("gpu/mig", "a100-node", "gpu-1-mig-2g10gb-14-2")],
    }
    text, code = explain(load(texts))
    assert code == 0
    assert "request 'gpu': the first available of 'gpu/full', then 'gpu/mig'" in text
    assert "gpu-0                  already allocated to default/one" in text
    assert "gpu-1-mig-2g10gb-14-2  accepted -> allocated" in text


def test_all_mode_takes_every_matching_device_or_nothing() -> None:
    all_migs = claim("migs", request("m", "mig.nvidia.com", allocationMode="All"))
    got = results([*fixture("a100-mig"), all_migs])
    assert [d for _, _, d in got["migs"]] == [
        "gpu-1-mig-1g5gb-19-0",
        "gpu-1-mig-1g5gb-19-1",
        "gpu-1-mig-2g10gb-14-2",
        "gpu-1-mig-3g20gb-9-4",
    ]
    one = claim("one", request("m", "mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile == '3g.20gb'"))
    outcome = simulate(load([*fixture("a100-mig"), one, all_migs]))
    assert outcome.failures == [
        "cannot allocate claim default/migs: request 'm' needs all matching devices, 3 of 5 devices on node "
        "a100-node qualify (1 rejected by the class selector, 1 in use)"
    ]


def test_admin_access_shares_devices_in_use_and_is_marked() -> None:
    user = claim("user", request("gpu", count=4))
    admin = claim("monitor", request("gpu", allocationMode="All", adminAccess=True))
    outcome = simulate(load([*fixture("h100"), user, admin]))
    assert not outcome.failures
    monitor = outcome.claims[1]["status"]["allocation"]["devices"]["results"]
    assert [(r["device"], r.get("adminAccess")) for r in monitor] == [(f"gpu-{i}", True) for i in range(4)]
    # Admin-access results do not hold devices: a later ordinary claim still gets one.
    later = claim("later", request("gpu"))
    assert results([*fixture("h100"), admin, later])["later"] == [("gpu", "h100-node", "gpu-0")]


def test_admin_access_needs_the_namespace_label_when_the_namespace_is_given() -> None:
    namespace = yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}})
    admin = claim("monitor", request("gpu", adminAccess=True))
    outcome = simulate(load([*fixture("h100"), namespace, admin]))
    assert outcome.failures == [
        "cannot allocate claim default/monitor: adminAccess requires the namespace label "
        "resource.kubernetes.io/admin-access=true on namespace default"
    ]


def test_taints_block_unless_tolerated() -> None:
    sliced = yaml.safe_load((FIXTURES / "l4.yaml").read_text())
    sliced["spec"]["devices"][0]["taints"] = [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]
    texts = [(FIXTURES / "deviceclasses.yaml").read_text(), yaml.safe_dump(sliced)]
    outcome = simulate(load([*texts, claim("c", request("gpu"))]))
    assert outcome.failures == [
        "cannot allocate claim default/c: request 'gpu' needs 1 device, 0 of 1 devices on node l4-node qualify "
        "(1 tainted)"
    ]
    text, _ = explain(load([*texts, claim("c", request("gpu"))]))
    assert "gpu-0  tainted gpu.nvidia.com/xid=79:NoSchedule (not tolerated)" in text
    toleration = {"key": "gpu.nvidia.com/xid", "operator": "Exists", "effect": "NoSchedule"}
    outcome = simulate(load([*texts, claim("c", request("gpu", tolerations=[toleration]))]))
    (allocated,) = outcome.claims
    assert allocated["status"]["allocation"]["devices"]["results"][0]["tolerations"] == [toleration]


def test_shared_counters_of_partitionable_devices() -> None:
    # The full H100 consumes every memory slice; the MIG placements consume some. Once a MIG device is
    # allocated the full GPU no longer fits, and the 3g.40gb placement (slices 4-7) still does.
    mig = claim("mig", request("m", "mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"))
    full = claim("full", request("g"))
    big = claim("big", request("m", "mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile == '3g.40gb'"))
    texts = fixture("h100-partitionable")
    outcome = simulate(load([*texts, mig, full, big]))
    assert outcome.failures == [
        "cannot allocate claim default/full: request 'g' needs 1 device, 0 of 4 devices on node h100-dyn-node "
        "qualify (1 out of shared counters, 1 in use, 2 rejected by the class selector)"
    ]
    assert [c["metadata"]["name"] for c in outcome.claims] == ["mig", "big"]
    text, _ = explain(load([*texts, mig, full, big]))
    assert (
        "gpu-0                  rejected: shared counter gpu-0-counter-set/multiprocessors exhausted: "
        "needs 132, 56 left" in text
    )
    # The full GPU first: then no MIG placement fits.
    outcome = simulate(load([*texts, full, mig]))
    assert [c["metadata"]["name"] for c in outcome.claims] == ["full"]
    assert outcome.failures and "out of shared counters" in outcome.failures[0]


def test_incomplete_pool_is_not_used() -> None:
    texts = fixture("h100-partitionable")
    texts[1] = texts[1].split("---", 1)[1]  # drop the counter slice: 1 of 2 slices published
    outcome = simulate(load([*texts, claim("c", request("g"))]))
    assert outcome.failures and "in an unusable pool" in outcome.failures[0]
    text, _ = explain(load([*texts, claim("c", request("g"))]))
    assert "rejected: pool h100-dyn-node is incomplete (1 of 2 slices published)" in text


def test_count_and_the_per_claim_result_limit() -> None:
    assert len(results([*fixture("h100"), claim("c", request("gpu", count=3))])["c"]) == 3
    outcome = simulate(load([*fixture("h100"), claim("c", request("gpu", count=5))]))
    assert outcome.failures == [
        "cannot allocate claim default/c: request 'gpu' needs 5 devices, 4 of 4 devices on node h100-node qualify"
    ]
    outcome = simulate(load([*fixture("h100"), claim("c", request("gpu", count=33))]))
    assert outcome.failures == [
        "cannot allocate claim default/c: it asks for 33 devices, at most 32 fit in one allocation"
    ]


def test_class_and_claim_configs_are_copied() -> None:
    classes = yaml.safe_load_all((FIXTURES / "deviceclasses.yaml").read_text())
    config = {"opaque": {"driver": "gpu.nvidia.com", "parameters": {"kind": "GpuConfig"}}}
    docs = list(classes)
    docs[0]["spec"]["config"] = [config]
    c = yaml.safe_load(claim("c", request("gpu")))
    c["spec"]["devices"]["config"] = [{"requests": ["gpu"], **config}, {"requests": ["other"], **config}]
    outcome = simulate(load([yaml.safe_dump_all(docs), (FIXTURES / "l4.yaml").read_text(), yaml.safe_dump(c)]))
    assert outcome.claims[0]["status"]["allocation"]["devices"]["config"] == [
        {"source": "FromClass", "requests": ["gpu"], **config},
        {"source": "FromClaim", "requests": ["gpu"], **config},
    ]


def test_invalid_cel_is_reported_with_a_caret(capsys: pytest.CaptureFixture[str]) -> None:
    bad = claim("c", request("gpu", "gpu.nvidia.com", "device.capacity['gpu.nvidia.com'].memory >="))
    sys.stdin = io.StringIO("\n---\n".join([*fixture("l4"), bad]))
    try:
        assert main(["allocate"]) == 2
    finally:
        sys.stdin = sys.__stdin__
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "dradriver allocate: <stdin>: ResourceClaim default/c: spec.devices.requests[0].exactly.selectors[0]."
        "cel.expression: invalid CEL: syntax error at line 1, column 42",
        "  | device.capacity['gpu.nvidia.com'].memory >=",
        "  |                                          ^",
    ]


def test_cli_allocate_and_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    claims = tmp_path / "claims.yaml"
    claims.write_text(claim("big", request("gpu", "gpu.nvidia.com", SEED)))
    files = [str(FIXTURES / f) for f in ("deviceclasses.yaml", "l4.yaml", "h100.yaml")] + [str(claims)]
    assert main(["allocate", *files]) == 0
    (out,) = list(yaml.safe_load_all(capsys.readouterr().out))
    assert out["status"]["allocation"]["devices"]["results"] == [
        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "h100-node", "device": "gpu-0"}
    ]
    assert main(["explain", *files]) == 0
    text = capsys.readouterr().out
    assert "claim default/big: allocated on node h100-node" in text
    assert main(["allocate", str(FIXTURES / "deviceclasses.yaml"), str(FIXTURES / "l4.yaml"), str(claims)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("cannot allocate claim default/big: request 'gpu' needs 1 device")
    assert main(["allocate", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_unknown_device_class_is_named() -> None:
    outcome = simulate(load([*fixture("l4"), claim("c", request("gpu", "tpu.example.com"))]))
    assert outcome.failures == [
        "cannot allocate claim default/c: request 'gpu' uses device class 'tpu.example.com', which does not exist"
    ]


@pytest.mark.parametrize("value", ["false", "true", 0, 1])
def test_admin_access_must_be_a_boolean(value: Any) -> None:
    """``adminAccess: "false"`` in a claim's request is an input error naming the field, never truthy."""
    from dradriver.allocator.resources import InputError

    bad = claim("monitor", request("gpu", adminAccess=value))
    with pytest.raises(InputError, match=r"requests\[0\]\.exactly\.adminAccess: must be a boolean, got (str|int)"):
        simulate(load([*fixture("h100"), bad]))


def test_parsed_objects_allocate_as_their_yaml_does_and_are_not_changed() -> None:
    texts = [*fixture("h100"), claim("one", request("gpu", "gpu.nvidia.com", SEED))]
    objects = [o for t in texts for o in yaml.safe_load_all(t) if o]
    listed = [{"apiVersion": "v1", "kind": "List", "items": objects[:-1]}, objects[-1]]
    before = yaml.safe_dump_all(listed)
    from_yaml = simulate(load(texts)).claims
    from_objects = simulate(load_objects(listed, "the API emulator")).claims
    assert from_objects == from_yaml and from_yaml[0]["status"]["allocation"]
    assert yaml.safe_dump_all(listed) == before  # read, not changed
    with pytest.raises(InputError, match=r"no Kubernetes objects in the API emulator \(empty input\)"):
        load_objects([{"apiVersion": "v1", "kind": "List", "items": []}], "the API emulator")


def _pod(claims: list[dict[str, Any]], *refs: dict[str, Any]) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"},
                           "spec": {"resourceClaims": claims,
                                    "containers": [{"name": "c", "image": "x", "resources": {"claims": list(refs)}}]}})


def test_a_container_naming_an_undeclared_claim_is_refused_as_the_api_server_refuses_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pod = tmp_path / "pod.yaml"
    pod.write_text(claim("one", request("gpu")) + "---\n"
                   + _pod([{"name": "gpu", "resourceClaimName": "one"}], {"name": "gpux"}))
    files = [str(FIXTURES / "deviceclasses.yaml"), str(FIXTURES / "h100.yaml"), str(pod)]
    for command in ("explain", "allocate"):
        assert main([command, *files]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err == (f"dradriver {command}: {pod}: Pod default/p is invalid: spec.containers[0].resources.claims[0]: "
                       'Not found: "gpux": must be one of the names in pod.spec.resourceClaims: gpu\n')
    with pytest.raises(InputError, match=r'claims\[0\]: Not found: "gpu": must be one of the names in '
                                         r"pod.spec.resourceClaims which is empty$"):
        load([*fixture("h100"), _pod([], {"name": "gpu"})])
    with pytest.raises(InputError, match=r'claims\[1\]: Duplicate value: "gpu"$'):
        load([*fixture("h100"), _pod([{"name": "gpu", "resourceClaimName": "one"}], {"name": "gpu"}, {"name": "gpu"})])
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "default"},
                  "spec": {"template": {"spec": {"containers": [
                      {"name": "c", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}]}}}}
    with pytest.raises(InputError) as info:
        load([*fixture("h100"), yaml.safe_dump(deployment)], ["classes.yaml", "h100.yaml", "deploy.yaml"])
    assert str(info.value) == ("deploy.yaml: Deployment default/d is invalid: spec.template.spec.containers[0]."
                               'resources.claims[0]: Not found: "gpu": must be one of the names in '
                               "pod.spec.resourceClaims which is empty")


def test_a_cel_typo_is_refused_with_the_claim_field_and_position(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    typo = tmp_path / "typo.yaml"
    typo.write_text(claim("typo", request("gpu", "gpu.nvidia.com",
                                          "device.atributes['gpu.nvidia.com'].productName == 'x'")))
    for command in ("explain", "allocate"):
        assert main([command, str(FIXTURES / "deviceclasses.yaml"), str(FIXTURES / "h100.yaml"), str(typo)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and "celpy" not in err and "overload" not in err
        assert err.splitlines()[0] == (
            f"dradriver {command}: {typo}: ResourceClaim default/typo: spec.devices.requests[0].exactly.selectors[0]."
            "cel.expression: invalid CEL: undefined field 'atributes' (device has driver, attributes, capacity, "
            "allowMultipleAllocations) at line 1, column 8")


def _passthrough_slices(held: set[str] | None = None) -> list[str]:
    from dradriver.domain.devices import DriverVersions, NodeInventory
    from dradriver.domain.pools import build_resource_slices
    from tests.factories import gpu_device, vfio_for

    gpus = (gpu_device(0), gpu_device(1))
    inventory = NodeInventory(versions=DriverVersions(driver="570.148.08", cuda_driver=12080), gpus=gpus,
                              vfio=vfio_for(*gpus, iommufd=True))
    return [yaml.safe_dump(s) for s in build_resource_slices(inventory, "vm-node", held=held or set())]


def test_vfio_requests_allocate_over_the_published_vfio_devices() -> None:
    texts = [(FIXTURES / "deviceclasses.yaml").read_text(), *_passthrough_slices()]
    vm = claim("vm", request("vm", "vfio.gpu.nvidia.com", "device.attributes['gpu.nvidia.com'].iommuFDEnabled",
                             count=2))
    assert results([*texts, vm]) == {"vm": [("vm", "vm-node", "gpu-vfio-0"), ("vm", "vm-node", "gpu-vfio-1")]}
    text, _ = explain(load([*texts, claim("three", request("vm", "vfio.gpu.nvidia.com", count=3))]))
    assert "request 'vm' needs 3 devices, 2 of 4 devices on node vm-node qualify" in text
    assert 'gpu-0       rejected by class selector #1: type "gpu" != "vfio"' in text
    assert "gpu-vfio-1  accepted" in text


def test_a_held_vfio_device_withdraws_its_gpu_from_allocation() -> None:
    texts = [(FIXTURES / "deviceclasses.yaml").read_text(), *_passthrough_slices({"gpu-vfio-0"})]
    every = claim("all", request("gpu", "gpu.nvidia.com", allocationMode="All"))
    assert results([*texts, every]) == {"all": [("gpu", "vm-node", "gpu-1")]}
