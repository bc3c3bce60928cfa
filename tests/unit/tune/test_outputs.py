"""Scores, explanations, the tuned profile and the report, from synthetic measurements."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orin.cli import profile as profile_cli
from orin.cli import tune as tune_cli
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile
from orin.profile.schema import SLOSection
from orin.tune import report, tuned
from orin.tune import run as run_mod
from orin.tune.explain import explain
from orin.tune.figures import Grid, Measurement, PhaseFigures, Point, score
from orin.tune.run import TuneResult, TuneSettings, grid_for, with_ctx
from orin.tune.search import Evaluation, successive_halving
from orin.tune.space import Candidate, build_space

PROFILE = """
name: unit
model: {demo: {size: tiny, quant: f16}}
engine: {n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 128, threads: 2}
slo: {ttft_p95_ms: 100, tpot_p90_ms: 20, prompt_tokens: [16, 64], concurrency: [1, 2]}
system: {swappiness: null}
"""
GRID = Grid((16, 64), (1, 2), 8)


def measurement(c: Candidate, ttft: float, tpot: float, gpu: float | None = None) -> Measurement:
    points = {}
    for length, streams in GRID.points:
        n = 3 * streams
        t = ttft * length / 64 * streams  # longer prompts and more streams wait longer
        points[(length, streams)] = Point(
            length, streams, [t] * n, [tpot] * n, [0.4 * t] * n, [0.6 * t] * n,
            [t + 7 * tpot] * n, [8 * n], [n * (t + 7 * tpot) / 1e3 / streams],
        )  # fmt: skip
    phases = {
        "prefill": PhaseFigures(1.0, 400, gpu, 0.49, 0.1),
        "decode": PhaseFigures(2.0, 200, gpu, 0.2, 0.3),
    }
    return Measurement(c, 3, points, phases, cost_s=1.0)


def result(tiny: Path, slow: bool = False, text: str = PROFILE) -> TuneResult:
    profile = parse_profile(text)
    info = read_model_info(tiny)
    space = build_space(profile, info, cores=2)
    scale = 10.0 if slow else 1.0
    ms = {
        c: measurement(c, scale * (20 + 5 * i), scale * (5 + i % 3))
        for i, c in enumerate([space.baseline, *space.candidates])
    }
    search = successive_halving(
        list(ms)[1:], lambda c, f: Evaluation(score(ms[c], profile.slo), 1.0), 1e9,
        first=space.baseline,
    )  # fmt: skip
    assert search.best is not None
    why = explain(ms[search.best], profile.slo)
    return TuneResult(
        profile, tiny, info, grid_for(profile, 8), space, search, ms, search.best, why,
        TuneSettings(budget_s=60), "2026-11-29T12:00:00+00:00", elapsed_s=30.0,
        telemetry_source="cpu",
    )  # fmt: skip


def test_score_is_the_worst_point_against_each_target() -> None:
    c = Candidate(128, 128, "on", "f16", "f16", 1, 2)
    m = measurement(c, ttft=40.0, tpot=10.0)  # worst TTFT: 64 tokens x 2 streams = 80 ms
    s = score(m, SLOSection(ttft_p95_ms=100, tpot_p90_ms=20))
    assert s.meets_slo and s.excess == pytest.approx(-0.2)
    miss = score(m, SLOSection(ttft_p95_ms=40, tpot_p90_ms=20))
    assert not miss.meets_slo and miss.excess == pytest.approx(1.0)
    assert m.throughput() == pytest.approx(m.points[(16, 2)].output_tokens * 2 / (
        m.points[(16, 2)].wall_s + m.points[(64, 2)].wall_s))  # fmt: skip
    assert score(Measurement(c, 1, error="load failed"), SLOSection()).failed


def test_explain_names_the_phase_and_its_figures() -> None:
    c = Candidate(128, 128, "on", "f16", "f16", 1, 2)
    lines = explain(measurement(c, 400.0, 30.0), SLOSection(ttft_p95_ms=100, tpot_p90_ms=20))
    assert len(lines) == 2
    assert "TTFT_p95 at 64 prompt tokens x 2 streams is 800 ms against 100 ms" in lines[0]
    assert "prefill-bound" in lines[0] and "400 tokens/s" in lines[0]
    assert "the target needs about 1280" in lines[0]
    assert "decode-bound" in lines[1] and "30% of decode time" in lines[1]
    gpu = explain(measurement(c, 400.0, 5.0, gpu=0.95), SLOSection(ttft_p95_ms=100))
    assert "GPU busy 95%" in gpu[0] and "saturated in prefill" in gpu[0]
    assert explain(measurement(c, 10.0, 5.0), SLOSection(ttft_p95_ms=100)) == []


def test_explain_states_the_targets_as_the_profile_gives_them() -> None:
    """A target below a millisecond, or with more digits than the figures, is written
    as given: rounding said "20 ms against 0 ms" for a TTFT target of 0.5 ms."""
    c = Candidate(128, 128, "on", "f16", "f16", 1, 2)
    slo = SLOSection(ttft_p95_ms=0.5, tpot_p90_ms=0.25)
    lines = explain(measurement(c, 10.0, 5.0), slo)
    assert "is 20 ms against 0.5 ms: prefill-bound" in lines[0]
    assert "is 5.0 ms against 0.25 ms: decode-bound" in lines[1]
    assert "against 12.5 ms" in explain(measurement(c, 10.0, 5.0), SLOSection(ttft_p95_ms=12.5))[0]


def test_the_tuned_profile_records_figures_and_validates(tiny_f16: Path, tmp_path: Path) -> None:
    r = result(tiny_f16)
    text = tuned.render(r)
    head = [line for line in text.splitlines() if line.startswith("#")]
    assert "2026-11-29T12:00:00+00:00" in head[0]
    assert any("TTFT_p95 from" in line and "TPOT_p90 from" in line for line in head)
    assert any(line.startswith("# SLO ttft_p95_ms 100") for line in head)
    data = yaml.safe_load(text)
    assert data["name"] == "unit-tuned" and data["model"]["demo"] == {
        "size": "tiny",
        "quant": "f16",
    }
    assert data["engine"]["type_k"] == r.chosen.type_k and data["engine"]["flash_attn"] in (
        "on", "off", "auto",
    )  # fmt: skip
    path = tuned.write(r, tmp_path / "t.yaml")
    out = CliRunner().invoke(profile_cli.app, ["validate", str(path)])
    assert out.exit_code == 0, out.output


@pytest.mark.parametrize(
    "model", ["{packaged: smollm2-135m-instruct}", "{hf: 'owner/repo:m.gguf'}"]
)
def test_a_packaged_or_hub_model_stays_named_as_it_was(tiny_f16: Path, model: str) -> None:
    """The tuned profile names the model as its input did (portable to another
    machine), unless --model replaced it; either way it parses back."""
    text = PROFILE.replace("{demo: {size: tiny, quant: f16}}", model)
    kept = yaml.safe_load(tuned.render(result(tiny_f16, text=text)))["model"]
    assert kept["path"] is None and yaml.safe_load(model).items() <= kept.items()
    given = dataclasses.replace(result(tiny_f16, text=text), model_given=True)
    replaced = yaml.safe_load(tuned.render(given))["model"]
    assert replaced["path"] == str(tiny_f16.resolve())
    assert (replaced["hf"], replaced["packaged"], replaced["demo"]) == (None, None, None)


def test_a_missed_slo_is_explained_in_profile_and_report(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "_pyplot", lambda: None)  # plots are tested below
    r = result(tiny_f16, slow=True)
    assert not r.meets_slo and r.explanation
    assert "NOT met" in tuned.render(r)
    report.write(r, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "**why**" in md and "prefill-bound" in md


def test_a_profile_without_slo_targets_is_not_said_to_meet_them(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo and smollm2 profiles list prompt lengths and concurrency but no targets:
    the choice is the fastest configuration, and no output calls that "SLO met"."""
    monkeypatch.setattr(report, "_pyplot", lambda: None)
    text = PROFILE.replace("ttft_p95_ms: 100, tpot_p90_ms: 20, ", "")
    r = result(tiny_f16, text=text)
    assert not r.has_targets and r.to_dict()["slo_targets"] is False
    head = [line for line in tuned.render(r).splitlines() if line.startswith("#")]
    assert "# No SLO targets (the profile's slo section sets none): ranked by throughput." in head
    assert not any(line.startswith("# SLO ") for line in head)
    report.write(r, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "no SLO targets (the profile's slo section sets none): the fastest configuration" in md
    assert "SLO met" not in md and "| yes |" not in md
    out = tune_cli.Output()
    shown: list[str] = []
    monkeypatch.setattr(out, "line", shown.append)
    monkeypatch.setattr(out, "table", lambda *a, **k: None)
    tune_cli._show_tuned(out, r)
    assert shown[0].startswith("no SLO targets (the profile's slo section sets none)")
    assert result(tiny_f16).has_targets  # the unit profile's own targets: the usual verdict
    trial = r.search.trials[0]
    assert run_mod._describe(trial, targets=False).endswith(f"tok/s ({trial.cost_s:.1f} s)")
    assert ", meets SLO (" in run_mod._describe(trial, targets=True)


def test_counts_of_one_are_singular(tiny_f16: Path) -> None:
    r = result(tiny_f16)
    one = dataclasses.replace(r, measurements={**r.measurements, r.chosen: dataclasses.replace(
        r.chosen_m, reps=1)})  # fmt: skip
    head = tuned.render(one)
    assert "(1 repetition per point;" in head and "1 repetitions" not in head


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="no matplotlib")
def test_the_report_has_plots_with_matplotlib(tiny_f16: Path, tmp_path: Path) -> None:
    written = report.write(result(tiny_f16), tmp_path)
    assert written["plots"] and all((tmp_path / p).stat().st_size > 0 for p in written["plots"])
    md = (tmp_path / "report.md").read_text()
    assert "![ttft_vs_prompt](ttft_vs_prompt.png)" in md
    assert (tmp_path / "report.json").is_file()


