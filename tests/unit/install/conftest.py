"""Fake roots with a metadata-only model at the profile's path, and the CLI's seams patched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from orin.cli import install as install_cli
from orin.doctor.findings import Finding
from orin.doctor.runner import Report
from orin.install.probe import HttpResult
from orin.profile.loader import load_profile
from tests.fakeboard import FakeBoard, GiB
from tests.ggufutil import LLAMA2_7B, write_gguf
from tests.unit.install.fakehost import FakeHost

EXECUTABLE = "/opt/orin-llm/venv/bin/orin-llm"
MOSTLY_Q4_K_M = 15  # GGUF general.file_type
HEALTH_OK = '{"status": "ok", "model": "test", "slots_total": 4}'


def make_root(base: Path, profile_name: str) -> Path:
    """A board tree with MemAvailable fixed and the profile's model file (metadata only)."""
    FakeBoard(base).meminfo(total=64 * GiB, available=48 * GiB)
    model_path = load_profile(profile_name).model.path
    assert model_path is not None
    target = base / model_path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(target, params=LLAMA2_7B, file_type=MOSTLY_Q4_K_M)
    return base


def doctor_report(*findings: Finding) -> Report:
    return Report(findings or (Finding("model-file", "ok", "fine"),), (), 0.01)


@pytest.fixture
def host() -> FakeHost:
    return FakeHost()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path / "root", "llama3.1-8b-q4_k_m")


@pytest.fixture
def health() -> list[HttpResult]:
    """What /health answers, in turn; the last answer repeats."""
    return [HttpResult(200, HEALTH_OK)]


@pytest.fixture
def patched(
    monkeypatch: pytest.MonkeyPatch, host: FakeHost, health: list[HttpResult]
) -> Callable[[Report], None]:
    """Patch every seam of orin.cli.install; call the result to change doctor's report."""

    def get(url: str, timeout: float) -> HttpResult:
        return health.pop(0) if len(health) > 1 else health[0]

    report = [doctor_report()]
    host.runner.programs.add(EXECUTABLE)  # tune system --revert on uninstall --purge
    monkeypatch.setattr(install_cli, "make_runner", lambda: host.runner)
    monkeypatch.setattr(install_cli, "effective_uid", lambda: 0)
    monkeypatch.setattr(install_cli, "http_get", get)
    monkeypatch.setattr(install_cli, "run_doctor", lambda profile, root, runner: report[0])
    monkeypatch.setattr(install_cli, "orin_executable", lambda: EXECUTABLE)
    monkeypatch.setattr("orin.install.probe.POLL_S", 0.0)

    def set_report(new: Report) -> None:
        report[0] = new

    return set_report
