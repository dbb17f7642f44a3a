"""Socket handling: order, permissions, stale sockets, refusal when live, path limits, cleanup."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.server import SocketInUseError, SocketPathError, sockets, start_servers

from .conftest import TablePreparer, claims, make_config, run

pytestmark = pytest.mark.timeout(15)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _dead_socket(path: Path) -> None:
    """Leave a socket file with no listener behind, as a SIGKILLed plugin does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(os.fspath(path))
    sock.close()


def test_dra_socket_serves_before_registration_socket_appears(short_dir: Path) -> None:
    config = make_config(short_dir)
    observed: list[str] = []
    done = threading.Event()

    def watcher() -> None:
        # Like the kubelet's fsnotify watch: react as soon as the registration socket shows up.
        while not done.is_set():
            if config.registration_socket.exists():
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(os.fspath(config.dra_socket))
                    observed.append("dra-accepting")
                except OSError as exc:
                    observed.append(f"dra-not-accepting: {exc}")
                finally:
                    probe.close()
                return

    thread = threading.Thread(target=watcher)
    thread.start()

    async def scenario() -> None:
        async with await start_servers(config, TablePreparer()):
            await asyncio.to_thread(thread.join, 5)

    try:
        run(scenario())
    finally:
        done.set()
        thread.join()
    assert observed == ["dra-accepting"]


def test_sockets_are_owner_only_and_new_directories_0750(short_dir: Path) -> None:
    config = make_config(short_dir)

    async def scenario() -> None:
        async with await start_servers(config, TablePreparer()):
            assert _mode(config.dra_socket) == 0o600
            assert _mode(config.registration_socket) == 0o600
            assert _mode(config.plugin_dir) == 0o750
            assert _mode(config.kubelet_plugins_directory_path) == 0o750
            assert _mode(config.kubelet_registrar_directory_path) == 0o750
            # no hidden temporary socket is left behind
            assert sorted(p.name for p in config.kubelet_registrar_directory_path.iterdir()) == [
                "gpu.nvidia.com-reg.sock"
            ]
            assert sorted(p.name for p in config.plugin_dir.iterdir()) == ["dra.sock"]

    run(scenario())


def test_existing_directory_modes_are_left_alone(short_dir: Path) -> None:
    config = make_config(short_dir)
    config.kubelet_registrar_directory_path.mkdir(mode=0o755)
    os.chmod(config.kubelet_registrar_directory_path, 0o755)

    async def scenario() -> None:
        async with await start_servers(config, TablePreparer()):
            assert _mode(config.kubelet_registrar_directory_path) == 0o755

    run(scenario())


def test_sockets_removed_on_stop(short_dir: Path) -> None:
    config = make_config(short_dir)

    async def scenario() -> None:
        servers = await start_servers(config, TablePreparer())
        assert sockets.is_socket(config.dra_socket) and sockets.is_socket(config.registration_socket)
        await servers.stop()
        await servers.stop()  # idempotent

    run(scenario())
    assert not config.dra_socket.exists()
    assert not config.registration_socket.exists()


def test_stale_sockets_from_a_killed_run_are_replaced(short_dir: Path) -> None:
    config = make_config(short_dir)
    _dead_socket(config.dra_socket)
    _dead_socket(config.registration_socket)

    async def scenario() -> None:
        async with await start_servers(config, TablePreparer()):
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
                assert (await plugin.prepare(claims("u1")))["u1"].ok

    run(scenario())


def test_live_socket_with_our_name_is_refused(short_dir: Path) -> None:
    config = make_config(short_dir)

    async def scenario() -> None:
        async with await start_servers(config, TablePreparer()):
            with pytest.raises(SocketInUseError, match=r"a live server answers on .*dra\.sock"):
                await start_servers(config, TablePreparer())
            # the running instance is untouched and still registers and serves
            assert sockets.is_socket(config.dra_socket) and sockets.is_socket(config.registration_socket)
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
                assert (await plugin.prepare(claims("u1")))["u1"].ok

    run(scenario())


def test_live_registration_socket_is_refused_and_dra_socket_cleaned_up(short_dir: Path) -> None:
    config = make_config(short_dir)
    config.kubelet_registrar_directory_path.mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(config.registration_socket))
    listener.listen(1)
    try:
        with pytest.raises(SocketInUseError, match=r"gpu\.nvidia\.com-reg\.sock"):
            run(start_servers(config, TablePreparer()))
        assert sockets.is_socket(config.registration_socket)
        assert not config.dra_socket.exists()
    finally:
        listener.close()


def test_non_socket_file_is_never_removed(short_dir: Path) -> None:
    config = make_config(short_dir)
    config.plugin_dir.mkdir(parents=True)
    config.dra_socket.write_text("not a socket")
    with pytest.raises(SocketPathError, match="exists and is not a Unix socket"):
        run(start_servers(config, TablePreparer()))
    assert config.dra_socket.read_text() == "not a socket"
    assert not config.registration_socket.exists()


def test_socket_path_over_108_bytes_is_refused_clearly(short_dir: Path) -> None:
    config = make_config(short_dir / ("d" * 80))
    with pytest.raises(SocketPathError, match=r"more than the 108 bytes of an AF_UNIX address") as info:
        run(start_servers(config, TablePreparer()))
    assert str(config.dra_socket) in str(info.value)
    assert not (short_dir / ("d" * 80)).exists()


def test_socket_path_limit_boundary(short_dir: Path) -> None:
    fits = Path("/" + "a" * 106)  # 107 bytes + NUL = 108
    sockets.check_socket_path(fits)
    with pytest.raises(SocketPathError):
        sockets.check_socket_path(Path("/" + "a" * 107))
    with pytest.raises(SocketPathError, match="must be absolute"):
        sockets.check_socket_path(Path("relative.sock"))


def test_failed_start_leaves_no_socket_behind(short_dir: Path) -> None:
    try:
        busy = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        busy.bind(("::", 0))
    except OSError:  # no IPv6 on this host: gRPC's "[::]" listener falls back to IPv4
        busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        busy.bind(("0.0.0.0", 0))
    busy.listen(1)
    config = make_config(short_dir, healthcheck_port=busy.getsockname()[1])
    try:
        with pytest.raises(SocketPathError, match=f"cannot listen on TCP port {config.healthcheck_port}"):
            run(start_servers(config, TablePreparer()))
    finally:
        busy.close()
    assert list(config.plugin_dir.iterdir()) == []
    assert list(config.kubelet_registrar_directory_path.iterdir()) == []
