"""VFIO passthrough deployed: ``deploy/kustomize/overlays/passthrough`` (component ``components/passthrough``) and
``deploy/helm/values-passthrough.yaml`` for NVIDIA's chart give the plugin the gate PassthroughSupport, ``HOST_ROOT``
and the host mounts NVIDIA's chart adds with that gate (the host's ``/`` at ``/host-root``, ``/sys``, ``/proc``),
and the DeviceClass ``vfio.gpu.nvidia.com``. The overlay's objects are validated against the Kubernetes schemas by
``tests/deploy/test_manifests.py`` (every overlay is a target there)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import yaml

from dradriver.domain.featuregates import parse_feature_gates

from . import chart
from .manifests import DEPLOY, container, env_of, find, mount_for, one, render, volume
from .test_manifests import K8S_VERSION, _plugin_config

OVERLAY = "overlays/passthrough"
VALUES = [yaml.safe_load((DEPLOY / "helm" / name).read_text())
          for name in ("values-dradriver.yaml", "values-passthrough.yaml")]


def _host_mounts(target: str) -> dict[str, tuple[str, str, bool]]:
    """Container path -> (host path, propagation, read-only) of the plugin's passthrough mounts in ``target``."""
    ds = one(render(target), "DaemonSet", "dradriver-kubelet-plugin")
    plugin = container(ds, "gpus")
    out = {}
    for path in ("/host-root", "/sys", "/proc", "/dev"):
        mount = next((m for m in plugin["volumeMounts"] if m["mountPath"] == path), None)
        if mount is not None:
            out[path] = (volume(ds, mount["name"])["hostPath"]["path"], mount.get("mountPropagation", ""),
                         bool(mount.get("readOnly")))
    return out


def test_passthrough_overlay_turns_the_gate_on_and_mounts_the_host_root_sys_and_proc() -> None:
    objs = render(OVERLAY)
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    plugin = container(one(objs, "DaemonSet", "dradriver-kubelet-plugin"), "gpus")
    assert env_of(plugin)["FEATURE_GATES"]["value"] == "PassthroughSupport=true"
    config = _plugin_config(OVERLAY)
    assert config.feature_gates.passthrough_support and not config.feature_gates.dynamic_mig
    assert config.host_root == Path("/host-root")
    assert mount_for(plugin, str(config.host_root))["readOnly"] is True
    assert _host_mounts(OVERLAY) == {"/host-root": ("/", "HostToContainer", True),
                                     "/sys": ("/sys", "Bidirectional", False),
                                     "/proc": ("/proc", "Bidirectional", False),
                                     "/dev": ("/dev", "HostToContainer", False)}
    assert str(config.sysfs_root) == "/sys" and str(config.proc_root) == "/proc"
    (vfio,) = [c for c in find(objs, "DeviceClass") if c["metadata"]["name"] == "vfio.gpu.nvidia.com"]
    assert [s["cel"]["expression"] for s in vfio["spec"]["selectors"]] == [
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'vfio'"]


def test_the_base_has_no_passthrough_mounts_and_the_gate_off() -> None:
    assert _host_mounts("base") == {}
    assert not _plugin_config("base").feature_gates.passthrough_support


def test_helm_passthrough_values_keep_dradrivers_gates_and_mount_what_the_overlay_mounts() -> None:
    values = chart.values(*VALUES)
    env = {e["name"]: e.get("value") for e in chart.gpus_container(values)["env"]}
    assert env["FEATURE_GATES"] == ("ComputeDomainCliques=true,IMEXDaemonsWithDNSNames=true,"
                                    "NVMLDeviceHealthCheck=true,PassthroughSupport=true,")
    gates = parse_feature_gates(env["FEATURE_GATES"], where="FEATURE_GATES")  # no exclusion refused
    assert gates.passthrough_support and not gates.fabric_manager_partitioning
    assert env["HOST_ROOT"] == "/host-root"
    mounts, volumes = chart.passthrough_volumes(values)
    host = {v["name"]: v["hostPath"]["path"] for v in volumes}
    assert {m["mountPath"].rstrip("/") or "/": (host[m["name"]].rstrip("/") or "/", m["mountPropagation"],
                                                bool(m.get("readOnly"))) for m in mounts} == {
        path: mount for path, mount in _host_mounts(OVERLAY).items() if path != "/dev"}  # /dev: beyond NVIDIA's
    assert chart.passthrough_volumes(chart.values(VALUES[0])) == ([], [])
