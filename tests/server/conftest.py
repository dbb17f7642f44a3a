"""Fixtures for the gRPC layer: short socket directories and a small in-test ClaimPreparer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from dradriver.config import PluginConfig
from dradriver.domain.claims import ClaimRef, ClaimResult, PreparedDevice

T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T], *, timeout: float = 10.0) -> T:
    """Run one test coroutine on a fresh event loop, bounded so a hang fails instead of blocking."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coroutine

    return asyncio.run(bounded())


def make_config(base: Path, *, pod_uid: str = "", healthcheck_port: int = -1) -> PluginConfig:
    return PluginConfig(
        node_name="node-a",
        kubelet_registrar_directory_path=base / "registry",
        kubelet_plugins_directory_path=base / "plugins",
        pod_uid=pod_uid,
        healthcheck_port=healthcheck_port,
    )


class TablePreparer:
    """A ClaimPreparer that hands out one GPU per claim and fails the claims it is told to.

    :param failing: claim UID -> error string returned for that claim.
    :param raise_on_prepare / raise_on_unprepare: exception raised for the whole batch.
    :param gate: when set, prepare waits for it (to keep a prepare in flight).
    """

    def __init__(
        self,
        *,
        failing: Mapping[str, str] | None = None,
        raise_on_prepare: Exception | None = None,
        raise_on_unprepare: Exception | None = None,
        gate: threading.Event | None = None,
        omit: Sequence[str] = (),
        extra: Sequence[str] = (),
        label: str = "",
    ) -> None:
        self.failing = dict(failing or {})
        self.raise_on_prepare = raise_on_prepare
        self.raise_on_unprepare = raise_on_unprepare
        self.gate = gate
        self.omit = set(omit)
        self.extra = tuple(extra)
        self.label = label
        self.prepared: list[list[ClaimRef]] = []
        self.unprepared: list[list[ClaimRef]] = []
        self.started = threading.Event()

    def prepare_claims(self, claims: Sequence[ClaimRef], *,
                       deadline_s: float | None = None) -> Mapping[str, ClaimResult]:
        self.prepared.append(list(claims))
        self.started.set()
        if self.gate is not None:
            self.gate.wait(30)
        if self.raise_on_prepare is not None:
            raise self.raise_on_prepare
        out: dict[str, ClaimResult] = {}
        for index, ref in enumerate(claims):
            if ref.uid in self.omit:
                continue
            if ref.uid in self.failing:
                out[ref.uid] = ClaimResult(error=self.failing[ref.uid])
                continue
            device = f"gpu-{index}"
            out[ref.uid] = ClaimResult(
                devices=(
                    PreparedDevice(
                        request_names=("gpu",),
                        pool_name="node-a",
                        device_name=device,
                        cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={ref.uid}-{device}{self.label}",),
                        share_id=f"share-{index}" if index % 2 else None,
                    ),
                )
            )
        for uid in self.extra:
            out[uid] = ClaimResult(error="not asked for")
        return out

    def unprepare_claims(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        self.unprepared.append(list(claims))
        if self.raise_on_unprepare is not None:
            raise self.raise_on_unprepare
        return {ref.uid: self.failing.get(ref.uid, "") for ref in claims if ref.uid not in self.omit}


def claims(*uids: str) -> list[ClaimRef]:
    return [ClaimRef(namespace="default", name=f"claim-{uid}", uid=uid) for uid in uids]
