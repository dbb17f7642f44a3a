"""docs/operations/metrics.md and the Grafana dashboard name exactly the metrics the code exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dradriver.health.metrics import DriverMetrics

from .conftest import MockNode, Services, TaintLog

REPO = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\b(?:dradriver|nvidia_dra)_[a-z_]+\b")


def _exposed(mock_node: Any, services: Services) -> tuple[set[str], set[str]]:
    """(family names, sample names) of a plugin registry with device metrics and one Xid seen."""
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.xid(2, 79)
    log.wait_for(bool, "a taint update")
    metrics = DriverMetrics(node="node-a")
    metrics.attach_devices(service)
    metrics.count_publish_error("Conflict")
    metrics.count_stale_claim("gone")
    metrics.count_nvml_error(15)
    metrics.observe_claim_store("append", "success", 0.001)
    metrics.observe_prepare("success", 0.1)
    families = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))
    return {f.name for f in families}, {s.name for f in families for s in f.samples}


def test_docs_and_dashboard_match_the_exposition(mock_node: Any, services: Services) -> None:
    families, samples = _exposed(mock_node, services)
    ours = {n for n in families | samples if NAME.fullmatch(n) and not n.endswith("_created")}
    docs = (REPO / "docs" / "operations" / "metrics.md").read_text()
    documented = set(NAME.findall(docs))
    assert documented - families - samples == set(), "documented but not exposed"
    undocumented = {f for f in families if NAME.fullmatch(f) and not f.endswith("_created")} - {
        re.sub(r"_total$", "", n) for n in documented
    } - documented
    assert undocumented == set(), "exposed but not documented"

    dashboard = json.loads((REPO / "deploy" / "grafana" / "dradriver-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in NAME.findall(e)}
    assert used and used - ours == set(), "dashboard queries unknown metrics"
    assert {p["gridPos"]["y"] for p in dashboard["panels"]} and dashboard["uid"] == "dradriver-gpu"
