"""docs/grafana-dashboard.json against a real app's /metrics: every query is scoped to
the ``instance`` variable, the named panels exist, and every metric they name is
one the server exports (the telemetry's included)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from orin.engine.types import RequestTimings, StepStats
from orin.server.app import create_app
from orin.server.metrics import ServerMetrics
from orin.server.state import ServerState
from orin.telemetry.metrics import PhaseMetrics
from orin.telemetry.phases import Share
from orin.telemetry.sources.base import Sample
from tests.fakes.board import FakeBoard
from tests.fakes.boards_system import thermal_zone
from tests.tools import promtool_or_skip
from tests.unit.server.test_auth import FakeEngine

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana-dashboard.json"
METRIC = re.compile(r"\b(?:orin_llm|process)_[a-zA-Z0-9_]+")
# a metric name followed by its label matchers, when it has any
SELECTOR = re.compile(r"\b((?:orin_llm|process)_[a-zA-Z0-9_]+)(\{[^}]*\})?")
SCOPED = 'instance=~"$instance"'

# panel title -> metrics it must query
NAMED_PANELS = {
    "Power by phase": {"orin_llm_energy_joules_total"},
    "Energy per token": {"orin_llm_energy_joules_total", "orin_llm_engine_batch_tokens_total"},
    "HTTP 5xx rate": {"orin_llm_http_requests_total"},
    "Prefix cache hits": {
        "orin_llm_prompt_tokens_cached_total",
        "orin_llm_prompt_cache_hits_total",
        "orin_llm_prompt_cache_misses_total",
    },
    "Memory and swap": {"orin_llm_memory_available_bytes", "orin_llm_swap_used_bytes"},
    "Temperatures": {"orin_llm_temperature_celsius"},
}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def targets() -> Iterator[tuple[str, str]]:
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every sample name of a real app's /metrics, fed so every series exists: a board
    with memory, swap and thermal zones, a GPU telemetry sample with power, a step,
    a finished request and a served request."""
    board = FakeBoard(tmp_path_factory.mktemp("board")).meminfo()
    thermal_zone(board, 0, "cpu-thermal", 47.5, [])
    metrics = ServerMetrics(2, 1024, "demo", root=board.root)
    PhaseMetrics(metrics.registry, "jetson_sysfs").observe(
        Sample(t_ns=1, gpu_util=0.5, power_mw={"VDD_GPU_SOC": 5000.0}),
        (Share("decode", 1.0),),
        0.02,
    )
    metrics.on_step(StepStats(0, 20_000_000, 16, 1, 1, 17, 0, 0, False))
    t = RequestTimings(
        queue_ms=1, prefill_ms=10, ttft_ms=11, tpot_ms=5, e2e_ms=21, itl_ms=(5, 5),
        prompt_tokens=10, cached_tokens=2, generated_tokens=3, context_shifts=0,
    )  # fmt: skip
    metrics.on_finish("r", "stop", t)
    state = ServerState(engine=FakeEngine(), model_name="demo", metrics=metrics, api_key="k")  # type: ignore[arg-type]
    with TestClient(create_app(state)) as client:
        headers = {"Authorization": "Bearer k"}
        assert client.get("/v1/models", headers=headers).status_code == 200
        r = client.get("/metrics", headers=headers)
    assert r.status_code == 200
    return {s.name for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_the_instance_variable_is_defined() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    instance = variables["instance"]
    assert instance["type"] == "query" and instance["multi"] and instance["includeAll"]
    assert instance["allValue"] == ".*"
    assert "instance" in instance["definition"]


def test_every_query_is_scoped_to_the_instance() -> None:
    checked = 0
    for title, expr in targets():
        selectors = SELECTOR.findall(expr)
        assert selectors, (title, expr)
        for name, matchers in selectors:
            assert SCOPED in matchers, (title, name, expr)
            checked += 1
        if "histogram_quantile" in expr:  # one percentile per instance, never merged
            assert "by (instance, le)" in expr, (title, expr)
        elif expr.startswith("sum") or "/ sum" in expr:
            assert all("instance" in by for by in re.findall(r"by \(([^)]*)\)", expr)), expr
    assert checked >= 30


def test_the_named_panels_exist_and_query_their_series() -> None:
    panels = {p["title"]: p for p in dashboard()["panels"]}
    for title, needed in NAMED_PANELS.items():
        assert title in panels, title
        used = {m for t in panels[title]["targets"] for m in METRIC.findall(t["expr"])}
        assert needed <= used, (title, needed - used)
    assert len({p["id"] for p in panels.values()}) == len(dashboard()["panels"])


def test_every_metric_a_panel_names_is_exported(exported: set[str]) -> None:
    used = {m for _, expr in targets() for m in METRIC.findall(expr)}
    variable = dashboard()["templating"]["list"][-1]["definition"]
    used |= set(METRIC.findall(variable))
    assert used <= exported, f"not exported: {sorted(used - exported)}"


def test_every_query_parses(tmp_path: Path) -> None:
    """promtool checks each expression (as a recording rule, $instance filled in)."""
    promtool = promtool_or_skip()
    rules = [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$instance", ".*")}
        for i, (_, expr) in enumerate(targets())
    ]
    path = tmp_path / "rules.json"  # YAML is a superset of JSON
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
