"""The plugin and the NVIDIA driver's state: a driver that is not loaded at start, comes back, or loses a module
while the plugin runs (the real plugin over the mock ``libnvidia-ml.so.1``, the kubelet emulator over its Unix
sockets, the API emulator over HTTP)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dradriver.app import GpuPlugin, start_plugin
from dradriver.domain.identity import GPU_DRIVER
from dradriver.kubeletplugin import driverstate
from dradriver.kubeletplugin.payload import read_payload
from dradriver.nvml import mock, settings
from dradriver.sandbox import scheduler
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.multinode import MultiNodeError, cdi_edits
from dradriver.sandbox.node import SandboxNode, install_driver_tools, lay_out_driver_tree
from tests.configs.test_plugin import allocate
from tests.factories import DEVICE_CLASS, write_profile
from tests.mps.test_plugin import mps_claim
from tests.plugin.conftest import SEED_SELECTOR, claim_object, ref_of, result, running, wait_for
from tests.plugin.test_dynamic_mig import GATES as MIG_GATES
from tests.plugin.test_dynamic_mig import ONE_G, _create_out_of_band, claim_for, state_lines
from tests.plugin.test_readiness import NOT_SERVING, SERVING, _status
from tests.plugin.test_timeslicing import GATE_ON, time_slicing


def test_a_prepare_after_nvidia_uvm_is_unloaded_fails_instead_of_reusing_its_device_numbers(
        sandbox: SandboxNode) -> None:
    """The spec-level edits are reused only while ``/proc/devices`` is what they were computed from: with
    ``nvidia-uvm`` gone the next prepare fails cleanly, as on a fresh node, instead of giving containers
    ``/dev/nvidia-uvm`` numbers of a module that is not loaded."""
    api = sandbox.api
    assert api is not None
    proc_devices = sandbox.root / "proc" / "devices"
    loaded = proc_devices.read_text()

    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            refs = []
            for name in ("before", "after", "again"):
                api.create(claim_object(name, selector=SEED_SELECTOR))
                [claim] = scheduler.allocate(api, [("default", name)], node_name=sandbox.node_name)
                refs.append(ref_of(claim))
            before, after, again = refs
            assert (await kubelet.prepare([before]))[before.uid].error == ""
            proc_devices.write_text(loaded.replace("508 nvidia-uvm\n", ""))  # the module was unloaded
            error = (await kubelet.prepare([after]))[after.uid].error
            assert after.uid in error and "nvidia-uvm" in error, error
            assert plugin.state.get(after.uid) is None
            proc_devices.write_text(loaded.replace("508 nvidia-uvm", "506 nvidia-uvm"))  # loaded again
            assert (await kubelet.prepare([again]))[again.uid].error == ""
            spec = plugin.runner.spec_path(again.uid).read_text()
            assert '"major":506' in spec.replace(" ", ""), spec

    asyncio.run(body())


def _mounted_libraries(spec_text: str) -> set[str]:
    """The file names of the libraries a claim spec mounts."""
    spec = json.loads(spec_text)
    return {os.path.basename(m["containerPath"]) for m in spec["containerEdits"].get("mounts", [])
            if ".so" in m["containerPath"]}


@pytest.mark.parametrize("change", ["driver container replaced", "library added in place"])
def test_a_driver_root_changed_at_the_same_version_gives_the_next_claim_its_new_files(
        sandbox: SandboxNode, change: str) -> None:
    """The spec-level edits are reused only while the driver root's library directory is the one they were found
    in: a driver container replaced by a rebuilt one of the same driver version (another directory there), or a
    library added beside the others, gives the next claim's spec the files there now, not the old list."""
    api = sandbox.api
    assert api is not None
    root = sandbox.driver_root
    libdir = root / "usr" / "lib" / "x86_64-linux-gnu"
    old, new = "libnvidia-egl-wayland.so.1.1.19", "libnvidia-egl-xcb.so.1.0.1"

    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            refs = []
            for name in ("before", "unchanged", "after"):
                api.create(claim_object(name, selector=SEED_SELECTOR))
                [claim] = scheduler.allocate(api, [("default", name)], node_name=sandbox.node_name)
                refs.append(ref_of(claim))
            before, unchanged, after = refs
            assert (await kubelet.prepare([before]))[before.uid].error == ""
            first = _mounted_libraries(plugin.runner.spec_path(before.uid).read_text())
            assert old in first and new not in first
            assert (await kubelet.prepare([unchanged]))[unchanged.uid].error == ""
            assert _mounted_libraries(plugin.runner.spec_path(unchanged.uid).read_text()) == first
            if change == "driver container replaced":  # the rebuilt image: another tree at the same path
                rebuilt = sandbox.root / "driver-root.rebuilt"
                shutil.copytree(root, rebuilt, symlinks=True)
                rebuilt_lib = rebuilt / libdir.relative_to(root)
                (rebuilt_lib / old).unlink()
                (rebuilt_lib / "libnvidia-egl-wayland.so.1").unlink()
                (rebuilt_lib / new).touch()
                root.rename(sandbox.root / "driver-root.old")
                rebuilt.rename(root)
            else:
                (libdir / new).touch()
            assert (await kubelet.prepare([after]))[after.uid].error == ""
            now = _mounted_libraries(plugin.runner.spec_path(after.uid).read_text())
            assert new in now
            assert (old not in now) == (change == "driver container replaced")
            assert now - {new} == first - ({old} if old not in now else set())

    asyncio.run(body())


