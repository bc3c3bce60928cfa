"""Ctrl-C during `tune run`: what was measured is written (report marked interrupted; a
tuned profile only when the best so far meets the targets), then exit 130. The
engine is replaced by synthetic measurements; the interrupt comes at a trial
boundary, as a KeyboardInterrupt from the measurer."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from orin.cli import tune as tune_cli
from orin.tune import report
from orin.tune import run as run_mod
from orin.tune.figures import Measurement, score
from orin.tune.search import Evaluation, Score, SearchInterrupted, successive_halving
from orin.tune.space import Candidate
from tests.unit.tune.test_outputs import PROFILE, measurement


class Interrupting:
    """EngineMeasurer's seam: synthetic figures, and Ctrl-C before evaluation ``at``."""

    at = 3
    scale = 1.0
    sigterm = False  # a real SIGTERM to this process instead of the KeyboardInterrupt

    def __init__(self, profile: Any, path: Path, info: Any, grid: Any, *args: Any) -> None:
        self.profile, self.grid = profile, grid
        self.results: dict[Candidate, Measurement] = {}
        self.deadline: float | None = None
        self.calls = 0

    def evaluate(self, c: Candidate, reps: int) -> Evaluation:
        if self.calls == self.at:
            if self.sigterm:
                os.kill(os.getpid(), signal.SIGTERM)
            raise KeyboardInterrupt  # reached only without sigterm
        self.calls += 1
        m = measurement(c, self.scale * (20 + 5 * self.calls), self.scale * 5)
        self.results[c] = m
        return Evaluation(score(m, self.profile.slo), 1.0)


def tune_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    at: int,
    scale: float = 1.0,
    sigterm: bool = False,
) -> tuple[int, str, str]:
    monkeypatch.setattr(Interrupting, "sigterm", sigterm)
    monkeypatch.setattr(Interrupting, "at", at)
    monkeypatch.setattr(Interrupting, "scale", scale)
    monkeypatch.setattr(run_mod, "EngineMeasurer", Interrupting)
    monkeypatch.setattr(run_mod, "_system", lambda: (None, None))
    monkeypatch.setattr(report, "_pyplot", lambda: None)
    (tmp_path / "p.yaml").write_text(PROFILE)
    args = ["run", "--profile", str(tmp_path / "p.yaml"), "--telemetry", "off", "-q",
            "--output-len", "8", "--out", str(tmp_path / "t.yaml"),
            "--report", str(tmp_path / "r")]  # fmt: skip
    r = CliRunner().invoke(tune_cli.app, args)
    return r.exit_code, r.stdout, r.stderr


def test_ctrl_c_writes_what_was_measured_and_a_profile_that_meets_the_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C lost everything the search had measured: exit 130, nothing written."""
    code, out, err = tune_run(tmp_path, monkeypatch, at=3)
    assert code == 130, err
    assert out == ""
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["interrupted"] is True and len(data["trials"]) == 3
    assert data["stopped"] == "interrupted (Ctrl-C) in round 0, after 3 measurements"
    assert data["meets_slo"] is True and data["speculation"] is None
    assert "**Interrupted (Ctrl-C)**" in (tmp_path / "r" / "report.md").read_text()
    tuned = (tmp_path / "t.yaml").read_text()
    assert "# Interrupted (Ctrl-C) before the search finished" in tuned
    assert "interrupted (Ctrl-C) with 3 configuration(s) measured: they are in" in err
    assert f"tuned profile: {tmp_path / 't.yaml'}" in err


def test_ctrl_c_before_a_configuration_met_the_targets_writes_no_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "t.yaml").write_text("# an earlier tuned profile\n")
    code, _, err = tune_run(tmp_path, monkeypatch, at=2, scale=10.0)
    assert code == 130, err
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["interrupted"] is True and data["meets_slo"] is False
    assert len(data["trials"]) == 2
    assert (tmp_path / "t.yaml").read_text() == "# an earlier tuned profile\n"
    assert "no tuned profile written: no configuration measured so far meets" in err
    assert f"({tmp_path / 't.yaml'} left as it was)" in err


def test_ctrl_c_before_any_measurement_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, _ = tune_run(tmp_path, monkeypatch, at=0)
    assert code == 130 and out == ""
    assert not (tmp_path / "r").exists() and not (tmp_path / "t.yaml").exists()


def test_sigterm_writes_what_was_measured_as_ctrl_c_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM (systemd stopping a unit, `timeout`) ended the process on the spot:
    nothing written. It now stops the search as Ctrl-C does, exit 143."""
    before = signal.getsignal(signal.SIGTERM)
    code, out, err = tune_run(tmp_path, monkeypatch, at=3, sigterm=True)
    assert code == 143, err
    assert out == ""
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["interrupted"] is True and len(data["trials"]) == 3
    assert data["stopped"] == "interrupted (SIGTERM) in round 0, after 3 measurements"
    assert "**Interrupted (SIGTERM)**" in (tmp_path / "r" / "report.md").read_text()
    tuned = (tmp_path / "t.yaml").read_text()
    assert "# Interrupted (SIGTERM) before the search finished" in tuned
    assert "interrupted (SIGTERM) with 3 configuration(s) measured" in err
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back


def test_sigterm_before_any_measurement_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = tune_run(tmp_path, monkeypatch, at=0, sigterm=True)
    assert code == 143 and out == ""
    assert "stopped by SIGTERM before a measurement finished" in err
    assert not (tmp_path / "r").exists() and not (tmp_path / "t.yaml").exists()


def test_the_search_keeps_the_best_of_the_round_it_reached() -> None:
    scores = {c: i for i, c in enumerate("abcdefghi")}

    def evaluate(c: str, fid: int) -> Evaluation:
        if fid == 3 and c == "g":  # round 1 measures the best third, best first
            raise KeyboardInterrupt
        return Evaluation(Score(True, float(scores[c]), -1.0), 1.0)

    with pytest.raises(SearchInterrupted) as caught:
        successive_halving(list(scores), evaluate, 1e9, first="a")
    partial = caught.value.partial
    assert [t.fidelity for t in partial.trials] == [1] * 9 + [3, 3]
    assert (partial.best, partial.best_fidelity) == ("i", 3)
    assert partial.stopped == "interrupted (Ctrl-C) in round 1, after 11 measurements"


def test_the_space_notes_are_said_before_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the slots stay the profile's (or --allow-fewer-slots has nothing to try) was
    only in the report, read after the whole budget."""
    from orin.profile.loader import parse_profile

    monkeypatch.setattr(Interrupting, "at", 10**6)
    monkeypatch.setattr(run_mod, "EngineMeasurer", Interrupting)
    monkeypatch.setattr(run_mod, "_system", lambda: (None, None))
    said: list[str] = []
    settings = run_mod.TuneSettings(budget_s=60, output_tokens=8, telemetry="off")
    run_mod.tune(parse_profile(PROFILE), settings=settings, progress=said.append)
    note = next(i for i, line in enumerate(said) if line.startswith("note: slots kept"))
    assert note == 1 and "--allow-fewer-slots also tries 2" in said[note]
    assert not any(line.startswith("round") for line in said[:note])
