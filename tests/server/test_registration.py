"""Registration with the kubelet emulator over real Unix sockets."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from dradriver.sandbox.kubelet import KubeletEmulator, KubeletError, SyncKubeletEmulator
from dradriver.server import start_servers
from dradriver.server.registration import RegistrationStatus

from .conftest import TablePreparer, claims, make_config, run

pytestmark = pytest.mark.timeout(15)


def test_registration_flow(short_dir: Path) -> None:
    verdicts: list[RegistrationStatus] = []

    async def scenario() -> None:
        config = make_config(short_dir)
        async with await start_servers(config, TablePreparer(), on_registration_status=verdicts.append) as servers:
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
                assert plugin.registration_socket == config.registration_socket
                assert plugin.endpoint == str(config.dra_socket)
                assert plugin.service == "v1.DRAPlugin"
                assert await servers.registration.wait_status() == RegistrationStatus(registered=True)
                info = await plugin.get_info()
                assert (info.type, info.name, info.endpoint) == ("DRAPlugin", "gpu.nvidia.com", str(config.dra_socket))
                assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
                assert (await plugin.prepare(claims("u1")))["u1"].ok

    run(scenario())
    assert verdicts == [RegistrationStatus(registered=True)]


def test_socket_names(short_dir: Path) -> None:
    config = make_config(short_dir)
    assert config.registration_socket == short_dir / "registry" / "gpu.nvidia.com-reg.sock"
    assert config.dra_socket == short_dir / "plugins" / "gpu.nvidia.com" / "dra.sock"


def test_health_service_advertised_last_when_served(short_dir: Path) -> None:
    class NoDevices:
        async def watch(self):  # type: ignore[no-untyped-def]
            yield []

    async def scenario() -> list[str]:
        config = make_config(short_dir)
        async with await start_servers(config, TablePreparer(), health_source=NoDevices()):
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
                return list(plugin.supported_versions)

    assert run(scenario()) == ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]


def test_older_kubelet_negotiates_v1beta1(short_dir: Path) -> None:
    async def scenario() -> str:
        config = make_config(short_dir)
        async with await start_servers(config, TablePreparer()):
            kubelet = KubeletEmulator(config.kubelet_registrar_directory_path, kubelet_services=["v1beta1.DRAPlugin"])
            async with kubelet:
                plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
                assert (await plugin.prepare(claims("u1")))["u1"].ok
                return plugin.service

    assert run(scenario()) == "v1beta1.DRAPlugin"


def test_refused_registration_is_reported_to_the_plugin(short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    verdicts: list[RegistrationStatus] = []

    async def scenario() -> None:
        config = make_config(short_dir)
        async with await start_servers(config, TablePreparer(), on_registration_status=verdicts.append) as servers:
            kubelet = KubeletEmulator(config.kubelet_registrar_directory_path, kubelet_services=["v2.DRAPlugin"])
            async with kubelet:
                with pytest.raises(KubeletError, match="none of services supported by the plugin"):
                    await kubelet.register(config.registration_socket)
                status = await servers.registration.wait_status()
                assert not status.registered
                assert "none of services" in status.error
                with pytest.raises(KubeletError, match="did not register"):
                    await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=0.2)

    run(scenario())
    assert [v.registered for v in verdicts] == [False, False]
    assert "kubelet refused to register DRA plugin gpu.nvidia.com" in caplog.text


def test_failing_status_callback_rolls_back_registration(short_dir: Path) -> None:
    def broken(status: RegistrationStatus) -> None:
        raise RuntimeError("cannot record registration")

    async def scenario() -> None:
        config = make_config(short_dir)
        async with await start_servers(config, TablePreparer(), on_registration_status=broken):
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                with pytest.raises(KubeletError) as info:
                    await kubelet.register(config.registration_socket)
                assert info.value.code == "INTERNAL"
                assert kubelet.instances("gpu.nvidia.com") == []

    run(scenario())


def test_get_info_answers_while_a_prepare_is_in_flight(short_dir: Path) -> None:
    async def scenario() -> None:
        gate = threading.Event()
        preparer = TablePreparer(gate=gate)
        config = make_config(short_dir)
        async with await start_servers(config, preparer):
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
                pending = asyncio.ensure_future(plugin.prepare(claims("slow")))
                assert await asyncio.to_thread(preparer.started.wait, 10)
                for _ in range(3):  # the kubelet's 1 s GetInfo deadline applies to each
                    assert (await plugin.get_info()).name == "gpu.nvidia.com"
                assert not pending.done()
                gate.set()
                assert (await pending)["slow"].ok

    run(scenario())


def test_rolling_update_two_instances_side_by_side(short_dir: Path) -> None:
    async def scenario() -> None:
        old_config = make_config(short_dir, pod_uid="1111-aaaa")
        new_config = make_config(short_dir, pod_uid="2222-bbbb")
        assert old_config.registration_socket.name == "gpu.nvidia.com-1111-aaaa-reg.sock"
        assert new_config.dra_socket.name == "dra-2222-bbbb.sock"
        old_preparer, new_preparer = TablePreparer(label="-old"), TablePreparer(label="-new")
        old = await start_servers(old_config, old_preparer)
        async with KubeletEmulator(old_config.kubelet_registrar_directory_path) as kubelet:
            await kubelet.wait_for_plugin("gpu.nvidia.com")
            new = await start_servers(new_config, new_preparer)
            await kubelet.scan()
            instances = kubelet.instances("gpu.nvidia.com")
            assert [p.endpoint for p in instances] == [str(old_config.dra_socket), str(new_config.dra_socket)]
            assert kubelet.plugin("gpu.nvidia.com").endpoint == str(new_config.dra_socket)
            old_result = await instances[0].prepare(claims("u1"))
            new_result = await instances[1].prepare(claims("u2"))
            assert old_result["u1"].devices[0].cdi_device_ids[0].endswith("-old")
            assert new_result["u2"].devices[0].cdi_device_ids[0].endswith("-new")

            await old.stop()
            assert not old_config.dra_socket.exists() and not old_config.registration_socket.exists()
            assert new_config.dra_socket.exists() and new_config.registration_socket.exists()
            await kubelet.scan()
            assert [p.endpoint for p in kubelet.instances("gpu.nvidia.com")] == [str(new_config.dra_socket)]
            assert (await kubelet.plugin("gpu.nvidia.com").prepare(claims("u3")))["u3"].ok
            await new.stop()

    run(scenario())


def test_sync_emulator_against_a_plugin_in_another_thread(short_dir: Path) -> None:
    config = make_config(short_dir)
    ready = threading.Event()
    stop = threading.Event()
    errors: list[BaseException] = []

    async def plugin_main() -> None:
        async with await start_servers(config, TablePreparer()):
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.01)

    def plugin_thread() -> None:
        try:
            run(plugin_main())
        except BaseException as exc:  # reported by the test below
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=plugin_thread)
    thread.start()
    try:
        assert ready.wait(10)
        assert not errors
        with SyncKubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
            plugin = kubelet.wait_for_plugin("gpu.nvidia.com", timeout=5)
            assert plugin.service == "v1.DRAPlugin"
            result = plugin.prepare(claims("u1", "u2"))
            assert sorted(result) == ["u1", "u2"]
            assert plugin.unprepare(claims("u1", "u2")) == {"u1": "", "u2": ""}
    finally:
        stop.set()
        thread.join(10)
    assert not errors
