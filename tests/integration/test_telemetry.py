"""Telemetry end to end on this machine: the CPU source, a generated model, real steps."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from typer.testing import CliRunner

from orin.cli.app import app
from orin.model import demo
from orin.server.state import ServerState
from orin.telemetry.phases import summarize
from orin.telemetry.record import read_recording
from tests.serverutil import free_port, live_server

pytestmark = pytest.mark.llama


def test_long_prompt_then_decode_attributes_both_phases(tmp_path: Path) -> None:
    """`serve --telemetry cpu --record`, a long prompt, then decode: both phases sampled.

    OpenMP worker threads spin while they wait, which reads as a busy core in
    every phase; with OMP_WAIT_POLICY=PASSIVE they sleep between steps, so the
    CPU figures show the phases as they are. The assertions hold whatever else
    the machine runs: counts, tokens and times, no utilization thresholds.
    """
    import os
    import signal
    import subprocess
    import sys

    model = demo.ensure("small", "f16")
    record, port = tmp_path / "run.jsonl", free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orin", "serve", "--model", str(model), "--port", str(port),
         "--slots", "1", "--ctx", "4096", "--telemetry", "cpu", "--record", str(record)],
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        time.sleep(0.3)  # some idle samples first
        prompt = [300 + (i * 7) % 500 for i in range(3500)]
        body = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=300).json()
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    assert r["usage"]["completion_tokens"] == 400
    rec = read_recording(record)
    samples = [SimpleNamespace(**x) for x in rec["sample"]]
    steps = [SimpleNamespace(**x) for x in rec["step"]]
    out = summarize(samples, steps)  # type: ignore[arg-type]
    pre, dec = out["prefill"], out["decode"]
    assert pre.stats["proc_cpu_util"].samples > 5 and dec.stats["proc_cpu_util"].samples > 5
    assert out["idle"].seconds > 0
    assert pre.tokens == 3500 and dec.tokens == 399
    # The prefill samples stand for the prefill steps' time, to the sampling resolution
    # there. (Comparing the phases' CPU shares instead would depend on what else the
    # machine runs: another process on a core lowers the prefill's share the most.)
    prefill = [st for st in steps if st.prefill_tokens]
    first, last = min(st.start_ns for st in prefill), max(st.end_ns for st in prefill)
    inside = sorted(x.t_ns for x in samples if first <= x.t_ns <= last)
    resolution = max(b - a for a, b in itertools.pairwise(inside)) / 1e9  # missed ticks too
    prefill_s = sum(st.end_ns - st.start_ns for st in prefill) / 1e9
    assert abs(pre.seconds - prefill_s) <= 2 * resolution + 0.05 * prefill_s


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerState, Path]]:
    record = tmp_path_factory.mktemp("rec") / "run.jsonl"
    engine = "engine: {n_ctx: 512, slots: 2, n_batch: 128, n_ubatch: 128}\n"
    with live_server(demo.ensure("tiny", "f16"), engine, "cpu", record) as (base, state):
        assert state.telemetry is not None
        yield base, state, record


def test_server_reports_phases_everywhere(served: tuple[str, ServerState, Path]) -> None:
    base = served[0]
    # long enough a decode (the tiny model makes ~300 tokens in 0.1 s) for several samples
    body = {"prompt": "telemetry " * 50, "max_tokens": 400, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    t = r["timings"]
    assert 0.0 <= t["decode_cpu_util"] <= 1.0
    metrics = httpx.get(f"{base}/metrics").text  # flushes the sampler: no wait needed
    assert 'orin_llm_telemetry_source_info{source="cpu"} 1.0' in metrics
    decode = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith('orin_llm_phase_seconds_total{phase="decode"}')
    )
    assert decode > 0
    snap = httpx.get(f"{base}/telemetry").json()
    assert snap["source"] == "cpu" and snap["latest"]["cpu_util"] is not None
    assert snap["recent_requests"][-1]["generated_tokens"] == 400


def test_monitor_once_and_json(served: tuple[str, ServerState, Path]) -> None:
    base = served[0]
    runner = CliRunner()
    frame = runner.invoke(app, ["monitor", "--url", base, "--once"], env={"COLUMNS": "160"})
    assert frame.exit_code == 0, frame.output
    assert "source cpu" in frame.stdout and "CPU (server)" in frame.stdout
    data = runner.invoke(app, ["monitor", "--url", base, "--json"])
    assert json.loads(data.stdout)["health"]["status"] == "ok"
    gone = runner.invoke(app, ["monitor", "--url", "http://127.0.0.1:9", "--once"])
    assert gone.exit_code == 1 and "nothing answers at http://127.0.0.1:9" in gone.stderr


def test_recording_and_its_summary(served: tuple[str, ServerState, Path]) -> None:
    base, state, record = served
    httpx.post(f"{base}/v1/completions", json={"prompt": "record me", "max_tokens": 16}, timeout=60)
    assert state.telemetry is not None and state.telemetry.recorder is not None
    with state.engine.idle(timeout=60):  # the request's step and finish observers have run
        state.telemetry.sampler.flush()
    assert state.telemetry.recorder.sync()  # what they enqueued is in the file
    rec = read_recording(record)
    assert rec["meta"][0]["source"] == "cpu"
    assert rec["sample"] and rec["step"] and rec["request"]
    assert {"t_ns", "cpu_util"} <= set(rec["sample"][0])
    result = CliRunner().invoke(app, ["monitor", "--recording", str(record), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["phases"]["decode"]["tokens"] > 0
    assert summary["recent_requests"]
