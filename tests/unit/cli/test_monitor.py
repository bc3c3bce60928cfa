"""monitor's "by phase" table: every figure over the same span (the window, or the
whole recording)."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console, Group
from rich.text import Text

from orin.cli.monitor import (
    MonitorError,
    TokenWindow,
    Watch,
    _frame,
    fetch,
    parse_token_counters,
    render,
    summarize_recording,
    watch_frames,
)
from orin.cli.output import Output
from orin.telemetry.record import Recorder
from orin.telemetry.sources.base import Sample

METRICS = """\
# HELP orin_llm_engine_batch_tokens_total Tokens in the batches of completed engine steps.
# TYPE orin_llm_engine_batch_tokens_total counter
orin_llm_engine_batch_tokens_total{kind="prefill"} 5000.0
orin_llm_engine_batch_tokens_total{kind="decode"} 700.0
# TYPE orin_llm_phase_seconds_total counter
orin_llm_phase_seconds_total{phase="decode"} 3.5
"""


def snapshot(phase: str = "decode", window: float = 10.0) -> dict[str, Any]:
    """A /telemetry snapshot: its token counts are those of the steps that ended in its
    window (the last 4,096 steps at most)."""
    return {
        "source": "cpu",
        "phase": phase,
        "latest": {},
        "window_s": window,
        "phases": {
            "prefill": {
                "seconds": 1.0,
                "tokens": 90000,
                "energy_j": 4.0,
                "energy_per_token_j": 4.0 / 90000,
            },
            "decode": {
                "seconds": 8.0,
                "tokens": 30000,
                "energy_j": 10.0,
                "energy_per_token_j": 10.0 / 30000,
            },
        },
        "recent_requests": [],
    }


def text(snap: dict[str, Any], tokens: dict[str, int] | None = None) -> str:
    console = Console(width=200, record=True)
    console.print(render(snap, None, tokens))
    return console.export_text()


def row(out: str, phase: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith(f"│ {phase} "))
    return [cell.strip() for cell in line.strip("│").split("│")]


def test_parse_token_counters() -> None:
    assert parse_token_counters(METRICS) == {"prefill": 5000.0, "decode": 700.0}


def test_token_counters_count_what_the_snapshot_counts() -> None:
    """Decode: the batches' 700 tokens less the 60 drafts the model rejected (90
    drafted, 30 accepted); prefill: the batches' 5000 and 12 embedded input tokens."""
    spec = METRICS + (
        "orin_llm_spec_drafted_tokens_total 90.0\n"
        "orin_llm_spec_accepted_tokens_total 30.0\n"
        "orin_llm_embedding_tokens_total 12.0\n"
    )
    assert parse_token_counters(spec) == {"prefill": 5012.0, "decode": 640.0}


def test_token_window_needs_readings_spanning_the_window() -> None:
    w = TokenWindow()
    assert w.tokens(10.0) is None
    w.add(100.0, {"prefill": 1000.0, "decode": 100.0})
    w.add(105.0, {"prefill": 1500.0, "decode": 200.0})
    assert w.tokens(10.0) is None  # 5 s watched: not yet 10
    w.add(110.0, {"prefill": 1600.0, "decode": 400.0})
    assert w.tokens(10.0) == {"prefill": 600, "decode": 300}
    w.add(112.0, {"prefill": 1600.0, "decode": 500.0})
    # the counters at 102 s, between the readings at 100 and 105: 1200 and 140
    assert w.tokens(10.0) == {"prefill": 400, "decode": 360}
    w.add(113.0, {"prefill": 10.0, "decode": 5.0})  # a restarted server: counters from 0
    assert w.tokens(10.0) is None


def test_live_table_shows_tokens_in_the_window_only() -> None:
    out = text(snapshot(), {"prefill": 600, "decode": 300})
    assert "last 10.0 s by phase (time, load, tokens and energy in those 10.0 s)" in out
    prefill, decode = row(out, "prefill"), row(out, "decode")
    assert prefill[1] == "1.00" and prefill[5] == "600" and prefill[6] == f"{4.0 / 600:.4f}"
    assert decode[5] == "300" and decode[6] == f"{10.0 / 300:.4f}"
    assert "90000" not in out and "30000" not in out  # never the history's counts


def test_live_table_without_window_tokens_says_so() -> None:
    out = text(snapshot())
    assert "tokens after 10.0 s of watching" in out
    assert row(out, "prefill")[5] == "-" and row(out, "prefill")[6] == "-"


def test_a_recording_is_summarised_over_its_whole_span() -> None:
    out = text(snapshot(phase="recording", window=42.0))
    assert "the whole recording (42.0 s) by phase" in out
    assert row(out, "prefill")[5] == "90000"


def record(path: Path, times_s: list[float]) -> Path:
    """A `serve --record` file of idle samples read at ``times_s``."""
    recorder = Recorder(path, {"source": "cpu", "hz": 50.0, "idle_hz": 1.0})
    for t in times_s:
        recorder.on_sample(Sample(t_ns=int(t * 1e9), cpu_util=0.2, proc_cpu_util=0.1))
    recorder.close()
    return path


