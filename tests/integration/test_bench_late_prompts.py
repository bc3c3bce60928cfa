"""benchmarks/late_prompts.py on the tiny demo model: both settings ran every round,
and the step that fed the late prompts is the one each setting makes (the prompts
alone in one pass, or beside the running stream's decode row in two); times are not
asserted (a benchmark's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import late_prompts

pytestmark = pytest.mark.llama


def test_the_late_prompts_run_alone_with_prompts_first(tiny_f16: Path) -> None:
    got = late_prompts.measure(tiny_f16, threads=1, rounds=2, late=3, tokens=64)
    assert {name: len(rounds) for name, rounds in got.items()} == {
        "prompts_first": 2,
        "whole_step": 2,
    }
    # the step that fed the late prompts (the running stream, 64 tokens long, still
    # decodes): alone, or beside the stream's decode row in two passes or more (one
    # token of every sequence first, then the rest of the prompts)
    for r in got["prompts_first"]:
        tokens, rows, _ = r.prompt_steps[0]
        assert rows == 0 and tokens > 3
    for r in got["whole_step"]:
        _, rows, passes = r.prompt_steps[0]
        assert rows == 1 and passes >= 2
    assert all(r.late_ttft_ms > 0 and r.running_max_gap_ms > 0 for v in got.values() for r in v)


def test_the_command_prints_and_writes_its_figures(
    tiny_f16: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "late.json"
    argv = ["--size", "tiny", "--rounds", "1", "--tokens", "6", "--threads", "1"]
    assert late_prompts.main([*argv, "--json", str(out)]) == 0
    assert "late prompts' TTFT median" in capsys.readouterr().out
    figures = json.loads(out.read_text())["results"]
    assert set(figures) == {"prompts_first", "whole_step"}
    assert len(figures["prompts_first"]["rounds"]) == 1
