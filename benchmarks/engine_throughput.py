"""Engine benchmark: continuous batching vs the same requests one by one in llama_cpp.Llama.

For each quantization of the generated demo model and each stream count S, one
repetition runs S distinct greedy requests two ways:

- engine: all S submitted at once to ``orin.engine.Engine``; aggregate throughput is
  the generated tokens over the wall time from the first submit to the last completion;
- sequential: the same token prompts one after another through one plain
  ``llama_cpp.Llama`` (``eval`` the prompt, then argmax / ``eval`` of one token),
  timed from the first prompt to the last token.

Both sides get the same prompts, output length, thread count, batch sizes, KV cache
types and flash-attention setting. The two sides alternate order from repetition to
repetition and every repetition uses fresh prompts. The engine keeps its default prefix
cache: fresh prompts share only the BOS token, so a reused slot skips at most that one
prompt token (summed up as ``cached_tokens``). Single-stream TPOT (first token
excluded) comes from the S=1 runs plus ``--tpot-pairs`` extra single-stream pairs per
repetition. A step breakdown pass at the end splits each side's time per generated step
into llama_decode and everything else, and counts the llama.cpp micro-batches per engine
step (see ``seq_runs``).

Every rate is also shown as memory-bandwidth utilization (docs/bench.md, "Bandwidth
utilization"): the bytes a decode step reads (the weights once, each stream's attended
KV cells; orin.model.traffic) times decode steps per second, over this machine's memory
bandwidth (orin.system.membw). Steps/s is 1000 / TPOT for one stream, tokens/s / S for
S streams (prefill included), and 1000 / step period for the steady steps of the
breakdown (decode only).

Run: ``.venv/bin/python -m benchmarks.engine_throughput [--quant f16,q4_k_m] [--size medium]
[--streams 1,4,8] [--tokens 64] [--reps 5] [--tpot-pairs 5] [--breakdown-runs 3]
[--json FILE]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from orin.bench.bandwidth import Utilization, at_rate
from orin.engine.backend import ggml_type
from orin.engine.config import EngineConfig, engine_config
from orin.engine.engine import Engine
from orin.engine.types import SamplingParams, StepStats
from orin.model import demo
from orin.model.gguf import ModelInfo, read_model_info
from orin.model.vocab import FIRST_NORMAL_ID
from orin.profile.loader import parse_profile
from orin.system.membw import Bandwidth, memory_bandwidth

BOS = 1  # <s> of the demo vocabulary
N_CTX = 512
N_BATCH = 512
PROMPT_MIN = 32
PROMPT_MAX = 64
TPOT_TARGET = 1.05  # engine TPOT at most 5 % above the plain loop's
RATIO_TARGET = 2.5  # f16, at the largest stream count (8)


@dataclass
class Run:
    """One side of one repetition at one stream count."""

    side: str  # "engine" or "sequential"
    streams: int
    generated: int
    wall_s: float
    tpot_ms: list[float]  # per request, first token excluded
    itl_median_ms: list[float]  # per request, median inter-token latency
    token_ids: list[list[int]] = field(repr=False)
    cached_tokens: int = 0
    slots: list[int] = field(default_factory=list)  # engine slot (= llama.cpp seq id) per request

    @property
    def tok_s(self) -> float:
        return self.generated / self.wall_s


@dataclass
class Breakdown:
    """Median milliseconds per steady generation step of one side at one stream count."""

    side: str
    streams: int
    steps: int
    period_ms: float  # wall time per step, including everything between steps
    decode_ms: float  # inside llama_decode (engine: Runner.decode, which fills the batch too)
    other_ms: float  # period - decode: Python bookkeeping, sampling, locks, thread hand-offs
    seq_runs: list[int]  # runs of consecutive busy slots seen (llama.cpp micro-batches per step)


# -- prompts -------------------------------------------------------------------


def make_prompts(seed: int, tag: str, streams: int, n_vocab: int) -> list[list[int]]:
    """``streams`` distinct prompts of PROMPT_MIN..PROMPT_MAX tokens: BOS + random words.

    ``tag`` names the run, so that every run gets its own prompts."""
    rng = random.Random(f"{seed}:{tag}:{streams}")
    return [
        [BOS]
        + [
            rng.randrange(FIRST_NORMAL_ID, n_vocab)
            for _ in range(rng.randint(PROMPT_MIN, PROMPT_MAX) - 1)
        ]
        for _ in range(streams)
    ]


# -- the two sides ---------------------------------------------------------------


def bench_config(path: Path, slots: int, flash_attn: str) -> EngineConfig:
    profile = parse_profile(
        "name: bench\n"
        f"engine: {{n_ctx: {N_CTX}, slots: {slots}, n_batch: {N_BATCH}, n_ubatch: {N_BATCH}, "
        f"flash_attn: {flash_attn}}}\n"
    )
    return engine_config(profile, path, read_model_info(path))


class PlainLlama:
    """One plain llama_cpp.Llama with the engine's settings, driven by a greedy loop."""

    def __init__(self, cfg: EngineConfig) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(cfg.model_path),
            n_ctx=cfg.n_ctx,
            n_batch=cfg.n_batch,
            n_ubatch=cfg.n_ubatch,
            n_threads=cfg.threads,
            n_threads_batch=cfg.threads_batch,
            flash_attn=cfg.flash_attn == "on",
            type_k=ggml_type(cfg.type_k),
            type_v=ggml_type(cfg.type_v),
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def generate(self, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
        """Greedy tokens and the perf_counter_ns time at which each was sampled."""
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        tokens: list[int] = []
        times: list[int] = []
        while True:
            token = self._argmax()
            tokens.append(token)
            times.append(time.perf_counter_ns())
            if len(tokens) == n:
                return tokens, times
            llm.eval([token])


def run_sequential(plain: PlainLlama, prompts: list[list[int]], n: int) -> Run:
    start = time.perf_counter_ns()
    outs = [plain.generate(p, n) for p in prompts]
    wall = (time.perf_counter_ns() - start) / 1e9
    tpot, itl = [], []
    for _, times in outs:
        gaps = np.diff(np.asarray(times, dtype=np.float64)) / 1e6
        tpot.append(float(gaps.mean()))
        itl.append(float(np.median(gaps)))
    return Run(
        "sequential",
        len(prompts),
        sum(len(t) for t, _ in outs),
        wall,
        tpot,
        itl,
        [t for t, _ in outs],
    )


def run_engine(eng: Engine, prompts: list[list[int]], n: int) -> Run:
    params = SamplingParams(max_tokens=n, temperature=0.0)
    start = time.perf_counter_ns()
    streams = [eng.submit(p, params) for p in prompts]
    results = [s.result() for s in streams]
    wall = (time.perf_counter_ns() - start) / 1e9
    tpot, itl, cached = [], [], 0
    for r in results:
        if r.finish_reason != "length" or r.timings is None or r.timings.tpot_ms is None:
            raise RuntimeError(f"{r.request_id} ended with {r.finish_reason}: {r.error}")
        tpot.append(r.timings.tpot_ms)
        itl.append(statistics.median(r.timings.itl_ms))
        cached += r.timings.cached_tokens
    return Run(
        "engine",
        len(prompts),
        sum(len(r.token_ids) for r in results),
        wall,
        tpot,
        itl,
        [list(r.token_ids) for r in results],
        cached,
        slots_of(eng, prompts),
    )


def slots_of(eng: Engine, prompts: list[list[int]]) -> list[int]:
    """The slot each prompt ran in, read from the idle engine's prefix cache (-1: not found)."""
    found = []
    for p in prompts:
        ids = [s.id for s in eng.scheduler.slots if s.cache[: len(p)] == p]
        found.append(ids[0] if ids else -1)
    return found


def seq_runs(slots: Sequence[int]) -> int:
    """Runs of consecutive ids among ``slots``.

    The engine gives every slot its own KV stream (kv_unified off); llama.cpp then
    splits a batch into one micro-batch per run of consecutive sequence ids, so a
    decode step of S streams costs this many passes over the weights."""
    ids = sorted(set(slots))
    return sum(1 for i, x in enumerate(ids) if i == 0 or x != ids[i - 1] + 1)


# -- step breakdown --------------------------------------------------------------


def _timed(fn: Callable[..., Any], sink: list[tuple[int, int]]) -> Callable[..., Any]:
    """``fn`` recording (start, duration) in perf_counter_ns of every call into ``sink``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append((t, time.perf_counter_ns() - t))

    return wrapper


def breakdown_engine(
    eng: Engine, prompts: list[list[int]], n: int
) -> list[tuple[float, float, int]]:
    """(period and time in Runner.decode in ms, runs of busy slots) of each steady decode
    step of one engine run."""
    assert eng.runner is not None
    runner = eng.runner
    calls: list[tuple[int, int]] = []
    steps: list[tuple[StepStats, int]] = []

    def observe(stats: StepStats) -> None:  # runs on the engine thread, after the step
        steps.append((stats, seq_runs([s.id for s in eng.scheduler.slots if s.busy])))

    runner.decode = _timed(runner.decode, calls)  # type: ignore[method-assign]
    eng.add_step_observer(observe)
    try:
        run_engine(eng, prompts, n)
    finally:
        del runner.decode
        eng.remove_step_observer(observe)
    out: list[tuple[float, float, int]] = []
    for (a, runs), (b, _) in itertools.pairwise(steps):
        # steady state: every stream decoding, no prompt in the step or in the next one
        if a.prefill_tokens or b.prefill_tokens:
            continue
        if {a.decode_tokens, b.decode_tokens} != {len(prompts)}:
            continue
        inside = [d for t, d in calls if a.start_ns <= t <= a.end_ns]
        if len(inside) == 1:
            out.append(((b.start_ns - a.start_ns) / 1e6, inside[0] / 1e6, runs))
    return out


def breakdown_plain(plain: PlainLlama, prompt: list[int], n: int) -> list[tuple[float, float, int]]:
    """(period, time in llama_decode) in ms of each generated token after the first."""
    ctx = plain.llm._ctx
    calls: list[tuple[int, int]] = []
    ctx.decode = _timed(ctx.decode, calls)  # type: ignore[method-assign]
    try:
        _, times = plain.generate(prompt, n)
    finally:
        del ctx.decode
    # calls[0] is the prompt; calls[i] evaluates token i-1, which yields token i
    return [((times[i] - times[i - 1]) / 1e6, calls[i][1] / 1e6, 1) for i in range(1, n)]


def summarize_steps(
    side: str, streams: int, steps: list[tuple[float, float, int]]
) -> Breakdown | None:
    if not steps:
        log(f"{side}, {streams} streams: no steady decode steps to measure (more --tokens?)")
        return None
    return Breakdown(
        side,
        streams,
        len(steps),
        statistics.median(p for p, _, _ in steps),
        statistics.median(d for _, d, _ in steps),
        statistics.median(p - d for p, d, _ in steps),
        sorted({r for _, _, r in steps}),
    )


# -- KV layout check ----------------------------------------------------------------

LAYOUT_SETS: dict[str, tuple[int, ...]] = {
    "{0}": (0,),
    "{0,1,2,3}": (0, 1, 2, 3),
    "{0,2,4,6}": (0, 2, 4, 6),
    "{0,1,4,6}": (0, 1, 4, 6),
    "{0..7}": tuple(range(8)),
    "{0..3,5..7}": (0, 1, 2, 3, 5, 6, 7),
}


def _decode_ms(lib: Any, ctx: Any, batch: Any, items: list[tuple[int, int, int]]) -> float:
    """One llama_decode of (sequence, position, token) items, each asking for logits."""
    for i, (seq, pos, token) in enumerate(items):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, True
        batch.seq_id[i][0] = seq
    batch.n_tokens = len(items)
    t = time.perf_counter_ns()
    if lib.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed in the layout check")
    return (time.perf_counter_ns() - t) / 1e6


def layout_check(cfg: EngineConfig, steps: int = 20) -> dict[str, dict[str, float]]:
    """Median ms of one llama_decode of one token for each sequence of a set, on a context
    like the engine's (8 sequences of a 48-token prompt each), with split and unified KV."""
    from orin.llamacpp import llama

    lib = llama()
    mp = lib.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(str(cfg.model_path).encode(), mp)
    batch = lib.llama_batch_init(cfg.n_batch, 0, 1)
    rng = random.Random(0)
    n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)))

    def token() -> int:
        return rng.randrange(FIRST_NORMAL_ID, n_vocab)

    out: dict[str, dict[str, float]] = {}
    try:
        for unified in (False, True):
            cp = lib.llama_context_default_params()
            cp.n_ctx, cp.n_seq_max = cfg.n_ctx * 8, 8
            cp.n_batch, cp.n_ubatch = cfg.n_batch, cfg.n_ubatch
            cp.n_threads, cp.n_threads_batch = cfg.threads, cfg.threads_batch
            cp.flash_attn_type = {"auto": -1, "off": 0, "on": 1}[cfg.flash_attn]
            cp.type_k, cp.type_v = ggml_type(cfg.type_k), ggml_type(cfg.type_v)
            cp.kv_unified = unified
            ctx = lib.llama_init_from_model(model, cp)
            for seq in range(8):
                _decode_ms(lib, ctx, batch, [(seq, p, token()) for p in range(48)])
            pos = [48] * 8
            times: dict[str, list[float]] = {k: [] for k in LAYOUT_SETS}
            for _ in range(steps):
                for name, seqs in LAYOUT_SETS.items():
                    items = [(q, pos[q], token()) for q in seqs]
                    times[name].append(_decode_ms(lib, ctx, batch, items))
                    for q in seqs:
                        pos[q] += 1
            out["unified" if unified else "split"] = {
                k: statistics.median(v) for k, v in times.items()
            }
            lib.llama_free(ctx)
    finally:
        lib.llama_batch_free(batch)
        lib.llama_model_free(model)
    return out