def _driver_loaded(profile: Path, loaded: bool) -> None:
    """Load or unload the NVIDIA driver of the mock node: the mock's profile makes every ``nvmlInit`` return
    ``NVML_ERROR_DRIVER_NOT_LOADED`` (9) while ``faults.initReturn`` says so (``ext/mocknvml/README.md``)."""
    data = json.loads(profile.read_text())
    faults = data.setdefault("faults", {})
    if loaded:
        faults.pop("initReturn", None)
    else:
        faults["initReturn"] = 9
    profile.write_text(json.dumps(data))


def test_a_plugin_started_without_the_driver_unprepares_refuses_prepares_and_picks_the_driver_up(
        sandbox: SandboxNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver upgrade: a time-sliced claim was prepared, the plugin restarts while the kernel module is not
    loaded. It registers, answers the kubelet's Unprepare from its claim state (spec deleted, devices released; the
    time-slice reset, which needs NVML, kept), refuses Prepare per claim naming the reason with readiness
    NOT_SERVING, and once the driver is loaded again undoes what it kept and prepares, without a restart."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)
    api = sandbox.api
    assert api is not None
    profile = Path(write_profile(tmp_path, "dgx-h100", name="node"))
    config = sandbox.config(feature_gates=GATE_ON, mock_profile=str(profile), healthcheck_port=0)

    async def body() -> None:
        async with running(config) as (plugin, kubelet):
            assert plugin.session is not None and plugin.registry is not None
            gpu0 = getattr(plugin.registry.get("gpu-0"), "uuid", "")
            ref = ref_of(allocate(sandbox, "sliced", [result("gpu-0")], [time_slicing("Long")]))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert settings.compute_timeslice(plugin.session, gpu0) == 3
        spec = GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, ref.uid)
        assert spec.exists()

        _driver_loaded(profile, False)
        plugin = await start_plugin(config)  # starts: no exit, no crash loop
        try:
            assert plugin.driver is not None and "Driver Not Loaded" in plugin.driver.reason()
            port = plugin.servers.health_port
            assert port is not None
            events = [e for e in api.objects("Event") if e.get("reason") == "NvidiaDriverUnavailable"]
            assert events and "Driver Not Loaded" in events[0]["message"], events
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                connection = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=10)
                assert await _status(port, "readiness") == NOT_SERVING
                assert await _status(port, "liveness") == SERVING
                other = ref_of(allocate(sandbox, "waiting", [result("gpu-1")], []))
                error = (await connection.prepare([other]))[other.uid].error
                assert other.uid in error and "NVIDIA driver is not available" in error, error
                assert "Driver Not Loaded" in error, error
                assert plugin.state.get(other.uid) is None

                assert await connection.unprepare([ref]) == {ref.uid: ""}
                assert not spec.exists()
                kept = plugin.state.get(ref.uid)
                assert kept is not None and kept.devices == ()  # gpu-0 released
                assert [r.kind for r in read_payload(kept.payload).undo] == ["gpu", "timeslicing"]

                _driver_loaded(profile, True)  # the upgrade is done: the module is loaded
                await wait_for(lambda: plugin.driver is not None and not plugin.driver.reason(), timeout=30)
                assert plugin.state.get(ref.uid) is None  # the kept undo ran
                assert plugin.session is not None and plugin.session.available
                assert settings.compute_timeslice(plugin.session, gpu0) == 0
                await wait_for(lambda: plugin.publisher.in_sync, timeout=30)
                assert await _status(port, "readiness") == SERVING
                answer = (await connection.prepare([other]))[other.uid]
                assert answer.error == "" and [d.device_name for d in answer.devices] == ["gpu-1"]
                assert await connection.unprepare([other]) == {other.uid: ""}
        finally:
            await plugin.stop()

    asyncio.run(body())


