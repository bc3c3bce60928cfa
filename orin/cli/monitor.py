"""orin-llm monitor: a live terminal view of a running server, or a recording's summary.

Every figure of the "by phase" table covers the same span: the last 10 s (the
server's snapshot window) in the live view, the whole recording with
--recording. The server's snapshot counts the tokens of the steps that ended in
its window, from the step history it keeps (the last 4,096 steps, which a
fast board can run in less than the window), so once the monitor has watched
for a window's length it takes tokens from the server's counters instead, read at
every refresh: the counter now minus the counter 10 s ago. They count what the
snapshot counts: prompt tokens prefilled (embedding passes' inputs included) and
tokens generated (a step's decode tokens less the drafts the model rejected).
Before that (and with --once) the snapshot's own counts are shown.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from orin.cli.errors import handle_errors, usage_error
from orin.cli.options import ApiKeyOpt, JsonOpt, bearer, check_url, finite, path_named
from orin.cli.output import Output, guard_stdout
from orin.errors import OrinError, os_error_text, unreachable
from orin.telemetry.power import board_power_mw

TOKENS_METRIC = "orin_llm_engine_batch_tokens_total"  # by kind: prefill, decode
EMBEDDED_METRIC = "orin_llm_embedding_tokens_total"  # embedding passes: prompt processing
HISTORY_S = 120.0  # counter readings kept (more than any window the server uses)


class MonitorError(OrinError):
    """The server cannot be reached or the recording cannot be read."""


def _bar(value: float | None, width: int = 30) -> str:
    if value is None:
        return "n/a"
    filled = round(max(0.0, min(1.0, value)) * width)
    return "█" * filled + "░" * (width - filled) + f" {value * 100:5.1f}%"


def _fmt(v: Any, unit: str = "", digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


class TokenWindow:
    """Tokens per phase in the last ``window_s`` seconds, from token counter readings."""

    def __init__(self) -> None:
        self.readings: deque[tuple[float, dict[str, float]]] = deque()

    def add(self, t: float, counts: Mapping[str, float]) -> None:
        last = self.readings[-1][1] if self.readings else None
        if last is not None and any(counts.get(k, 0.0) < v for k, v in last.items()):
            self.readings.clear()  # the server restarted: its counters began again
        self.readings.append((t, dict(counts)))
        while len(self.readings) > 2 and self.readings[1][0] <= t - HISTORY_S:
            self.readings.popleft()

    def tokens(self, window_s: float) -> dict[str, int] | None:
        """Tokens by phase over the last window_s seconds; None before the readings
        span that long."""
        if not self.readings:
            return None
        now, counts = self.readings[-1]
        start = now - window_s
        before = [(t, c) for t, c in self.readings if t <= start]
        if not before:
            return None
        t0, c0 = before[-1]
        t1, c1 = self.readings[len(before)] if len(before) < len(self.readings) else (t0, c0)
        share = (start - t0) / (t1 - t0) if t1 > t0 else 0.0  # the counters at `start`,
        base = {k: v + (c1.get(k, v) - v) * share for k, v in c0.items()}  # interpolated
        return {k: round(v - base.get(k, 0.0)) for k, v in counts.items()}


def parse_token_counters(text: str) -> dict[str, float]:
    """Tokens by phase, from /metrics text, counted as the /telemetry snapshot counts
    them: prefill is the prompt tokens of the batches and of embedding passes, decode
    the tokens generated, which are the decode batches' tokens less the speculative
    drafts the model rejected (``rejected_drafts``)."""
    from orin.bench.server import parse_metrics, rejected_drafts, value

    m = parse_metrics(text)
    out: dict[str, float] = {}
    prefill = value(m, TOKENS_METRIC, kind="prefill")
    if prefill is not None:
        out["prefill"] = prefill + (value(m, EMBEDDED_METRIC) or 0.0)
    decode = value(m, TOKENS_METRIC, kind="decode")
    if decode is not None:
        out["decode"] = decode - rejected_drafts(m)
    return out


def phase_title(snap: Mapping[str, Any], tokens_known: bool) -> str:
    if snap.get("phase") == "recording":
        return f"the whole recording ({snap.get('window_s', '-')} s) by phase"
    window = snap.get("window_s", "-")
    later = "" if tokens_known else f"; tokens after {window} s of watching"
    return f"last {window} s by phase (time, load, tokens and energy in those {window} s{later})"


def render(
    snap: dict[str, Any],
    health: dict[str, Any] | None = None,
    tokens: Mapping[str, int] | None = None,
) -> Group:
    """One frame from a /telemetry snapshot (the same shape a recording summary has).

    ``tokens``: tokens by phase in the snapshot's window (TokenWindow); a recording's
    summary counts its own, over the whole recording like its other figures."""
    if snap.get("source") is None and "phases" not in snap:  # serve --telemetry off
        # health on a line of its own: appended, it made the line wider than the 80
        # columns of a pipe and wrapped between "health" and its status
        text = Text("telemetry is off on this server (serve --telemetry off): nothing to show")
        if health is not None:
            return Group(Text(f"health {health.get('status')}"), text)
        return Group(text)
    latest = snap.get("latest") or {}
    head = Text(
        f"source {snap.get('source')}  phase {snap.get('phase')}  "
        f"slots {snap.get('slots_busy', '-')}/{snap.get('slots_total', '-')}  "
        f"queue {snap.get('waiting', '-')}"
    )
    if health is not None:
        head.append(f"  health {health.get('status')}")
    load = Table.grid(padding=(0, 2))
    load.add_row("GPU", _bar(latest.get("gpu_util")))
    load.add_row("EMC", _bar(latest.get("emc_util")))
    load.add_row("CPU (machine)", _bar(latest.get("cpu_util")))
    load.add_row("CPU (server)", _bar(latest.get("proc_cpu_util")))
    power = board_power_mw(latest.get("power_mw"))
    if power is not None:
        load.add_row("power", f"{power / 1000:.1f} W")
    recording = snap.get("phase") == "recording"
    phases = Table(title=phase_title(snap, recording or tokens is not None), title_justify="left")
    for col in ("phase", "seconds", "GPU mean", "GPU p95", "CPU mean", "tokens", "J/token"):
        phases.add_column(col)
    for name, p in (snap.get("phases") or {}).items():
        gpu, cpu = p.get("gpu_util") or {}, p.get("proc_cpu_util") or {}
        n = p.get("tokens") if recording else (tokens or {}).get(name)
        energy = p.get("energy_j")
        phases.add_row(
            name,
            _fmt(p.get("seconds"), "", 2),
            _fmt(_pct(gpu.get("mean")), "%"),
            _fmt(_pct(gpu.get("p95")), "%"),
            _fmt(_pct(cpu.get("mean")), "%"),
            "-" if n is None else str(n),
            _fmt(energy / n if energy is not None and n else None, "", 4),
        )
    reqs = Table(title="latest requests", title_justify="left")
    for col in ("id", "finish", "prompt", "generated", "TTFT ms", "TPOT ms"):
        reqs.add_column(col)
    for r in list(snap.get("recent_requests") or [])[-8:]:
        reqs.add_row(
            str(r["id"]), str(r["finish_reason"]), str(r["prompt_tokens"]),
            str(r["generated_tokens"]), _fmt(_ttft(r)), _fmt(r["tpot_ms"], "", 2),
        )  # fmt: skip
    return Group(head, load, phases, reqs)


def _ttft(r: dict[str, Any]) -> float | None:
    """A request's TTFT; none for one that produced no token (cancelled while queued or
    during prefill), whose ``ttft_ms`` in a recording made before it was written as
    null is only the time it ended."""
    return r.get("ttft_ms") if r.get("generated_tokens") else None


def _pct(v: float | None) -> float | None:
    return None if v is None else v * 100


def fetch(url: str, client: httpx.Client) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        resp = client.get(f"{url}/telemetry")
        if resp.status_code == 401:
            raise MonitorError(
                f"{url} requires an API key: give it with --api-key or ORIN_LLM_API_KEY"
            )
        if resp.status_code == 404:  # not "telemetry off", which orin-llm answers with 200
            raise MonitorError(f"{url} has no /telemetry (404): monitor watches an orin-llm server")
        if resp.status_code >= 400:
            raise MonitorError(f"{url}/telemetry answered {resp.status_code}")
        snap = resp.json()
        health = client.get(f"{url}/health").json()
    except httpx.ConnectError as exc:
        raise MonitorError(unreachable(url, os_error_text(str(exc)))) from exc
    except (httpx.HTTPError, ValueError) as exc:
        raise MonitorError(f"cannot read {url}: {os_error_text(str(exc))}") from exc
    return snap, health


def fetch_tokens(url: str, client: httpx.Client) -> dict[str, float] | None:
    """The token counters, or None when /metrics cannot be read (then no tokens)."""
    try:
        response = client.get(f"{url}/metrics")
        response.raise_for_status()
        return parse_token_counters(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def _frame(url: str, client: httpx.Client, window: TokenWindow) -> Group:
    snap, health = fetch(url, client)
    counts = fetch_tokens(url, client)
    if counts is not None:
        window.add(time.monotonic(), counts)
    tokens = window.tokens(float(snap.get("window_s") or 10.0)) if counts is not None else None
    if tokens is None:  # not watched for a window yet: the snapshot's own counts
        tokens = _snapshot_tokens(snap)
    return render(snap, health, tokens)


class Watch:
    """The live view's frames after the first. A server that stops answering (systemctl
    restart, a crash, a network drop) is said to be gone, since when, and asked again
    at every refresh; its figures come back when it answers, as top's and watch's do.
    The first frame is not one of these: a wrong --url or key ends the command."""

    def __init__(self, url: str, client: httpx.Client, window: TokenWindow, interval: float):
        self.url, self.client, self.window, self.interval = url, client, window, interval
        self.gone_since: str | None = None

    def frame(self) -> Group:
        try:
            frame = _frame(self.url, self.client, self.window)
        except MonitorError as exc:
            if self.gone_since is None:
                self.gone_since = time.strftime("%H:%M:%S")
            return Group(
                Text(f"{exc}"),
                Text(f"since {self.gone_since}; asking again every {self.interval:g} s"),
            )
        self.gone_since = None
        return frame


def _snapshot_tokens(snap: Mapping[str, Any]) -> dict[str, int] | None:
    """The tokens by phase of the steps that ended in the snapshot's window."""
    phases = snap.get("phases") or {}
    counts = {name: p.get("tokens") for name, p in phases.items()}
    if not counts or any(not isinstance(n, int) for n in counts.values()):
        return None
    return counts


