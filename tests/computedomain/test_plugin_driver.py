"""The compute-domain kubelet plugin and the NVIDIA driver's state, and the start's order: a driver that is not
loaded at start and comes back, a kubeconfig that cannot work (the real plugin over the mock ``libnvidia-ml.so.1``,
the kubelet emulator over its Unix sockets, the API emulator over HTTP)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from dradriver.app.computedomain import BASE_SPEC_NAME, start_compute_domain_plugin
from dradriver.errors import DradriverError
from dradriver.kubeletplugin import driverstate
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from tests.commands.test_kubeconfig import _env
from tests.computedomain import cdplugin_helpers as cd
from tests.computedomain.test_plugin_fabric import FAST, NOT_SERVING, SERVING, _events, _probe, node_clique_label
from tests.factories import write_profile
from tests.plugin.test_driver_state import _driver_loaded

REPO = Path(__file__).resolve().parents[2]


def test_the_compute_domain_plugin_started_without_the_driver_unprepares_refuses_prepares_and_picks_the_driver_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver upgrade evicts a ComputeDomain's pods: a channel claim and a daemon claim were prepared, the plugin
    restarts while the kernel module is not loaded. It registers, records a ``NvidiaDriverUnavailable`` Event,
    answers the kubelet's Unprepare from its claim state (specs deleted, records gone, the domain's node label
    removed), refuses Prepare per claim naming the reason with readiness NOT_SERVING, and once the driver is loaded
    again reads the fabric, writes the base spec, sets the clique label, publishes and prepares, without a
    restart."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)
    with SandboxNode(profile="gb200-nvl72-node") as node:
        cd.write_imex_proc(node)
        api = node.api
        assert api is not None
        profile = Path(write_profile(tmp_path, "gb200-nvl72-node", name="node"))
        config = cd.cd_config(node, mock_profile=str(profile), healthcheck_port=0, gpu_clique_label_enabled=True)
        uid = cd.seed_domain(api)
        cd.seed_clique(api, uid, node.node_name, "Ready")
        channel = cd.seed_claim(api, "wl-0", uid)
        daemon = cd.seed_claim(api, "daemon", uid, namespace=cd.DRIVER_NAMESPACE, kind="daemon")
        base = node.cdi_root / BASE_SPEC_NAME

        async def body() -> None:
            async with cd.running(config) as (_plugin, kubelet):
                answers = await kubelet.prepare([channel, daemon])
                assert all(a.ok for a in answers.values()), answers
                assert cd.node_label(api) == uid
            assert cd.spec_path(node, channel.uid).exists() and cd.spec_path(node, daemon.uid).exists()

            _driver_loaded(profile, False)  # the driver's upgrade unloads the module
            base.unlink()
            plugin = await start_compute_domain_plugin(config)  # starts: no exit, no crash loop
            try:
                assert plugin.driver is not None and "Driver Not Loaded" in plugin.driver.reason()
                events = [e for e in api.objects("Event") if e.get("reason") == "NvidiaDriverUnavailable"]
                assert events and "Driver Not Loaded" in events[0]["message"], events
                assert not base.exists() and not plugin.driver_read
                port = plugin.servers.health_port
                assert port is not None
                async with KubeletEmulator(config.kubelet_registrar_directory_path) as emulator:
                    connection = await emulator.wait_for_plugin(cd.DRIVER, timeout=10)
                    assert await _probe(port, "readiness") == NOT_SERVING
                    assert await _probe(port, "liveness") == SERVING
                    other = cd.seed_claim(api, "wl-1", uid)
                    error = (await connection.prepare([other]))[other.uid].error
                    assert other.uid in error and "NVIDIA driver is not available" in error, error
                    assert "Driver Not Loaded" in error, error
                    assert plugin.state.get(other.uid) is None

                    assert await connection.unprepare([channel, daemon]) == {channel.uid: "", daemon.uid: ""}
                    assert not any(cd.spec_path(node, ref.uid).exists() for ref in (channel, daemon))
                    assert plugin.state.get(channel.uid) is None and plugin.state.get(daemon.uid) is None
                    assert cd.node_label(api) is None  # the domain's label goes as on any unprepare

                    _driver_loaded(profile, True)  # the upgrade is done: the module is loaded
                    await cd.wait_for(lambda: plugin.driver is not None and not plugin.driver.reason(), timeout=30)
                    assert plugin.driver_read and plugin.clique_id == cd.GB200_CLIQUE
                    assert node_clique_label(api) == cd.GB200_CLIQUE
                    assert base.exists()
                    await cd.wait_for(lambda: plugin.publisher.in_sync and bool(api.objects("ResourceSlice")),
                                   timeout=30)
                    assert await _probe(port, "readiness") == SERVING
                    answer = (await connection.prepare([other]))[other.uid]
                    assert answer.error == "" and [d.device_name for d in answer.devices] == ["channel-0"]
                    assert cd.node_label(api) == uid
                    assert await connection.unprepare([other]) == {other.uid: ""}
            finally:
                await plugin.stop()

        asyncio.run(body())


def test_a_compute_domain_plugin_start_that_fails_on_the_kubeconfig_touches_nothing_on_the_host(
        sandbox: SandboxNode, tmp_path: Path) -> None:
    """Validate, then touch the host: ``compute-domain-kubelet-plugin`` with a kubeconfig that cannot be loaded
    fails with one line naming it, before its plugin directory, the CDI root or a socket is created."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\n\tkind: Config\n")
    env = _env(sandbox, kubeconfig)
    cdi_root = tmp_path / "cdi-not-yet"
    env["CDI_ROOT"] = str(cdi_root)
    proc = subprocess.run([sys.executable, "-m", "dradriver", "compute-domain-kubelet-plugin"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot start the kubelet plugin" in proc.stderr and "invalid YAML" in proc.stderr, proc.stderr
    assert not cdi_root.exists()
    registry, plugins = Path(env["KUBELET_REGISTRAR_DIRECTORY_PATH"]), Path(env["KUBELET_PLUGINS_DIRECTORY_PATH"])
    assert list(registry.iterdir()) == [] and list(plugins.iterdir()) == [], (list(registry.iterdir()),
                                                                               list(plugins.iterdir()))


def test_start_compute_domain_plugin_connects_before_creating_its_directories(sandbox: SandboxNode,
                                                                               tmp_path: Path) -> None:
    """The composition connects first: a kubeconfig that cannot be loaded creates neither the plugin directory nor
    the CDI root."""
    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\n\tkind: Config\n")
    config = cd.cd_config(sandbox, kubeconfig=str(bad), cdi_root=tmp_path / "cdi",
                       kubelet_plugins_directory_path=tmp_path / "plugins")
    with pytest.raises(DradriverError, match="invalid YAML"):
        asyncio.run(start_compute_domain_plugin(config))
    assert not (tmp_path / "cdi").exists() and not (tmp_path / "plugins").exists()


def test_a_driver_back_while_the_fabric_registers_waits_for_the_fabric_and_a_stop_ends_the_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver comes back before the fabric manager registered GPU 2: the plugin, still serving, waits for the
    registration (``FabricRegistrationPending`` Event, prepares refused naming it); a stop meanwhile ends the wait at
    once instead of the driver watch's thread outliving the plugin."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)

    def registering(data: dict[str, object]) -> None:
        gpus = data["gpus"]
        assert isinstance(gpus, list)
        gpus[2]["fabric"].update(state=2)  # IN_PROGRESS

    with SandboxNode(profile="gb200-nvl72-node") as node:
        cd.write_imex_proc(node)
        api = node.api
        assert api is not None
        profile = Path(write_profile(tmp_path, "gb200-nvl72-node", registering, name="node"))
        _driver_loaded(profile, False)
        config = cd.cd_config(node, mock_profile=str(profile))

        async def body() -> None:
            plugin = await start_compute_domain_plugin(config, fabric_wait=FAST)
            stopped = False
            try:
                assert plugin.driver is not None and "Driver Not Loaded" in plugin.driver.reason()
                _driver_loaded(profile, True)
                await cd.wait_for(lambda: bool(plugin.fabric_pending), timeout=30)
                assert "GPU 2 (GPU-" in plugin.fabric_pending and not plugin.driver_read
                await cd.wait_for(lambda: bool(_events(node, "FabricRegistrationPending")), timeout=10)
                async with KubeletEmulator(config.kubelet_registrar_directory_path) as emulator:
                    connection = await emulator.wait_for_plugin(cd.DRIVER, timeout=10)
                    ref = cd.seed_claim(api, "wl-0", cd.seed_domain(api))
                    error = (await connection.prepare([ref]))[ref.uid].error
                    assert "waiting for NVLink fabric registration (GPU 2 (GPU-" in error, error
                loop = asyncio.get_running_loop()
                began = loop.time()
                await plugin.stop()
                stopped = True
                assert loop.time() - began < 5.0
                assert not config.registration_socket.exists() and not config.dra_socket.exists()
            finally:
                if not stopped:
                    await plugin.stop()

        asyncio.run(body())
