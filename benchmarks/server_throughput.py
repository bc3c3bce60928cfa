"""orin-llm serve over HTTP: its overhead against the engine, and its throughput
against llama-cpp-python's own server on the same model.

1. Single-stream TPOT seen by an HTTP streaming client of `orin-llm serve`
   against the engine's TPOT when called directly in-process (same model,
   threads, batch sizes, KV types): the HTTP layer's overhead.
2. Aggregate generated tokens/s with 8 concurrent streaming clients against
   `orin-llm serve` and against `python -m llama_cpp.server` (interrupt_requests
   off, so a new request does not end the running one), runs interleaved.

    make install-bench
    .venv/bin/python -m benchmarks.server_throughput [--size medium] [--quant f16] [--reps 3]

Both servers get the same GGUF file, context, threads and batch size; requests
are greedy (temperature 0) with a fixed output length: the generated demo
models never emit EOS under greedy decoding, so max_tokens is what every
request produces. Token counts come from each server's `usage`.

Each figure also comes as memory-bandwidth utilization (docs/bench.md, "Bandwidth
utilization"): the bytes a decode step reads (weights once, each stream's KV cells)
times the decode steps per second, over this machine's memory bandwidth. Single
stream: steps/s = 1000 / TPOT; 8 streams: steps/s = aggregate tokens/s / 8.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from orin.bench.bandwidth import at_rate, describe
from orin.bench.client import Timed, stream, streams
from orin.engine.config import default_threads
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.system.membw import memory_bandwidth
from tests.serverutil import free_port

N_CTX_PER_SLOT = 512


def start_orin(
    model: Path, port: int, slots: int, threads: int | None = None
) -> subprocess.Popen[bytes]:
    """orin-llm's default threads: one per physical core (default_threads())."""
    extra: list[str] = []
    if threads is not None:
        profile = Path(tempfile.mkdtemp(prefix="orin-bench-")) / "threads.yaml"
        profile.write_text(f"name: bench\nengine: {{threads: {threads}}}\n")
        extra = ["--profile", str(profile)]
    return subprocess.Popen(
        [sys.executable, "-m", "orin", "serve", "--model", str(model), "--port", str(port),
         "--slots", str(slots), "--ctx", str(N_CTX_PER_SLOT), "--telemetry", "off",
         *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def start_llama_cpp_python(model: Path, port: int, threads: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port),
         "--n_ctx", str(N_CTX_PER_SLOT * 8), "--n_threads", str(threads),
         "--n_batch", "512", "--interrupt_requests", "False", "--verbose", "False"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:  # /health says 503 while the model loads (orin-llm, llama-server)
            health = httpx.get(f"{url}/health", timeout=1).status_code
            if health == 200 or (
                health == 404 and httpx.get(f"{url}/v1/models", timeout=1).status_code == 200
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def loop_cpu_ns(pid: int) -> int | None:
    """CPU time of a process's main thread (uvicorn's event loop), from Linux's
    schedstat (nanoseconds); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def concurrent(url: str, prompts: list[str], n: int) -> tuple[float, list[Timed]]:
    """Generated tokens/s of all prompts streamed at once, and each stream."""
    wall, results = streams(url, prompts, n)
    return sum(r.tokens for r in results) / wall, results


def engine_tpot(
    model: Path, prompt: str, n: int, reps: int, threads: int | None = None
) -> list[float]:
    from orin.engine.config import engine_config
    from orin.engine.engine import Engine
    from orin.engine.types import SamplingParams
    from orin.model.gguf import read_model_info
    from orin.profile.schema import Profile

    p = Profile(name="bench")
    p.engine.slots, p.engine.n_ctx = 8, N_CTX_PER_SLOT
    if threads is not None:
        p.engine.threads = threads
    cfg = engine_config(p, model, read_model_info(model))
    out = []
    with Engine(cfg) as e:
        e.generate(prompt, SamplingParams(max_tokens=8, temperature=0))  # warm-up
        for _ in range(reps):
            t = e.generate(prompt, SamplingParams(max_tokens=n, temperature=0)).timings
            assert t is not None and t.tpot_ms is not None
            out.append(t.tpot_ms)
    return out


def engine_tpot_subprocess(
    model: Path, n: int, reps: int, threads: int | None = None
) -> list[float]:
    """engine_tpot in a process of its own, like the server it is compared with."""
    code = (
        "import json, sys; from pathlib import Path; from benchmarks.server_throughput import *; "
        f"print(json.dumps(engine_tpot(Path({str(model)!r}), prompts(1)[0], {n}, {reps}, "
        f"{threads!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def server_kv_types(url: str) -> tuple[str, str]:
    """The KV cache types orin-llm reports in /v1/models; llama.cpp's f16 for others."""
    try:
        meta = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0].get("meta") or {}
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        meta = {}
    return str(meta.get("type_k") or "f16"), str(meta.get("type_v") or "f16")


def prompt_tokens(url: str, prompt: str) -> int:
    """The prompt's token count by the server's /tokenize (BOS included); an estimate
    of 1.3 tokens per word plus BOS where the server has none."""
    try:
        body = {"content": prompt, "add_special": True}
        return len(httpx.post(f"{url}/tokenize", json=body, timeout=5).json()["tokens"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return round(1.3 * len(prompt.split())) + 1


def prompts(k: int) -> list[str]:
    return [f"Request {i}: the edge board serves a model to robot number {i}." for i in range(k)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="medium")
    ap.add_argument("--quant", default="f16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tpot-only", action="store_true", help="Skip the llama-cpp-python part.")
    ap.add_argument(
        "--threads",
        type=int,
        help="llama.cpp threads for the TPOT part (default: one per physical core); "
        "fewer than the cores leaves the HTTP layer a core of its own, as a GPU build does",
    )
    args = ap.parse_args()
    model = demo.ensure(args.size, args.quant)
    info = read_model_info(model)
    bw = memory_bandwidth()
    threads = default_threads()
    results: dict[str, object] = {
        "model": model.name,
        "tokens": args.tokens,
        "threads": threads,
        "tpot_threads": args.threads or threads,
    }

    direct: list[float] = []
    via_http: list[float | None] = []
    server_side: list[float | None] = []
    loop_cpu: list[float] = []  # ms of the server's event-loop thread per streamed token
    orin_kv, cells = ("f16", "f16"), float(args.tokens)
    for _ in range(args.reps):  # interleaved, each in a fresh process, so drift hits both
        direct += engine_tpot_subprocess(model, args.tokens, 3, args.threads)
        port = free_port()
        proc = start_orin(model, port, 8, args.threads)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_up(url, proc)
            orin_kv = server_kv_types(url)
            cells = prompt_tokens(url, prompts(1)[0]) + args.tokens / 2  # mean during decode
            concurrent(url, prompts(1), 8)  # warm-up
            cpu0, streamed = loop_cpu_ns(proc.pid), 0
            for _ in range(3):
                one = stream(url, prompts(1)[0], args.tokens)
                via_http.append(one.tpot_ms)
                server_side.append(one.server_tpot_ms)
                streamed += one.tokens
            cpu1 = loop_cpu_ns(proc.pid)
            if cpu0 is not None and cpu1 is not None and streamed:
                loop_cpu.append((cpu1 - cpu0) / 1e6 / streamed)
        finally:
            stop(proc)
    http_tpot = [t for t in via_http if t is not None]
    overhead = statistics.median(http_tpot) / statistics.median(direct)
    served = [t for t in server_side if t is not None]
    results["tpot"] = {
        "engine_ms": direct,
        "http_ms": http_tpot,
        "server_reported_ms": served,
        "http_over_engine": overhead,
        "server_reported_over_engine": statistics.median(served) / statistics.median(direct),
        "event_loop_cpu_ms_per_token": loop_cpu,
    }
    e_ms, h_ms = statistics.median(direct), statistics.median(http_tpot)
    print(f"single-stream TPOT: engine {e_ms:.2f} ms, HTTP {h_ms:.2f} ms, ratio {overhead:.3f}")
    print(f"  as the server reports it while streaming: {statistics.median(served):.2f} ms")
    if loop_cpu:
        print(f"  event loop CPU per streamed token: {statistics.median(loop_cpu):.3f} ms")
    single = {
        "engine": at_rate(info, 1, cells, 1000 / e_ms, *orin_kv, bw),
        "http": at_rate(info, 1, cells, 1000 / h_ms, *orin_kv, bw),
    }
    bandwidth: dict[str, Any] = {
        "mem_bandwidth": bw.to_dict(),
        "type_k": orin_kv[0],
        "type_v": orin_kv[1],
        "mean_kv_cells": cells,
        "single_stream": {k: u.to_json() for k, u in single.items()},
    }
    results["bandwidth"] = bandwidth
    for name, u in single.items():
        print(f"  decode traffic at the {name} TPOT: {describe(u)}")

    if args.tpot_only:
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    rates: dict[str, list[float]] = {"orin-llm": [], "llama-cpp-python": []}
    for rep in range(args.reps):
        order = (
            ["orin-llm", "llama-cpp-python"] if rep % 2 == 0 else ["llama-cpp-python", "orin-llm"]
        )
        for name in order:
            port = free_port()
            proc = (start_orin(model, port, 8) if name == "orin-llm"
                    else start_llama_cpp_python(model, port, threads))  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            try:
                wait_up(url, proc)
                concurrent(url, prompts(2), 4)  # warm-up
                rate, done = concurrent(url, prompts(8), args.tokens)
                assert all(r.tokens == args.tokens for r in done), [r.tokens for r in done]
                rates[name].append(rate)
                print(f"rep {rep} {name}: {rate:.1f} tok/s")
            finally:
                stop(proc)
    ratio = statistics.median(rates["orin-llm"]) / statistics.median(rates["llama-cpp-python"])
    results["throughput_8_streams"] = {**rates, "ratio": ratio}
    print(f"8 streams: orin-llm {statistics.median(rates['orin-llm']):.1f} tok/s, "
          f"llama-cpp-python {statistics.median(rates['llama-cpp-python']):.1f} tok/s, "
          f"ratio {ratio:.2f}")  # fmt: skip
    kv_of = {"orin-llm": orin_kv, "llama-cpp-python": ("f16", "f16")}
    eight = {  # 8 streams decode together: a step yields 8 tokens
        name: at_rate(info, 8, cells, statistics.median(r) / 8, *kv_of[name], bw)
        for name, r in rates.items()
    }
    bandwidth["streams_8"] = {k: u.to_json() for k, u in eight.items()}
    for name, u in eight.items():
        print(f"  {name}, 8 streams, aggregate: {describe(u)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