# -- the benchmark ---------------------------------------------------------------


def run_pair(
    eng: Engine, plain: PlainLlama, prompts: list[list[int]], n: int, engine_first: bool
) -> tuple[Run, Run]:
    """The same prompts through the engine (all at once) and the plain loop (in turn)."""
    if engine_first:
        e = run_engine(eng, prompts, n)
        return e, run_sequential(plain, prompts, n)
    q = run_sequential(plain, prompts, n)
    return run_engine(eng, prompts, n), q


def single_sample(e: Run, q: Run) -> dict[str, float]:
    return {
        "engine_tpot_ms": e.tpot_ms[0],
        "plain_tpot_ms": q.tpot_ms[0],
        "engine_itl_median_ms": e.itl_median_ms[0],
        "plain_itl_median_ms": q.itl_median_ms[0],
    }


def bench_quant(args: argparse.Namespace, quant: str) -> dict[str, Any]:
    path = demo.ensure(args.size, quant)
    cfg = bench_config(path, max(args.streams), args.flash_attn)
    plain = PlainLlama(cfg)
    n_vocab, n = plain.n_vocab, args.tokens
    runs: list[dict[str, Any]] = []
    singles: list[dict[str, float]] = []  # single-stream pairs for the TPOT comparison
    breakdowns: list[Breakdown] = []
    with Engine(cfg) as eng:
        log(
            f"[{quant}] {path.name}: threads={cfg.threads} KV={cfg.type_k}/{cfg.type_v} "
            f"flash_attn={cfg.flash_attn}; warm-up"
        )
        for s in args.streams:
            run_pair(eng, plain, make_prompts(args.seed, "warm-up", s, n_vocab), n, True)
        for rep in range(args.reps):
            for s in args.streams:
                prompts = make_prompts(args.seed, f"rep{rep}", s, n_vocab)
                e, q = run_pair(eng, plain, prompts, n, engine_first=rep % 2 == 0)
                same = sum(a == b for a, b in zip(e.token_ids, q.token_ids, strict=True))
                runs.append(
                    {
                        "rep": rep,
                        "streams": s,
                        "first": "engine" if rep % 2 == 0 else "sequential",
                        "identical_outputs": same,
                        "engine": _run_dict(e),
                        "sequential": _run_dict(q),
                    }
                )
                if s == 1:
                    singles.append(single_sample(e, q))
                log(
                    f"[{quant}] rep {rep} S={s}: engine {e.tok_s:6.1f} tok/s, sequential "
                    f"{q.tok_s:6.1f} tok/s, ratio {e.tok_s / q.tok_s:4.2f}; "
                    f"identical outputs {same}/{s}; slots {e.slots}"
                )
            for k in range(args.tpot_pairs):
                prompts = make_prompts(args.seed, f"tpot{rep}.{k}", 1, n_vocab)
                e, q = run_pair(eng, plain, prompts, n, engine_first=(rep + k) % 2 == 1)
                singles.append(single_sample(e, q))
            if singles:
                last = singles[-1]
                log(
                    f"[{quant}] rep {rep} TPOT: engine {last['engine_tpot_ms']:.2f} ms, "
                    f"plain {last['plain_tpot_ms']:.2f} ms"
                )
        if args.breakdown_runs:
            pooled: dict[int, list[tuple[float, float, int]]] = {s: [] for s in args.streams}
            plain_steps: list[tuple[float, float, int]] = []
            for run in range(args.breakdown_runs):
                for s in args.streams:
                    prompts = make_prompts(args.seed, f"breakdown{run}", s, n_vocab)
                    pooled[s] += breakdown_engine(eng, prompts, n)
                prompt = make_prompts(args.seed, f"breakdown{run}", 1, n_vocab)[0]
                plain_steps += breakdown_plain(plain, prompt, n)
            found = [summarize_steps("engine", s, pooled[s]) for s in args.streams]
            found.append(summarize_steps("plain", 1, plain_steps))
            breakdowns = [b for b in found if b is not None]
    plain.llm.close()
    layout = layout_check(cfg) if args.layout_check else None
    summary = summarize(runs, singles, args.streams)
    return {
        "quant": quant,
        "model": path.name,
        "model_bytes": path.stat().st_size,
        "config": {
            "threads": cfg.threads,
            "threads_batch": cfg.threads_batch,
            "n_ctx_per_slot": cfg.n_ctx,
            "slots": cfg.slots,
            "n_batch": cfg.n_batch,
            "n_ubatch": cfg.n_ubatch,
            "type_k": cfg.type_k,
            "type_v": cfg.type_v,
            "flash_attn": cfg.flash_attn,
            "prefix_cache": cfg.prefix_cache,
        },
        "runs": runs,
        "single_stream": singles,
        "summary": summary,
        "breakdown": [asdict(b) for b in breakdowns],
        "layout_check": layout,
        "bandwidth": bandwidth(read_model_info(path), cfg, summary, breakdowns, n),
    }


