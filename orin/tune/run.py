"""orin-llm tune end to end: space -> successive halving over in-process measurements
-> speculative decoding tried on the winner -> the chosen configuration, the
profile's own for comparison, and why targets miss.

The budget covers everything: measuring gets what is left after loading and a
reserve for writing the profile and the report (plots take a few seconds); of
the measuring budget the search leaves a share (speculation.SPEC_SHARE) to the
speculation settings, when there are any to try.
"""

from __future__ import annotations

import datetime as dt
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orin.errors import OrinError, ProfileError, Terminated, interruption
from orin.llamacpp import BuildInfo
from orin.model.gguf import ModelInfo, read_model_info
from orin.profile.fit import draft_info
from orin.profile.loader import describe_error, resolve_model_path
from orin.profile.schema import Profile
from orin.system.commands import SubprocessRunner
from orin.system.root import SysRoot
from orin.telemetry.sampler import Sampler
from orin.telemetry.sources import select_source
from orin.tune.explain import explain
from orin.tune.figures import Grid, Measurement, has_targets, score
from orin.tune.measure import EngineMeasurer, workload
from orin.tune.search import (
    SearchInterrupted,
    SearchResult,
    Trial,
    cost_model,
    successive_halving,
)
from orin.tune.space import Candidate, Space, build_space, fits
from orin.tune.speculation import SPEC_SHARE, SpecChoice, refine

Progress = Callable[[str], None]


class TuneError(OrinError):
    """Nothing could be measured (every candidate failed, or no time to measure)."""


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM after something was measured: still a KeyboardInterrupt,
    carrying the result of what was measured before it (``result.interrupted`` is set,
    ``result.interrupted_by`` says which)."""

    def __init__(self, result: TuneResult) -> None:
        super().__init__()
        self.result = result


@dataclass(frozen=True)
class TuneSettings:
    budget_s: float = 600.0
    output_tokens: int = 32
    seed: int = 0
    telemetry: str = "auto"  # auto, off, or a source name
    min_fidelity: int = 1
    max_fidelity: int = 9
    eta: int = 3
    allow_fewer_slots: bool = False  # also try fewer slots than the profile's (space.py)
    n_ctx: int | None = None  # tune for this context per slot instead of the profile's


@dataclass
class TuneResult:
    profile: Profile
    model_path: Path
    info: ModelInfo
    grid: Grid
    space: Space
    search: SearchResult[Candidate]
    measurements: dict[Candidate, Measurement]
    chosen: Candidate
    explanation: list[str]
    settings: TuneSettings
    started_at: str
    elapsed_s: float = 0.0
    telemetry_source: str | None = None
    model_given: bool = False  # --model overrode the profile's model
    notes: list[str] = field(default_factory=list)
    speculation: SpecChoice | None = None  # what speculation was tried; run.tune sets it
    original: Profile | None = None  # the profile as given, before --ctx (profile: after)
    interrupted: bool = False  # Ctrl-C ended the search: the result of what it measured
    interrupted_by: str = "Ctrl-C"  # or SIGTERM

    @property
    def chosen_m(self) -> Measurement:
        return self.measurements[self.chosen]

    @property
    def baseline_m(self) -> Measurement | None:
        return self.measurements.get(self.space.baseline)

    @property
    def meets_slo(self) -> bool:
        return score(self.chosen_m, self.profile.slo).meets_slo

    @property
    def has_targets(self) -> bool:
        """The profile's slo sets ttft_p95_ms or tpot_p90_ms (else: ranked by throughput)."""
        return has_targets(self.profile.slo)

    def to_dict(self) -> dict[str, Any]:
        return {
            "date": self.started_at,
            "profile": self.profile.name,
            "model": str(self.model_path),
            "quantization": self.info.quantization,
            "budget_s": self.settings.budget_s,
            "elapsed_s": self.elapsed_s,
            "measuring_s": self.search.spent_s,
            "telemetry_source": self.telemetry_source,
            "slo": self.profile.slo.model_dump(),
            "grid": vars(self.grid),
            "space": {"size": len(self.space), "axes": self.space.axes},
            "fidelities": self.search.fidelities,
            "first_round": self.search.first_round,
            "stopped": self.search.stopped,
            "interrupted": self.interrupted,
            "chosen": self.chosen.to_dict(),
            "baseline": self.space.baseline.to_dict(),
            "meets_slo": self.meets_slo,
            "slo_targets": self.has_targets,
            "explanation": self.explanation,
            "speculation": self.speculation.to_dict() if self.speculation else None,
            "notes": self.notes + list(self.space.notes),
            "trials": [_trial(t) for t in self.search.trials],
            "measurements": [m.to_dict() for m in self.measurements.values()],
        }