def test_a_plugin_starts_when_the_driver_root_has_no_nvml_library(sandbox: SandboxNode, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver container that has not populated the driver root yet: ``--nvml-library`` names a file that does
    not exist. The plugin serves, not ready, and loads the library once it appears."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)
    library = tmp_path / "driver" / "libnvidia-ml.so.1"
    config = sandbox.config(mock_profile="", nvml_library=str(library))

    async def body() -> None:
        plugin = await start_plugin(config)
        try:
            assert plugin.driver is not None and f"NVML library {library} does not exist" in plugin.driver.reason()
            assert plugin.registry is not None and not plugin.registry.snapshot.gpus
            library.parent.mkdir()
            # the driver's SONAME link appears (to the mock: one library mapped in this process, as on a node)
            library.symlink_to(mock.library_path())
            await wait_for(lambda: plugin.driver is not None and not plugin.driver.reason(), timeout=30)
            assert len(plugin.registry.snapshot.gpus) == 8
        finally:
            await plugin.stop()

    monkeypatch.setenv(mock.PROFILE_ENV, str(mock.profile_path("dgx-h100")))
    asyncio.run(body())


def test_dynamic_mig_undo_and_sweep_wait_for_the_driver_and_run_once_it_is_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dynamic-MIG claim unprepared while the driver is not loaded: its spec goes and its placement is released at
    once; its GPU instance is destroyed when the driver is back, and the start-up sweep, which saw no devices, runs
    then too (a stray instance no claim owns is destroyed)."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)
    with SandboxNode(profile="dgx-h100", mig_state=True) as node:
        api = node.api
        assert api is not None
        api.create(DEVICE_CLASS)
        profile = Path(write_profile(tmp_path, "dgx-h100", name="node"))
        config = node.config(feature_gates=MIG_GATES, mock_profile=str(profile))

        async def body() -> None:
            async with running(config) as (_plugin, kubelet):
                ref = claim_for(node, "one-g", ONE_G.format(m=0, s=3))
                assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            _create_out_of_band(1, 19, 0, 1)  # a stray instance of another NVML client
            assert len(state_lines(node, "gi")) == 2
            _driver_loaded(profile, False)
            plugin = await start_plugin(config)
            try:
                async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                    connection = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=10)
                    assert await connection.unprepare([ref]) == {ref.uid: ""}
                    assert not GPU_DRIVER.cdi.spec_path(node.cdi_root, ref.uid).exists()
                    kept = plugin.state.get(ref.uid)
                    assert kept is not None and kept.devices == ()
                    assert [r.kind for r in read_payload(kept.payload).undo] == ["dynamic-mig"]
                    assert len(state_lines(node, "gi")) == 2  # nothing could be destroyed without the driver
                    _driver_loaded(profile, True)
                    await wait_for(lambda: plugin.driver is not None and not plugin.driver.reason(), timeout=30)
                    assert state_lines(node, "gi") == []
                    assert plugin.state.get(ref.uid) is None
            finally:
                await plugin.stop()

        asyncio.run(body())


def test_a_session_made_unavailable_by_a_reinit_after_the_driver_went_is_taken_for_the_driver_gone(
        sandbox: SandboxNode) -> None:
    """The VFIO swap re-initialises NVML (``NvmlSession.reinit``); one that runs after the module was unloaded and
    before the watch's check leaves the session without NVML, which the reload check cannot tell (it has no NVML to
    ask). The watch takes it for the driver gone: prepares refused with the reason, ``depart`` run; once the driver
    is loaded again its next try initialises NVML and runs ``arrive``. Without it the watch never tried again."""
    from dradriver.nvml.session import open_session

    session = open_session(mock_profile=sandbox.profile)
    arrived: list[bool] = []
    departed: list[str] = []
    detector = driverstate.ReloadDetector(session, lambda: {"nvidia": 195})
    watch = driverstate.DriverWatch(session, library=lambda: "", arrive=lambda: arrived.append(True),
                                    reloaded=detector.check, depart=departed.append)
    try:
        detector.remember()
        with sandbox.nvml_control.open("a") as control:
            control.write("driver unloaded\n")
        assert not session.reinit() and not watch.reason()  # the swap's re-initialisation, the watch not told
        assert watch.check_once()
        assert "Driver Not Loaded" in watch.refusal() and len(departed) == 1, (watch.refusal(), departed)
        with sandbox.nvml_control.open("a") as control:
            control.write("driver loaded\n")
        assert watch.try_once() and arrived == [True] and not watch.reason()
        assert session.available
    finally:
        session.close()


NEW_DRIVER = "590.48.01"


def _replace_driver(root: Path, old: str, new: str) -> None:
    """The driver container's upgrade of the driver root: the files of driver ``old`` (libraries, their links,
    firmware) go, those of ``new`` are laid out, with ``libnvidia-ml.so.1`` pointing at the new library."""
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if old in path.name:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        elif path.is_symlink() and not path.exists():  # a link to a file of the old driver
            path.unlink()
    lay_out_driver_tree(root, new)
    install_driver_tools(root, new)


def _slice_driver_versions(api: ApiServerEmulator) -> set[str]:
    return {str(device.get("attributes", {}).get("driverVersion", {}).get("version"))
            for item in api.objects("ResourceSlice") for device in item["spec"].get("devices", [])}