def test_without_matplotlib_the_report_says_plots_were_skipped(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "_pyplot", lambda: None)
    written = report.write(result(tiny_f16), tmp_path)
    assert written["plots"] is None and not list(tmp_path.glob("*.png"))
    assert "Plots were skipped" in (tmp_path / "report.md").read_text()


def test_grid_must_fit_a_slot() -> None:
    p = parse_profile(PROFILE.replace("[16, 64]", "[16, 600]"))
    with pytest.raises(Exception, match="cannot hold"):
        grid_for(p, 8)


def test_tune_group_has_run_and_system() -> None:
    out = CliRunner().invoke(tune_cli.app, ["--help"])
    assert out.exit_code == 0
    assert "system" in out.output and "run" in out.output and "--budget" in out.output
    out = CliRunner().invoke(tune_cli.app, ["run", "--help"])
    assert out.exit_code == 0 and "--allow-fewer-slots" in out.output and "--ctx" in out.output


def test_every_change_from_the_profile_is_stated(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "_pyplot", lambda: None)
    r = result(tiny_f16)
    r.original = r.profile
    r.profile = with_ctx(r.profile, 256)  # as tune --ctx 256 does
    r.chosen = dataclasses.replace(r.chosen, n_batch=256, n_ubatch=256, threads=1)
    r.measurements[r.chosen] = measurement(r.chosen, 20.0, 5.0)
    changes = {k: (a, b) for k, a, b in tuned.profile_changes(r)}
    assert changes["engine.n_ctx"] == (512, 256)
    assert changes["engine.n_batch"] == (128, 256) and changes["engine.threads"] == (2, 1)
    assert changes["engine.type_k"] == ("auto", "f16")  # made explicit: a change too
    assert "name" not in changes and "description" not in changes
    assert "engine.slots" not in changes  # the profile's 4 slots stay
    text = tuned.render(r)
    assert "# Changed from the profile:\n" in text and "#   engine.n_ctx: 512 -> 256\n" in text
    report.write(r, tmp_path)
    md = (tmp_path / "report.md").read_text()
    section = md.split("## Changes from the profile")[1].split("##")[0]
    for key, (before, after) in changes.items():
        assert f"`{key}: {before} -> {after}`" in section
    data = json.loads((tmp_path / "report.json").read_text())
    assert {c["field"] for c in data["changes"]} == set(changes)


