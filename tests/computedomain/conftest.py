"""Fixtures of the controller tests: one API emulator with the ComputeDomain CRDs and a client of it per test
(``controller_helpers.emulator`` / ``client_for``). A module that needs another ``api`` or ``client`` defines its
own, which takes precedence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.kube.client import KubeClient
from dradriver.sandbox.apiserver import ApiServerEmulator
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
