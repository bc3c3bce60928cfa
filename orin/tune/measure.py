"""Measuring one candidate: the engine in this process, on the SLO's prompt lengths
and concurrency levels, with the telemetry sampler running.

A repetition runs every (prompt length, concurrency) point of the grid once:
C distinct greedy requests of L tokens submitted together, each generating
exactly ``output_tokens`` (ignore_eos). Figures come from the engine's own
RequestTimings (docs/metrics.md). Repetitions accumulate: asking for 9 after
3 measures 6 more and merges them, so successive halving pays only for the
added repetitions (plus one model load). Telemetry samples and engine steps of
the measured span go through phases.summarize, which says how long the engine
spent in prefill and decode and how busy the GPU (or this process's CPU) was
in each: what explains a missed target.

The prompts are the standard workload (``workload``): tune has no prompts of
the user's, and the grid needs exact lengths. What it cannot say is how often a
real workload's output repeats its context, which decides what n-gram
speculation gains (orin/tune/speculation.py).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orin.bench.prompts import TokenPool, corpus
from orin.engine.config import engine_config
from orin.engine.engine import Engine
from orin.engine.errors import EngineError
from orin.engine.stream import RequestStream
from orin.engine.types import SamplingParams, StepStats
from orin.errors import OrinError
from orin.llamacpp import BuildInfo
from orin.model.gguf import ModelInfo
from orin.profile.schema import Profile
from orin.telemetry.phases import summarize
from orin.telemetry.sampler import Sampler
from orin.tune.figures import Grid, Measurement, PhaseFigures, Point, score
from orin.tune.search import Evaluation
from orin.tune.space import Candidate

LOAD_TIMEOUT_S = 120.0
ALLOWANCE = 5.0  # a measurement may take this many times the median one before it is cut
MIN_ALLOWANCE_S = 5.0


def workload(grid: Grid) -> str:
    """What the measured requests are, in words (the report says what speculation was
    judged on)."""
    return (
        f"the standard workload: distinct prompts of random common words "
        f"({', '.join(map(str, grid.prompt_tokens))} tokens), greedy, "
        f"{grid.output_tokens} generated tokens each"
    )


class Cutoff:
    """Cancels the running requests when a measurement overruns its allowance: a
    configuration several times slower than the median would never be chosen, and
    measuring it to the end would spend the budget the others need."""

    def __init__(self, seconds: float | None, why: str = "its allowance") -> None:
        self.seconds, self.why = seconds, why
        self.fired = threading.Event()
        self.live: list[RequestStream] = []
        self._timer = threading.Timer(seconds, self._fire) if seconds is not None else None
        if self._timer is not None:
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        self.fired.set()
        for stream in list(self.live):
            stream.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class EngineMeasurer:
    """Measures candidates of one profile and model; remembers every measurement."""

    def __init__(
        self,
        profile: Profile,
        model_path: Path,
        info: ModelInfo,
        grid: Grid,
        build: BuildInfo | None = None,
        available: int | None = None,
        sampler: Sampler | None = None,
        seed: int = 0,
        rate_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.profile, self.model_path, self.info, self.grid = profile, model_path, info, grid
        self.build, self.available, self.sampler = build, available, sampler
        # what a repetition's duration is read from for throughput: wall time, or (for
        # benchmarks of the search on a shared CPU) the process's CPU time
        self.rate_clock = rate_clock
        self.rng = random.Random(f"tune:{seed}")
        self.seed = seed
        self.pool: TokenPool | None = None
        self.results: dict[Candidate, Measurement] = {}
        self.deadline: float | None = None  # perf_counter time when measuring must end
        self._per_rep: list[float] = []  # seconds per repetition of completed measurements

    def evaluate(self, candidate: Candidate, reps: int) -> Evaluation:
        """Bring ``candidate`` to ``reps`` repetitions; the cost is this call's wall time,
        its fixed part the engine's load and warm-up."""
        start = time.perf_counter()
        have = self.results.get(candidate)
        need = reps - (have.reps if have else 0)
        fixed = 0.0
        if need > 0:
            m = self.measure(candidate, need)
            self.results[candidate] = have.merge(m) if have else m
            fixed = m.setup_s
        cost = time.perf_counter() - start
        return Evaluation(score(self.results[candidate], self.profile.slo), cost, fixed)

    def allowance(self, reps: int) -> tuple[float | None, str]:
        """Seconds a measurement of ``reps`` repetitions may take (None: unbounded), and
        what sets them, in words: its allowance or the end of the budget."""
        limits: list[tuple[float, str]] = []
        if len(self._per_rep) >= 3:
            per_rep = statistics.median(self._per_rep)
            seconds = max(ALLOWANCE * per_rep * reps, MIN_ALLOWANCE_S)
            limits.append((seconds, f"its allowance, {ALLOWANCE:g} times the median run"))
        if self.deadline is not None:
            limits.append((self.deadline - time.perf_counter(), "the end of the budget"))
        return min(limits) if limits else (None, "")

    def measure(self, candidate: Candidate, reps: int) -> Measurement:
        """Load the engine with the candidate's settings and run ``reps`` repetitions."""
        start = time.perf_counter()
        limit, why = self.allowance(reps)
        if limit is not None and limit <= 0:
            return Measurement(candidate, reps, error="the budget ran out before this run")
        steps: list[StepStats] = []
        try:
            cfg = engine_config(
                candidate.apply(self.profile), self.model_path, self.info, self.build,
                self.available,
            )  # fmt: skip
            engine = Engine(cfg)
            engine.add_step_observer(steps.append)
            engine.start().wait_ready(LOAD_TIMEOUT_S)
        except (OrinError, TimeoutError, ValueError) as exc:
            cost = time.perf_counter() - start
            return Measurement(candidate, reps, cost_s=cost, error=str(exc), setup_s=cost)
        cutoff = Cutoff(limit, why)
        try:
            m = self._run(engine, candidate, reps, steps, start, cutoff)
        except EngineError as exc:
            return Measurement(candidate, reps, cost_s=time.perf_counter() - start, error=str(exc))
        finally:
            cutoff.close()
            engine.stop(drain=False, timeout=5)
        if m.error is None:
            self._per_rep.append(m.cost_s / reps)
        return m

    def _run(
        self,
        engine: Engine,
        c: Candidate,
        reps: int,
        steps: list[StepStats],
        start: float,
        cutoff: Cutoff,
    ) -> Measurement:
        if self.pool is None:
            text = corpus(self.seed)
            self.pool = TokenPool.from_tokenizations(
                engine.tokenize(text), engine.tokenize("zebra " + text)
            )
        self._request(engine, [self.pool.prompt(self.rng, min(self.grid.prompt_tokens))], 2, cutoff)
        setup = time.perf_counter() - start  # loaded and warmed up: the rest is repetitions
        steps.clear()
        t0 = time.perf_counter_ns()
        points: dict[tuple[int, int], Point] = {}
        for _ in range(reps):
            for key in self.grid.points:
                if cutoff.fired.is_set():
                    error = f"cut off after {cutoff.seconds:.1f} s ({cutoff.why})"
                    cost = time.perf_counter() - start
                    return Measurement(c, reps, cost_s=cost, error=error, setup_s=setup)
                p = self._point(engine, *key, cutoff)
                points[key] = points[key].merge(p) if key in points else p
        phases = self._phases(steps, t0, time.perf_counter_ns())
        return Measurement(c, reps, points, phases, time.perf_counter() - start, setup_s=setup)

    def _request(
        self, engine: Engine, prompts: list[list[int]], n: int, cutoff: Cutoff
    ) -> list[Any]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        cutoff.live = [engine.submit(p, params) for p in prompts]
        if cutoff.fired.is_set():  # fired while submitting: these would run to the end
            for stream in cutoff.live:
                stream.cancel()
        return [s.result() for s in cutoff.live]

    def _point(self, engine: Engine, length: int, streams: int, cutoff: Cutoff) -> Point:
        assert self.pool is not None
        prompts = [self.pool.prompt(self.rng, length) for _ in range(streams)]
        t = self.rate_clock()
        done = self._request(engine, prompts, self.grid.output_tokens, cutoff)
        point = Point(length, streams, rep_tokens=[0], rep_wall_s=[self.rate_clock() - t])
        for c in done:
            tm = c.timings
            if c.finish_reason not in ("stop", "length") or tm is None:
                point.errors += 1
                continue
            point.ttft_ms.append(tm.ttft_ms)
            point.queue_ms.append(tm.queue_ms)
            point.prefill_ms.append(tm.prefill_ms)
            point.e2e_ms.append(tm.e2e_ms)
            point.rep_tokens[0] += tm.generated_tokens
            point.drafted += tm.drafted_tokens
            point.accepted += tm.accepted_tokens
            if tm.tpot_ms is not None:
                point.tpot_ms.append(tm.tpot_ms)
        return point

    def _phases(self, steps: list[StepStats], t0: int, t1: int) -> dict[str, PhaseFigures]:
        if self.sampler is None:
            return {}
        samples = self.sampler.samples(since_ns=t0, until_ns=t1)
        out: dict[str, PhaseFigures] = {}
        for name, s in summarize(samples, [x for x in steps if not x.aborted]).items():
            gpu, cpu = s.stats.get("gpu_util"), s.stats.get("proc_cpu_util")
            out[name] = PhaseFigures(
                s.seconds, s.tokens, gpu.mean if gpu else None, cpu.mean if cpu else None,
                s.mixed_share,
            )  # fmt: skip
        return out
