"""Stand-in for NVIDIA's ``nvidia-imex`` daemon, installed into the sandbox's driver root (``usr/bin``).

Standard library only (asyncio): the sandbox copies this file with a ``#!<python>`` line and runs it as the
binary. It behaves as the real daemon does for what the compute-domain daemon wrapper relies on (NVIDIA IMEX
guide: "IMEX Service Config Options", "Signal handling", "Connections, Quorum, and Clean up", "IMEX Service
Command Service"; NVIDIA's ``cmd/compute-domain-daemon/``):

* ``nvidia-imex -c <config>`` runs in the foreground (the template pins ``DAEMONIZE=0``) and reads ``KEY=value``
  lines: ``SERVER_PORT`` (peer port, default 50000), ``BIND_INTERFACE_IP`` (peer address; empty: the pod's
  address, which in the sandbox is ``IMEX_CMD_BIND_INTERFACE_IP`` since every emulated node shares one network
  namespace and has its own loopback address ``127.x.y.z``), ``IMEX_CMD_ENABLED``, ``IMEX_CMD_PORT`` (command
  service, default 50005), ``IMEX_CMD_BIND_INTERFACE_IP``, ``IMEX_CMD_UNIX_DOMAIN_PATH`` (command service on a
  Unix socket as well, host-managed IMEX), ``IMEX_NODE_CONFIG_FILE`` (``nodes.cfg``), ``LOG_FILE_NAME`` (empty:
  stderr). Other keys are accepted and ignored.
* ``nodes.cfg`` holds one peer per line: an IP address or a name resolved through the hosts file
  (``/etc/hosts``; env ``DRADRIVER_HOSTS_FILE`` overrides it so each sandbox pod has its own). The entry that
  resolves to the daemon's own address is its own name; every other entry that resolves, except to the
  unused-slot sentinel ``127.0.0.2``, is a live peer. Unresolvable entries are logged and not waited for.
* Peers: the daemon listens on ``<address>:SERVER_PORT`` and connects (from its own address) to every live
  peer. The connector sends one JSON line ``{"to": <the peer's name as the connector resolved it>, "from": <the
  connector's own name>}``; the listener accepts only when ``to`` is its own name in *its* ``nodes.cfg`` and
  ``from`` is one of its peers resolving to the connection's source address, and answers ``{"ok": true}`` or
  ``{"ok": false, "reason": ...}``. So a wrong ``nodes.cfg``, a stale hosts entry or another domain's daemon on a
  reused pod IP (another domain's DNS names) is refused, and both sides log why. Accepted connections stay open;
  a closed one is retried with exponential backoff (0.05 s doubling to 1 s).
* ``SIGUSR1`` re-reads ``nodes.cfg`` and the hosts file: peers no longer listed are dropped (their connections
  closed), new ones connected, changed addresses reconnected. The daemon's own entry (its node index and name)
  is fixed at start, as the real daemon reads its node configuration at start only: when after a ``SIGUSR1``
  another entry resolves to its address, it logs an ``ERROR`` and keeps its start-up identity (peers that ask
  for the new name are refused) until it is restarted. ``SIGTERM``/``SIGINT`` end the daemon (exit 0).
* Signal handlers are installed once the event loop runs, some tens of milliseconds after ``exec``: a ``SIGUSR1``
  before that takes the default action (``signal(7)``: terminate), exit status -10, as a real ``nvidia-imex``
  signalled before it installed its handler.
* The IMEX session: the real daemon opens the driver's ``fabric-imex-mgmt`` capability device and the driver
  serves one IMEX daemon per node (a host ``nvidia-imex.service`` and a daemon pod's ``nvidia-imex`` cannot both
  run: NVIDIA's ComputeDomain prerequisites say to disable the host service). The stand-in takes an exclusive
  ``flock`` on the file named by env ``DRADRIVER_FABRIC_IMEX_MGMT`` (the sandbox passes the node's
  ``dev/nvidia-caps/nvidia-cap<minor>``; unset: no session is taken) and writes its PID into it; when another
  process holds it, the daemon logs an ``ERROR`` naming the holder's PID and exits 1 before it listens. The log
  wording is the stand-in's own (NVIDIA's text is not public).
* Command service (``nvidia-imex-ctl``): a client sends one line (``Q``: query, ``N``: node status) and gets one
  JSON line ``{"state", "domain", "nodes": [...]}``. ``state`` is ``READY`` when every live peer is connected in
  both directions (no live peer: ``READY`` at once), else ``WAITING_FOR_PEERS`` (also while no entry resolves
  to the daemon's own address); ``SHUTTING_DOWN`` while stopping (state names: NVIDIA's daemon states as
  DCGM lists them for ``nvidia-imex-ctl -q``).

Log lines go to stderr (or ``LOG_FILE_NAME``) as ``[<time>] [<LEVEL>] [tid <pid>] <text>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import sys
import time
from typing import Any

UNUSED_SLOT_IP = "127.0.0.2"
BACKOFF_START_S, BACKOFF_MAX_S = 0.05, 1.0
HANDSHAKE_TIMEOUT_S = 5.0


def read_config(path: str) -> dict[str, str]:
    """``KEY=value`` lines of an IMEX config file; ``#`` comments and blank lines skipped."""
    values: dict[str, str] = {}
    with open(path, encoding="utf-8") as source:
        for line in source:
            line = line.strip()
            if not line or line.startswith("#") or "=" not in line:
                continue
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def read_hosts(path: str) -> dict[str, str]:
    """Name -> address from a hosts file; the first line naming a host wins, as the resolver's."""
    names: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as source:
            for line in source:
                fields = line.split("#", 1)[0].split()
                if len(fields) < 2:
                    continue
                for name in fields[1:]:
                    names.setdefault(name, fields[0])
    except FileNotFoundError:
        pass
    return names


