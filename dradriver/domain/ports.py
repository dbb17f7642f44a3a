"""Interfaces the layers meet at, as ``typing.Protocol`` classes (no implementation here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from dradriver.domain.claims import ClaimRef, ClaimResult


class ClaimPreparer(Protocol):
    """What the gRPC layer calls; implemented by ``dradriver.driver``.

    Every UID in the input gets an entry in the output; an error for one claim never fails the batch.
    """

    async def prepare_claims(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimResult]:
        """Prepare ``claims``; returns claim UID -> result."""
        ...

    async def unprepare_claims(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Unprepare ``claims``; returns claim UID -> error string (empty on success)."""
        ...
