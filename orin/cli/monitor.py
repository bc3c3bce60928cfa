"""orin-llm monitor: a live terminal view of a running server, or a recording's summary."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from orin.cli.errors import handle_errors
from orin.cli.output import Output
from orin.errors import OrinError


class MonitorError(OrinError):
    """The server cannot be reached or the recording cannot be read."""


def _bar(value: float | None, width: int = 30) -> str:
    if value is None:
        return "n/a"
    filled = round(max(0.0, min(1.0, value)) * width)
    return "█" * filled + "░" * (width - filled) + f" {value * 100:5.1f}%"


def _fmt(v: Any, unit: str = "", digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def render(snap: dict[str, Any], health: dict[str, Any] | None = None) -> Group:
    """One frame from a /telemetry snapshot (the same shape a recording summary has)."""
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
    power = latest.get("power_mw") or {}
    if power:
        load.add_row("power", f"{sum(power.values()) / 1000:.1f} W")
    phases = Table(title=f"last {snap.get('window_s', '-')} s by phase", title_justify="left")
    for col in ("phase", "seconds", "GPU mean", "GPU p95", "CPU mean", "tokens", "J/token"):
        phases.add_column(col)
    for name, p in (snap.get("phases") or {}).items():
        gpu, cpu = p.get("gpu_util") or {}, p.get("proc_cpu_util") or {}
        phases.add_row(
            name,
            _fmt(p.get("seconds"), "", 2),
            _fmt(_pct(gpu.get("mean")), "%"),
            _fmt(_pct(gpu.get("p95")), "%"),
            _fmt(_pct(cpu.get("mean")), "%"),
            str(p.get("tokens", "-")),
            _fmt(p.get("energy_per_token_j"), "", 4),
        )
    reqs = Table(title="latest requests", title_justify="left")
    for col in ("id", "finish", "prompt", "generated", "TTFT ms", "TPOT ms"):
        reqs.add_column(col)
    for r in list(snap.get("recent_requests") or [])[-8:]:
        reqs.add_row(
            str(r["id"]), str(r["finish_reason"]), str(r["prompt_tokens"]),
            str(r["generated_tokens"]), _fmt(r["ttft_ms"]), _fmt(r["tpot_ms"], "", 2),
        )  # fmt: skip
    return Group(head, load, phases, reqs)


def _pct(v: float | None) -> float | None:
    return None if v is None else v * 100


def fetch(url: str, client: httpx.Client) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        snap = client.get(f"{url}/telemetry").json()
        health = client.get(f"{url}/health").json()
    except (httpx.HTTPError, ValueError) as exc:
        raise MonitorError(f"cannot read {url}: {exc}") from exc
    return snap, health


def summarize_recording(path: Path) -> dict[str, Any]:
    """A snapshot-shaped summary of a whole recording."""
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
    phases = summarize(samples, steps)
    span = (samples[-1].t_ns - samples[0].t_ns) / 1e9 if len(samples) > 1 else 0.0
    return {
        "source": rec["meta"][0].get("source"),
        "phase": "recording",
        "latest": None,
        "window_s": round(span, 1),
        "phases": {p: s.to_dict() for p, s in phases.items()},
        "recent_requests": rec["request"],
    }


@handle_errors
def monitor(
    url: Annotated[str, typer.Option(help="Server to watch.")] = "http://127.0.0.1:8080",
    recording: Annotated[
        Path | None, typer.Option(help="Summarize a `serve --record` file instead.")
    ] = None,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 0.25,
    once: Annotated[bool, typer.Option(help="Print one frame and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the data as JSON.")] = False,
) -> None:
    """GPU load, phase, running requests and the latest TTFT/TPOT, a few times a second."""
    out = Output(as_json)
    if recording is not None:
        snap = summarize_recording(recording)
        if as_json:
            out.json(snap)
        else:
            out.out.print(render(snap))
        return
    with httpx.Client(timeout=2.0) as client:
        snap, health = fetch(url.rstrip("/"), client)
        if as_json:
            out.json({**snap, "health": health})
            return
        if once:
            out.out.print(render(snap, health))
            return
        with Live(render(snap, health), console=out.out, refresh_per_second=8) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(render(*fetch(url.rstrip("/"), client)))
            except KeyboardInterrupt:
                pass
