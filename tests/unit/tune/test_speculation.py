"""Speculative decoding as a tune setting: the options, how a candidate carries one, the
refinement of the winner within its budget, and the decision with its wording."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from orin.model.gguf import ModelInfo, read_model_info
from orin.profile.loader import parse_profile
from orin.profile.schema import Profile, SLOSection
from orin.tune import report, tuned
from orin.tune.explain import speculation
from orin.tune.figures import Measurement, Point, score
from orin.tune.search import Evaluation
from orin.tune.space import Candidate, Speculation, build_space, speculation_options
from orin.tune.speculation import (
    MIN_GAIN,
    SpecChoice,
    acceptance,
    beats,
    decide,
    fidelity_for,
    median_tpot,
    refine,
    why_not,
)
from tests.unit.tune.test_outputs import result

PROFILE = """
name: t
engine: {n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 128, threads: 2}
slo: {ttft_p95_ms: 1000, tpot_p90_ms: 50, prompt_tokens: [16, 64], concurrency: [1, 2]}
"""
SLO = SLOSection(ttft_p95_ms=1000, tpot_p90_ms=50, prompt_tokens=[16, 64], concurrency=[1, 2])
WINNER = Candidate(128, 128, "on", "f16", "f16", 2, 4)
OFF, NGRAM8, NGRAM4 = Speculation("off"), Speculation("ngram", 8), Speculation("ngram", 4)


@pytest.fixture(scope="module")
def info(tiny_f16: Path) -> ModelInfo:
    return read_model_info(tiny_f16)


def profile(extra: str = "") -> Profile:
    return parse_profile(PROFILE + extra)


def measured(
    c: Candidate,
    tpot: float,
    tokens_per_s: float = 100.0,
    ttft: float = 50.0,
    reps: int = 3,
    drafted: int | None = None,
    accepted: int | None = None,
) -> Measurement:
    """Every request of every point at ``tpot``; throughput ``tokens_per_s`` per point;
    a speculating candidate drafts 30 tokens per point and 24 are accepted unless told."""
    speculates = c.speculative != "off"
    drafted = (30 if speculates else 0) if drafted is None else drafted
    accepted = (24 if speculates else 0) if accepted is None else accepted
    points = {}
    for length, streams in ((16, 1), (16, 2), (64, 1), (64, 2)):
        n = reps * streams
        points[(length, streams)] = Point(
            length, streams, [ttft] * n, [tpot] * n, [0.0] * n, [ttft] * n, [ttft] * n,
            [100] * reps, [100 / tokens_per_s] * reps, 0, drafted, accepted,
        )  # fmt: skip
    return Measurement(c, reps, points, cost_s=2.0 * reps)


# -- the options and the candidate -------------------------------------------------------


def test_options_start_with_the_profiles_own_and_name_a_draft_model_only_when_given() -> None:
    assert speculation_options(profile()) == (OFF, NGRAM8, NGRAM4)
    spec = "speculative: {mode: ngram, n_draft: 6}\n"
    assert speculation_options(profile(spec)) == (
        Speculation("ngram", 6), Speculation("off", 6), NGRAM8, NGRAM4,
    )  # fmt: skip
    draft = "speculative: {draft_model: d.gguf, n_draft: 4}\n"
    assert speculation_options(profile(draft)) == (
        Speculation("off", 4), NGRAM8, Speculation("draft", 4), NGRAM4,
    )  # fmt: skip


def test_the_grid_carries_the_profiles_own_setting_and_does_not_multiply(
    info: ModelInfo,
) -> None:
    plain = build_space(profile(), info, cores=2)
    spec = build_space(profile("speculative: {mode: ngram, n_draft: 6}\n"), info, cores=2)
    assert len(spec) == len(plain) > 0
    assert {c.speculation for c in spec.candidates} == {Speculation("ngram", 6)}
    assert spec.baseline.speculation == Speculation("ngram", 6)
    assert spec.axes["speculative"] == ("ngram/6", "off", "ngram/8", "ngram/4")
    assert spec.speculation[0] == spec.baseline.speculation


def test_a_candidate_applies_its_speculation_and_keeps_the_rest_of_the_section() -> None:
    p = profile("speculative: {ngram_min: 3, probation: 64}\n")
    c = WINNER.with_speculation(NGRAM4)
    q = c.apply(p)
    assert (q.speculative.mode, q.speculative.n_draft) == ("ngram", 4)
    assert (q.speculative.ngram_min, q.speculative.probation) == (3, 64)
    assert q.engine == WINNER.apply(p).engine  # the engine section does not see it
    assert p.speculative.mode == "off"
    assert c.label == WINNER.label + " spec=ngram/4"
    assert c.to_dict()["speculative"] == "ngram" and c.to_dict()["n_draft"] == 4
    assert WINNER.apply(profile("speculative: {mode: ngram}\n")).speculative.mode == "off"


# -- the decision ------------------------------------------------------------------------


def test_ngram_is_chosen_only_for_a_clear_tpot_gain() -> None:
    off = measured(WINNER, 20.0)
    fast = measured(WINNER.with_speculation(NGRAM8), 14.0, 120.0, drafted=90, accepted=72)
    marginal = measured(WINNER.with_speculation(NGRAM4), 20.0 * (1 - MIN_GAIN / 2), 101.0)
    assert median_tpot(fast) == pytest.approx(14.0) and acceptance(fast) == pytest.approx(0.8)
    assert acceptance(off) is None
    assert beats(fast, off, SLO) and not beats(marginal, off, SLO)
    assert decide(off, [marginal, fast], SLO) is fast
    assert decide(off, [marginal], SLO) is off


def test_speculation_whose_drafts_were_never_accepted_is_not_chosen() -> None:
    """Without an accepted draft every token took a decode step as with off: a lower
    TPOT (or an SLO met) is the noise between two measurements, not speculation's.
    tune chose ngram/4 for "median TPOT 11% lower" with 0% of its drafts accepted."""
    off = measured(WINNER, 20.0)
    rejected = measured(WINNER.with_speculation(NGRAM4), 17.8, 104.0, drafted=90, accepted=0)
    silent = measured(WINNER.with_speculation(NGRAM8), 17.8, 104.0, drafted=0, accepted=0)
    assert not beats(rejected, off, SLO) and not beats(silent, off, SLO)
    assert decide(off, [rejected, silent], SLO) is off
    slow = measured(WINNER, 60.0)  # misses the TPOT target; the idle setting "meets" it
    assert decide(slow, [measured(WINNER.with_speculation(NGRAM8), 40.0, accepted=0)], SLO) is slow
    assert why_not(rejected, off, SLO) == (
        "none of its drafted tokens was accepted, so it decoded as off does "
        "(its TPOT -11.0% is noise)"
    )
    assert why_not(silent, off, SLO).startswith("it drafted nothing, so it decoded as off")
    # off replacing a profile's speculation that never drafted follows the usual rule
    assert decide(silent, [off], SLO) is silent  # off is 12 % slower here
    assert decide(silent, [measured(WINNER, 15.0, 104.0)], SLO).candidate == WINNER


def test_speculation_that_costs_throughput_at_full_concurrency_is_not_chosen() -> None:
    off = measured(WINNER, 20.0, 100.0)
    costly = measured(WINNER.with_speculation(NGRAM8), 15.0, 90.0)
    assert not beats(costly, off, SLO) and decide(off, [costly], SLO) is off


def test_the_lowest_tpot_wins_among_settings_that_beat_the_profiles() -> None:
    off = measured(WINNER, 20.0)
    a = measured(WINNER.with_speculation(NGRAM8), 12.0)
    b = measured(WINNER.with_speculation(NGRAM4), 15.0)
    assert decide(off, [b, a], SLO) is a


def test_a_profile_that_speculates_keeps_it_unless_off_is_clearly_faster() -> None:
    own = WINNER.with_speculation(NGRAM8)
    ngram = measured(own, 20.0)
    assert decide(ngram, [measured(WINNER, 19.5)], SLO) is ngram  # a 2.5 % cost: kept
    off = measured(WINNER, 17.0)
    assert decide(ngram, [off], SLO) is off


def test_failures_never_win_and_meeting_the_slo_comes_first() -> None:
    off = measured(WINNER, 60.0)  # misses the 50 ms TPOT target
    broken = Measurement(WINNER.with_speculation(NGRAM8), 3, error="draft failed")
    meets = measured(WINNER.with_speculation(NGRAM4), 40.0, 80.0)
    assert not score(off, SLO).meets_slo and score(meets, SLO).meets_slo
    assert decide(off, [broken], SLO) is off
    assert decide(off, [broken, meets], SLO) is meets  # the SLO outranks throughput


# -- the refinement within its budget ----------------------------------------------------


class Fake:
    """An evaluator that records calls and files measurements with preset TPOTs."""

    def __init__(self, tpots: dict[Speculation, float], cost_per_rep: float = 2.0) -> None:
        self.tpots, self.cost = tpots, cost_per_rep
        self.results: dict[Candidate, Measurement] = {WINNER: measured(WINNER, 20.0, reps=9)}
        self.calls: list[tuple[Candidate, int]] = []

    def __call__(self, c: Candidate, reps: int) -> Evaluation:
        self.calls.append((c, reps))
        self.results[c] = measured(c, self.tpots[c.speculation], reps=reps)
        return Evaluation(score(self.results[c], SLO), self.cost * reps)


def test_refine_tries_every_other_setting_on_the_winner_at_its_repetitions() -> None:
    ev = Fake({NGRAM8: 15.0, NGRAM4: 16.0})
    out = refine(WINNER, (OFF, NGRAM8, NGRAM4), ev, ev.results, SLO, (1, 3, 9), 100.0, "words")
    assert ev.calls == [(WINNER.with_speculation(NGRAM8), 9), (WINNER.with_speculation(NGRAM4), 9)]
    assert out.chosen == WINNER.with_speculation(NGRAM8) and out.changed
    assert out.spent_s == pytest.approx(36.0) and not out.skipped
    assert out.measured == [WINNER, *(c for c, _ in ev.calls)]
    assert out.to_dict()["tried"][0]["speculation"] == "ngram/8"


def test_a_short_budget_lowers_the_repetitions_then_skips() -> None:
    # the winner cost 2 s per repetition: 9 need 18 s, 3 need 6 s
    ev = Fake({NGRAM8: 15.0, NGRAM4: 16.0})
    out = refine(WINNER, (OFF, NGRAM8, NGRAM4), ev, ev.results, SLO, (1, 3, 9), 8.0, "words")
    assert ev.calls == [(WINNER.with_speculation(NGRAM8), 3), (WINNER.with_speculation(NGRAM4), 1)]
    assert out.spent_s <= 8.0
    out = refine(WINNER, (OFF, NGRAM8), Fake({}), Fake({}).results, SLO, (1, 3, 9), 1.0, "w")
    assert not out.trials and out.skipped == [NGRAM8] and out.chosen == WINNER
    assert fidelity_for((1, 3, 9), 9, 2.0, 5.9) == 1 and fidelity_for((1, 3, 9), 3, 1.0, 9) == 3


def test_the_search_cost_model_predicts_the_speculation_measurements() -> None:
    """The winner is often the profile's own settings, measured first with the cold
    model load in its cost: 29 s over 9 repetitions predicted 29 s for each setting
    where a load and 9 repetitions take 2.8, so the settings were measured once each
    (or skipped) by a budget that held 9 repetitions of both."""
    ev = Fake({NGRAM8: 15.0, NGRAM4: 16.0}, cost_per_rep=0.3)
    ev.results[WINNER] = dataclasses.replace(ev.results[WINNER], cost_s=29.0)
    args = (WINNER, (OFF, NGRAM8, NGRAM4), ev, ev.results, SLO, (1, 3, 9), 8.0, "words")
    out = refine(*args, cost=(0.1, 0.3))
    assert [r for _, r in ev.calls] == [9, 9] and not out.skipped
    ev.calls.clear()
    refine(*args)  # 29/9 s a repetition, loads included: only 1 fits each
    assert [r for _, r in ev.calls] == [1, 1]
    assert fidelity_for((1, 3, 9), 9, 0.3, 2.7, fixed_s=0.1) == 3


def test_a_draft_model_that_would_not_fit_beside_the_winner_is_not_measured() -> None:
    """On a unified-memory board a setting that does not fit is a killed process, not a
    slow measurement: the refinement leaves it out and says why."""
    draft = Speculation("draft", 8)
    ev = Fake({NGRAM8: 15.0, draft: 10.0})
    out = refine(
        WINNER, (OFF, NGRAM8, draft), ev, ev.results, SLO, (1, 3, 9), 100.0, "words",
        fits=lambda c: c.speculative != "draft",
    )  # fmt: skip
    assert ev.calls == [(WINNER.with_speculation(NGRAM8), 9)]
    assert out.unfit == [draft] and not out.skipped
    assert out.to_dict()["unfit"] == ["draft/8"]
    assert any(
        line.startswith("not tried (the draft model's weights and cache would not fit")
        and line.endswith(": draft/8")
        for line in speculation(out, ev.results, SLO)
    )
    out = refine(
        WINNER, (OFF, draft), ev, ev.results, SLO, (1, 3, 9), 100.0, "words",
        fits=lambda c: c.speculative != "draft",
    )  # fmt: skip
    assert speculation(out, ev.results, SLO)[0] == "speculative decoding stays off (the profile's)"


def test_the_grid_counts_the_draft_model_of_a_profile_that_drafts(
    info: ModelInfo, tiny_f16: Path
) -> None:
    """A profile with speculative.mode draft runs every grid candidate with the draft
    model beside it: a candidate is kept only when both fit."""
    from orin.model.memplan import draft_bytes, total_bytes
    from orin.tune.space import fits

    drafting = profile(f"speculative: {{mode: draft, draft_model: {tiny_f16}}}\n")
    c = WINNER.with_speculation(Speculation("draft", 8))
    plain = WINNER
    own = build_space(profile(), info, cores=2)
    e = drafting.engine
    need = total_bytes(info, e.n_ctx, plain.slots, "f16", "f16", plain.n_ubatch, True, e.n_batch)
    extra = draft_bytes(info, e.n_ctx, c.slots, c.n_ubatch, True, e.n_batch)
    room = need + extra // 2  # the winner fits, the draft model beside it not
    assert fits(drafting, info, room, plain, info)
    assert not fits(drafting, info, room, c, info)
    assert fits(drafting, info, room + extra, c, info)
    assert len(build_space(drafting, info, available=room, cores=2)) < len(
        build_space(profile(), info, available=room, cores=2)
    )
    assert len(own) == len(build_space(drafting, info, cores=2))  # no memory limit given


# -- the wording: report, explanation and tuned profile -----------------------------------


def choice(tpot_off: float, tpot_ngram: float) -> tuple[SpecChoice, dict[Candidate, Measurement]]:
    ev = Fake({NGRAM8: tpot_ngram})
    ev.results[WINNER] = measured(WINNER, tpot_off, reps=9)
    return refine(WINNER, (OFF, NGRAM8), ev, ev.results, SLO, (1, 3, 9), 1e3, "W"), ev.results


def test_the_explanation_gives_tpot_with_and_without() -> None:
    won, results = choice(20.0, 15.0)
    lines = speculation(won, results, SLO)
    assert lines[0] == (
        "speculative decoding ngram/8 chosen over the profile's off: median TPOT 25% lower, "
        "15 ms with ngram/8, 20 ms with off"
    )
    assert lines[1].startswith("off: median TPOT 20 ms, worst TPOT_p90 20.0 ms")
    assert lines[2].startswith("ngram/8: median TPOT 15 ms") and "(9 repetitions)" in lines[2]
    assert lines[-1].startswith("measured on W.") and "copying" in lines[-1]
    lost, results = choice(20.0, 19.6)
    text = speculation(lost, results, SLO)[0]
    assert text.startswith("speculative decoding stays off (the profile's; a change needs a 5%")
    assert "ngram/8: median TPOT -2.0% (a change needs -5% or lower)" in text


def test_the_tuned_profile_and_report_keep_a_winning_speculation(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "_pyplot", lambda: None)
    r = result(tiny_f16)
    c = r.chosen.with_speculation(NGRAM8)
    r.measurements[c] = measured(c, 1.0, 1e6)
    spec = SpecChoice(r.chosen, c, "the standard workload")
    r.speculation, r.chosen = spec, c
    text = tuned.render(r)
    data = yaml.safe_load(text)
    assert data["speculative"]["mode"] == "ngram" and data["speculative"]["n_draft"] == 8
    assert "# Speculative decoding ngram/8 chosen over the profile's off" in text
    assert "#   speculative.mode: off -> ngram\n" in text.split("# Changed from the profile:")[1]
    report.write(r, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## Speculative decoding" in md and "spec=ngram/8" in md
    assert "measured on the standard workload" in md


def test_a_relative_draft_model_is_written_absolute(tiny_f16: Path, tmp_path: Path) -> None:
    r = result(tiny_f16)
    src = tmp_path / "profiles" / "p.yaml"
    data = r.profile.model_dump()
    data["speculative"]["draft_model"] = "d.gguf"
    r.profile = Profile.model_validate(data)
    r.profile.source = src
    data = tuned.profile_data(r)
    assert data["speculative"]["draft_model"] == str((src.parent / "d.gguf").resolve())
