"""The bench's per-phase figures from two scrapes of orin-llm's /metrics."""

from __future__ import annotations

from orin.bench.server import parse_metrics, phase_delta

BEFORE = """
orin_llm_telemetry_source_info{source="cpu"} 1.0
orin_llm_phase_seconds_total{phase="prefill"} 1.0
orin_llm_phase_seconds_total{phase="decode"} 2.0
orin_llm_process_cpu_busy_seconds_total{phase="prefill"} 0.5
orin_llm_process_cpu_busy_seconds_total{phase="decode"} 1.0
orin_llm_engine_batch_tokens_total{kind="prefill"} 100.0
orin_llm_engine_batch_tokens_total{kind="decode"} 50.0
orin_llm_spec_drafted_tokens_total 10.0
orin_llm_spec_accepted_tokens_total 6.0
"""

AFTER = """
orin_llm_telemetry_source_info{source="cpu"} 1.0
orin_llm_phase_seconds_total{phase="prefill"} 2.0
orin_llm_phase_seconds_total{phase="decode"} 6.0
orin_llm_process_cpu_busy_seconds_total{phase="prefill"} 1.25
orin_llm_process_cpu_busy_seconds_total{phase="decode"} 3.0
orin_llm_engine_batch_tokens_total{kind="prefill"} 400.0
orin_llm_engine_batch_tokens_total{kind="decode"} 290.0
orin_llm_spec_drafted_tokens_total 70.0
orin_llm_spec_accepted_tokens_total 46.0
"""


def test_decode_tokens_are_the_tokens_generated_not_the_rejected_drafts() -> None:
    """240 decode batch tokens over the run, 60 of them drafts of which 40 were
    accepted: 220 tokens generated; prefill tokens are the batches' own."""
    got = phase_delta(parse_metrics(BEFORE), parse_metrics(AFTER))
    assert got is not None and got["source"] == "cpu"
    prefill, decode = got["phases"]["prefill"], got["phases"]["decode"]
    assert (prefill["seconds"], prefill["tokens"], prefill["cpu_util"]) == (1.0, 300, 0.75)
    assert (decode["seconds"], decode["tokens"], decode["cpu_util"]) == (4.0, 220, 0.5)
    assert decode["gpu_util"] is None  # the cpu source measures no GPU


def test_without_telemetry_there_are_no_phases() -> None:
    text = 'orin_llm_engine_batch_tokens_total{kind="decode"} 5.0\n'
    assert phase_delta(parse_metrics(""), parse_metrics(text)) is None
