"""install with a profile whose model is on the Hugging Face Hub: pulled into the
service's models directory before anything is planned or started, from a hub stand-in
on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from orin.cli.deps import Deps
from orin.doctor.context import DoctorContext
from orin.doctor.report import Report
from orin.install.layout import MODELS_DIR
from tests.fakes.host import FakeHost
from tests.ggufutil import LLAMA2_7B, write_gguf
from tests.unit.install.conftest import (
    MOSTLY_Q4_K_M,
    assert_the_service_gets,
    board_with_profile,
    doctor_report,
    invoke,
)
from tests.unit.model.fakehub import FakeHub, Request, point_at, serve

REPO = "acme/Llama-GGUF"
FILE = "Llama-7B-Q4_K_M.gguf"


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    src = write_gguf(
        tmp_path / "src.gguf",
        params=LLAMA2_7B,
        file_type=MOSTLY_Q4_K_M,
        tensors={"w": np.zeros(1024, dtype=np.float32)},
    )
    with serve(FakeHub(repos={REPO: {FILE: src.read_bytes()}})) as h:
        point_at(h, monkeypatch, tmp_path / "hf-home")
        monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path / "cache"))
        yield h


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    return board_with_profile(
        tmp_path, "hf-llama", f"  hf: {REPO}:Q4_K_M\n  quantization: Q4_K_M\n"
    )


def test_install_pulls_before_it_plans_or_starts(
    setup: tuple[Path, Path], fake_hub: FakeHub, host: FakeHost, deps: Deps
) -> None:
    root, profile = setup
    seen: list[DoctorContext] = []
    calls_at_download: list[int] = []

    def on_request(request: Request) -> None:
        if request.method == "GET" and "/resolve/" in request.path:
            calls_at_download.append(len(host.calls))

    def doctor(context: DoctorContext) -> Report:
        seen.append(context)
        return doctor_report()

    fake_hub.on_request = on_request
    deps = Deps(**{**deps.__dict__, "run_doctor": doctor})
    code, out, err = invoke(deps, root, "install", "--profile", str(profile))
    assert code == 0, err
    target = root / MODELS_DIR.lstrip("/") / FILE
    assert target.is_file() and target.read_bytes() == fake_hub.repos[REPO][FILE]
    assert f"model {REPO}:Q4_K_M: pulling into {MODELS_DIR}" in out
    assert "SHA-256" in out and "checked" in out
    # the download came before any change: no useradd, no systemctl enable yet
    assert len(calls_at_download) == 1
    before = host.calls[: calls_at_download[0]]
    assert not any(c[0] == "useradd" or c[:2] == ("systemctl", "enable") for c in before)
    # doctor looked at the pulled file
    assert seen[0].model_path == target
    # the service's profile names the file install checked
    # the user did not exist while pulling: the file is given to it once it does
    assert_the_service_gets(root, host, target, "Q4_K_M")

    host.calls.clear()
    gets = len(fake_hub.gets())
    code, out, err = invoke(deps, root, "install", "--profile", str(profile))
    assert code == 0, err
    assert "pulled already" in out and len(fake_hub.gets()) == gets
    assert "already installed and up to date" in out


def test_an_existing_user_gets_the_file_at_once(
    setup: tuple[Path, Path], fake_hub: FakeHub, host: FakeHost, deps: Deps
) -> None:
    root, profile = setup
    host.users["orin-llm"] = {"video", "render"}
    code, _, err = invoke(deps, root, "install", "--profile", str(profile), "--no-start")
    assert code == 0, err
    target = root / MODELS_DIR.lstrip("/") / FILE
    assert host.changes()[0] == ("chown", "orin-llm:", str(target))


def test_dry_run_does_not_download(
    setup: tuple[Path, Path], fake_hub: FakeHub, host: FakeHost, deps: Deps
) -> None:
    root, profile = setup
    code, _, err = invoke(deps, root, "install", "--profile", str(profile), "--dry-run")
    assert code == 1
    assert f"sudo orin-llm model pull {REPO}:Q4_K_M" in err
    assert fake_hub.gets() == [] and host.changes() == []


def test_a_refused_checksum_stops_install(
    setup: tuple[Path, Path], fake_hub: FakeHub, host: FakeHost, deps: Deps
) -> None:
    root, profile = setup
    fake_hub.sha_override[f"{REPO}/{FILE}"] = "0" * 64
    code, _, err = invoke(deps, root, "install", "--profile", str(profile))
    assert code == 9 and "refused and deleted" in err
    assert host.changes() == []
    models = root / MODELS_DIR.lstrip("/")
    assert [p for p in models.rglob("*") if p.is_file()] == []


def test_install_prints_the_doctor_summary_it_acted_on(
    root: Path, host: FakeHost, deps: Deps, report: list[Report]
) -> None:
    from orin.doctor.findings import Finding

    report[0] = doctor_report(
        Finding("model-file", "ok", "fine"),
        Finding("swap", "warn", "zram is off"),
        Finding("power-mode", "info", "MAXN"),
    )
    code, out, err = invoke(deps, root, "install", "--profile", "llama3.1-8b-q4_k_m")
    assert code == 0, err
    assert "doctor: 1 ok, 1 info, 1 warn" in out
    assert "  warn swap: zram is off" in out
    assert "power-mode" not in out
