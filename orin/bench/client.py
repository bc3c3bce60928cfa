"""One streaming completion request, timed token by token.

Token counts come from the server whenever it reports them (``usage``, then
llama.cpp-style ``timings.predicted_n``, then orin-llm's per-token
``token_ids``); counting stream chunks is the last resort, for servers that
report nothing, because a server may hold text back and send several tokens in
one chunk. The stream's chunk times give TTFT, E2EL and the inter-token gaps;
with orin-llm's ``return_token_ids`` every token arrives in its own chunk, so
the gaps are per token.

One client for the load generator (``send``) and the repository's benchmarks
(``stream`` and ``streams``, benchmarks/): blocking http.client, one thread per
stream, each chunk stamped as it arrives and split by one SSE decoder (sse.py).
Both run on the same small machine as the server they measure, and on two
cores an httpx streaming client (async stack, a line iterator) cost about 1 ms
of CPU per token, measured against llama-server, against 0.25 ms for this one;
that CPU is taken from the server's decode threads and charged to whichever
server loses most when a core is taken from it. ``send`` parses every event
(it counts orin-llm's ``token_ids``); ``stream`` parses JSON only for the
events that carry usage or timings. Every server gets the same client.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from orin.bench.sse import SSEDecoder
from orin.bench.stats import RequestResult

CONNECT_TIMEOUT_S = 10.0
READ_SIZE = 65536
JSON_HEADERS = {"Content-Type": "application/json"}

SERVER_TIMING_KEYS = (
    "queue_ms",
    "prefill_ms",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "prompt_n",
    "cache_n",
    "predicted_n",
    "prefill_gpu_util",
    "decode_gpu_util",
    "prefill_cpu_util",
    "decode_cpu_util",
)


class Connections:
    """The connections of a run that are open, so that a cancelled run (Ctrl-C) closes
    them at once: a worker thread blocked reading a stream then returns, instead of
    holding the interpreter's exit (it joins the pool's threads) until the server
    finishes the request or the read timeout passes. Once closed, a connection that
    opens is closed too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.closed = False

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            if self.closed:
                raise ConnectionAbortedError("the run was cancelled")
            self._open.add(sock)

    def discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)

    def close_all(self) -> None:
        with self._lock:
            self.closed = True
            socks = list(self._open)
        for sock in socks:  # a blocked read returns (end of stream) in its own thread
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@dataclass(frozen=True)
class Target:
    """Where and how to send: the base URL, model name, headers, the extra body
    fields this server understands (``ignore_eos``, ``return_token_ids``), the
    read timeout and the run's open connections (closed at once when it is
    cancelled)."""

    base_url: str
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0  # per connection read, as --timeout
    live: Connections | None = None

    def body(self, prompt: str | list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
            **self.extra,
        }
        if stream:
            out["stream_options"] = {"include_usage": True}
        if self.model:
            out["model"] = self.model
        return out


@dataclass
class StreamParser:
    """Accumulates the events of one completion stream (pure: times are passed in)."""

    t0: float
    token_times: list[float] = field(default_factory=list)
    token_ids: int = 0
    saw_token_ids: bool = False
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False

    def feed(self, payload: bytes, t: float) -> None:
        """One event's data (from SSEDecoder), received at ``t``."""
        if payload.strip() == b"[DONE]":
            self.done = True
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            err = chunk["error"] if isinstance(chunk["error"], dict) else {}
            self.error = f"stream error {err.get('type') or err.get('code') or ''}".strip()
            return
        self.usage = chunk.get("usage") or self.usage
        self.timings = chunk.get("timings") or self.timings
        for choice in chunk.get("choices") or ():
            if self._has_token(choice):
                self.token_times.append(t)

    def _has_token(self, choice: dict[str, Any]) -> bool:
        ids = choice.get("token_ids")
        if ids is not None:
            self.saw_token_ids = True
            self.token_ids += len(ids)
            return bool(ids)
        delta = choice.get("delta") or {}
        return bool(choice.get("text") or delta.get("content"))

    def output_tokens(self) -> tuple[int, str]:
        """(n_out, where it came from), preferring the server's own counts."""
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"]), "usage"
        if self.timings and self.timings.get("predicted_n") is not None:
            return int(self.timings["predicted_n"]), "timings"
        if self.saw_token_ids:
            return self.token_ids, "token_ids"
        return len(self.token_times), "chunks"

    def prompt_tokens(self) -> int | None:
        if self.usage and self.usage.get("prompt_tokens") is not None:
            return int(self.usage["prompt_tokens"])
        if self.timings and self.timings.get("prompt_n") is not None:
            return int(self.timings["prompt_n"]) + int(self.timings.get("cache_n") or 0)
        return None

    def result(self, index: int, input_len: int, start_s: float) -> RequestResult:
        if self.error is not None or not self.token_times:
            error = self.error or "no tokens"
            return RequestResult(index, input_len, False, error, start_s=start_s)
        n_out, source = self.output_tokens()
        times = [(t - self.t0) * 1e3 for t in self.token_times]
        timings = self.timings or {}
        return RequestResult(
            index,
            input_len,
            True,
            prompt_tokens=self.prompt_tokens(),
            output_tokens=n_out,
            count_source=source,
            ttft_ms=times[0],
            e2el_ms=times[-1],
            itl_ms=tuple(b - a for a, b in itertools.pairwise(times)),
            start_s=start_s,
            server={k: timings[k] for k in SERVER_TIMING_KEYS if k in timings},
        )


