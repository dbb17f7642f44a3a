"""Stand-in for NVIDIA's ``nvidia-imex-ctl``, installed into the sandbox's driver root (``usr/bin``).

Standard library only. It talks to the command service of the ``nvidia-imex`` stand-in
(:mod:`dradriver.sandbox.standins.nvidia_imex`) as the real tool talks to the real daemon (NVIDIA IMEX guide,
"IMEX Service Command Service"; NVIDIA's ``cmd/compute-domain-kubelet-plugin/device_state.go``,
``cmd/compute-domain-daemon/``):

* where: ``-c <config>`` (default ``/etc/nvidia-imex/config.cfg``: the command service at
  ``IMEX_CMD_BIND_INTERFACE_IP:IMEX_CMD_PORT``), ``-i <ip> <port>``, or ``-u <socket>`` / ``--u=<socket>`` (the
  Unix socket ``IMEX_CMD_UNIX_DOMAIN_PATH``; host-managed IMEX is queried this way);
* ``-q``: prints the local daemon's state on one line, ``READY`` (exit 0) or another state such as
  ``WAITING_FOR_PEERS`` (exit 1); what the compute-domain daemon's ``check`` compares with ``READY\\n``;
* ``-N``: the domain's node status (``Domain State: UP|DEGRADED|DOWN`` and one line per node of ``nodes.cfg``;
  ``-j``: the same as JSON; ``-H``: with host names); exit 0 when the domain is ``UP``, else 1.

A command service that does not answer (no daemon, ``IMEX_CMD_ENABLED`` off) is reported on stderr, exit 1.
``-t <ms>`` sets the connection timeout (default 5000 ms).
"""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

DEFAULT_CONFIG = "/etc/nvidia-imex/config.cfg"
USAGE = ("Usage: nvidia-imex-ctl [-i <IP> <PORT>|-u <unix domain socket path>|-c <nvidia-imex config.cfg path>] "
         "<-N|-q> [-j] [-H] [-t <timeout>]")


def read_config(path: str) -> dict[str, str]:
    values: dict[str, str] = {}
    with open(path, encoding="utf-8") as source:
        for line in source:
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                key, _, value = line.partition("=")
                values[key.strip()] = value.strip()
    return values


def ask(where: tuple[str, int] | str, command: str, timeout_s: float) -> dict[str, Any]:
    family = socket.AF_UNIX if isinstance(where, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(where)
        sock.sendall(command.encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    answer: dict[str, Any] = json.loads(data)
    return answer


def main(argv: list[str]) -> int:
    args = list(argv)
    config_path, address, unix_path = DEFAULT_CONFIG, None, ""
    mode, as_json, hostnames, timeout_s = "", False, False, 5.0
    while args:
        arg = args.pop(0)
        if arg == "-c" and args:
            config_path = args.pop(0)
        elif arg == "-i" and len(args) >= 2:
            address = (args.pop(0), int(args.pop(0)))
        elif arg == "-u" and args:
            unix_path = args.pop(0)
        elif arg.startswith(("--u=", "-u=")):
            unix_path = arg.split("=", 1)[1]
        elif arg in ("-q", "-N"):
            mode = arg
        elif arg == "-j":
            as_json = True
        elif arg == "-H":
            hostnames = True
        elif arg == "-t" and args:
            timeout_s = int(args.pop(0)) / 1000.0
        elif arg in ("-h", "--help"):
            print(USAGE)
            return 0
        else:
            print(f"nvidia-imex-ctl: unknown argument {arg!r}\n{USAGE}", file=sys.stderr)
            return 2
    if not mode:
        print(USAGE, file=sys.stderr)
        return 2
    where: tuple[str, int] | str
    if unix_path:
        where = unix_path
    elif address is not None:
        where = address
    else:
        try:
            config = read_config(config_path)
        except OSError as exc:
            print(f"nvidia-imex-ctl: cannot read config file {config_path}: {exc}", file=sys.stderr)
            return 1
        if config.get("IMEX_CMD_ENABLED", "0") != "1":
            print(f"nvidia-imex-ctl: IMEX_CMD_ENABLED is not 1 in {config_path}", file=sys.stderr)
            return 1
        where = (config.get("IMEX_CMD_BIND_INTERFACE_IP") or "127.0.0.1", int(config.get("IMEX_CMD_PORT") or 50005))
    try:
        status = ask(where, "Q" if mode == "-q" else "N", timeout_s)
    except (OSError, ValueError) as exc:
        shown = where if isinstance(where, str) else f"{where[0]}:{where[1]}"
        print(f"nvidia-imex-ctl: cannot connect to the IMEX command service at {shown}: {exc}", file=sys.stderr)
        return 1
    if mode == "-q":
        sys.stdout.write(f"{status['state']}\n")
        return 0 if status["state"] == "READY" else 1
    if as_json:
        print(json.dumps({"status": status["domain"], "nodes": status["nodes"]}, indent=2))
    else:
        print("Nodes:\n")
        for node in status["nodes"]:
            host = f" ({node['name']})" if hostnames and node["name"] != node["ip"] else ""
            print(f"Node #{node['index']} - {node['ip'] or '?'}{host} - {node['state']}")
        print(f"\nDomain State: {status['domain']}")
    return 0 if status["domain"] == "UP" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
