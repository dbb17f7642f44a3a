"""The compute-domain kubelet plugin and the NVIDIA driver's state, and the start's order: a driver that is not
loaded at start and comes back, a kubeconfig that cannot work (the real plugin over the mock ``libnvidia-ml.so.1``,
the kubelet emulator over its Unix sockets, the API emulator over HTTP)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dradriver.app.computedomain import start_compute_domain_plugin
from dradriver.errors import DradriverError
from dradriver.kubeletplugin import driverstate
from dradriver.kubeletplugin.basespec import BASE_SPEC_NAME
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from tests.cdi.helpers import validate
from tests.commands.test_kubeconfig import _env
from tests.computedomain import cdplugin_helpers as cd
from tests.computedomain.test_isolation import IMEX_CTL_READY, _give_channel, _isolated
from tests.computedomain.test_plugin_fabric import FAST, NOT_SERVING, SERVING, _events, _probe, node_clique_label
from tests.factories import write_profile
from tests.plugin.test_driver_state import NEW_DRIVER, _driver_loaded, _replace_driver

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


def _majors(spec: Path) -> dict[str, set[int]]:
    """The majors of a CDI spec's device nodes by path prefix: ``/dev/nvidia<n>`` GPUs and the IMEX channels."""
    data = validate(spec.read_bytes())
    nodes = [n for d in data["devices"] for n in d["containerEdits"].get("deviceNodes") or ()]
    nodes += (data.get("containerEdits") or {}).get("deviceNodes") or []
    gpus = {n["major"] for n in nodes if n["path"].removeprefix("/dev/nvidia").isdigit()}
    channels = {n["major"] for n in nodes if n["path"].startswith("/dev/nvidia-caps-imex-channels/")}
    return {"gpu": gpus, "channel": channels}