# -- HTTP: blocking http.client, one connection per request -----------------------


@dataclass(frozen=True)
class Reply:
    """A whole (non-streaming) response: the probes' and /metrics'."""

    status: int
    data: bytes

    def json(self) -> Any:
        return json.loads(self.data)

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """An unopened connection to the URL's host and the path to ask for; the read
    timeout applies once connected (connecting has its own, shorter one)."""
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=min(CONNECT_TIMEOUT_S, timeout))
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return conn, path


@contextlib.contextmanager
def _exchange(
    method: str,
    url: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
    timeout: float,
    live: Connections | None = None,
) -> Iterator[http.client.HTTPResponse]:
    """Send one request and yield its response, unread; the connection closes after."""
    conn, path = _connection(url, timeout)
    sock = None
    try:
        conn.connect()
        sock = conn.sock
        if sock is not None:
            sock.settimeout(timeout)
            if live is not None:
                live.add(sock)
        data = json.dumps(body) if body is not None else None
        conn.request(method, path, data, {**JSON_HEADERS, **headers} if data else headers)
        yield conn.getresponse()
    finally:
        if live is not None and sock is not None:
            live.discard(sock)
        conn.close()


def request(
    method: str,
    url: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 600.0,
    live: Connections | None = None,
) -> Reply:
    """One whole request; a refused connection or a timeout raises (OSError,
    http.client.HTTPException)."""
    with _exchange(method, url, body, headers or {}, timeout, live) as resp:
        return Reply(resp.status, resp.read())


def _events(resp: http.client.HTTPResponse) -> Iterator[tuple[bytes, float]]:
    """(event data, perf_counter when its chunk arrived), as the bytes come in."""
    decoder = SSEDecoder()
    while chunk := resp.read1(READ_SIZE):
        now = time.perf_counter()
        for data in decoder.feed(chunk):
            yield data, now
    for data in decoder.close():
        yield data, time.perf_counter()


def http_error(status: int, data: bytes) -> str:
    """``http 400 context_length_exceeded``: the status and the OpenAI error code,
    never the message text (it changes between server versions)."""
    code = None
    try:
        err = json.loads(data).get("error")
        if isinstance(err, dict):
            code = err.get("code") or err.get("type")
    except (ValueError, AttributeError):
        pass
    return f"http {status}" + (f" {code}" if code else "")


def send(
    target: Target,
    prompt: str | list[int],
    max_tokens: int,
    index: int,
    input_len: int,
    run_start: float,
) -> RequestResult:
    """Stream one request (blocking: the load generator runs it on a worker thread);
    every failure becomes a failed result, never an exception."""
    t0 = time.perf_counter()
    parser = StreamParser(t0)
    start_s = t0 - run_start
    url = f"{target.base_url}/v1/completions"
    body = target.body(prompt, max_tokens, stream=True)
    try:
        with _exchange("POST", url, body, target.headers, target.timeout_s, target.live) as resp:
            if resp.status >= 400:
                error = http_error(resp.status, resp.read())
                return RequestResult(index, input_len, False, error, start_s=start_s)
            for data, t in _events(resp):
                parser.feed(data, t)
                if parser.done:
                    break
    except TimeoutError:
        return RequestResult(index, input_len, False, "timeout", start_s=start_s)
    except (OSError, http.client.HTTPException) as exc:
        return RequestResult(index, input_len, False, failure_kind(exc), start_s=start_s)
    except (ValueError, KeyError, TypeError):
        return RequestResult(index, input_len, False, "malformed stream", start_s=start_s)
    return parser.result(index, input_len, start_s)