def bandwidth(
    info: ModelInfo,
    cfg: EngineConfig,
    summary: dict[str, Any],
    breakdowns: list[Breakdown],
    n: int,
    bw: Bandwidth | None = None,
) -> dict[str, Any]:
    """Each rate as decode memory traffic against this machine's memory bandwidth.

    The KV cells a stream attends to average the mean prompt plus half the output."""
    bw = bw or memory_bandwidth()
    cells = (PROMPT_MIN + PROMPT_MAX) / 2 + n / 2

    def at(streams: int, steps_per_s: float) -> dict[str, Any]:
        u: Utilization = at_rate(info, streams, cells, steps_per_s, cfg.type_k, cfg.type_v, bw)
        return u.to_json()

    rows: list[dict[str, Any]] = []
    tp = summary.get("tpot")
    if tp:
        for side, key in (("engine TPOT", "engine_ms"), ("plain TPOT", "plain_ms")):
            rows.append({"what": side, **at(1, 1000 / tp[key]["median"])})
    for s, row in summary["streams"].items():
        streams = int(s)
        rows.append(
            {"what": "engine tok/s", **at(streams, row["engine_tok_s"]["median"] / streams)}
        )
        if streams == 1:
            rows.append({"what": "sequential tok/s", **at(1, row["sequential_tok_s"]["median"])})
    for b in breakdowns:
        name = "engine steady step" if b.side == "engine" else "plain steady step"
        rows.append({"what": name, **at(b.streams, 1000 / b.period_ms)})
    return {"mem_bandwidth": bw.to_dict(), "mean_kv_cells": cells, "rows": rows}