@pytest.mark.parametrize(
    ("times_s", "seconds"), [([1.0, 2.0], 2.0), ([1.0, 2.0, 4.0], 4.5), ([1.0], 0.0)]
)
def test_a_recordings_length_is_what_its_phase_rows_add_up_to(
    tmp_path: Path, times_s: list[float], seconds: float
) -> None:
    """Two idle samples a second apart stand for a second each: the title says 2.0 s,
    as the idle row does (it said 1.0 s, the gap between them, beside idle 2.00)."""
    snap = summarize_recording(record(tmp_path / "run.jsonl", times_s))
    rows = sum(float(p["seconds"]) for p in snap["phases"].values())
    assert snap["window_s"] == seconds == pytest.approx(rows)
    out = text(snap)
    assert f"the whole recording ({seconds} s) by phase" in out
    assert row(out, "idle")[1] == f"{seconds:.2f}"


def test_fetch_asks_for_the_api_key_when_the_server_wants_one() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.headers.get("authorization") != "Bearer k":
            return httpx.Response(401, json={"error": {"code": "invalid_api_key"}})
        return httpx.Response(200, json={"source": None, "phase": None})

    transport = httpx.MockTransport(answer)
    with (
        httpx.Client(transport=transport) as client,
        pytest.raises(MonitorError, match="requires an API key"),
    ):
        fetch("http://127.0.0.1:8080", client)
    with httpx.Client(transport=transport, headers={"Authorization": "Bearer k"}) as client:
        snap, health = fetch("http://127.0.0.1:8080", client)
    assert snap["source"] is None and health == {"status": "ok"}


def test_a_server_with_telemetry_off_says_so() -> None:
    out = text({"source": None, "phase": None})  # what /telemetry answers then
    assert out.strip() == "telemetry is off on this server (serve --telemetry off): nothing to show"
    assert "source None" not in out


def test_a_server_with_telemetry_off_shows_its_health_whole_at_80_columns() -> None:
    """The width of a pipe: "health" and its status stay on one line."""
    console = Console(width=80, record=True)
    console.print(render({"source": None, "phase": None}, {"status": "ok"}))
    lines = console.export_text().splitlines()
    assert [ln.rstrip() for ln in lines] == [
        "health ok",
        "telemetry is off on this server (serve --telemetry off): nothing to show",
    ]


def test_the_first_frame_shows_the_snapshots_tokens_then_the_counters_window() -> None:
    """`monitor --once` and the first 10 s of the live view show the tokens of the steps
    that ended in the server's window; once the monitor has counter readings 10 s
    apart it counts from the counters (here unchanged since: 0 tokens)."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, json=snapshot())

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        console = Console(width=200, record=True)
        console.print(_frame("http://127.0.0.1:8080", client, TokenWindow()))
        first = console.export_text()
        watched = TokenWindow()
        watched.add(time.monotonic() - 11.0, {"prefill": 5000.0, "decode": 700.0})
        console.print(_frame("http://127.0.0.1:8080", client, watched))
        later = console.export_text()
    assert row(first, "prefill")[5] == "90000" and row(first, "decode")[5] == "30000"
    assert "tokens after" not in first
    assert row(later, "prefill")[5] == "0" and row(later, "decode")[5] == "0"


def test_a_request_that_produced_no_token_shows_no_ttft() -> None:
    """A recording made before its request lines said null kept the engine's timings
    as they were: a request cancelled before its first token has a ``ttft_ms`` that is
    only when it ended."""
    snap = snapshot()
    snap["recent_requests"] = [
        {"id": "req-gone", "finish_reason": "cancelled", "ttft_ms": 1109.97,
         "tpot_ms": None, "prompt_tokens": 36, "generated_tokens": 0},
        {"id": "req-served", "finish_reason": "stop", "ttft_ms": 289.57,
         "tpot_ms": 29.97, "prompt_tokens": 38, "generated_tokens": 27},
    ]  # fmt: skip
    out = text(snap)
    assert row(out, "req-gone") == ["req-gone", "cancelled", "36", "0", "-", "-"]
    assert row(out, "req-served") == ["req-served", "stop", "38", "27", "289.6", "29.97"]


def test_off_a_terminal_every_refresh_is_printed_after_the_one_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file or a pipe gets a frame per refresh at once (a live view would print
    nothing until the monitor stops), until Ctrl-C."""
    monkeypatch.setattr(time, "sleep", lambda s: None)
    sink = io.StringIO()
    out = Output()
    out.out = Console(file=sink, width=80)
    assert not out.out.is_terminal
    frames = iter(["two", "three"])

    def next_frame() -> Group:
        for name in frames:
            return Group(Text(f"frame {name}"))
        raise KeyboardInterrupt

    watch_frames(out, Group(Text("frame one")), next_frame, 0.25)
    assert sink.getvalue().splitlines() == ["frame one", "frame two", "frame three"]