def test_throughput_is_the_median_over_repetitions() -> None:
    c = Candidate(128, 128, "on", "f16", "f16", 1, 2)
    a = Point(16, 2, rep_tokens=[100, 100, 100], rep_wall_s=[1.0, 1.0, 10.0])  # one disturbed
    b = Point(64, 2, rep_tokens=[100, 100, 100], rep_wall_s=[1.0, 3.0, 1.0])
    m = Measurement(c, 3, {(16, 2): a, (64, 2): b})
    # per repetition: 200/2, 200/4, 200/11 -> median 50
    assert m.throughput() == pytest.approx(50.0)
    assert a.throughput == pytest.approx(100.0) and a.output_tokens == 300
    assert a.merge(b).rep_wall_s == [1.0, 1.0, 10.0, 1.0, 3.0, 1.0]


def test_one_stream_is_one_stream() -> None:
    c = Candidate(128, 128, "on", "f16", "f16", 1, 2)
    m = measurement(c, 400.0, 30.0)
    single = Measurement(c, m.reps, {(64, 1): m.points[(64, 1)]}, m.phases, cost_s=1.0)
    lines = explain(single, SLOSection(ttft_p95_ms=100, tpot_p90_ms=20))
    assert "64 prompt tokens x 1 stream is" in lines[0] and "1 streams" not in " ".join(lines)