def test_a_driver_reload_under_the_running_compute_domain_plugin_is_survived_without_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU Operator upgrade reloads the driver under the running compute-domain plugin (host-managed IMEX with a
    channel per ComputeDomain, so several channel claims share the node): NVML calls fail DRIVER_NOT_LOADED, the
    driver root's files of 580.173.02 are replaced by those of 590.48.01, the ``nvidia`` and
    ``nvidia-caps-imex-channels`` modules come back with other majors and the GPUs in another clique. The plugin
    detects it, is NOT_SERVING with a Node Event and refuses a prepare naming the reason, unprepares a claim prepared
    before; once the driver is back it re-initialises NVML, reads the new clique (node label), rewrites the base CDI
    spec for the new driver's files and device numbers and the kept claim's spec for the new channel major, prepares
    the refused claim again and a new one: the same process throughout."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)
    with SandboxNode(profile="gb200-nvl72-node") as node:
        cd.write_imex_proc(node)
        ctl = node.driver_root / "usr" / "bin" / "nvidia-imex-ctl"  # the host's IMEX daemon answers READY
        ctl.write_text(IMEX_CTL_READY)
        ctl.chmod(0o755)
        api = node.api
        assert api is not None
        profile = Path(write_profile(tmp_path, "gb200-nvl72-node", name="node"))
        old = json.loads(profile.read_text())["system"]["driverVersion"]
        config = _isolated(node, mock_profile=str(profile), healthcheck_port=0, gpu_clique_label_enabled=True)
        refs = []
        for channel, name in enumerate(("kept", "gone", "during", "after"), start=1):
            uid = cd.seed_domain(api, f"job-{name}")
            _give_channel(api, f"job-{name}", "default", channel)
            refs.append(cd.seed_claim(api, f"wl-{name}", uid, device=f"channel-{channel}"))
        kept, gone, during, after = refs
        base = node.cdi_root / BASE_SPEC_NAME
        proc_devices = node.root / "proc" / "devices"

        async def body() -> None:
            async with cd.running(config) as (plugin, kubelet):
                assert plugin.driver is not None and plugin.session is not None
                session = plugin.session
                port = plugin.servers.health_port
                assert port is not None
                answers = await kubelet.prepare([kept, gone])
                assert all(a.ok for a in answers.values()), answers
                assert f"libcuda.so.{old}" in base.read_text()
                assert _majors(base)["gpu"] == {195}
                kept_spec = cd.spec_path(node, kept.uid)
                assert _majors(kept_spec)["channel"] == {cd.CHANNEL_MAJOR}
                assert await _probe(port, "readiness") == SERVING

                with node.nvml_control.open("a") as control:  # the modules are unloaded under the plugin
                    control.write("driver unloaded\n")
                await cd.wait_for(lambda: not session.available, timeout=10)  # detected, the stale handle shut
                assert "Driver Not Loaded" in plugin.driver.reason() and not plugin.driver_read
                assert await _probe(port, "readiness") == NOT_SERVING
                away = _events(node, "NvidiaDriverUnavailable")
                assert away and "Driver Not Loaded" in away[0]["message"], away
                error = (await kubelet.prepare([during]))[during.uid].error
                assert during.uid in error and "NVIDIA driver is not available" in error, error
                assert plugin.state.get(during.uid) is None
                assert await kubelet.unprepare([gone]) == {gone.uid: ""}
                assert not cd.spec_path(node, gone.uid).exists() and plugin.state.get(gone.uid) is None

                _replace_driver(node.driver_root, old, NEW_DRIVER)  # the driver container's new user space
                proc_devices.write_text(proc_devices.read_text().replace("195 nvidia", "196 nvidia").replace(
                    f"{cd.CHANNEL_MAJOR} nvidia-caps-imex-channels", "235 nvidia-caps-imex-channels"))
                data = json.loads(profile.read_text())
                data["system"]["driverVersion"] = NEW_DRIVER
                for gpu in data["gpus"]:
                    gpu["fabric"]["cliqueId"] = 5
                profile.write_text(json.dumps(data))
                with node.nvml_control.open("a") as control:
                    control.write("driver loaded\n")
                await cd.wait_for(lambda: plugin.driver is not None and not plugin.driver.reason(), timeout=30)
                assert plugin.driver.reloads == 1 and plugin.driver_read and session.available
                moved = cd.GB200_CLIQUE.rsplit(".", 1)[0] + ".5"
                assert plugin.clique_id == moved and node_clique_label(api) == moved
                text = base.read_text()  # the base spec names the new driver's files and device numbers
                assert f"libcuda.so.{NEW_DRIVER}" in text and f"libcuda.so.{old}" not in text, text
                assert _majors(base)["gpu"] == {196}
                assert _majors(kept_spec)["channel"] == {235}  # new containers of the kept claim get the new major
                await cd.wait_for(lambda: plugin.publisher.in_sync, timeout=30)
                assert await _probe(port, "readiness") == SERVING

                answer = (await kubelet.prepare([during]))[during.uid]  # the kubelet's retry
                assert answer.error == "" and [d.device_name for d in answer.devices] == ["channel-3"]
                answer = (await kubelet.prepare([after]))[after.uid]
                assert answer.error == "" and [d.device_name for d in answer.devices] == ["channel-4"]
                assert _majors(cd.spec_path(node, after.uid))["channel"] == {235}
                answer = (await kubelet.prepare([kept]))[kept.uid]
                assert answer.error == "" and [d.device_name for d in answer.devices] == ["channel-1"]
                assert await kubelet.unprepare([kept, during, after]) == {kept.uid: "", during.uid: "",
                                                                         after.uid: ""}
                back = _events(node, "NvidiaDriverAvailable")
                assert back and f"NVIDIA driver {NEW_DRIVER} loaded again (was {old})" in back[0]["message"], back
                assert "1 prepared claim CDI spec(s) rewritten" in back[0]["message"], back

        asyncio.run(body())


def test_an_nvml_failure_of_the_fabric_check_checks_for_a_driver_reload_at_once(
        imex_node: SandboxNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fabric check's NVML calls fail DRIVER_NOT_LOADED: the driver watch checks at once, not at its next period
    (60 s here), so prepares are refused and readiness drops right after the failed check."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 60.0)
    config = cd.cd_config(imex_node, healthcheck_port=0)

    async def body() -> None:
        async with cd.running(config) as (plugin, _kubelet):
            session = plugin.session
            assert session is not None and plugin.driver is not None
            with imex_node.nvml_control.open("a") as control:
                control.write("driver unloaded\n")
            kept = await asyncio.to_thread(plugin.check_fabric)  # fails: the last reading stays
            assert kept.clique_id == cd.GB200_CLIQUE
            await cd.wait_for(lambda: not session.available, timeout=10)
            assert plugin.driver.reloads == 1 and "Driver Not Loaded" in plugin.refusal()
            with imex_node.nvml_control.open("a") as control:
                control.write("driver loaded\n")

    asyncio.run(body())
