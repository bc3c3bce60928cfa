"""orin-llm against the servers people would otherwise wire up by hand.

    make install-bench
    .venv/bin/python -m benchmarks.peers [--quant f16,q4_k_m] [--reps 3] [--json FILE]

1. Builds llama.cpp's own `llama-server` from the llama.cpp sources vendored in
   the llama-cpp-python source distribution the project pins (so all three
   servers run the same llama.cpp), once, into the user cache.
2. Runs the same load against `orin-llm serve`, `llama-server` and
   `python -m llama_cpp.server` (interrupt_requests off: by default a new
   request ends the running stream), interleaved rep by rep so the machine's
   drift hits all alike, on the generated medium model:
   - single stream: TTFT and TPOT over 5 requests one after another;
   - 4 and 8 concurrent streams: throughput, TTFT p95, TPOT p90;
   - a long prompt (most of a slot) arriving while 4 streams decode: ITL p99 of those;
   - one request that generates past the context size: who survives.
   Identical settings: context per slot, slots / parallel sequences, batch,
   threads, KV types; greedy decoding with a fixed output length.
3. Prints ratios (orin-llm / peer) with medians and spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.server_throughput import stop, wait_up
from orin.bench.client import stream, streams
from orin.engine.backend import ggml_type
from orin.engine.config import default_threads
from orin.model import demo
from orin.paths import cache_dir
from tests.serverutil import free_port

LLAMA_CPP_PYTHON = "0.3.36"
SLOTS, CTX_PER_SLOT, N_BATCH = 8, 512, 512


def install_script_options() -> tuple[list[str], str, dict[str, str]]:
    """The CMake options, compiler flags and build key scripts/install-llama-cpp.sh
    gives this machine (its dry run), so llama-server gets the same CPU kernels (and
    GPU build) as the llama-cpp-python build orin-llm runs on."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "install-llama-cpp.sh"
    said = subprocess.run(
        ["bash", str(script), "--dry-run", "--python", sys.executable],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    options: list[str] = []
    key = ""
    env = dict(os.environ)
    for line in said.splitlines():
        if line.startswith("install-llama-cpp: CUDACXX="):
            env["CUDACXX"] = line.split("=", 1)[1]  # else a CUDA build comes out CPU-only
        elif line.startswith("install-llama-cpp: CFLAGS="):
            # CMake's initial C/C++ flags: AMX off on x86-64 (the script's reason)
            env["CFLAGS"] = env["CXXFLAGS"] = line.split("=", 1)[1]
        elif line.startswith("install-llama-cpp: CMAKE_ARGS="):
            options = line.split("=", 1)[1].split()
        elif line.startswith("install-llama-cpp: build "):
            key = line.split()[2].rstrip(",")
    if not options or not key:
        raise RuntimeError(f"unexpected output from {script} --dry-run:\n{said}")
    return options, key, env


def build_llama_server() -> Path:
    """llama-server from the pinned llama-cpp-python sdist's vendored llama.cpp, built with
    the install script's options (cached per option set)."""
    options, key, env = install_script_options()
    out = cache_dir() / "peers" / f"llama-server-{LLAMA_CPP_PYTHON}-{key}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "-d", str(t), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        sdist = next(t.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(t, filter="data")
        src = next(t.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = t / "build"
        subprocess.run(
            ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", *options],
            check=True, stdout=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        jobs = str(os.cpu_count() or 2)
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        binary = next(build.rglob("llama-server"))
        out.write_bytes(binary.read_bytes())
        out.chmod(0o755)
    return out


@dataclass
class Peer:
    name: str
    argv: list[str]
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_up(self.url, self.proc, timeout=180)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def kv_types(model: Path) -> tuple[str, str]:
    """The KV cache types orin-llm serve picks for the model (its KV rules: q8_0 for a
    q4_k_m model, f16 for f16); the peers get the same, so every server stores and
    reads the same cache."""
    from orin.engine.config import engine_config
    from orin.model.gguf import read_model_info
    from orin.profile.schema import Profile

    profile = Profile(name=model.stem)
    profile.engine.slots, profile.engine.n_ctx = SLOTS, CTX_PER_SLOT
    cfg = engine_config(profile, model, read_model_info(model))
    return cfg.type_k, cfg.type_v


def peers(model: Path, server_bin: Path) -> list[Peer]:
    threads = str(default_threads())
    ctx_total = str(SLOTS * CTX_PER_SLOT)
    k, v = kv_types(model)
    return [
        Peer("orin-llm", [sys.executable, "-m", "orin", "serve", "--model", str(model),
             "--slots", str(SLOTS), "--ctx", ctx_total, "--telemetry", "off",
             "--port", "{port}"], 0),
        Peer("llama-server", [str(server_bin), "-m", str(model), "-c", ctx_total,
             "-np", str(SLOTS), "-b", str(N_BATCH), "-ub", str(N_BATCH), "-t", threads,
             "-fa", "on", "-ctk", k, "-ctv", v, "--port", "{port}", "--host", "127.0.0.1"], 0),
        Peer("llama-cpp-python", [sys.executable, "-m", "llama_cpp.server", "--model", str(model),
             "--n_ctx", ctx_total, "--n_batch", str(N_BATCH), "--n_threads", threads,
             "--flash_attn", "True", "--type_k", str(ggml_type(k)), "--type_v", str(ggml_type(v)),
             "--interrupt_requests", "False", "--port", "{port}"], 0),
    ]  # fmt: skip


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def concurrent(url: str, k: int, n: int) -> dict[str, float | None]:
    prompts = [f"Stream {i} of the benchmark on the edge board." for i in range(k)]
    wall, results = streams(url, prompts, n)
    ttfts = [t for r in results if (t := r.ttft_ms) is not None]
    tpots = [t for r in results if (t := r.tpot_ms) is not None]
    return {
        "throughput": sum(r.tokens for r in results) / wall,
        "ttft_p95_ms": pct(ttfts, 0.95),
        "tpot_p90_ms": pct(tpots, 0.90),
        "errors": float(sum(1 for r in results if r.error)),
    }


def one_at_a_time(url: str, k: int, n: int) -> dict[str, float | None]:
    """``k`` single-stream requests one after another: a TPOT median over k requests
    rather than the figure of one."""
    results = [stream(url, f"Single stream {i} on the edge board.", n) for i in range(k)]
    wall = sum(r.token_times[-1] - r.t0 for r in results if r.token_times)
    ttfts = [t for r in results if (t := r.ttft_ms) is not None]
    tpots = [t for r in results if (t := r.tpot_ms) is not None]
    return {
        "throughput": sum(r.tokens for r in results) / wall if wall else None,
        "ttft_p95_ms": pct(ttfts, 0.95),
        "tpot_median_ms": pct(tpots, 0.5),
        "tpot_p90_ms": pct(tpots, 0.90),
        "errors": float(sum(1 for r in results if r.error)),
    }


def long_prompt_during_decode(url: str, n: int) -> dict[str, float | None]:
    """ITL p99 of 4 decoding streams while a ~400-token prompt (most of a slot) arrives."""
    with ThreadPoolExecutor(max_workers=5) as pool:
        running = [pool.submit(stream, url, f"Decode {i}.", n) for i in range(4)]
        time.sleep(1.0)
        intruder = pool.submit(stream, url, "long context " * 100, 4)
        results = [f.result() for f in running]
        intruder.result()
    itl = [x for r in results for x in r.itl_ms]
    return {"itl_p99_ms": pct(itl, 0.99), "itl_max_ms": max(itl) if itl else None}


def past_the_context(url: str) -> dict[str, float | None]:
    """One request for twice the per-slot context: completes, or how far it got."""
    r = stream(url, "Keep going.", 2 * CTX_PER_SLOT)
    return {"tokens": float(r.tokens), "failed": float(r.error is not None)}


def run_scenarios(peer: Peer, tokens: int) -> dict[str, dict[str, float | None]]:
    concurrent(peer.url, 2, 8)  # warm-up
    return {
        "single": one_at_a_time(peer.url, 5, tokens),
        "streams_4": concurrent(peer.url, 4, tokens),
        "streams_8": concurrent(peer.url, 8, tokens),
        "long_prompt": long_prompt_during_decode(peer.url, tokens * 2),
        "past_context": past_the_context(peer.url),
    }


def summarize(runs: dict[str, list[dict[str, dict[str, float | None]]]]) -> list[str]:
    """Markdown rows: the median (min–max) per server and orin-llm / peer ratios."""
    rows = ["| scenario | metric | " + " | ".join(runs) + " | orin-llm / peer |",
            "|---|---|" + "---:|" * (len(runs) + 1)]  # fmt: skip
    first = next(iter(runs.values()))[0]
    for scenario, metrics in first.items():
        for metric in metrics:
            meds: dict[str, float | None] = {}
            cells = []
            for name, reps in runs.items():
                vals = [v for r in reps if (v := r[scenario][metric]) is not None]
                meds[name] = statistics.median(vals) if vals else None
                cells.append(f"{meds[name]:.1f} ({min(vals):.1f}–{max(vals):.1f})" if vals else "-")
            ours = meds.get("orin-llm")
            ratios = [
                f"{n}: {ours / m:.2f}" for n, m in meds.items() if n != "orin-llm" and m and ours
            ]
            rows.append(
                f"| {scenario} | {metric} | " + " | ".join(cells) + f" | {', '.join(ratios)} |"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="f16,q4_k_m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    server_bin = build_llama_server()
    report: dict[str, object] = {}
    for quant in args.quant.split(","):
        model = demo.ensure("medium", quant)
        runs: dict[str, list[dict[str, dict[str, float | None]]]] = {}
        for rep in range(args.reps):
            order = peers(model, server_bin)
            order = order[rep % 3 :] + order[: rep % 3]  # rotate who goes first
            for peer in order:
                peer.port = free_port()
                peer.argv = [a.replace("{port}", str(peer.port)) for a in peer.argv]
                peer.start()
                try:
                    runs.setdefault(peer.name, []).append(run_scenarios(peer, args.tokens))
                finally:
                    peer.stop()
                print(f"[{quant}] rep {rep} {peer.name}: {json.dumps(runs[peer.name][-1])}")
        report[quant] = runs
        print(f"\n### {quant}\n")
        print("\n".join(summarize(runs)))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
