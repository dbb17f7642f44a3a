"""Fixtures used by more than one test folder. Builders (devices, waits, profiles) are in ``tests.factories``."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dradriver.commands import _grpcenv
from tests.factories import DEVICE_CLASS

# The gRPC settings the entry points start with, before anything imports grpc: tests serve gRPC as production does.
_grpcenv.apply_defaults()

# NVIDIA's peer binaries (its gpu-kubelet-plugin, nvidia-ctk and mock NVML), which every developer and CI run has
# beside the checkout; the product finds them only through this variable. Tests that need them skip, with the
# reason, where the folder is absent.
os.environ.setdefault("DRADRIVER_NVIDIA_PEERS", str(Path(__file__).resolve().parents[2] / "shared" / "peers"))

if TYPE_CHECKING:
    from dradriver.nvml.session import NvmlSession
    from dradriver.sandbox.node import SandboxNode


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """Each test starts with the logging the one before it found: a command run in process (``dradriver demo``
    sets the ``dradriver`` logger to ERROR, ``logs.configure`` replaces the root handlers) would otherwise hide the
    log lines a later test asserts on."""
    root, ours = logging.getLogger(), logging.getLogger("dradriver")
    saved = (root.level, list(root.handlers), ours.level, list(ours.handlers), ours.propagate)
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    ours.setLevel(saved[2])
    ours.handlers[:] = saved[3]
    ours.propagate = saved[4]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory directly under /tmp: Unix socket paths must fit in 108 bytes (pytest's tmp_path may not)."""
    path = Path(tempfile.mkdtemp(prefix="dratest-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def mock_session() -> Iterator[Callable[[str], NvmlSession]]:
    """Factory ``mock_session(profile_name_or_path)``: an NVML session over the C mock library with that
    profile; every session it opened is closed after the test."""
    from dradriver.nvml.session import open_session

    opened: list[NvmlSession] = []

    def start(profile: str) -> NvmlSession:
        session = open_session(mock_profile=profile)
        opened.append(session)
        return session

    yield start
    for session in reversed(opened):
        session.close()


@pytest.fixture
def sandbox(request: pytest.FixtureRequest) -> Iterator[SandboxNode]:
    """A sandboxed node serving :data:`~tests.factories.DEVICE_CLASS`; profile from
    ``@pytest.mark.parametrize('sandbox', [...], indirect=True)`` (default ``dgx-h100``)."""
    from dradriver.sandbox.node import SandboxNode

    profile = getattr(request, "param", "dgx-h100")
    with SandboxNode(profile=profile) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        yield node
