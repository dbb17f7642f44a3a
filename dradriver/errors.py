"""Root of dradriver's own exception hierarchy.

Boundary packages (``nvml``, ``kube``) raise subclasses of :class:`DradriverError`; the gRPC layer turns
any of them into a per-claim error string, so one bad claim never fails a whole batch.
"""

from __future__ import annotations


class DradriverError(Exception):
    """Base class of every error dradriver raises on purpose."""


class FlagError(DradriverError):
    """A flag, environment variable or configuration file holds an invalid value."""


class ExtensionMissingError(DradriverError):
    """A compiled module from ``ext/`` is not importable and ``DRADRIVER_NO_EXTENSIONS=1`` is not set."""