def _driver_metrics(plugin: GpuPlugin) -> tuple[float, float]:
    """``dradriver_nvidia_driver_available`` and ``dradriver_nvidia_driver_reloads_total`` as a scrape reads them."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    assert plugin.metrics is not None
    samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(plugin.metrics.registry)
                                                                       .decode()) for s in f.samples}
    return samples["dradriver_nvidia_driver_available"], samples["dradriver_nvidia_driver_reloads_total"]


def test_a_driver_reload_under_the_running_plugin_is_survived_without_a_restart(
        sandbox: SandboxNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU Operator upgrade reloads the driver under the running plugin: NVML calls fail DRIVER_NOT_LOADED, the
    driver root's files of 580.105.08 are replaced by those of 590.48.01 and the ``nvidia`` module comes back with
    another character-device major. The plugin detects it, is NOT_SERVING with a Node Event and refuses a prepare
    naming the reason, unprepares a claim prepared before; once the driver is back it re-initialises NVML, keeps
    the device names, republishes the new driver version, rewrites the spec of the claim still prepared for the
    new library files and device numbers, and prepares a new claim with them: the same process throughout. The
    metrics say it: ``dradriver_nvidia_driver_available`` 0 while away, ``..._reloads_total`` 1."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)
    api = sandbox.api
    assert api is not None
    profile = Path(write_profile(tmp_path, "dgx-h100", name="node"))
    old = json.loads(profile.read_text())["system"]["driverVersion"]
    config = sandbox.config(mock_profile=str(profile), healthcheck_port=0)
    proc_devices = sandbox.root / "proc" / "devices"

    async def body() -> None:
        async with running(config) as (plugin, kubelet):
            assert plugin.driver is not None and plugin.registry is not None
            port = plugin.servers.health_port
            assert port is not None
            uuids = {name: getattr(plugin.registry.get(name), "uuid", "") for name in ("gpu-0", "gpu-1")}
            assert _driver_metrics(plugin) == (1.0, 0.0)
            kept, gone, during, after = (ref_of(allocate(sandbox, name, [result(f"gpu-{i}")], []))
                                         for i, name in enumerate(("kept", "gone", "during", "after")))
            assert (await kubelet.prepare([kept, gone]))[kept.uid].error == ""
            kept_spec = plugin.runner.spec_path(kept.uid)
            assert f"libcuda.so.{old}" in kept_spec.read_text()
            assert await _status(port, "readiness") == SERVING

            with sandbox.nvml_control.open("a") as control:  # the modules are unloaded under the plugin
                control.write("driver unloaded\n")
            session = plugin.session
            assert session is not None
            await wait_for(lambda: not session.available, timeout=10)  # detected, the stale handle shut
            assert "Driver Not Loaded" in plugin.driver.reason()
            assert await _status(port, "readiness") == NOT_SERVING
            assert _driver_metrics(plugin) == (0.0, 1.0)
            events = [e for e in api.objects("Event") if e.get("reason") == "NvidiaDriverUnavailable"]
            assert events and "Driver Not Loaded" in events[0]["message"], events
            error = (await kubelet.prepare([during]))[during.uid].error
            assert during.uid in error and "NVIDIA driver is not available" in error, error
            assert plugin.state.get(during.uid) is None
            assert await kubelet.unprepare([gone]) == {gone.uid: ""}
            assert not plugin.runner.spec_path(gone.uid).exists() and plugin.state.get(gone.uid) is None

            _replace_driver(sandbox.driver_root, old, NEW_DRIVER)  # the driver container's new user space
            proc_devices.write_text(proc_devices.read_text().replace("195 nvidia", "196 nvidia"))
            data = json.loads(profile.read_text())
            data["system"]["driverVersion"] = NEW_DRIVER
            profile.write_text(json.dumps(data))
            with sandbox.nvml_control.open("a") as control:
                control.write("driver loaded\n")
            await wait_for(lambda: plugin.driver is not None and not plugin.driver.reason(), timeout=30)
            assert plugin.driver.reloads == 1
            assert _driver_metrics(plugin) == (1.0, 1.0)
            assert plugin.inventory.versions.driver == NEW_DRIVER
            assert {n: getattr(plugin.registry.get(n), "uuid", "") for n in uuids} == uuids  # same names
            await wait_for(lambda: plugin.publisher.in_sync and any(
                NEW_DRIVER.split(".")[0] in v for v in _slice_driver_versions(api)), timeout=30)
            assert await _status(port, "readiness") == SERVING

            rewritten = kept_spec.read_text()  # new containers of the prepared claim get the new driver
            assert f"libcuda.so.{NEW_DRIVER}" in rewritten and f"libcuda.so.{old}" not in rewritten, rewritten
            assert '"major":196' in rewritten.replace(" ", "") and '"major":195' not in rewritten.replace(" ", "")
            answer = (await kubelet.prepare([kept]))[kept.uid]
            assert answer.error == "" and [d.device_name for d in answer.devices] == ["gpu-0"]
            answer = (await kubelet.prepare([after]))[after.uid]
            assert answer.error == "" and [d.device_name for d in answer.devices] == ["gpu-3"]
            spec = plugin.runner.spec_path(after.uid).read_text()
            assert f"libcuda.so.{NEW_DRIVER}" in spec and f"libcuda.so.{old}" not in spec, spec
            answer = (await kubelet.prepare([during]))[during.uid]  # the kubelet retries the claim refused while away
            assert answer.error == "" and [d.device_name for d in answer.devices] == ["gpu-2"]
            assert await kubelet.unprepare([kept, after, during]) == {kept.uid: "", after.uid: "", during.uid: ""}
            assert plugin.state.claims() == {}
            back = [e for e in api.objects("Event") if e.get("reason") == "NvidiaDriverAvailable"]
            assert back and NEW_DRIVER in back[0]["message"], back

    asyncio.run(body())


def test_an_nvml_failure_seen_by_the_health_monitor_checks_for_a_driver_reload_at_once(
        sandbox: SandboxNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The health monitor's NVML calls fail DRIVER_NOT_LOADED: the watch checks at once, not at its next period
    (60 s here), so prepares are refused and readiness drops within the monitor's own wait."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 60.0)
    profile = Path(write_profile(tmp_path, "dgx-h100", name="node"))
    config = sandbox.config(mock_profile=str(profile), healthcheck_port=0)

    async def body() -> None:
        async with running(config) as (plugin, _kubelet):
            session = plugin.session
            assert session is not None and plugin.driver is not None
            with sandbox.nvml_control.open("a") as control:
                control.write("driver unloaded\n")
            await wait_for(lambda: not session.available, timeout=10)
            assert plugin.driver.reloads == 1 and "Driver Not Loaded" in plugin.driver.reason()
            with sandbox.nvml_control.open("a") as control:
                control.write("driver loaded\n")

    asyncio.run(body())


def test_a_new_nvidia_major_is_a_reload_and_prepared_specs_get_the_new_device_numbers(
        sandbox: SandboxNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``nvidia`` module was loaded again and its device nodes re-created with another major while NVML still
    answers: a reload all the same. NVML is initialised again and the spec of a prepared claim names the new
    numbers (``/dev/nvidia0``, ``/dev/nvidiactl``) for the containers its pod starts from now on."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)
    api = sandbox.api
    assert api is not None
    profile = Path(write_profile(tmp_path, "dgx-h100", name="node"))
    config = sandbox.config(mock_profile=str(profile), healthcheck_port=0)
    proc_devices = sandbox.root / "proc" / "devices"

    async def body() -> None:
        async with running(config) as (plugin, kubelet):
            assert plugin.driver is not None
            ref = ref_of(allocate(sandbox, "kept", [result("gpu-0")], []))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            spec = plugin.runner.spec_path(ref.uid)
            assert '"major":195' in spec.read_text().replace(" ", "")
            proc_devices.write_text(proc_devices.read_text().replace("195 nvidia", "197 nvidia"))
            await wait_for(lambda: plugin.driver is not None and plugin.driver.reloads == 1
                           and not plugin.driver.reason(), timeout=10)
            text = spec.read_text().replace(" ", "")
            assert '"major":197' in text and '"major":195' not in text, text
            assert "the nvidia character-device major was 195 and is 197 now" in "\n".join(
                e["message"] for e in api.objects("Event") if e.get("reason") == "NvidiaDriverUnavailable")

    asyncio.run(body())


@pytest.mark.parametrize("made_again", ["nvidiactl", "sysfs module"])
def test_a_same_version_same_major_reload_is_noticed_by_the_module_s_files_made_again(
        sandbox: SandboxNode, monkeypatch: pytest.MonkeyPatch, made_again: str) -> None:
    """The module is unloaded and loaded again between two checks, as the same driver version with the same
    ``nvidia`` major (195), and no NVML call of the plugin failed meanwhile: only its files tell, made again at the
    same paths (``/dev/nvidiactl``, ``/sys/module/nvidia``). The watch counts a reload, names the file in the Node
    Event, initialises NVML again and serves again; the claim prepared before is kept and answered."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)
    api = sandbox.api
    assert api is not None
    config = sandbox.config(healthcheck_port=0)
    path = {"nvidiactl": sandbox.root / "dev" / "nvidiactl",
            "sysfs module": sandbox.root / "sys" / "module" / "nvidia"}[made_again]

    async def body() -> None:
        async with running(config) as (plugin, kubelet):
            assert plugin.driver is not None
            ref = ref_of(allocate(sandbox, "kept", [result("gpu-0")], []))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            await asyncio.sleep(0.3)  # several checks: nothing changed, no reload
            assert plugin.driver.reloads == 0
            before = path.stat().st_ino
            if made_again == "nvidiactl":  # both files made again (the first one checked is named)
                sandbox.reload_kernel_module()
            else:  # only the sysfs directory: a node whose /dev the plugin does not see
                fresh = path.with_name("nvidia.new")
                fresh.mkdir()
                path.rename(path.with_name("nvidia.old"))
                fresh.rename(path)
            assert path.stat().st_ino != before
            await wait_for(lambda: plugin.driver is not None and plugin.driver.reloads == 1
                           and not plugin.driver.reason(), timeout=10)
            messages = "\n".join(e["message"] for e in api.objects("Event")
                                  if e.get("reason") == "NvidiaDriverUnavailable")
            assert f"{path} was made again: the kernel module was reloaded" in messages, messages
            assert plugin.session is not None and plugin.session.available
            answer = (await kubelet.prepare([ref]))[ref.uid]
            assert answer.error == "" and [d.device_name for d in answer.devices] == ["gpu-0"]
            await asyncio.sleep(0.3)
            assert plugin.driver.reloads == 1  # the files seen after the reload are the ones compared with now
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}

    asyncio.run(body())


