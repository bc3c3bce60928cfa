"""benchmarks/loop_cost.py's fake engine still serves the app it measures: a streamed
completion through the real routes gets every token and the end of the stream."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from benchmarks.loop_cost import fake_app


def test_the_fake_engine_streams_a_completion_through_the_app() -> None:
    with TestClient(fake_app()) as client:
        body = {"prompt": "one two three", "max_tokens": 5, "stream": True}
        reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"][0]["text"]]
    assert texts == [" w0", " w1", " w2", " w3", " w4"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
