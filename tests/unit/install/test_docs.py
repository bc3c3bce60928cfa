"""Machine-read docs stay true: the Grafana dashboard and the install doc's measured figure."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from orin.server.metrics import ServerMetrics
from orin.telemetry.metrics import PhaseMetrics

DOCS = Path(__file__).resolve().parents[3] / "docs"
METRIC = re.compile(r"\borin_llm_[a-zA-Z0-9_]+")
PANELS = (
    "TTFT p95",
    "TPOT p90",
    "ITL p99",
    "Tokens/s",
    "Requests by finish reason",
    "KV cache usage",
    "Queue and slots",
    "GPU utilization by phase",
    "Power by phase",
    "Energy per token",
    "HTTP 5xx rate",
    "Prefix cache hits",
    "Memory and swap",
    "Temperatures",
)


def exported_names() -> set[str]:
    """Every name the server exposes on /metrics, telemetry included: the samples, and the
    declared families (a labelled gauge has no sample before its first observation)."""
    registry = CollectorRegistry()
    metrics = ServerMetrics(4, 4096, "m", registry)
    PhaseMetrics(registry, "jetson_sysfs")
    names = set()
    for line in metrics.render()[0].decode().splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif m := METRIC.match(line):
            names.add(m.group(0))
    return names


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DOCS / "grafana-dashboard.json").read_text())
    return data


def test_dashboard_queries_name_only_exported_metrics() -> None:
    names = exported_names()
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    assert exprs
    used = {m for e in exprs for m in METRIC.findall(e)}
    assert used, exprs
    assert used <= names, f"not exported: {sorted(used - names)}"


def test_dashboard_has_the_panels() -> None:
    panels = dashboard()["panels"]
    assert [p["title"] for p in panels] == list(PANELS)
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"])


def test_install_doc_records_the_measured_exposure() -> None:
    text = (DOCS / "install.md").read_text(encoding="utf-8")
    assert re.search(r"exposure level for orin-llm\.service: \d\.\d OK", text)
