"""What the HTTP server's event loop spends per request and per streamed token.

The server (uvicorn on uvloop and httptools, the FastAPI app of
``orin.server.app``) runs in a child process over a fake engine: a thread that
hands each stream one token per "step" through ``batched_delivery``, as the
engine does, and waits until the loop has taken it, so every token costs the
loop one wake-up, as it does behind a real decode. No llama.cpp: what is
measured is the server's own work, without the decode competing for the
cores. The client streams ``--requests`` completions of ``--short`` tokens and
as many of ``--long`` tokens; the two totals give the cost of a request (its
routing, validation, submission and last events) and of each further token.

Two clocks:

- ``--valgrind``: the loop thread's instructions under callgrind (counters
  zeroed after a warm-up request, dumped after the run). Instruction counts
  repeat to within a few tenths of a percent on a machine other jobs share,
  where CPU time moves by tens of percent; they leave out the kernel (the
  socket write of each event).
- otherwise: the loop thread's CPU time (``/proc/PID/task/PID/schedstat``,
  kernel included), the median of ``--reps`` runs.

    .venv/bin/python -m benchmarks.loop_cost --valgrind       # ~1 min
    .venv/bin/python -m benchmarks.loop_cost --reps 5         # CPU time
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from orin.bench.client import stream
from orin.engine.client import Arrival, EngineStatus
from orin.engine.scheduler import ContextPolicy
from orin.engine.stream import RequestStream, batched_delivery
from orin.engine.timings import TimingRecorder, now_ns
from orin.engine.types import SamplingParams, TokenEvent

WORDS = [f" w{i}" for i in range(100)]


@dataclass(eq=False)  # told apart by identity
class _Stream:
    stream: RequestStream
    limit: int
    prompt: int
    timings: TimingRecorder = field(default_factory=TimingRecorder)
    sent: int = 0


class _Ticket:
    def close(self) -> None:
        pass


class FakeEngine:
    """What the completion routes ask of an engine; one token per stream per step."""

    def __init__(self) -> None:
        self.cfg = SimpleNamespace(
            model_path="/models/fake.gguf",
            n_ctx=512,
            slots=8,
            max_queue=64,
            type_k="f16",
            type_v="f16",
            context=ContextPolicy(512),
        )
        self.model_info = None
        self.state = "ready"
        self._lock = threading.Condition()
        self._active: list[_Stream] = []
        threading.Thread(target=self._run, name="fake-engine", daemon=True).start()

    def status(self) -> EngineStatus:
        return EngineStatus("ready", None, 8, 0, 0, 0, 0, 4096, None, 0)

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        return [1] + [10 + len(w) for w in text.split()]

    def control_tokens(self, texts: tuple[str, ...]) -> tuple[int, ...]:
        return ()

    def piece(self, token: int, special: bool = False) -> bytes:
        return WORDS[token % len(WORDS)].encode()

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        return "".join(WORDS[t % len(WORDS)] for t in tokens)

    def cancel(self, request_id: str) -> None:
        pass

    def add_step_observer(self, fn: object) -> None:  # the dashboard's history
        pass

    def remove_step_observer(self, fn: object) -> None:
        pass

    def add_finish_observer(self, fn: object) -> None:
        pass

    def arrival(self) -> Arrival:
        return _Ticket()  # nothing waits for requests being prepared here

    def remove_finish_observer(self, fn: object) -> None:
        pass

    async def submit_async(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        whole: bool = False,
        media: object = None,
        arrival: Arrival | None = None,
    ) -> RequestStream:
        if arrival is not None:
            arrival.close()
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id or "req", self.cancel, loop, whole)
        limit = params.max_tokens if params is not None else 16
        with self._lock:
            self._active.append(_Stream(stream, limit, len(prompt)))
            self._lock.notify_all()
        return stream

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._active:
                    self._lock.wait()
                active = list(self._active)
            while any(a.stream.backlog for a in active):  # one wake-up of the loop per token
                time.sleep(0.0002)
            time.sleep(0.001)  # the "decode"
            finished = []
            with batched_delivery():
                for a in active:
                    rid = a.stream.request_id
                    a.timings.token(now_ns())
                    a.stream.put(TokenEvent(rid, 5, WORDS[a.sent % len(WORDS)]))
                    a.sent += 1
                    if a.sent >= a.limit:
                        result = a.timings.result(now_ns(), a.prompt, 0, 0)
                        a.stream.put(TokenEvent(rid, None, "", None, "length", result))
                        finished.append(a)
            if finished:
                with self._lock:
                    self._active = [a for a in self._active if a not in finished]


def fake_app() -> Any:
    """orin-llm's FastAPI app over the fake engine."""
    from orin.server.app import create_app
    from orin.server.metrics import ServerMetrics
    from orin.server.state import ServerState

    state = ServerState(
        engine=FakeEngine(),  # type: ignore[arg-type]
        model_name="fake",
        metrics=ServerMetrics(8, 4096, "fake"),
    )
    return create_app(state)