def _run_dict(r: Run) -> dict[str, Any]:
    return {
        "generated": r.generated,
        "wall_s": round(r.wall_s, 4),
        "tok_s": round(r.tok_s, 2),
        "tpot_ms": [round(x, 3) for x in r.tpot_ms],
        "itl_median_ms": [round(x, 3) for x in r.itl_median_ms],
        "cached_tokens": r.cached_tokens,
        "slots": r.slots,
        "seq_runs": seq_runs(r.slots) if r.slots else 1,
    }


def _spread(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(
    runs: list[dict[str, Any]], singles: list[dict[str, float]], streams: Sequence[int]
) -> dict[str, Any]:
    out: dict[str, Any] = {"streams": {}}
    for s in streams:
        rs = [r for r in runs if r["streams"] == s]
        eng = [r["engine"]["tok_s"] for r in rs]
        seq = [r["sequential"]["tok_s"] for r in rs]
        out["streams"][str(s)] = {
            "engine_tok_s": _spread(eng),
            "sequential_tok_s": _spread(seq),
            "ratio": _spread([a / b for a, b in zip(eng, seq, strict=True)]),
            "engine_tpot_ms": _spread([statistics.mean(r["engine"]["tpot_ms"]) for r in rs]),
            "identical_outputs": sum(r["identical_outputs"] for r in rs),
            "engine_cached_tokens": sum(r["engine"]["cached_tokens"] for r in rs),
            "engine_seq_runs": [r["engine"]["seq_runs"] for r in rs],
            "requests": s * len(rs),
        }
    if singles:
        eng_t = [x["engine_tpot_ms"] for x in singles]
        seq_t = [x["plain_tpot_ms"] for x in singles]
        eng_i = [x["engine_itl_median_ms"] for x in singles]
        seq_i = [x["plain_itl_median_ms"] for x in singles]
        out["tpot"] = {
            "samples": len(singles),
            "engine_ms": _spread(eng_t),
            "plain_ms": _spread(seq_t),
            "ratio": statistics.median(eng_t) / statistics.median(seq_t),
            "paired_ratio": _spread([a / b for a, b in zip(eng_t, seq_t, strict=True)]),
            "engine_itl_median_ms": _spread(eng_i),
            "plain_itl_median_ms": _spread(seq_i),
            "itl_ratio": statistics.median(eng_i) / statistics.median(seq_i),
        }
    return out


# -- reporting ---------------------------------------------------------------------


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    import llama_cpp
    import psutil

    model = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.CalledProcessError):
        pass
    return {
        "cpu": model,
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cpus": psutil.cpu_count(logical=True),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "platform": platform.platform(),
    }