@pytest.mark.parametrize(
    ("errors", "hint"),
    [
        (["cut off after 0.8 s (its allowance)", "the budget ran out before this run"], True),
        (["cut off after 0.8 s (its allowance)", "llama.cpp failed to load the model"], False),
    ],
)
def test_when_the_budget_ended_every_measurement_the_error_asks_for_more(
    errors: list[str], hint: bool
) -> None:
    """The shortest --budget the CLI accepts can end the first measurement before it
    completes: the error says what to change rather than only "cut off"."""
    from types import SimpleNamespace

    from orin.tune.search import Score, SearchResult

    cs = [Candidate(128, 128, "on", "f16", "f16", 1, s) for s in (1, 2)]
    failed = Score(False, 0.0, float("inf"), failed=True)
    found = SearchResult(cs[0], failed, 1, [], 1.0, 1.0, (1,), 2)
    ms = SimpleNamespace(
        results={c: Measurement(c, 1, error=e) for c, e in zip(cs, errors, strict=True)}
    )
    with pytest.raises(run_mod.TuneError) as exc:
        run_mod._chosen(found, ms)  # type: ignore[arg-type]
    assert str(exc.value).startswith("every configuration failed: ")
    assert ("give a larger --budget" in str(exc.value)) is hint


def test_tune_without_a_profile_says_which_profile_it_tunes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare `tune run` tunes the profile serve runs (smollm2 when its model file is in
    the cache), and says so before it starts; here the cached file is not a GGUF file, so
    the run stops right after (exit 3) without measuring anything."""
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    (models / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"not a gguf file")
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ORIN_LLM_PROFILE", raising=False)
    args = ["run", "--budget", "0.1", "--out", str(tmp_path / "t.yaml")]
    r = CliRunner().invoke(tune_cli.app, [*args, "--report", str(tmp_path / "r")])
    assert r.exit_code == 3, r.output
    assert "no --profile given: tuning smollm2, the profile serve runs without one" in r.stderr
    assert "not a GGUF file" in r.stderr
    quiet = CliRunner().invoke(tune_cli.app, [*args, "--report", str(tmp_path / "r"), "-q"])
    assert quiet.exit_code == 3 and "no --profile given" not in quiet.stderr


@pytest.mark.parametrize(
    ("make", "option"),
    [("unit-tuned.yaml/", "--out"), ("unit-tune-report", "--report")],
)
def test_default_outputs_are_checked_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: str, option: str
) -> None:
    """Without --out or --report, tune writes NAME-tuned.yaml and NAME-tune-report/
    in the working directory; a folder or a file already in their way is a usage error
    at the start (exit 2), as with the options given, not an internal error (exit 70)
    after the whole budget was spent measuring."""

    def measuring(*args: object, **kwargs: object) -> TuneResult:
        raise AssertionError("tune measured before checking where it writes")

    monkeypatch.setattr(run_mod, "tune", measuring)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text(PROFILE)
    if make.endswith("/"):
        (tmp_path / make).mkdir()
    else:
        (tmp_path / make).write_text("in the way")
    r = CliRunner().invoke(tune_cli.app, ["run", "--profile", "p.yaml", "--budget", "0.1"])
    assert r.exit_code == 2, r.output
    assert f"{option} (default {make.rstrip('/')})" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["p.yaml", make.rstrip("/")])


@pytest.mark.parametrize(("out", "report"), [("same", "same"), ("t.yaml", "t.yaml/report")])
def test_one_path_for_the_tuned_profile_and_the_report_is_refused_at_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str, report: str
) -> None:
    """--out same --report same measured the whole budget, wrote the profile, then
    failed to make the report's folder where the file now was (exit 1)."""
    monkeypatch.setattr(run_mod, "tune", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text(PROFILE)
    args = ["run", "--profile", "p.yaml", "--out", out, "--report", report]
    r = CliRunner().invoke(tune_cli.app, args)
    assert r.exit_code == 2, r.output
    assert f"--out {out}, --report {report}: the tuned profile is a file" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]