def summarize_recording(path: Path) -> dict[str, Any]:
    """A snapshot-shaped summary of a whole recording. Its ``window_s`` is the time the
    phase rows account for, so that they add up to it: each sample stands for half
    the gap to each neighbour, the first and last mirroring their one gap, so two
    idle samples a second apart are two seconds, not the one between them."""
    from types import SimpleNamespace

    from orin.telemetry.phases import summarize
    from orin.telemetry.record import read_recording

    try:
        rec = read_recording(path)
    except OSError as exc:
        raise MonitorError(f"{path}: {exc.strerror or exc}") from exc
    if not rec["meta"]:
        raise MonitorError(f"{path}: not an orin-llm recording")
    samples = [
        SimpleNamespace(**{k: v for k, v in s.items() if k != "type"}) for s in rec["sample"]
    ]
    steps = [SimpleNamespace(**s) for s in rec["step"]]
    try:
        phases = summarize(samples, steps)
    except (AttributeError, TypeError) as exc:  # a line without a field a recording has
        missing = getattr(exc, "name", None)
        why = f"a line has no {missing!r}" if missing else "a line has a field of another type"
        raise MonitorError(
            f"{path}: not a recording this version of orin-llm reads ({why})"
        ) from None
    covered = sum(p.seconds for p in phases.values())
    return {
        "source": rec["meta"][0].get("source"),
        "phase": "recording",
        "latest": None,
        "window_s": round(covered, 1),
        "phases": {p: s.to_dict() for p, s in phases.items()},
        "recent_requests": [{**r, "ttft_ms": _ttft(r)} for r in rec["request"]],
    }


