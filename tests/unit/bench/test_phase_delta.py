"""The bench's per-phase figures from two scrapes of orin-llm's /metrics."""

from __future__ import annotations

from orin.bench.server import parse_metrics, phase_delta


def metrics(
    seconds: tuple[float, float],
    cpu: tuple[float, float],
    tokens: tuple[float, float],
    drafted: float,
    accepted: float,
) -> str:
    """/metrics text with the counters the bench reads, (prefill, decode) each."""
    lines = ['orin_llm_telemetry_source_info{source="cpu"} 1.0']
    for i, phase in enumerate(("prefill", "decode")):
        lines += [
            f'orin_llm_phase_seconds_total{{phase="{phase}"}} {seconds[i]}',
            f'orin_llm_process_cpu_busy_seconds_total{{phase="{phase}"}} {cpu[i]}',
            f'orin_llm_engine_batch_tokens_total{{kind="{phase}"}} {tokens[i]}',
        ]
    lines += [
        f"orin_llm_spec_drafted_tokens_total {drafted}",
        f"orin_llm_spec_accepted_tokens_total {accepted}",
    ]
    return "\n".join(lines) + "\n"


BEFORE = metrics((1.0, 2.0), (0.5, 1.0), (100.0, 50.0), drafted=10.0, accepted=6.0)
AFTER = metrics((2.0, 6.0), (1.25, 3.0), (400.0, 290.0), drafted=70.0, accepted=46.0)


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
