"""Reach the running server over HTTP, and wait for it to become healthy after install.

The HTTP GET is injected (``HttpGet``), so install and status are tested
without a server. Waiting also watches the unit: a service that fails while
loading stops the wait at once, with the journal's last lines as the reason,
instead of running into the timeout.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from orin.errors import os_error_text
from orin.install.layout import SERVICE
from orin.system.commands import CommandRunner
from orin.system.services import unit_active_state

JOURNAL_LINES = 20
POLL_S = 1.0
REQUEST_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class HttpResult:
    status: int | None  # None: no HTTP answer at all
    body: str = ""
    error: str | None = None

    def json(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.body)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None


class HttpGet(Protocol):
    """One HTTP GET: ``headers`` carry the API key where a route needs it."""

    def __call__(
        self, url: str, timeout: float, /, headers: dict[str, str] | None = None
    ) -> HttpResult: ...


def http_get(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
    """GET with httpx; a refused connection or a timeout is a result, not an exception."""
    import httpx

    try:
        r = httpx.get(url, timeout=timeout, headers=headers)
    except httpx.TimeoutException:
        return HttpResult(None, error=f"no answer within {timeout:g} s")
    except httpx.HTTPError as exc:
        return HttpResult(None, error=os_error_text(str(exc)) or type(exc).__name__)
    return HttpResult(r.status_code, r.text)


@dataclass(frozen=True)
class HealthOutcome:
    ok: bool
    seconds: float
    detail: str  # the /health body, or why it never answered 200
    journal: str = ""


def wait_healthy(
    get: Callable[[str, float], HttpResult],
    url: str,
    runner: CommandRunner,
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    tick: Callable[[float, str], None] | None = None,
) -> HealthOutcome:
    """Poll ``url``/health until it answers 200, the unit fails, or the time is up.
    ``tick`` hears, after each unhealthy answer, the seconds waited and that answer
    (install's progress bar)."""
    start = clock()
    last = "no answer yet"
    while True:
        res = get(f"{url}/health", REQUEST_TIMEOUT_S)
        if res.status == 200:
            return HealthOutcome(True, clock() - start, res.body.strip())
        last = f"HTTP {res.status}: {res.body.strip()}" if res.status else str(res.error)
        if tick is not None:
            tick(clock() - start, last)
        state = unit_active_state(runner, SERVICE)
        if state == "failed" or (res.json() or {}).get("status") == "failed":
            return HealthOutcome(
                False, clock() - start, f"{SERVICE} failed; {last}", _journal(runner)
            )
        if clock() - start >= timeout_s:
            detail = f"not healthy after {timeout_s:.0f} s (unit {state}); {last}"
            return HealthOutcome(False, clock() - start, detail, _journal(runner))
        sleep(POLL_S)


def _journal(runner: CommandRunner) -> str:
    res = runner.run(
        ("journalctl", "--unit", SERVICE, "--lines", str(JOURNAL_LINES), "--no-pager"),
        timeout=10.0,
    )
    return (res.stdout or res.stderr).rstrip()
