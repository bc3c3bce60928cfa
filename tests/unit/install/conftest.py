"""Fake roots with a metadata-only model at the profile's path, and the CLI's deps faked."""

from __future__ import annotations

from pathlib import Path

import pytest

from orin.cli.deps import Deps
from orin.doctor.findings import Finding
from orin.doctor.report import Report
from orin.install.probe import HttpResult
from orin.profile.loader import load_profile
from tests.fakes.board import FakeBoard, GiB
from tests.fakes.host import FakeHost
from tests.ggufutil import LLAMA2_7B, write_gguf

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


def invoke(deps: Deps, root: Path, *args: str) -> tuple[int, str, str]:
    """The CLI on the fake root with ``deps``: exit code, stdout, stderr."""
    from typer.testing import CliRunner

    from orin.cli.app import app

    result = CliRunner().invoke(app, [*args, "--root", str(root)], env={"COLUMNS": "200"}, obj=deps)
    return result.exit_code, result.stdout, result.stderr


def board_with_profile(tmp_path: Path, name: str, model: str) -> tuple[Path, Path]:
    """A fake board root with memory to spare, and a profile file whose model section
    is ``model`` (YAML lines under ``model:``)."""
    root = tmp_path / "root"
    FakeBoard(root).meminfo(total=64 * GiB, available=48 * GiB)
    profile = tmp_path / f"{name}.yaml"
    profile.write_text(f"name: {name}\nmodel:\n{model}")
    return root, profile


def assert_the_service_gets(root: Path, host: FakeHost, target: Path, quantization: str) -> None:
    """The installed profile names ``target`` (under the service's models directory),
    and the file is given to the service user once install created it."""
    import yaml

    from orin.install.layout import MODELS_DIR, PROFILE_FILE

    copy = yaml.safe_load((root / PROFILE_FILE.lstrip("/")).read_text())
    assert copy["model"] == {"path": f"{MODELS_DIR}/{target.name}", "quantization": quantization}
    changes = host.changes()
    enable = next(i for i, c in enumerate(changes) if c[:2] == ("systemctl", "enable"))
    assert ("chown", "orin-llm:", str(target)) in changes[enable:]


def doctor_report(*findings: Finding) -> Report:
    return Report(findings or (Finding("model-file", "ok", "fine"),), (), 0.01)


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return FakeHost(root=tmp_path / "root")  # the root fixture's and board_with_profile's


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path / "root", "llama3.1-8b-q4_k_m")


@pytest.fixture
def health() -> list[HttpResult]:
    """What /health answers, in turn; the last answer repeats."""
    return [HttpResult(200, HEALTH_OK)]


@pytest.fixture
def report() -> list[Report]:
    """doctor's report, in a cell a test can change."""
    return [doctor_report()]


@pytest.fixture
def deps(
    monkeypatch: pytest.MonkeyPatch, host: FakeHost, health: list[HttpResult], report: list[Report]
) -> Deps:
    """Every side effect of orin.cli.install faked: root on the fake host, /health from
    ``health``, doctor's report from ``report``."""

    def get(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
        return health.pop(0) if len(health) > 1 else health[0]

    host.runner.programs.add(EXECUTABLE)  # tune system --revert on uninstall --purge
    monkeypatch.setattr("orin.install.probe.POLL_S", 0.0)
    return Deps(
        runner=host.runner,
        effective_uid=lambda: 0,
        http_get=get,
        run_doctor=lambda context: report[0],
        orin_executable=lambda: EXECUTABLE,
    )