def _trial(t: Trial[Candidate]) -> dict[str, Any]:
    return {"label": t.candidate.label, "round": t.round, "fidelity": t.fidelity,
            "cost_s": t.cost_s, **t.score.to_dict()}  # fmt: skip


def grid_for(profile: Profile, output_tokens: int) -> Grid:
    """The SLO's prompt lengths and concurrency levels; each must fit one slot."""
    slo = profile.slo
    prompts = tuple(sorted(set(slo.prompt_tokens)))
    if not prompts or not slo.concurrency or min(prompts) < 1 or min(slo.concurrency) < 1:
        raise ProfileError("slo.prompt_tokens and slo.concurrency need positive values")
    need = max(prompts) + output_tokens + 1
    if need > profile.engine.n_ctx:
        raise ProfileError(
            f"engine.n_ctx ({profile.engine.n_ctx} per slot) cannot hold the SLO's "
            f"{max(prompts)}-token prompts plus {output_tokens} generated tokens"
        )
    return Grid(prompts, tuple(sorted(set(slo.concurrency))), output_tokens)


def report_reserve(budget_s: float) -> float:
    """Seconds kept for writing the profile and the report (plots)."""
    return min(max(0.1 * budget_s, 5.0), 30.0)


def _system() -> tuple[BuildInfo | None, int | None]:
    """The llama.cpp build (which rules apply) and the memory available now."""
    from orin.llamacpp import build_info
    from orin.system.memory import read_meminfo

    try:
        available: int | None = read_meminfo(SysRoot()).available
    except OrinError:
        available = None
    return build_info(), available


def _sampler(name: str, budget_s: float) -> tuple[Sampler | None, str | None]:
    if name == "off":
        return None, None
    source, _ = select_source(None if name == "auto" else name, SysRoot(), SubprocessRunner())
    return Sampler(source, seconds=budget_s + 300).start(), source.name


def with_ctx(profile: Profile, n_ctx: int | None) -> Profile:
    """A copy of the profile with engine.n_ctx (per slot) set, as serve's --ctx does; a
    sliding window longer than the new context is dropped (it then defaults to it)."""
    if n_ctx is None:
        return profile
    try:
        return profile.with_n_ctx(n_ctx)
    except ValidationError as exc:
        problems = "; ".join(describe_error(e) for e in exc.errors())
        raise ProfileError(f"--ctx {n_ctx}: {problems}") from None


def tune(
    profile: Profile,
    model: Path | None = None,
    settings: TuneSettings | None = None,
    progress: Progress | None = None,
) -> TuneResult:
    """Measure, search and choose; writes nothing (see tuned.write and report.write)."""
    s = settings or TuneSettings()
    start = time.perf_counter()
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    original, profile = profile, with_ctx(profile, s.n_ctx)
    path = resolve_model_path(profile, model)
    info = read_model_info(path)
    grid = grid_for(profile, s.output_tokens)
    build, available = _system()
    space = build_space(profile, info, build, available, allow_fewer_slots=s.allow_fewer_slots)
    say = progress or (lambda _: None)
    say(f"{len(space)} configurations; grid {grid.points}; budget {s.budget_s:.0f} s")
    for note in space.notes:  # slots kept, configurations that do not fit: before the wait
        say(f"note: {note}")
    sampler, source = _sampler(s.telemetry, s.budget_s)
    measurer = EngineMeasurer(profile, path, info, grid, build, available, sampler, s.seed)
    try:
        budget = s.budget_s - report_reserve(s.budget_s) - (time.perf_counter() - start)
        measurer.deadline = time.perf_counter() + budget
        draft = draft_info(profile, named=True)
        fit = functools.partial(fits, profile, info, available, draft=draft)
        result, spec, stopped_by = _search(measurer, space, profile, s, budget, say, fit)
    finally:
        if sampler is not None:
            sampler.stop()
    try:  # only an interrupted run has no speculation choice
        chosen = spec.chosen if spec is not None else _chosen(result, measurer)
    except TuneError:  # interrupted before anything could be chosen: nothing to report
        raise (Terminated if stopped_by == "SIGTERM" else KeyboardInterrupt) from None
    m = measurer.results[chosen]
    out = TuneResult(
        profile, path, info, grid, space, result, measurer.results, chosen,
        [] if score(m, profile.slo).meets_slo else explain(m, profile.slo), s, started,
        telemetry_source=source, speculation=spec, interrupted=stopped_by is not None,
        interrupted_by=stopped_by or "Ctrl-C",
    )  # fmt: skip
    if result.first_round < len(space) + (space.baseline not in space.candidates):
        out.notes.append(
            f"the budget allowed {result.first_round} of the configurations in the first "
            "round (a seeded random subset, the profile's own always included)"
        )
    out.model_given = model is not None
    out.original = original
    out.elapsed_s = time.perf_counter() - start
    if stopped_by is not None:
        raise TuneInterrupted(out)
    return out