def read_nodes(path: str) -> list[str]:
    """Entries of ``nodes.cfg``: one name or address per line."""
    try:
        with open(path, encoding="utf-8") as source:
            return [line.strip() for line in source if line.strip() and not line.strip().startswith("#")]
    except FileNotFoundError:
        return []


def resolve(entry: str, hosts: dict[str, str]) -> str | None:
    """An address as is; a name through the hosts file; ``None`` when it does not resolve."""
    try:
        ipaddress.ip_address(entry)
        return entry
    except ValueError:
        return hosts.get(entry)


class Peer:
    """One live peer: its name in ``nodes.cfg``, the address it resolves to, both connection directions."""

    def __init__(self, name: str, ip: str) -> None:
        self.name, self.ip = name, ip
        self.outbound = False
        self.inbound: set[asyncio.StreamWriter] = set()
        self.task: asyncio.Task[None] | None = None
        self.last_error = ""

    @property
    def connected(self) -> bool:
        return self.outbound and bool(self.inbound)


class Imex:
    def __init__(self, config: dict[str, str]) -> None:
        self.config = config
        self.cmd_ip = config.get("IMEX_CMD_BIND_INTERFACE_IP", "") or "127.0.0.1"
        self.ip = config.get("BIND_INTERFACE_IP", "") or self.cmd_ip
        self.port = int(config.get("SERVER_PORT", "") or 50000)
        self.cmd_enabled = config.get("IMEX_CMD_ENABLED", "0") == "1"
        self.cmd_port = int(config.get("IMEX_CMD_PORT", "") or 50005)
        self.cmd_unix = config.get("IMEX_CMD_UNIX_DOMAIN_PATH", "")
        self.nodes_file = config.get("IMEX_NODE_CONFIG_FILE", "") or "/etc/nvidia-imex/nodes_config.cfg"
        self.hosts_file = os.environ.get("DRADRIVER_HOSTS_FILE") or "/etc/hosts"
        log_file = config.get("LOG_FILE_NAME", "")
        self.log_out = open(log_file, "a", encoding="utf-8") if log_file else sys.stderr
        self.own_name: str | None = None
        self.loaded = False  # the start-up load fixed own_name
        self.entries: list[str] = []
        self.peers: dict[str, Peer] = {}
        self.stopping = False
        self.stop = asyncio.Event()

    def log(self, level: str, text: str) -> None:
        stamp = time.strftime("%b %d %Y %H:%M:%S", time.localtime())
        self.log_out.write(f"[{stamp}] [{level}] [tid {os.getpid()}] {text}\n")
        self.log_out.flush()

    # -- membership --------------------------------------------------------------------------------------------

    def load(self) -> None:
        """(Re-)read nodes.cfg and the hosts file; start, stop or restart peer connectors to match."""
        hosts = read_hosts(self.hosts_file)
        self.entries = read_nodes(self.nodes_file)
        own: str | None = None
        wanted: dict[str, str] = {}
        for entry in self.entries:
            address = resolve(entry, hosts)
            if address is None:
                self.log("WARN", f"cannot resolve node {entry!r} of {self.nodes_file} (hosts file {self.hosts_file})")
            elif address == self.ip:
                own = own or entry
            elif address != UNUSED_SLOT_IP:
                wanted[entry] = address
        if not self.loaded:
            self.log("INFO", f"this node is {own!r} in {self.nodes_file}" if own else
                     f"no entry of {self.nodes_file} resolves to this node's address {self.ip}")
            self.own_name, self.loaded = own, True
        elif own != self.own_name:
            self.log("ERROR", f"this node's entry in {self.nodes_file} changed from {self.own_name!r} to {own!r}: "
                              "the node identity is read at start only; restart nvidia-imex to apply it")
        if self.own_name is not None:
            wanted.pop(self.own_name, None)
        for name in list(self.peers):
            peer = self.peers[name]
            if wanted.get(name) != peer.ip:
                why = "no longer listed" if name not in wanted else f"now at {wanted[name]}"
                self.log("INFO", f"dropping peer {name} ({peer.ip}): {why}")
                self.drop(peer)
        for name, address in wanted.items():
            if name not in self.peers:
                peer = Peer(name, address)
                self.peers[name] = peer
                peer.task = asyncio.get_running_loop().create_task(self.connect(peer))
        self.log("INFO", f"{len(self.peers)} live peer(s) of {len(self.entries)} node(s) in {self.nodes_file}")

    def drop(self, peer: Peer) -> None:
        del self.peers[peer.name]
        if peer.task is not None:
            peer.task.cancel()
        for writer in list(peer.inbound):
            writer.close()
        peer.inbound.clear()

    @property
    def state(self) -> str:
        if self.stopping:
            return "SHUTTING_DOWN"
        if self.own_name is None:  # not in its own nodes.cfg: no peer can reach it by name
            return "WAITING_FOR_PEERS"
        return "READY" if all(p.connected for p in self.peers.values()) else "WAITING_FOR_PEERS"

    # -- peer connections ----------------------------------------------------------------------------------

    async def connect(self, peer: Peer) -> None:
        """Keep one accepted outbound connection to ``peer``; back off after each failure."""
        delay = BACKOFF_START_S
        while not self.stopping:
            reason = await self._connect_once(peer)
            if reason is None:
                delay = BACKOFF_START_S
                continue
            if reason != peer.last_error:
                self.log("WARN", f"connection to {peer.name} ({peer.ip}:{self.port}) failed: {reason}")
                peer.last_error = reason
            await asyncio.sleep(delay)
            delay = min(BACKOFF_MAX_S, delay * 2)

    async def _connect_once(self, peer: Peer) -> str | None:
        """One connection: ``None`` after an accepted connection closed, else why it failed."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(peer.ip, self.port, local_addr=(self.ip, 0)), HANDSHAKE_TIMEOUT_S)
        except (TimeoutError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            writer.write(json.dumps({"to": peer.name, "from": self.own_name or ""}).encode() + b"\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), HANDSHAKE_TIMEOUT_S)
            answer: dict[str, Any] = json.loads(line) if line else {"ok": False, "reason": "connection closed"}
            if not answer.get("ok"):
                return f"refused by the peer: {answer.get('reason', '?')}"
            peer.outbound, peer.last_error = True, ""
            self.log("INFO", f"connected to {peer.name} ({peer.ip}:{self.port})")
            self._ready_log()
            await reader.read()  # until the peer closes
            self.log("WARN", f"connection to {peer.name} ({peer.ip}) closed")
            return None
        except (TimeoutError, OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            peer.outbound = False
            writer.close()

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The listener's side of the handshake; an accepted connection is held until either side closes it."""
        source = str(writer.get_extra_info("peername")[0])
        peer: Peer | None = None
        try:
            line = await asyncio.wait_for(reader.readline(), HANDSHAKE_TIMEOUT_S)
            hello = json.loads(line)
            to, sender = str(hello.get("to", "")), str(hello.get("from", ""))
            reason = ""
            if self.own_name is None or to != self.own_name:
                reason = (f"{source} asked for node {to!r}, but this node is {self.own_name!r} in "
                          f"{self.nodes_file}")
            elif sender not in self.peers:
                reason = f"{source} says it is {sender!r}, which is not a peer in {self.nodes_file}"
            elif self.peers[sender].ip != source:
                reason = (f"{source} says it is {sender!r}, which resolves to {self.peers[sender].ip} in "
                          f"{self.hosts_file}")
            if reason:
                self.log("WARN", f"refusing connection: {reason}")
                writer.write(json.dumps({"ok": False, "reason": reason}).encode() + b"\n")
                await writer.drain()
                return
            peer = self.peers[sender]
            writer.write(b'{"ok": true}\n')
            await writer.drain()
            peer.inbound.add(writer)
            self.log("INFO", f"accepted connection from {sender} ({source})")
            self._ready_log()
            await reader.read()
            self.log("WARN", f"connection from {sender} ({source}) closed")
        except (TimeoutError, OSError, ValueError) as exc:
            self.log("WARN", f"connection from {source}: {type(exc).__name__}: {exc}")
        finally:
            if peer is not None:
                peer.inbound.discard(writer)
            writer.close()

    def _ready_log(self) -> None:
        if self.state == "READY":
            self.log("INFO", "IMEX daemon is READY: all peers connected")

    # -- command service ---------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        hosts = read_hosts(self.hosts_file)
        nodes = []
        for index, entry in enumerate(self.entries):
            address = resolve(entry, hosts) or ""
            peer = self.peers.get(entry)
            if entry == self.own_name:
                node_state = self.state
            elif peer is not None:
                node_state = "READY" if peer.connected else "UNAVAILABLE"
            else:
                node_state = "UNAVAILABLE"
            nodes.append({"index": index, "name": entry, "ip": address, "state": node_state,
                          "self": entry == self.own_name,
                          "connected": bool(peer and peer.connected) or entry == self.own_name})
        live = [n for n in nodes if n["self"] or n["name"] in self.peers]
        domain = "UP" if live and all(n["state"] == "READY" for n in live) else \
            ("DEGRADED" if any(n["state"] == "READY" for n in live) else "DOWN")
        return {"state": self.state, "domain": domain, "nodes": nodes}

    async def command(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.readline(), HANDSHAKE_TIMEOUT_S)
            writer.write(json.dumps(self.status()).encode() + b"\n")
            await writer.drain()
        except (TimeoutError, OSError):
            pass
        finally:
            writer.close()

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        loop.add_signal_handler(signal.SIGUSR1, self._reload)
        servers = []
        self.load()  # before listening: a peer's first handshake is checked against this node's own name
        try:
            servers.append(await asyncio.start_server(self.accept, self.ip, self.port, reuse_address=True))
            if self.cmd_enabled:
                servers.append(await asyncio.start_server(self.command, self.cmd_ip, self.cmd_port,
                                                          reuse_address=True))
                if self.cmd_unix:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.cmd_unix)
                    servers.append(await asyncio.start_unix_server(self.command, self.cmd_unix))
        except OSError as exc:
            self.log("ERROR", f"cannot listen: {exc}")
            return 1
        self.log("INFO", f"IMEX stand-in listening on {self.ip}:{self.port}"
                 + (f", command service on {self.cmd_ip}:{self.cmd_port}" if self.cmd_enabled else ""))
        self._ready_log()
        await self.stop.wait()
        self.stopping = True
        self.log("INFO", "SIGTERM received: shutting down")
        for server in servers:
            server.close()
        for peer in list(self.peers.values()):
            self.drop(peer)
        if self.cmd_unix:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cmd_unix)
        return 0

    def _reload(self) -> None:
        self.log("INFO", f"SIGUSR1 received: re-reading {self.nodes_file} and {self.hosts_file}")
        self.load()
        self._ready_log()


