"""Stand-in for ``mount(8)`` and ``umount(8)`` (tmpfs only), for sandboxes where a real mount is not permitted.

Standard library only; the sandbox installs it twice, as ``<bin>/mount`` and ``<bin>/umount``, with a
``#!<python>`` line, and it acts by the name it was run as. Its mount table is ``<bin>/mountinfo``, in
``/proc/self/mountinfo`` format, which is what the plugin's mount helper reads (``MountCommands.mountinfo``).
It fails as util-linux does, with exit status 32:

* ``mount -t tmpfs -o <options> tmpfs <target>``: "mount: <target>: mount point does not exist." for a missing
  directory, "mount: <target>: <source> already mounted on <target>." when mounted; other types: "unknown
  filesystem type";
* ``umount <target>``: "umount: <target>: not mounted." when it is not; "umount: <target>: no mount point
  specified." without an argument.

Mounting does not hide what the directory held (nothing is overlaid); the table is the only effect.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

BUSY = 32


def _table() -> Path:
    return Path(sys.argv[0]).resolve().parent / "mountinfo"


def _escape(path: str) -> str:
    return path.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")


def _lines(table: Path) -> list[str]:
    try:
        return [line for line in table.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _mounted(lines: list[str], target: str) -> bool:
    return any(len(parts) > 4 and parts[4] == _escape(target) for parts in (line.split() for line in lines))


def _fail(tool: str, text: str) -> int:
    print(f"{tool}: {text}", file=sys.stderr)
    return BUSY


def mount(args: list[str], table: Path) -> int:
    fstype, options, rest = "", "", []
    i = 0
    while i < len(args):
        if args[i] == "-t" and i + 1 < len(args):
            fstype, i = args[i + 1], i + 2
        elif args[i] == "-o" and i + 1 < len(args):
            options, i = args[i + 1], i + 2
        else:
            rest.append(args[i])
            i += 1
    if len(rest) != 2:
        return _fail("mount", "bad usage")
    source, target = rest[0], os.path.abspath(rest[1])
    if fstype != "tmpfs":
        return _fail("mount", f"{target}: unknown filesystem type '{fstype}'.")
    if not os.path.isdir(target):
        return _fail("mount", f"{target}: mount point does not exist.")
    lines = _lines(table)
    if _mounted(lines, target):
        return _fail("mount", f"{target}: {source} already mounted on {target}.")
    mount_options = [o for o in options.split(",") if o and not o.startswith("size=")] or ["rw"]
    super_options = ["rw", *(o for o in options.split(",") if o.startswith("size="))]
    number = 1000 + len(lines)
    lines.append(f"{number} 1 0:{number} / {_escape(target)} {','.join(mount_options)} - tmpfs {source} "
                 f"{','.join(super_options)}")
    table.write_text("\n".join(lines) + "\n")
    return 0


def umount(args: list[str], table: Path) -> int:
    if len(args) != 1:
        return _fail("umount", "no mount point specified.")
    target = os.path.abspath(args[0])
    lines = _lines(table)
    if not _mounted(lines, target):
        return _fail("umount", f"{target}: not mounted.")
    kept = [line for line in lines if not (len(line.split()) > 4 and line.split()[4] == _escape(target))]
    table.write_text("\n".join(kept) + ("\n" if kept else ""))
    return 0


def main() -> int:
    table = _table()
    with open(table.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if Path(sys.argv[0]).name == "umount":
            return umount(sys.argv[1:], table)
        return mount(sys.argv[1:], table)


if __name__ == "__main__":
    sys.exit(main())
