"""A process holding a plugin lock as NVIDIA's plugin holds it (``pkg/flock/flock.go``: ``flock(LOCK_EX)``, released
by closing, so by the process's death too), for the tests of :mod:`dradriver.host.pluginlocks`. Standard library only.

``python tests/rollback/lockholder.py LOCK [SRC DST]...``: takes the lock, prints ``held``, waits for a line on stdin,
then renames each SRC over DST (what NVIDIA's in-flight prepare writes, its checkpoint and CDI spec, just before it
releases) and exits.
"""

from __future__ import annotations

import fcntl
import os
import sys


def main(argv: list[str]) -> int:
    lock, moves = argv[0], argv[1:]
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.readline()
    for src, dst in zip(moves[::2], moves[1::2], strict=True):
        os.replace(src, dst)
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