def _search(
    measurer: EngineMeasurer,
    space: Space,
    profile: Profile,
    s: TuneSettings,
    budget: float,
    say: Progress,
    fit: Callable[[Candidate], bool],
) -> tuple[SearchResult[Candidate], SpecChoice | None, str | None]:
    """The search, speculation tried on its winner (where ``fit`` says it holds in
    memory, a draft model counted), and the profile's own settings
    topped up: (search, speculation, what interrupted it). Ctrl-C or SIGTERM keeps what
    was measured before it (``Ctrl-C`` or ``SIGTERM``, else None; no speculation choice
    unless it was made)."""
    targets = has_targets(profile.slo)
    result: SearchResult[Candidate] | None = None
    spec: SpecChoice | None = None
    try:
        share = SPEC_SHARE if len(space.speculation) > 1 else 0.0
        result = successive_halving(
            space.candidates, measurer.evaluate, budget * (1 - share), s.min_fidelity,
            s.max_fidelity, s.eta, s.seed, first=space.baseline,
            on_trial=lambda t: say(_describe(t, targets=targets)),
        )  # fmt: skip
        spec = refine(
            _chosen(result, measurer), space.speculation, measurer.evaluate, measurer.results,
            profile.slo, result.fidelities, budget - result.spent_s, workload(measurer.grid),
            on_trial=lambda t: say(_describe(t, "speculation", targets=targets)),
            fits=fit, cost=cost_model(result.trials, result.fidelities) if result.trials else None,
        )  # fmt: skip
        result.spent_s += spec.spent_s
        reps = measurer.results[spec.chosen].reps
        _top_up_baseline(measurer, space.baseline, reps, result, budget)
    except SearchInterrupted as exc:
        return exc.partial, None, exc.by
    except (KeyboardInterrupt, Terminated) as exc:  # in speculation or the top-up
        if result is None:  # the search itself is done
            raise
        by = interruption(exc)
        result.stopped = result.stopped or f"interrupted ({by}) after the search"
        return result, spec, by
    return result, spec, None


# a measurement's error when the budget, not the configuration, ended it (measure.py)
BUDGET_ERRORS = ("cut off after", "the budget ran out")


def _chosen(result: SearchResult[Candidate], measurer: EngineMeasurer) -> Candidate:
    if result.best is None or result.best_score is None:
        raise TuneError("the budget did not allow a single measurement; give a larger --budget")
    if result.best_score.failed:
        errors = {m.error for m in measurer.results.values() if m.error}
        hint = ""
        if errors and all(e.startswith(BUDGET_ERRORS) for e in errors):
            hint = ": the budget ran out before a measurement completed; give a larger --budget"
        raise TuneError("every configuration failed: " + "; ".join(sorted(errors)) + hint)
    return result.best


def _top_up_baseline(
    measurer: EngineMeasurer,
    baseline: Candidate,
    reps: int,
    result: SearchResult[Candidate],
    budget: float,
) -> None:
    """Measure the profile's own settings as often as the chosen ones (``reps``) when
    time allows, so the before/after figures compare like with like. The cost is the
    search's model (a load plus the added repetitions): the profile's own settings were
    measured first, and their whole cost per repetition, the first load's reading of
    the model from disk in it, would say no time is left when there is."""
    have = measurer.results.get(baseline)
    if have is None or have.error or have.reps >= reps or have.reps == 0 or not result.trials:
        return
    fixed, unit = cost_model(result.trials, result.fidelities)
    predicted = fixed + unit * (reps - have.reps)
    if result.spent_s + predicted <= budget:
        ev = measurer.evaluate(baseline, reps)
        result.spent_s += ev.cost_s


def _describe(t: Trial[Candidate], stage: str | None = None, targets: bool = True) -> str:
    s = t.score
    if s.failed:
        state = ", failed"
    elif not targets:
        state = "" if s.meets_slo else ", some requests failed"  # nothing to meet or miss
    else:
        state = ", meets SLO" if s.meets_slo else f", {s.excess:+.0%} over"
    head = stage or f"round {t.round}"
    return (
        f"{head} x{t.fidelity}: {t.candidate.label}: {s.throughput:.1f} tok/s"
        f"{state} ({t.cost_s:.1f} s)"
    )
