"""JSON-lines recording of a serving run: samples, steps and finished requests.

One object per line with a "type" (meta, sample, step, request), all on the
perf_counter_ns clock, so tune and bench reports (and ``orin-llm monitor``)
can replay the run and attribute phases afterwards. Writes happen on a thread
of their own; the engine and sampler only enqueue.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from orin.engine.types import FinishReason, RequestTimings, StepStats
from orin.telemetry.sources.base import Sample

_STOP = object()


class Recorder:
    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self._fh: IO[str] = path.open("w", encoding="utf-8")
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._write(
            {"type": "meta", "wall_time": time.time(), "t_ns": time.perf_counter_ns(), **meta}
        )
        self._thread = threading.Thread(target=self._run, name="orin-recorder", daemon=True)
        self._thread.start()

    def on_sample(self, s: Sample) -> None:
        self._q.put({"type": "sample", **asdict(s)})

    def on_step(self, s: StepStats) -> None:
        self._q.put({"type": "step", **s._asdict()})

    def on_finish(self, request_id: str, reason: FinishReason, t: RequestTimings) -> None:
        line = {"type": "request", "id": request_id, "finish_reason": reason, **asdict(t)}
        line["ttft_ms"] = t.first_token_ms  # null without a token, as /telemetry gives it
        self._q.put(line)

    def _write(self, obj: dict[str, Any]) -> None:
        self._fh.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def sync(self, timeout: float = 10.0) -> bool:
        """Wait until everything enqueued before this call is written and flushed (a
        reader of the file, tests); False if the writer did not get there in time."""
        done = threading.Event()
        self._q.put(done)
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                break
            if isinstance(item, threading.Event):
                self._fh.flush()
                item.set()
                continue
            assert isinstance(item, dict)
            self._write(item)
            if self._q.empty():
                self._fh.flush()

    def close(self) -> None:
        self._q.put(_STOP)
        self._thread.join(timeout=10)
        self._fh.close()


def read_recording(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The recording's lines grouped by type; a torn last line (a killed run) is skipped,
    as is any line that is not a JSON object (a file that is no recording, text or
    binary, has no meta line then)."""
    out: dict[str, list[dict[str, Any]]] = {"meta": [], "sample": [], "step": [], "request": []}
    with path.open(encoding="utf-8", errors="replace") as fh:  # bytes of another file
        for line in fh:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.setdefault(str(obj.get("type", "unknown")), []).append(obj)
    return out