def serve(port: int) -> None:
    """The child: orin-llm's app on uvicorn, as ``orin-llm serve`` runs it."""
    import uvicorn

    from orin.server.main import http_stack

    loop, http = http_stack()
    config = uvicorn.Config(
        fake_app(),
        host="127.0.0.1",
        port=port,
        loop=loop,
        http=http,
        log_config=None,
        access_log=False,
    )
    uvicorn.Server(config).run()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(port: int, callgrind: Path | None) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "benchmarks.loop_cost", "--serve", str(port)]
    if callgrind is not None:
        argv = ["valgrind", "--tool=callgrind", "--separate-threads=yes",
                f"--callgrind-out-file={callgrind}/cg.%p", *argv]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        if not stream(f"http://127.0.0.1:{port}", "up", 2, timeout=30).error:
            return proc
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not come up")


def run(url: str, requests: int, tokens: int) -> int:
    """Stream ``requests`` completions one after another; the tokens received."""
    got = 0
    for i in range(requests):
        r = stream(url, f"Single stream {i} on the edge board.", tokens)
        if r.error:
            raise RuntimeError(r.error)
        got += r.tokens
    return got


def loop_cpu_ns(pid: int) -> int:
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def instructions(folder: Path, pid: int) -> int:
    """The loop thread's instructions in the last callgrind dump of ``pid``."""
    dumps = sorted(glob.glob(f"{folder}/cg.{pid}.*-01"))
    text = Path(dumps[-1]).read_text()
    found = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)
    if found is None:
        raise RuntimeError(f"no totals in {dumps[-1]}")
    return int(found.group(1))


def measure(tokens: int, requests: int, valgrind: bool) -> float:
    """The loop's cost of ``requests`` streamed completions of ``tokens`` tokens each:
    instructions (valgrind) or CPU nanoseconds."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="orin-loop-cost-") as tmp:
        folder = Path(tmp) if valgrind else None
        proc = start(port, folder)
        try:
            run(url, 1, tokens)  # warm-up
            if folder is not None:
                subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True,
                               capture_output=True)  # fmt: skip
                run(url, requests, tokens)
                subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True,
                               capture_output=True)  # fmt: skip
                time.sleep(1.0)
                return float(instructions(folder, proc.pid))
            before = loop_cpu_ns(proc.pid)
            run(url, requests, tokens)
            return float(loop_cpu_ns(proc.pid) - before)
        finally:
            proc.send_signal(2)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--valgrind", action="store_true", help="count instructions (callgrind)")
    ap.add_argument("--requests", type=int, default=5, help="requests per measurement")
    ap.add_argument("--short", type=int, default=20, help="tokens of the short requests")
    ap.add_argument("--long", type=int, default=200, help="tokens of the long requests")
    ap.add_argument("--reps", type=int, default=5, help="CPU-time runs (without --valgrind)")
    ap.add_argument("--json", type=Path, help="write the figures to this file")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve)
        return
    if a.valgrind and not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        ap.error("--valgrind needs valgrind's callgrind and callgrind_control")
    reps = 1 if a.valgrind else a.reps
    per_request: list[float] = []
    per_token: list[float] = []
    for _ in range(reps):
        short = measure(a.short, a.requests, a.valgrind) / a.requests
        long = measure(a.long, a.requests, a.valgrind) / a.requests
        token = (long - short) / (a.long - a.short)
        per_token.append(token)
        per_request.append(short - a.short * token)
    unit = "instructions" if a.valgrind else "ns of CPU time"
    out = {
        "unit": unit,
        "per_request": statistics.median(per_request),
        "per_token": statistics.median(per_token),
        "runs": {"per_request": per_request, "per_token": per_token},
        "settings": {k: v for k, v in vars(a).items() if k not in ("json", "serve")},
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    print(
        f"event loop, {unit}: {out['per_request']:,.0f} per request (routing, validation, "
        f"submission, last events), {out['per_token']:,.0f} per streamed token"
    )
    if a.json is not None:
        a.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