@pytest.mark.parametrize("option", ["--out", "--report"])
def test_an_empty_output_path_is_a_usage_error_not_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: str
) -> None:
    """``--report "$DIR"`` with DIR unset wrote report.md, report.json and the plots
    into the working directory; ``--out ""`` said ". is a folder"."""
    monkeypatch.setattr(run_mod, "tune", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text(PROFILE)
    r = CliRunner().invoke(tune_cli.app, ["run", "--profile", "p.yaml", option, ""])
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}': an empty name" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]


def test_an_out_that_is_the_profile_or_the_model_tuned_is_refused_at_the_start(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--out naming the profile being tuned replaced it (its comments and settings) with
    the tuned one after the whole budget; naming the --model, the model file."""
    monkeypatch.setattr(run_mod, "tune", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text(PROFILE)
    r = CliRunner().invoke(tune_cli.app, ["run", "--profile", "p.yaml", "--out", "./p.yaml"])
    assert r.exit_code == 2, r.output
    assert "--out p.yaml is the profile it tunes: the tuned profile would replace it" in r.stderr
    assert (tmp_path / "p.yaml").read_text() == PROFILE
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_f16.read_bytes())
    args = ["run", "--profile", "p.yaml", "--model", str(model), "--out", "m.gguf"]
    r = CliRunner().invoke(tune_cli.app, args)
    assert r.exit_code == 2, r.output
    assert "--out m.gguf is the model: the tuned profile would replace it" in r.stderr
    assert model.read_bytes() == tiny_f16.read_bytes()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any folder")
def test_an_out_in_a_folder_this_user_cannot_write_is_refused_at_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    monkeypatch.setattr(run_mod, "tune", lambda *a, **k: pytest.fail("measured"))
    (tmp_path / "p.yaml").write_text(PROFILE)
    args = ["run", "--profile", str(tmp_path / "p.yaml"), "--out", str(locked / "t.yaml")]
    r = CliRunner().invoke(tune_cli.app, [*args, "--report", str(tmp_path / "r")])
    assert r.exit_code == 2, r.output
    assert "cannot write in" in r.stderr


@pytest.mark.parametrize("budget", ["inf", "nan"])
def test_a_budget_that_is_not_a_number_of_minutes_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: str
) -> None:
    """--budget inf ended in an internal error (exit 70) sizing the telemetry sampler."""
    monkeypatch.setattr(run_mod, "tune", lambda *a, **k: pytest.fail("measured"))
    (tmp_path / "p.yaml").write_text(PROFILE)
    args = ["run", "--profile", str(tmp_path / "p.yaml"), "--budget", budget]
    r = CliRunner().invoke(tune_cli.app, [*args, "--out", str(tmp_path / "t.yaml")])
    assert r.exit_code == 2, r.output
    assert "Invalid value for '--budget'" in r.stderr


def test_a_failed_measurement_keeps_the_json_strict(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed trial's distance to the targets is infinite; report.json and `tune
    --json` write it as null, not as Infinity, which strict JSON parsers refuse."""
    from orin.tune.search import Score

    monkeypatch.setattr(report, "_pyplot", lambda: None)
    r = result(tiny_f16)
    failed = Score(False, 0.0, float("inf"), failed=True)
    r.search.trials.append(dataclasses.replace(r.search.trials[-1], score=failed))
    report.write(r, tmp_path / "rep")

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    data = json.loads((tmp_path / "rep" / "report.json").read_text(), parse_constant=refuse)
    assert data["trials"][-1]["failed"] is True and data["trials"][-1]["excess"] is None
    json.dumps(r.to_dict(), allow_nan=False)


@pytest.mark.parametrize(
    ("args", "slo_prompt", "code", "named"),
    [
        (["--output-len", "1000"], 64, 2, "--output-len: "),
        (["--ctx", "256", "--output-len", "300"], 64, 2, "--ctx, --output-len: "),
        ([], 500, 4, "orin-llm: engine.n_ctx (512 per slot)"),
    ],
)
def test_an_slo_grid_that_does_not_fit_a_slot_names_its_cause(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    slo_prompt: int,
    code: int,
    named: str,
) -> None:
    """--ctx or --output-len that leave no room for the SLO's longest prompt plus the
    generated tokens are a usage error naming the options (exit 2, as cli.md says of
    a value the profile's rules refuse with its other settings); a profile whose own
    SLO does not fit stays a profile error (exit 4)."""
    monkeypatch.setattr(run_mod, "tune", lambda *a, **k: pytest.fail("measured"))
    text = PROFILE.replace("prompt_tokens: [16, 64]", f"prompt_tokens: [16, {slo_prompt}]")
    (tmp_path / "p.yaml").write_text(text)
    out = ["--out", str(tmp_path / "t.yaml"), "--report", str(tmp_path / "r")]
    r = CliRunner().invoke(
        tune_cli.app, ["run", "--profile", str(tmp_path / "p.yaml"), *args, *out]
    )
    assert r.exit_code == code, r.output
    assert named in r.stderr and "cannot hold the SLO's" in r.stderr


def test_the_tuned_profile_is_written_for_the_file_it_was_measured_on(
    tiny_f16: Path, tmp_path: Path
) -> None:
    """`tune --model x-f16.gguf` on a profile written for Q4_K_M measured the F16 file;
    the tuned profile names that file and says F16, so `profile validate` does
    not warn that it was written for another quantization, and the header says so."""
    text = PROFILE.replace("{demo: {size: tiny, quant: f16}}", "{quantization: Q4_K_M}")
    r = dataclasses.replace(result(tiny_f16, text=text), model_given=True)
    rendered = tuned.render(r)
    assert yaml.safe_load(rendered)["model"]["quantization"] == "F16"
    assert "#   model.quantization: Q4_K_M -> F16" in rendered.splitlines()
    path = tuned.write(r, tmp_path / "t.yaml")
    out = CliRunner().invoke(profile_cli.app, ["validate", str(path)])
    assert out.exit_code == 0 and "model-quantization" not in out.output, out.output


def test_a_folder_that_went_away_during_the_run_is_said_not_an_internal_error(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paths are checked at the start; when the folder of --out is replaced by a
    file while tune measures, the end says what it could not write (exit 1), not
    "internal error" (exit 70, a bug)."""
    folder = tmp_path / "out"
    folder.mkdir()

    def measuring(*args: object, **kwargs: object) -> TuneResult:
        folder.rmdir()
        folder.write_text("now a file")
        return result(tiny_f16)

    monkeypatch.setattr(run_mod, "tune", measuring)
    (tmp_path / "p.yaml").write_text(PROFILE)
    args = ["run", "--profile", str(tmp_path / "p.yaml"), "--out", str(folder / "t.yaml")]
    r = CliRunner().invoke(tune_cli.app, [*args, "--report", str(tmp_path / "r"), "-q"])
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith(f"orin-llm: cannot write the tuned profile {folder / 't.yaml'}: ")


@pytest.mark.parametrize("as_json", [False, True])
def test_targets_out_of_reach_exit_1_after_writing_the_closest(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    """No configuration meets the profile's targets: the closest is written and shown
    as always, and the exit code says the targets were missed (1, as bench --slo), so
    `tune run && serve --profile tuned.yaml` does not serve it unawares."""
    monkeypatch.setattr(report, "_pyplot", lambda: None)
    monkeypatch.setattr(run_mod, "tune", lambda *a, **k: result(tiny_f16, slow=True))
    (tmp_path / "p.yaml").write_text(PROFILE)
    out, folder = tmp_path / "t.yaml", tmp_path / "r"
    args = ["run", "--profile", str(tmp_path / "p.yaml"), "--out", str(out), "-q"]
    r = CliRunner().invoke(tune_cli.app, [*args, "--report", str(folder), *["--json"] * as_json])
    assert r.exit_code == 1, r.output
    assert out.is_file() and (folder / "report.json").is_file()
    assert r.stderr.startswith("orin-llm: SLO not met: ttft_p95_ms ")
    assert "ms > 100 ms at 64 prompt tokens x 2 streams" in r.stderr
    assert f"the closest configuration is in {out}" in r.stderr
    if as_json:
        assert json.loads(r.stdout)["meets_slo"] is False
    else:
        assert "SLO NOT met: the closest configuration" in r.stdout


def test_targets_met_exit_0(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "_pyplot", lambda: None)
    monkeypatch.setattr(run_mod, "tune", lambda *a, **k: result(tiny_f16))
    (tmp_path / "p.yaml").write_text(PROFILE)
    args = ["run", "--profile", str(tmp_path / "p.yaml"), "--out", str(tmp_path / "t.yaml")]
    r = CliRunner().invoke(tune_cli.app, [*args, "--report", str(tmp_path / "r"), "-q"])
    assert r.exit_code == 0, r.output
    assert "SLO met" in r.stdout and r.stderr == ""


@pytest.mark.parametrize("slow", [False, True])
def test_the_report_and_profile_say_what_was_tried_and_why_the_choice_won(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow: bool
) -> None:
    """The report listed the measured configurations but neither the values searched per
    setting nor the rule and the runner-up that decided the choice."""
    monkeypatch.setattr(report, "_pyplot", lambda: None)
    r = result(tiny_f16, slow=slow)
    finalists = [c for c in r.search.finalists if c != r.chosen]
    runner_up = r.measurements[finalists[0]]
    report.write(r, tmp_path)
    md = (tmp_path / "report.md").read_text()
    head = [line for line in tuned.render(r).splitlines() if line.startswith("#")]
    if slow:
        why = "no configuration measured meets the SLO targets; it is the closest to them: "
        assert f"{runner_up.candidate.label}, worst point +" in md
    else:
        why = "it meets the SLO targets at every point, with the highest throughput at 2 streams: "
        assert f"{runner_up.candidate.label}, {runner_up.throughput():.1f} tokens/s" in md
    assert f"- **chosen because** {why}" in md
    assert f"runner-up in the last round ({len(finalists) + 1} configurations, 9 repetitions)" in md
    assert any(line.startswith(f"# Chosen {r.chosen.label}: {why}") for line in head)
    assert "| setting | values tried | the profile's |" in md
    assert "| n_batch/n_ubatch | 128/128, 256/256, 512/512 | 128/128 |" in md
    assert "| threads | 1, 2 | 2 |" in md
    own = r.space.baseline not in r.space.candidates  # auto flash attention: not searched
    assert own and f"- search: {len(r.space)} configurations and the profile's own," in md


def test_a_choice_the_budget_left_alone_is_not_said_to_have_won_a_ranking(
    tiny_f16: Path,
) -> None:
    r = result(tiny_f16)
    base = r.space.baseline
    only = successive_halving(
        [base], lambda c, f: Evaluation(score(r.measurements[c], r.profile.slo), 1.0), 1e9
    )
    lone = dataclasses.replace(r, search=only, chosen=base)
    head = [line for line in tuned.render(lone).splitlines() if line.startswith("# Chosen")]
    assert head == [
        f"# Chosen {base.label}: the only configuration the budget let the search measure "
        f"({r.measurements[base].throughput():.1f} tokens/s; a larger --budget compares others)."
    ]


def test_a_note_leaves_the_progress_bar_on_the_step_running() -> None:
    """The space's notes come as progress lines; the bar named its step "note"."""
    from rich.console import Console
    from rich.progress import Progress

    from orin.cli.output import Output

    bar = Progress(console=Console(file=io.StringIO(), force_terminal=True))
    progress = tune_cli.TuneProgress(Output(), 60.0, bar, quiet=False)
    progress.say("13 configurations; grid [(16, 1)]; budget 60 s")
    progress.say("note: slots kept at the profile's 4 although ...")
    assert bar.tasks[0].description == "13 configurations"
    progress.say("round 0 x1: b128/u128 ...: 10.0 tok/s (1.0 s)")
    assert bar.tasks[0].description == "round 0 x1"


def test_a_cut_off_says_whether_its_allowance_or_the_budget_ended_it(tiny_f16: Path) -> None:
    """Every cut-off said "(its allowance)", also when the end of the budget cut it,
    beside "the budget ran out ...; give a larger --budget"."""
    import time

    from orin.tune.measure import EngineMeasurer

    profile = parse_profile(PROFILE)
    m = EngineMeasurer(profile, tiny_f16, read_model_info(tiny_f16), GRID)
    assert m.allowance(3) == (None, "")
    m._per_rep = [1.0, 1.0, 1.0]
    assert m.allowance(3) == (15.0, "its allowance, 5 times the median run")
    m.deadline = time.perf_counter() + 1000.0
    assert m.allowance(3) == (15.0, "its allowance, 5 times the median run")
    m.deadline = time.perf_counter() + 10.0
    seconds, why = m.allowance(3)
    assert seconds is not None and seconds <= 10.0 and why == "the end of the budget"


def test_the_profiles_own_settings_that_failed_are_said_to_with_the_reason(
    tiny_f16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile llama.cpp refuses (a quantized V cache with flash attention off) is
    tuned into one that works; the output showed "before: -" and said nothing of why."""
    monkeypatch.setattr(report, "_pyplot", lambda: None)
    r = result(tiny_f16)
    why = "kv-quant-v-needs-fa: a quantized V cache (q4_0) needs flash attention"
    base = r.space.baseline
    r.measurements[base] = Measurement(base, 1, cost_s=0.1, error=why)
    r = dataclasses.replace(r, chosen=next(c for c in r.search.finalists if c != base))
    line = f"the profile's own settings failed: {why}"
    assert f"# The profile's own settings failed: {why}" in tuned.render(r).splitlines()
    report.write(r, tmp_path)
    assert f"- **the profile's own settings failed**: {why}" in (tmp_path / "report.md").read_text()
    monkeypatch.setattr(run_mod, "tune", lambda *a, **k: r)
    (tmp_path / "p.yaml").write_text(PROFILE)
    args = ["run", "--profile", str(tmp_path / "p.yaml"), "--out", str(tmp_path / "t.yaml")]
    out = CliRunner().invoke(tune_cli.app, [*args, "--report", str(tmp_path / "r"), "-q"])
    assert out.exit_code == 0, out.output
    assert f"  {line}" in out.stdout.splitlines()
