"""docs/images/dashboard.png: the dashboard of a real server under load.

Starts ``orin-llm serve``'s server in this process on a free loopback port (SmolLM2-
135M-Instruct when it is in the model cache, the generated demo model otherwise),
keeps more streaming chat requests going than it has slots (so the queue shows),
lets the history fill for ``--seconds``, sends one message from the playground and
takes the screenshot with Debian's chromium (``make browser``) through playwright,
while the load still runs.

    .venv/bin/python scripts/dashboard_screenshot.py [--seconds 40] [--out PATH]
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from orin.model import demo, packaged
from orin.profile.loader import parse_profile
from orin.server.main import build_server

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PROFILE = """name: dashboard-screenshot
engine: {n_ctx: 1024, slots: 4, n_batch: 256, n_ubatch: 256}
server: {host: 127.0.0.1, max_tokens_limit: 512}
"""
PROMPTS = [
    "Explain what a KV cache is in two sentences.",
    "Write a short poem about a robot on a factory floor.",
    "List five things to check before deploying a model to an embedded board.",
    "What is the difference between latency and throughput?",
    "Summarize the plot of a detective story in one paragraph.",
    "Give three tips for saving power on a small computer.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_path() -> Path:
    return packaged.find(packaged.SMOLLM2) or demo.ensure("small", "q4_k_m")


def keep_busy(base: str, model: str, stop: threading.Event, worker: int) -> None:
    """Streamed chat requests one after another until ``stop``."""
    i = worker
    while not stop.is_set():
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": 96 + 48 * (i % 4),
            "stream": True,
        }
        i += 1
        try:
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break
        except httpx.HTTPError:
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="load before the shot")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/images/dashboard.png")
    parser.add_argument("--workers", type=int, default=5, help="concurrent streams (4 slots)")
    args = parser.parse_args(argv)

    from playwright.sync_api import sync_playwright

    profile = parse_profile(PROFILE)
    profile.server.port = free_port()
    server, state = build_server(profile, model_path(), telemetry="auto")
    state.engine.start()
    if state.telemetry is not None:
        state.telemetry.start()
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{profile.server.port}"
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        workers = [
            threading.Thread(target=keep_busy, args=(base, state.model_name, stop, n), daemon=True)
            for n in range(args.workers)
        ]
        for w in workers:
            w.start()
        print(f"loading {base} for {args.seconds:.0f} s", file=sys.stderr)
        time.sleep(args.seconds)
        with sync_playwright() as p, tempfile.TemporaryDirectory() as profile_dir:
            context = p.chromium.launch_persistent_context(
                profile_dir,
                executable_path=CHROMIUM,
                args=ARGS,
                headless=True,
                viewport={"width": 1400, "height": 900},
            )
            page = context.new_page()
            page.goto(base + "/")
            page.wait_for_function("document.querySelector('#chart-throughput').dataset.points > 5")
            page.fill("#chat-max", "64")
            page.fill("#chat-input", "In one sentence: what does a dashboard show?")
            page.click("#chat-send")
            page.wait_for_selector(".msg.assistant[data-streaming=false]", timeout=120_000)
            page.wait_for_timeout(1500)  # one more poll: the charts include the latest second
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out), full_page=True)
            context.close()
        print(f"wrote {args.out}", file=sys.stderr)
    finally:
        stop.set()
        server.should_exit = True
        thread.join(timeout=10)
        state.engine.stop(drain=False, timeout=5)
        if state.telemetry is not None:
            state.telemetry.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