def test_a_recordings_summary_gives_no_ttft_for_a_request_without_a_token(
    tmp_path: Path,
) -> None:
    """`monitor --recording --json` says null for a request that produced no token, also
    for a recording whose line kept the raw time (one made before lines said null)."""
    path = record(tmp_path / "run.jsonl", [1.0, 2.0])
    old = {
        "type": "request",
        "id": "req-gone",
        "finish_reason": "cancelled",
        "ttft_ms": 1109.97,
        "tpot_ms": None,
        "prompt_tokens": 36,
        "generated_tokens": 0,
    }
    served = {**old, "id": "req-served", "finish_reason": "stop", "ttft_ms": 289.57,
              "generated_tokens": 27}  # fmt: skip
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(old) + "\n" + json.dumps(served) + "\n")
    requests = summarize_recording(path)["recent_requests"]
    assert [(r["id"], r["ttft_ms"]) for r in requests] == [
        ("req-gone", None),
        ("req-served", 289.57),
    ]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"[1, 2]\n", "not an orin-llm recording"),  # JSON lines, not objects
        (b"GGUF\x03\x00\x00\x00\x80\xff\xfe binary", "not an orin-llm recording"),
        (
            b'{"type": "meta", "source": "cpu"}\n{"type": "sample", "t_ns": 1}\n{"type": "step"}\n',
            "not a recording this version of orin-llm reads (a line has no 'start_ns')",
        ),
    ],
)
def test_a_file_that_is_not_a_recording_is_said_to_be_one(
    tmp_path: Path, content: bytes, says: str
) -> None:
    """Another file given to `monitor --recording` is a MonitorError (exit 1, one line),
    not an internal error."""
    path = tmp_path / "run.jsonl"
    path.write_bytes(content)
    with pytest.raises(MonitorError) as caught:
        summarize_recording(path)
    assert str(caught.value) == f"{path}: {says}"


@pytest.mark.parametrize(
    ("status", "says"),
    [
        (404, "has no /telemetry (404): monitor watches an orin-llm server"),
        (500, "/telemetry answered 500"),
    ],
)
def test_a_server_without_telemetry_is_not_said_to_have_it_off(status: int, says: str) -> None:
    """Another OpenAI-compatible server (or a URL with a path before /telemetry) answers
    404 with an error body: that is not orin-llm's "telemetry off" (a 200)."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(status, json={"error": {"message": "Not Found"}})

    with (
        httpx.Client(transport=httpx.MockTransport(answer)) as client,
        pytest.raises(MonitorError) as caught,
    ):
        fetch("http://127.0.0.1:8080", client)
    assert str(caught.value).startswith("http://127.0.0.1:8080") and says in str(caught.value)


def test_power_of_an_orin_nx_is_its_input_rail() -> None:
    snap = snapshot()
    snap["latest"] = {"power_mw": {"VDD_IN": 6000.0, "VDD_CPU_GPU_CV": 1000.0, "VDD_SOC": 1500.0}}
    power = next(x for x in text(snap).splitlines() if x.startswith("power"))
    assert power.split() == ["power", "6.0", "W"]  # not 8.5 W: VDD_IN feeds the other two


def test_a_server_that_goes_away_and_comes_back_is_watched_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """systemctl restart orin-llm under a running monitor: it used to end with exit 1 at
    the first refresh the server missed; it now says the server is gone, since when, and
    shows its figures again once it answers (its counters began again: no tokens from
    the readings before the restart)."""
    monkeypatch.setattr(time, "sleep", lambda s: None)
    up = iter([False, False, True])
    answering = {"now": True}

    def answer(request: httpx.Request) -> httpx.Response:
        if not answering["now"]:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, json=snapshot())

    sink = io.StringIO()
    out = Output()
    out.out = Console(file=sink, width=200)
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        watch = Watch("http://127.0.0.1:8080", client, TokenWindow(), 0.25)

        def next_frame() -> Group:
            for now in up:
                answering["now"] = now
                return watch.frame()
            raise KeyboardInterrupt

        watch_frames(out, watch.frame(), next_frame, 0.25)
    lines = sink.getvalue().splitlines()
    assert [line.startswith("source cpu") for line in lines].count(True) == 2  # before, after
    gone = [i for i, line in enumerate(lines) if line.startswith("nothing answers")]
    assert len(gone) == 2
    for i in gone:
        assert lines[i] == "nothing answers at http://127.0.0.1:8080: connection refused"
        assert re.fullmatch(r"since \d\d:\d\d:\d\d; asking again every 0.25 s", lines[i + 1])
    assert lines[gone[0] + 1] == lines[gone[1] + 1]  # gone since the first missed refresh
    assert lines[-1].startswith("└")  # the last frame is the server's tables again
    assert watch.gone_since is None