# connection failures by what happened, for the errors table (the first match names it)
FAILURE_KINDS: tuple[tuple[type[Exception], str], ...] = (
    (ConnectionRefusedError, "connection refused"),
    (http.client.IncompleteRead, "broken stream"),  # the response ended early
    (http.client.RemoteDisconnected, "closed without a response"),
    (ConnectionResetError, "connection reset"),
)


def failure_kind(exc: Exception) -> str:
    """A failed connection in words (``connection refused``, ``broken stream``), or the
    exception's name where there are none."""
    for kind, words in FAILURE_KINDS:
        if isinstance(exc, kind):
            return words
    return type(exc).__name__


# The benchmarks' results: the token times and the server's counts, nothing more.


@dataclass
class Timed:
    """One streamed completion as the client saw it."""

    t0: float  # perf_counter when the request was sent
    token_times: list[float] = field(default_factory=list)  # perf_counter of each token chunk
    usage_tokens: int | None = None  # completion_tokens from the server's usage
    server_tpot_ms: float | None = None  # the server's own figure, from its timings
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times)

    @property
    def ttft_ms(self) -> float | None:
        return (self.token_times[0] - self.t0) * 1e3 if self.token_times else None

    @property
    def itl_ms(self) -> list[float]:
        t = self.token_times
        return [(b - a) * 1e3 for a, b in itertools.pairwise(t)]

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first, by the server's count when
        it gives one (a chunk may carry more than one token)."""
        t, n = self.token_times, self.tokens
        return (t[-1] - t[0]) * 1e3 / (n - 1) if len(t) > 1 and n > 1 else None


def _is_token(event: bytes) -> bool:
    return b'"text": ""' not in event and b'"text":""' not in event


def stream(url: str, prompt: str, n: int, timeout: float = 900.0) -> Timed:
    """POST /v1/completions with stream=true, greedy, ``n`` tokens; never raises."""
    parts = urlsplit(url)
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    out = Timed(time.perf_counter())
    try:
        with _exchange("POST", f"{parts.scheme or 'http'}://{parts.netloc}/v1/completions",
                       body, {}, timeout) as resp:  # fmt: skip
            if resp.status != 200:
                out.error = f"http {resp.status}"
                resp.read()
                return out
            for event, now in _events(resp):
                _lean_event(out, event, now)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def _lean_event(out: Timed, event: bytes, now: float) -> None:
    if event == b"[DONE]":
        return
    if _has_figures(event):
        _final(out, json.loads(event), now)
    elif _is_token(event):
        out.token_times.append(now)


def _has_figures(event: bytes) -> bool:
    """Whether a chunk may carry usage, timings or an error: parsed in full then. With
    include_usage every token chunk has ``"usage": null`` (OpenAI's shape), which
    stays on the cheap path."""
    if b'"timings"' in event or b'"error"' in event:
        return True
    return b'"usage"' in event and b'"usage": null' not in event and b'"usage":null' not in event


def _final(out: Timed, data: dict[str, object], now: float) -> None:
    if data.get("error"):
        out.error = f"stream error: {data['error']}"
        return
    usage = data.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        out.usage_tokens = int(usage["completion_tokens"])
    timings = data.get("timings")
    if isinstance(timings, dict) and timings.get("tpot_ms") is not None:
        out.server_tpot_ms = float(timings["tpot_ms"])
    choices = data.get("choices")
    if isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("text") for c in choices
    ):  # a server may put the last token's text beside its usage or timings
        out.token_times.append(now)


def streams(url: str, prompts: list[str], n: int) -> tuple[float, list[Timed]]:
    """All prompts at once, a thread each; (wall seconds, results in prompt order)."""
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(lambda p: stream(url, p, n), prompts))
        wall = time.perf_counter() - t0
    return wall, results
