"""Stand-in for ``nvidia-cdi-hook`` (NVIDIA container toolkit), the binary the hooks of claim CDI specs run.

Standard library only. It is run as the container runtime runs a CDI ``createContainer`` hook: ``argv`` is the
hook's ``args`` (``nvidia-cdi-hook <subcommand> <flags>``, or ``nvidia-ctk hook <subcommand> <flags>``) and the
OCI state of the container being created is on stdin (``{"bundle": ...}``; the bundle's ``config.json`` names the
root filesystem). It behaves as the toolkit's hook (v1.20, ``nvidia-ctk hook <subcommand> --help``) does for what
dradriver's specs use:

* flags are checked per subcommand as the toolkit's CLI does: an undefined flag is "flag provided but not
  defined: -<name>" on stderr and exit status 1; ``--help``/``-h`` prints the subcommand's flags, exit 0;
* an unknown subcommand is a warning ("Unsupported CDI hook: <name>") and exit status 0, so an older spec or a
  newer hook never breaks a container (recent toolkits, nvidia-container-toolkit's ``cmd/nvidia-cdi-hook``);
* ``create-symlinks --link <target>::<link>`` creates each link in the container's root filesystem (an existing
  link is replaced), as the real hook does; the other subcommands (``update-ldcache``, ``enable-cuda-compat``,
  ``disable-device-node-modification``, ``chmod``) only validate their flags (there is no ``ldconfig`` or driver
  ``params`` file to act on in a sandbox).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

#: Subcommand -> flags it defines (name -> takes a value), the toolkit's (``nvidia-ctk hook <sub> --help``).
SUBCOMMANDS: dict[str, dict[str, bool]] = {
    "create-symlinks": {"link": True},
    "update-ldcache": {"folder": True, "ldconfig-path": True, "container-spec": True},
    "enable-cuda-compat": {"host-driver-version": True, "host-cuda-version": True, "cuda-compat-container-root": True},
    "disable-device-node-modification": {},
    "chmod": {"path": True, "mode": True, "container-spec": True},
    "update-application-profile": {},
}
#: Flags every subcommand accepts (the CLI's global ones and help).
GLOBAL_FLAGS: dict[str, bool] = {"debug": False, "d": False, "quiet": False, "config": True, "help": False, "h": False}


class UsageError(Exception):
    """A flag the subcommand does not define, or one missing its value."""


def parse(subcommand: str, args: list[str]) -> dict[str, list[str]]:
    """The flags of ``args`` as urfave/cli parses them (``--name value``, ``--name=value``, ``-name``).

    :raises UsageError: an undefined flag or a missing value, in the toolkit's words.
    """
    defined = {**SUBCOMMANDS[subcommand], **GLOBAL_FLAGS}
    values: dict[str, list[str]] = {}
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if not arg.startswith("-") or arg in ("-", "--"):
            continue  # positional arguments are ignored by every hook
        name, has_value, value = arg.lstrip("-").partition("=")
        if name not in defined:
            raise UsageError(f"flag provided but not defined: -{name}")
        if defined[name] and not has_value:
            if index >= len(args):
                raise UsageError(f"flag needs an argument: -{name}")
            value = args[index]
            index += 1
        values.setdefault(name, []).append(value)
    return values


def rootfs() -> Path | None:
    """The container's root filesystem from the OCI state on stdin (``None`` when stdin holds no state)."""
    try:
        state = json.loads(sys.stdin.read() or "{}")
    except (OSError, ValueError):
        return None
    bundle = state.get("bundle") if isinstance(state, dict) else None
    if not bundle:
        return None
    config = json.loads((Path(bundle) / "config.json").read_text())
    root = Path(config.get("root", {}).get("path", "rootfs"))
    return root if root.is_absolute() else Path(bundle) / root


def create_symlinks(links: list[str]) -> None:
    root = rootfs()
    if root is None:
        raise UsageError("failed to load container state: no OCI state on stdin")
    for spec in links:
        target, sep, link = spec.partition("::")
        if not sep or not target or not link:
            raise UsageError(f"invalid symlink specification {spec!r}")
        path = root / link.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.exists():
            path.unlink()
        os.symlink(target, path)


def main(argv: list[str]) -> int:
    args = argv[1:]
    if args[:1] == ["hook"]:  # run as ``nvidia-ctk hook ...``
        args = args[1:]
    if not args or args[0] in ("--help", "-h", "help"):
        print("commands: " + ", ".join(SUBCOMMANDS))
        return 0
    subcommand, rest = args[0], args[1:]
    if subcommand not in SUBCOMMANDS:
        print(f'level=warning msg="Unsupported CDI hook: {subcommand}"', file=sys.stderr)
        return 0
    try:
        values = parse(subcommand, rest)
        if "help" in values or "h" in values:
            print(f"{subcommand} options: " + ", ".join(f"--{name}" for name in SUBCOMMANDS[subcommand]))
            return 0
        if subcommand == "create-symlinks":
            create_symlinks(values.get("link", []))
    except UsageError as exc:
        print(f"Incorrect Usage: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
