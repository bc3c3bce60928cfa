"""benchmarks/engine_gap.py on the tiny demo model: one gap per pair of steady decodes,
every figure present and the JSON written; times are not asserted (a benchmark's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import engine_gap

pytestmark = pytest.mark.llama


def test_gaps_are_counted_over_the_steady_decodes(tiny_f16: Path) -> None:
    gaps = engine_gap.measure(tiny_f16, threads=1, requests=2, tokens=10)
    # 10 tokens: the prompt and 9 more decodes; 3 left out, 7 steady, 6 gaps between them
    assert len(gaps.decodes_us) == 2 * 7
    assert len(gaps.gaps_us) == 2 * 6
    assert all(g > 0 for g in gaps.gaps_us) and all(d > 0 for d in gaps.decodes_us)


def test_the_command_prints_and_writes_its_figures(
    tiny_f16: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gap.json"
    argv = ["--size", "tiny", "--requests", "1", "--tokens", "8", "--threads", "1"]
    assert engine_gap.main([*argv, "--json", str(out)]) == 0
    assert "gap between decodes median" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["steps"] == len(figures["gaps_us"]) == 4
    assert figures["gap_p10_us"] <= figures["gap_median_us"] <= figures["gap_p90_us"]
