"""Fixtures of the controller tests: one API emulator with the ComputeDomain CRDs and a client of it per test
(``controller_helpers.emulator`` / ``client_for``). A module that needs another ``api`` or ``client`` defines its
own, which takes precedence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.kube.client import KubeClient
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import write_imex_proc
from tests.computedomain.controller_helpers import client_for, emulator


@pytest.fixture
def api(tmp_path: Path) -> Iterator[ApiServerEmulator]:
    server = emulator(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(api: ApiServerEmulator, tmp_path: Path) -> Iterator[KubeClient]:
    kube = client_for(api, tmp_path)
    try:
        yield kube
    finally:
        kube.close()


@pytest.fixture
def imex_node() -> Iterator[SandboxNode]:
    """A GB200 NVL72 node sandbox with its IMEX procfs files (``write_imex_proc``), for the compute-domain plugin."""
    with SandboxNode(profile="gb200-nvl72-node") as sandbox:
        write_imex_proc(sandbox)
        yield sandbox
