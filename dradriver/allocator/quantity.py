"""Kubernetes resource quantities for the allocator: the one implementation lives in
:mod:`dradriver.domain.quantity` (the domain parses quantities in opaque configs too); re-exported here."""

from __future__ import annotations

from dradriver.domain.quantity import (
    INT64_MAX,
    INT64_MIN,
    NANO,
    Format,
    Quantity,
    QuantityError,
    parse_quantity,
)

__all__ = ["INT64_MAX", "INT64_MIN", "NANO", "Format", "Quantity", "QuantityError", "parse_quantity"]