def _fmt(s: dict[str, float], digits: int = 1) -> tuple[str, str]:
    return f"{s['median']:.{digits}f}", f"{s['min']:.{digits}f}–{s['max']:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """The tables docs/performance.md shows, one per quantization."""
    lines: list[str] = []
    for q in result["quants"]:
        c = q["config"]
        lines += [
            f"### {q['quant']} ({q['model']}, {q['model_bytes'] / 1e6:.0f} MB; "
            f"KV {c['type_k']}/{c['type_v']}, flash attention {c['flash_attn']})",
            "",
            "| streams | engine tok/s (min–max) | sequential tok/s (min–max) "
            "| engine/sequential (min–max) | engine TPOT ms | micro-batches per step "
            "| identical outputs |",
            "|---:|---:|---:|---:|---:|---|---:|",
        ]
        for s, row in q["summary"]["streams"].items():
            e, es = _fmt(row["engine_tok_s"])
            p, ps = _fmt(row["sequential_tok_s"])
            r, rs = _fmt(row["ratio"], 2)
            t, _ = _fmt(row["engine_tpot_ms"], 2)
            lines.append(
                f"| {s} | {e} ({es}) | {p} ({ps}) | **{r}x** ({rs}) | {t} "
                f"| {', '.join(map(str, row['engine_seq_runs']))} "
                f"| {row['identical_outputs']}/{row['requests']} |"
            )
        tp = q["summary"].get("tpot")
        if tp:
            e, es = _fmt(tp["engine_ms"], 2)
            p, ps = _fmt(tp["plain_ms"], 2)
            r, rs = _fmt(tp["paired_ratio"], 3)
            ei, _ = _fmt(tp["engine_itl_median_ms"], 2)
            pi, _ = _fmt(tp["plain_itl_median_ms"], 2)
            lines += [
                "",
                f"Single-stream TPOT ({tp['samples']} pairs): engine {e} ms ({es}), "
                f"plain Llama loop {p} ms ({ps}); "
                f"engine/plain {tp['ratio']:.3f} (median of paired ratios {r}, {rs}). "
                f"Median inter-token latency: engine {ei} ms, plain {pi} ms "
                f"(ratio {tp['itl_ratio']:.3f}).",
            ]
        if q["breakdown"]:
            lines += [
                "",
                "| steady decode steps (medians) | steps | micro-batches | ms per step "
                "| in llama_decode | other | tok/s |",
                "|---|---:|---|---:|---:|---:|---:|",
            ]
            for b in q["breakdown"]:
                plural = "s" if b["streams"] > 1 else ""
                name = (
                    f"engine, {b['streams']} stream{plural}"
                    if b["side"] == "engine"
                    else "plain loop"
                )
                lines.append(
                    f"| {name} | {b['steps']} | {', '.join(map(str, b['seq_runs']))} "
                    f"| {b['period_ms']:.2f} | {b['decode_ms']:.2f} "
                    f"| {b['other_ms']:.3f} ({100 * b['other_ms'] / b['period_ms']:.1f} %) "
                    f"| {1000 * b['streams'] / b['period_ms']:.0f} |"
                )
        if q.get("bandwidth"):
            lines += ["", *bandwidth_table(q["bandwidth"])]
        if q.get("layout_check"):
            lc = q["layout_check"]
            lines += [
                "",
                "| one llama_decode, one token per sequence | micro-batches (split) "
                "| split KV ms | unified KV ms |",
                "|---|---:|---:|---:|",
            ]
            for name, seqs in LAYOUT_SETS.items():
                lines.append(
                    f"| sequences {name} | {seq_runs(seqs)} | {lc['split'][name]:.1f} "
                    f"| {lc['unified'][name]:.1f} |"
                )
        lines.append("")
    return "\n".join(lines)


def bandwidth_table(bw: dict[str, Any]) -> list[str]:
    m = bw["mem_bandwidth"]
    known = m["gb_per_s"] is not None
    lines = [
        "| decode memory traffic | streams | MiB per step | steps/s | GB/s | of bandwidth |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in bw["rows"]:
        util = f"{r['utilization_pct']:.1f} %" if r["utilization_pct"] is not None else "-"
        lines.append(
            f"| {r['what']} | {r['decode_streams']:g} | {r['decode_bytes_per_step'] / 2**20:.1f} "
            f"| {r['decode_steps_per_s']:.1f} | {r['achieved_gb_per_s']:.2f} | {util} |"
        )
    where = f"{m['gb_per_s']:.1f} GB/s ({m['source']})" if known else "unknown"
    lines += [
        "",
        f"Memory bandwidth: {where}; {bw['mean_kv_cells']:.0f} attended KV cells per stream.",
    ]
    return lines


def targets(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for q in result["quants"]:
        summary = q["summary"]
        top = str(max(int(s) for s in summary["streams"]))
        ratio = summary["streams"][top]["ratio"]["median"]
        entry: dict[str, Any] = {f"ratio_at_{top}": round(ratio, 3)}
        if q["quant"] == "f16" and "8" in summary["streams"]:
            at8 = summary["streams"]["8"]["ratio"]["median"]
            entry["ratio_target"] = f">= {RATIO_TARGET} at 8 streams"
            entry["ratio_met"] = at8 >= RATIO_TARGET
        if "tpot" in summary:
            entry["tpot_ratio"] = round(summary["tpot"]["ratio"], 3)
            entry["tpot_target"] = f"<= {TPOT_TARGET}"
            entry["tpot_met"] = summary["tpot"]["ratio"] <= TPOT_TARGET
        out[q["quant"]] = entry
    return out


def _csv(cast: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [cast(x.strip()) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quant", type=_csv(str), default=["f16", "q4_k_m"], help="demo model quantizations"
    )
    p.add_argument("--size", default="medium", choices=sorted(demo.SIZES), help="demo model size")
    p.add_argument("--streams", type=_csv(int), default=[1, 4, 8], help="concurrent stream counts")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (after a warm-up)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument(
        "--flash-attn",
        choices=["on", "off"],
        default="on",
        help="flash attention for both sides (llama.cpp's CPU auto turns it on)",
    )
    p.add_argument(
        "--tpot-pairs",
        type=int,
        default=5,
        help="extra single-stream engine/plain pairs per repetition for the TPOT comparison",
    )
    p.add_argument(
        "--breakdown-runs",
        type=int,
        default=3,
        help="runs per stream count of the step time breakdown pass (0: skip it)",
    )
    p.add_argument(
        "--layout-check",
        action="store_true",
        help="also time raw llama_decode steps by set of sequence ids, split vs unified KV",
    )
    p.add_argument("--json", type=Path, help="write all results here")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.reps < 1 or min(args.streams) < 1:
        p.error("--tokens must be at least 2, --reps and every stream count at least 1")
    if args.tpot_pairs < 0 or args.breakdown_runs < 0:
        p.error("--tpot-pairs and --breakdown-runs must not be negative")
    args.streams = sorted(set(args.streams))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now(dt.timezone.utc)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "command": " ".join([".venv/bin/python -m benchmarks.engine_throughput", *sys.argv[1:]]),
        "date": started.isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {
            "size": args.size,
            "streams": args.streams,
            "tokens": args.tokens,
            "reps": args.reps,
            "seed": args.seed,
            "prompt_tokens": [PROMPT_MIN, PROMPT_MAX],
            "flash_attn": args.flash_attn,
            "tpot_pairs": args.tpot_pairs,
            "breakdown_runs": args.breakdown_runs,
            "layout_check": args.layout_check,
        },
        "quants": [bench_quant(args, q) for q in args.quant],
    }
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}
    result["duration_s"] = round(time.perf_counter() - t0, 1)
    result["targets"] = targets(result)
    print(markdown(result))
    print(json.dumps(result["targets"], indent=2))
    m = result["machine"]
    print(
        f"\n{m['cpu']}, {m['physical_cores']} cores; llama-cpp-python {m['llama_cpp_python']}; "
        f"{result['date']}; {result['duration_s']} s; load average before "
        f"{load_before[0]:.2f}, after {result['load_average']['after'][0]:.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
