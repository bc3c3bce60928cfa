"""The live dashboard: the page at ``/``, its login, its assets and ``GET /dashboard/data``.

The page (orin/server/static/) is static: everything it shows comes from
``/dashboard/data``, which it polls once a second. That endpoint answers the
current load (slots, queue, KV cells: the figures ``/slots`` has) and a history
of one row a second over the last ``HISTORY_S`` seconds, kept here in a ring
buffer whether or not a page is open, so a page opened during an incident shows
the minutes before it. A poll passes ``since`` (the time of the newest row it
has) and gets only the rows after it.

A row is closed once a second by a task on the event loop (``History.run``,
started and stopped with the app's lifespan). What happens between two rows is
added up by observers on the threads that see it: the engine's step and finish
observers (tokens, TTFT and TPOT) and the telemetry's phase tracker (GPU
utilization of the samples attributed to prefill and to decode, power). The
tick reads the engine's status, /proc/meminfo and the thermal zones (as
``/metrics`` does: ``read_temperatures``, a zone switched off left out), and
touches no GPU counter itself: the telemetry sampler alone decides how often
the GPU is read (at 1 Hz while idle, so that it can rail-gate).

Auth (orin/server/auth.py): ``/``, ``/login``, ``/logout`` and
``/dashboard/assets/`` are public. ``/`` serves the dashboard to a caller with
the key (header or cookie) and otherwise a login page with nothing of the
server's in it; the login form posts the key to ``/login``, which sets it as
an HttpOnly, SameSite=Strict cookie, so the page's own requests
(``/dashboard/data``, ``/slots``, the playground's ``/v1/chat/completions``)
carry it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import html
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles

from orin.engine.types import FinishReason, RequestTimings, StepStats
from orin.errors import OrinError
from orin.server import auth, slots
from orin.server.state import ServerState
from orin.system.memory import read_meminfo
from orin.system.root import SysRoot
from orin.telemetry.metrics import read_temperatures
from orin.telemetry.phases import Share
from orin.telemetry.power import board_power_mw
from orin.telemetry.sources.base import Sample

log = logging.getLogger("orin.server")

STATIC = Path(__file__).parent / "static"
ASSETS = "/dashboard/assets"
HISTORY_S = 300  # rows kept: five minutes at one a second
INTERVAL_S = 1.0
LATENCY_WINDOW_S = 60.0  # the TTFT/TPOT percentiles of a row: requests finished this recently
MAX_LOGIN_BYTES = 4096

# The page's own: scripts and styles from this server only, no framing. uPlot
# positions its elements through the CSSOM (element.style), which style-src
# does not govern; 'unsafe-inline' is not needed.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

# The columns of a history row besides the per-zone temperatures, in the order the
# page draws them. None: not measured in that second (no request finished, no GPU
# counter, no power rails).
SERIES = (
    "slots_busy",
    "queue",
    "tokens_per_s",  # generated tokens (decoded and accepted drafts)
    "prompt_tokens_per_s",  # prompt tokens prefilled (embedding inputs included)
    "ttft_p50_ms",
    "ttft_p95_ms",
    "tpot_p50_ms",
    "tpot_p95_ms",
    "requests_per_s",  # requests finished
    "gpu_util_prefill",  # 0..1, the samples attributed to prefill in that second
    "gpu_util_decode",
    "gpu_util",  # 0..1, every sample of that second, idle ones included
    "mem_used_bytes",  # MemTotal - MemAvailable: on a Jetson the GPU's memory too
    "gpu_mem_used_bytes",  # a discrete GPU's own memory (NVML); None on a Jetson
    "kv_cells_used",
    "kv_cells_cached",
    "power_w",  # the sum of the rails the source reports
)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class _Window:
    """What happened since the last row, added up by the engine and sampler threads."""

    generated: int = 0
    prompt: int = 0
    finished: int = 0
    util: dict[str, list[float]] = field(default_factory=dict)  # phase -> [sum, weight]


class History:
    """One row a second of the server's load, latency, GPU, memory and board figures."""

    def __init__(
        self,
        state: ServerState,
        root: SysRoot | None = None,
        seconds: int = HISTORY_S,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = state
        self.root = root or SysRoot()
        self.interval_s = interval_s
        self.rows: deque[dict[str, Any]] = deque(maxlen=max(1, int(seconds / interval_s)))
        self._clock = clock
        # when this process began keeping rows: a page that sees it change knows the
        # server restarted, and that its rows do not join the ones it held before
        self.started = round(clock(), 3)
        self._lock = threading.Lock()
        self._window = _Window()
        self._finished: deque[tuple[float, float | None, float | None]] = deque()
        self._latest: Sample | None = None
        self._last_t: float | None = None

    # -- observers: engine thread and sampler thread ------------------------------

    def attach(self) -> None:
        """Observe the engine's steps and finished requests, and the telemetry's phases."""
        engine = self.state.engine
        engine.add_step_observer(self.on_step)
        engine.add_finish_observer(self.on_finish)
        if self.state.telemetry is not None:
            self.state.telemetry.tracker.observers.append(self.on_sample)

    def detach(self) -> None:
        engine = self.state.engine
        with contextlib.suppress(ValueError):
            engine.remove_step_observer(self.on_step)
        with contextlib.suppress(ValueError):
            engine.remove_finish_observer(self.on_finish)
        if self.state.telemetry is not None:
            with contextlib.suppress(ValueError):
                self.state.telemetry.tracker.observers.remove(self.on_sample)

    def on_step(self, s: StepStats) -> None:
        generated = s.decode_tokens - s.drafted_tokens + s.accepted_tokens
        with self._lock:
            self._window.generated += max(generated, 0)
            self._window.prompt += s.prefill_tokens + s.embedded_tokens

    def on_finish(self, request_id: str, reason: FinishReason, t: RequestTimings) -> None:
        with self._lock:
            self._window.finished += 1
            self._finished.append((self._clock(), t.first_token_ms, t.tpot_ms))

    def on_sample(self, sample: Sample, shares: tuple[Share, ...], dt: float) -> None:
        with self._lock:
            self._latest = sample
            if sample.gpu_util is None:
                return
            for share in shares:
                acc = self._window.util.setdefault(share.phase, [0.0, 0.0])
                acc[0] += sample.gpu_util * share.weight * dt
                acc[1] += share.weight * dt

    # -- rows ---------------------------------------------------------------------

    def tick(self) -> dict[str, Any]:
        """Close the current second into a row and keep it."""
        now = self._clock()
        elapsed = self.interval_s if self._last_t is None else max(now - self._last_t, 1e-3)
        self._last_t = now
        with self._lock:
            window, self._window = self._window, _Window()
            while self._finished and self._finished[0][0] < now - LATENCY_WINDOW_S:
                self._finished.popleft()
            finished = list(self._finished)
            latest = self._latest
        s = self.state.engine.status()
        ttft = [f[1] for f in finished if f[1] is not None]
        tpot = [f[2] for f in finished if f[2] is not None]
        row: dict[str, Any] = {
            "t": round(now, 3),
            "slots_busy": s.slots_busy,
            "queue": s.waiting,
            "tokens_per_s": round(window.generated / elapsed, 2),
            "prompt_tokens_per_s": round(window.prompt / elapsed, 2),
            "ttft_p50_ms": _ms(percentile(ttft, 50)),
            "ttft_p95_ms": _ms(percentile(ttft, 95)),
            "tpot_p50_ms": _ms(percentile(tpot, 50)),
            "tpot_p95_ms": _ms(percentile(tpot, 95)),
            "requests_per_s": round(window.finished / elapsed, 3),
            "gpu_util_prefill": _mean(window.util.get("prefill")),
            "gpu_util_decode": _mean(window.util.get("decode")),
            "gpu_util": _mean(_total(window.util.values())),
            "mem_used_bytes": self._mem_used(),
            "gpu_mem_used_bytes": latest.gpu_mem_used_bytes if latest is not None else None,
            "kv_cells_used": s.kv_cells_used,
            "kv_cells_cached": s.kv_cells_cached,
            "power_w": _power_w(latest),
            "temp_c": read_temperatures(self.root),
        }
        self.rows.append(row)
        return row

    def _mem_used(self) -> int | None:
        try:
            m = read_meminfo(self.root)
        except OrinError:
            return None
        return m.total - m.available

    def columns(self, since: float | None = None) -> dict[str, Any]:
        """The rows after ``since`` (all without it), column by column as the page's
        charts take them; temperatures per zone, a zone absent from a row as None."""
        rows = [r for r in list(self.rows) if since is None or r["t"] > since]
        zones = sorted({z for r in rows for z in r["temp_c"]})
        out: dict[str, Any] = {"t": [r["t"] for r in rows]}
        for key in SERIES:
            out[key] = [r[key] for r in rows]
        out["temp_c"] = {z: [r["temp_c"].get(z) for r in rows] for z in zones}
        return out

    async def run(self) -> None:
        """Tick every ``interval_s`` until cancelled (the app's lifespan)."""
        while True:
            self.tick()
            await asyncio.sleep(self.interval_s)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _mean(acc: list[float] | None) -> float | None:
    if acc is None or acc[1] <= 0:
        return None
    return round(acc[0] / acc[1], 4)


def _total(accs: Iterable[list[float]]) -> list[float] | None:
    parts = list(accs)
    if not parts:
        return None
    return [sum(a[0] for a in parts), sum(a[1] for a in parts)]


def _power_w(sample: Sample | None) -> float | None:
    power = board_power_mw(sample.power_mw) if sample is not None else None
    return None if power is None else round(power / 1000, 3)


# -- the endpoint -------------------------------------------------------------------


def data_body(state: ServerState, history: History | None, since: float | None) -> dict[str, Any]:
    """``GET /dashboard/data``: the server, its load now, and the history after ``since``."""
    s = state.engine.status()
    telemetry = state.telemetry
    return {
        "model": state.model_name,
        "version": state.version,
        "state": s.state,
        "auth": state.api_key is not None,  # the page offers to sign out
        "meta": state.model_meta(),
        "interval_s": history.interval_s if history is not None else INTERVAL_S,
        "history_s": HISTORY_S,
        "started": history.started if history is not None else None,
        "telemetry": {
            "source": telemetry.source_name if telemetry is not None else None,
            "phase": telemetry.tracker.phase if telemetry is not None else None,
        },
        "now": slots.slots_body(state.engine),
        "history": history.columns(since) if history is not None else None,
    }


# -- the routes ---------------------------------------------------------------------


def register(app: FastAPI, state: ServerState) -> History | None:
    """``GET /slots`` always; the page, login, assets and ``/dashboard/data`` unless the
    profile turns the dashboard off (``server.dashboard: false``: ``/`` is a 404).
    Returns the history (None when off), whose ticks follow the app's lifespan.

    The routes are coroutines: each is a few reads, and on the event loop they run
    on the thread that ticks the history, so reading the rows needs no lock.

    ``server.dashboard`` reaches here as ``state.dashboard`` (absent: on)."""

    slots.register(app, state)
    if not state.dashboard:
        return None
    page = (STATIC / "index.html").read_text("utf-8")
    history = History(state)
    _run_with_lifespan(app, history)
    app.mount(ASSETS, StaticFiles(directory=STATIC), name="dashboard-assets")

    @app.get("/", include_in_schema=False)
    async def index(request: Request) -> Response:
        if not auth.authorized(state, request):
            return _login_page()
        return HTMLResponse(page, headers=SECURITY_HEADERS)

    @app.get("/login", include_in_schema=False)
    async def login_form(request: Request) -> Response:
        if state.api_key is None or auth.authorized(state, request):
            return RedirectResponse("/", status_code=303)
        return _login_page()

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        if state.api_key is None:
            return RedirectResponse("/", status_code=303)
        address = request.client.host if request.client else ""
        wait = state.login_limiter.retry_after(address)
        if wait:  # before the key is compared: a guess here tells nothing
            page = _login_page(f"Too many wrong keys: try again in {wait} s.", 429)
            page.headers["Retry-After"] = str(wait)
            return page
        key = await _form_key(request)
        if key is None or not hmac.compare_digest(key.encode(), state.api_key.encode()):
            state.login_limiter.failed(address)
            return _login_page("That key is not the server's API key.", 401)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(
            auth.COOKIE,
            key,
            httponly=True,
            samesite="strict",
            path="/",
            secure=request.url.scheme == "https",
        )
        return response

    @app.post("/logout", include_in_schema=False)
    async def logout() -> Response:
        """Forget the key in this browser, whatever the cookie holds (a public path: a
        stale cookie, from before the key changed, is deleted too)."""
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(auth.COOKIE, path="/", httponly=True, samesite="strict")
        return response

    @app.get("/dashboard/data")
    async def data(request: Request, since: float | None = None) -> JSONResponse:
        slots.require_key(state, request)
        return JSONResponse(data_body(state, history, since), headers={"Cache-Control": "no-store"})

    return history


def _run_with_lifespan(app: FastAPI, history: History) -> None:
    """Keep the history while the app runs: its observers attached and a ticking task
    started with the app's lifespan, both undone at its end, around whatever
    lifespan the app already has."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        history.attach()
        task = asyncio.create_task(history.run(), name="orin-dashboard-history")
        try:
            async with inner(a) as value:
                yield value
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            history.detach()

    app.router.lifespan_context = lifespan


async def _form_key(request: Request) -> str | None:
    """The ``key`` field of the login form (application/x-www-form-urlencoded), read
    without python-multipart; None when absent or the body is too large for a key."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BYTES:
            return None
    values = parse_qs(body.decode("utf-8", errors="replace")).get("key")
    return values[0].strip() if values else None


LOGIN_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>orin-llm: sign in</title>
<link rel="icon" href="{assets}/favicon.svg" type="image/svg+xml">
<link rel="stylesheet" href="{assets}/dashboard.css">
</head>
<body class="login">
<main class="login-box">
<h1>orin-llm</h1>
<p>This server needs its API key.</p>
<form method="post" action="/login" id="login-form">
<label for="key">API key</label>
<input type="password" id="key" name="key" autocomplete="current-password" required autofocus>
<button type="submit">Sign in</button>
</form>
{message}
</main>
</body>
</html>
"""


def _login_page(message: str | None = None, status: int = 200) -> HTMLResponse:
    note = f'<p class="error" id="login-error">{html.escape(message)}</p>' if message else ""
    body = LOGIN_PAGE.format(assets=ASSETS, message=note)
    return HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)