def test_a_reload_that_renumbers_gpus_withdraws_a_moved_claim_s_spec_and_refuses_it_by_its_uuid(
        sandbox: SandboxNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver comes back with GPUs 0 and 1 under each other's minors: device names follow the minor
    (``gpu-<minor>``), so ``gpu-0`` is the other GPU now. The spec of a claim prepared on the old ``gpu-0`` named
    ``/dev/nvidia0``, which is the other GPU now: it is neither kept nor re-rendered for that GPU but withdrawn, so a
    container the claim's pod creates later fails to resolve the claim's CDI device instead of getting the other GPU
    (a claim is never given another GPU). The Node Event counts it, and the claim's Prepare answers naming the UUID
    it was prepared with (the "was GPU-… when prepared" rule), without writing the spec back."""
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)
    api = sandbox.api
    assert api is not None
    profile = Path(write_profile(tmp_path, "dgx-h100", name="node"))
    config = sandbox.config(mock_profile=str(profile), healthcheck_port=0)

    async def body() -> None:
        async with running(config) as (plugin, kubelet):
            assert plugin.driver is not None and plugin.registry is not None and plugin.session is not None
            session = plugin.session
            first, second = (getattr(plugin.registry.get(n), "uuid", "") for n in ("gpu-0", "gpu-1"))
            ref = ref_of(allocate(sandbox, "moved", [result("gpu-0")], []))
            answer = (await kubelet.prepare([ref]))[ref.uid]
            assert answer.error == ""
            ids = [i for device in answer.devices for i in device.cdi_device_ids]
            assert "/dev/nvidia0" in cdi_edits(sandbox.cdi_root, ids).device_paths()  # the container's GPU
            spec = plugin.runner.spec_path(ref.uid)
            with sandbox.nvml_control.open("a") as control:
                control.write("driver unloaded\n")
            await wait_for(lambda: not session.available, timeout=10)
            data = json.loads(profile.read_text())
            gpus = data["gpus"]
            gpus[0]["minorNumber"], gpus[1]["minorNumber"] = gpus[1]["minorNumber"], gpus[0]["minorNumber"]
            profile.write_text(json.dumps(data))
            with sandbox.nvml_control.open("a") as control:
                control.write("driver loaded\n")
            await wait_for(lambda: plugin.driver is not None and not plugin.driver.reason(), timeout=30)
            assert getattr(plugin.registry.get("gpu-0"), "uuid", "") == second
            assert getattr(plugin.registry.get("gpu-1"), "uuid", "") == first
            assert not spec.exists()  # /dev/nvidia0 is the other GPU now
            with pytest.raises(MultiNodeError, match="is not defined by any spec"):
                cdi_edits(sandbox.cdi_root, ids)  # the runtime refuses a new container of the claim
            error = (await kubelet.prepare([ref]))[ref.uid].error
            assert f"was {first} when the claim was prepared and is now {second}" in error, error
            assert not spec.exists()
            back = [e for e in api.objects("Event") if e.get("reason") == "NvidiaDriverAvailable"]
            assert back and "1 claim(s) refused (a claim whose devices are other GPUs now has its CDI spec withdrawn" \
                in back[0]["message"], back
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}

    asyncio.run(body())


_POLL_ACROSS_A_RELOAD = """
import json, sys
from pathlib import Path
from dradriver.health.monitor import HealthMonitor
from dradriver.nvml import discovery, mock
from dradriver.nvml.session import open_session
from dradriver.sandbox.node import install_driver_tools

root, profile, old, new = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
library = root / "usr" / "lib" / "x86_64-linux-gnu" / "libnvidia-ml.so.1"
mock.activate(str(profile))
install_driver_tools(root, old)
session = open_session(str(library))
health = HealthMonitor(discovery.discover(session), pool_name="node", session=session, poll_interval_s=3600.0)
readings = [health.poll_now() is not None]
session.lose("driver unloaded")
health.stop()
library.unlink()  # the driver container's upgrade: the new version's file, the link pointing at it
install_driver_tools(root, new)
data = json.loads(profile.read_text())
data["system"]["driverVersion"] = new
profile.write_text(json.dumps(data))
assert session.init(str(library)), session.unavailable_reason
sample = health.poll_now()
readings.append(sample is not None and all(code in (0, 3) for code in sample.status))
print(json.dumps({"driver": session.driver_version(), "readings": readings, "errors": health.nvml_errors()}))
"""


@pytest.mark.parametrize("twin", ["compiled", "python"])
def test_the_health_poller_samples_the_library_the_session_opened_after_a_reload_to_another_version(
        tmp_path: Path, twin: str) -> None:
    """After a reload to another driver version NVML is opened from the new driver's ``libnvidia-ml.so.<version>``
    while the old copy stays mapped in the process, and each copy answers for its own file (the mock refuses an
    init with LIB_RM_VERSION_MISMATCH when its file's version is not the loaded driver's). The health poller, both
    the compiled one and its pynvml twin, samples through the session's library: readings before and after, no
    NVML error; a poller that found ``libnvidia-ml.so.1`` by name would keep the old copy. A fresh process, since
    which copy a lookup by name finds depends on what the process loaded first."""
    profile = Path(write_profile(tmp_path, "dgx-h100", name="node"))
    old = json.loads(profile.read_text())["system"]["driverVersion"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    if twin == "python":
        env["DRADRIVER_NO_EXTENSIONS"] = "1"
    else:
        env.pop("DRADRIVER_NO_EXTENSIONS", None)
    done = subprocess.run([sys.executable, "-c", _POLL_ACROSS_A_RELOAD, str(tmp_path / "driver"), str(profile), old,
                           NEW_DRIVER], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["driver"] == NEW_DRIVER
    assert answer["readings"] == [True, True], done.stderr
    assert answer["errors"] == {}, answer


def _reload_driver(node: SandboxNode, profile: Path, old: str, new: str) -> None:
    """The GPU Operator's upgrade under the running plugin, seen from the node: the module unloaded (every NVML call
    of the plugin's session fails DRIVER_NOT_LOADED), the driver root's files replaced, the module loaded again as
    driver ``new`` (same ``nvidia`` major). The caller waits for the plugin between the two halves."""
    with node.nvml_control.open("a") as control:
        control.write("driver unloaded\n")


def _driver_back(node: SandboxNode, profile: Path, old: str, new: str) -> None:
    _replace_driver(node.driver_root, old, new)
    data = json.loads(profile.read_text())
    data["system"]["driverVersion"] = new
    profile.write_text(json.dumps(data))
    with node.nvml_control.open("a") as control:
        control.write("driver loaded\n")


def _semver(version: str) -> str:
    """A driver version as its ``driverVersion`` attribute spells it (semver: no leading zeros)."""
    return ".".join(str(int(part)) for part in version.split("."))


def _metadata_driver_versions(node: SandboxNode, uid: str) -> tuple[set[str], set[int]]:
    """The ``driverVersion`` attributes (as driver versions) and generations a container of the claim reads in its
    metadata files (followed from the claim's CDI spec, as the runtime mounts them)."""
    from dradriver.domain import devicemetadata as dm
    from tests.cdi.helpers import read_mounted_metadata, validate

    spec = validate(GPU_DRIVER.cdi.spec_path(node.cdi_root, uid).read_bytes())
    versions: set[str] = set()
    generations: set[int] = set()
    for mounts in dm.spec_mounts(spec).values():
        for mount in mounts:
            doc = read_mounted_metadata(mount)[0]
            generations.add(int(doc["metadata"]["generation"]))
            versions |= {str(d["attributes"]["driverVersion"]["version"])
                         for r in doc["requests"] for d in r["devices"]}
    return versions, generations


@pytest.mark.parametrize("kind", ["static-mig", "dynamic-mig", "mps", "consumable-share"])
def test_mig_dynamic_mig_and_share_claims_with_device_metadata_cross_a_reload_and_a_refused_claim_is_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A reload under the running plugin with a claim of each other device kind prepared before it, with the
    ``DeviceMetadata`` gate: a static MIG device (dgx-a100), a dynamic MIG device (``DynamicMIG``), an MPS-shared
    GPU (``MPSSupport``, its control daemon), a consumable share of an H200 (``--consumable-shares``, its MPS
    control daemon). While the driver is away a second claim of
    the kind is refused naming the reason; the kubelet retries it once the driver is back and it is prepared. The
    claim prepared before keeps its device, its spec names the new driver's files and its metadata file the new
    ``driverVersion`` (generation 2); the retried claim's file names it too. Both are unprepared cleanly after: no
    claim state, spec, metadata file, MIG instance or MPS daemon is left."""
    from dradriver.domain.featuregates import FeatureGates
    from dradriver.host.devicemetadata import SUBDIR
    from dradriver.sandbox.node import SANDBOX_NAMESPACE
    from dradriver.sandbox.profiles import h200_node
    from tests.plugin.test_shares import allocate as allocate_shares
    from tests.plugin.test_shares import share_claim

    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)
    base = {"static-mig": "dgx-a100", "dynamic-mig": "dgx-h100", "mps": "dgx-h100",
            "consumable-share": h200_node(tmp_path, gpus=2)}[kind]
    profile = Path(write_profile(tmp_path, base, name="node"))
    old = json.loads(profile.read_text())["system"]["driverVersion"]
    metadata = FeatureGates({"DeviceMetadata": True})
    with SandboxNode(profile=str(profile), mig_state=kind == "dynamic-mig") as node:
        api = node.api
        assert api is not None
        api.create(DEVICE_CLASS)
        if kind in ("mps", "consumable-share"):
            node.run_workloads()
            config = node.shares_config() if kind == "consumable-share" else node.mps_config()
            config = dataclasses.replace(config, feature_gates=config.feature_gates.with_gates(DeviceMetadata=True))
        elif kind == "dynamic-mig":
            config = node.config(feature_gates=MIG_GATES.with_gates(DeviceMetadata=True))
        else:
            config = node.config(feature_gates=metadata)

        async def body() -> None:
            async with running(config) as (plugin, kubelet):
                assert plugin.driver is not None and plugin.registry is not None and plugin.session is not None
                session = plugin.session
                await wait_for(lambda: bool(api.objects("ResourceSlice")))
                if kind == "static-mig":
                    migs = [d.name for d in plugin.inventory.allocatable() if "-mig-" in d.name]
                    kept, during = (ref_of(allocate(node, name, [result(device)], []))
                                    for name, device in (("kept", migs[0]), ("during", migs[-1])))
                elif kind == "dynamic-mig":
                    kept = claim_for(node, "kept", ONE_G.format(m=0, s=3))
                    during = claim_for(node, "during", ONE_G.format(m=1, s=0))
                elif kind == "mps":
                    (kept, _), (during, _) = mps_claim(node, "kept"), mps_claim(node, "during")
                else:
                    kept, during = (ref_of(c) for c in allocate_shares(node, share_claim("kept"),
                                                                         share_claim("during")))
                answer = (await kubelet.prepare([kept]))[kept.uid]
                assert answer.error == ""
                devices = [d.device_name for d in answer.devices]
                kept_spec = plugin.runner.spec_path(kept.uid)
                assert f"libcuda.so.{old}" in kept_spec.read_text()
                assert _metadata_driver_versions(node, kept.uid) == ({_semver(old)}, {1})

                _reload_driver(node, profile, old, NEW_DRIVER)
                await wait_for(lambda: not session.available, timeout=10)
                error = (await kubelet.prepare([during]))[during.uid].error
                assert during.uid in error and "NVIDIA driver is not available" in error, error
                assert plugin.state.get(during.uid) is None

                _driver_back(node, profile, old, NEW_DRIVER)
                await wait_for(lambda: plugin.driver is not None and not plugin.driver.reason(), timeout=30)
                assert plugin.driver.reloads == 1 and plugin.inventory.versions.driver == NEW_DRIVER
                rewritten = kept_spec.read_text()
                assert f"libcuda.so.{NEW_DRIVER}" in rewritten and f"libcuda.so.{old}" not in rewritten, rewritten
                assert _metadata_driver_versions(node, kept.uid) == ({_semver(NEW_DRIVER)}, {2})
                answer = (await kubelet.prepare([kept]))[kept.uid]  # the kubelet's retry of a prepared claim
                assert answer.error == "" and [d.device_name for d in answer.devices] == devices

                answer = (await kubelet.prepare([during]))[during.uid]  # the kubelet retries the refused claim
                assert answer.error == "", answer.error
                assert f"libcuda.so.{NEW_DRIVER}" in plugin.runner.spec_path(during.uid).read_text()
                assert _metadata_driver_versions(node, during.uid) == ({_semver(NEW_DRIVER)}, {1})

                assert await kubelet.unprepare([kept, during]) == {kept.uid: "", during.uid: ""}
                assert plugin.state.claims() == {}
                assert not kept_spec.exists() and not plugin.runner.spec_path(during.uid).exists()
                assert list((config.plugin_dir / SUBDIR).iterdir()) == []
                if kind == "dynamic-mig":
                    assert state_lines(node, "gi") == [] and state_lines(node, "ci") == []
                if kind in ("mps", "consumable-share"):
                    await wait_for(lambda: not [d for d in api.objects("Deployment")
                                                if d["metadata"].get("namespace") == SANDBOX_NAMESPACE], timeout=30)

        asyncio.run(body())