DEFAULT_URL = "http://127.0.0.1:8080"


@handle_errors
def monitor(
    url: Annotated[
        str | None,
        typer.Option(callback=check_url, help=f"Server to watch (default: {DEFAULT_URL})."),
    ] = None,
    recording: Annotated[
        Path | None,
        typer.Option(parser=path_named, help="Summarize a `serve --record` file instead."),
    ] = None,
    interval: Annotated[
        float, typer.Option(min=0.1, callback=finite, help="Seconds between refreshes.")
    ] = 0.25,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    api_key: ApiKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """GPU load, phase, running requests and the latest TTFT/TPOT, a few times a second."""
    out = Output(as_json)
    if recording is not None and url is not None:
        raise usage_error("--recording and --url exclude each other: a file or a server")
    if recording is not None:
        snap = summarize_recording(recording)
        if as_json:
            out.json(snap)
        else:
            out.print(render(snap))
        return
    base = (url or DEFAULT_URL).rstrip("/")
    with httpx.Client(timeout=2.0, headers=bearer(api_key)) as client:
        if as_json:
            snap, health = fetch(base, client)
            out.json({**snap, "health": health})
            return
        window = TokenWindow()
        frame = _frame(base, client, window)
        if once:
            out.print(frame)
            return
        watch = Watch(base, client, window, interval)
        if not out.out.is_terminal:
            watch_frames(out, frame, watch.frame, interval)
            return
        with Live(frame, console=out.out, refresh_per_second=8) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(watch.frame())
            except KeyboardInterrupt:
                pass


def watch_frames(
    out: Output, first: Group, next_frame: Callable[[], Group], interval: float
) -> None:
    """Off a terminal (a file, a pipe): every refresh printed after the one before, as
    ``top -b`` does, since a live view redraws only a terminal and would print nothing
    until the monitor stops (``orin-llm monitor | head`` waited forever). A reader that
    goes away ends it with 141, as for any command (errors.stdout_closed)."""
    frame = first
    try:
        while True:
            out.print(frame)
            with guard_stdout():
                out.out.file.flush()
            time.sleep(interval)
            frame = next_frame()
    except KeyboardInterrupt:
        pass