def take_session(path: str, log: Any) -> int | None:
    """The IMEX session (module docstring): an exclusive ``flock`` on ``path``, held while the process lives;
    returns the open descriptor, or ``None`` after logging why it cannot be had."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        log("ERROR", f"cannot open the fabric-imex-mgmt capability {path}: {exc}")
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        log("ERROR", f"cannot start an IMEX session: the fabric-imex-mgmt capability {path} is in use by another "
                     f"IMEX daemon (pid {holder}); one nvidia-imex runs per node")
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def main(argv: list[str]) -> int:
    config_path = "/etc/nvidia-imex/config.cfg"
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "-c" and args:
            config_path = args.pop(0)
        elif arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        elif arg in ("-h", "--help"):
            print("Usage: nvidia-imex [-c <config file>]")
            return 0
        else:
            print(f"nvidia-imex: unknown argument {arg!r}", file=sys.stderr)
            return 2
    try:
        config = read_config(config_path)
    except OSError as exc:
        print(f"nvidia-imex: cannot read config file {config_path}: {exc}", file=sys.stderr)
        return 1

    session = os.environ.get("DRADRIVER_FABRIC_IMEX_MGMT", "")

    async def run() -> int:
        imex = Imex(config)
        if session and take_session(session, imex.log) is None:
            return 1
        return await imex.run()

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
