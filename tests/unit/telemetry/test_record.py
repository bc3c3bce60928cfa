"""`serve --record`: a request line says what /telemetry and monitor say."""

from __future__ import annotations

import json
from pathlib import Path

from orin.telemetry.record import Recorder, read_recording
from tests.timings import finished


def test_a_request_that_produced_no_token_is_recorded_without_a_ttft(tmp_path: Path) -> None:
    """A request cancelled while queued has a ``ttft_ms`` that is only the time it
    ended: its line says null, as /telemetry and the metrics leave it out."""
    recorder = Recorder(tmp_path / "run.jsonl", {"source": "cpu"})
    recorder.on_finish("req-gone", "cancelled", finished(0, 1109.97))
    recorder.on_finish("req-served", "stop", finished(27, 289.57))
    recorder.close()
    gone, served = read_recording(tmp_path / "run.jsonl")["request"]
    assert (gone["id"], gone["ttft_ms"], gone["generated_tokens"]) == ("req-gone", None, 0)
    assert (served["id"], served["ttft_ms"]) == ("req-served", 289.57)
    raw = (tmp_path / "run.jsonl").read_text().splitlines()[1]
    assert json.loads(raw)["ttft_ms"] is None and '"ttft_ms":null' in raw
