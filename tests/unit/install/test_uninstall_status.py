"""orin-llm uninstall and status, and reading TTFT/TPOT back from a real /metrics body."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from orin.cli.deps import Deps
from orin.engine.types import RequestTimings
from orin.install.layout import SERVICE, TUNE_SERVICE
from orin.install.probe import HttpResult
from orin.install.status import histogram_quantile, parse_latency
from orin.server.metrics import ServerMetrics
from tests.fakes.host import FakeHost
from tests.unit.install.conftest import EXECUTABLE
from tests.unit.install.test_install import PROFILE, UNIT_DIR, invoke


def installed(deps: Deps, root: Path, host: FakeHost) -> None:
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 0, err
    host.calls.clear()


def test_uninstall_keeps_models_and_state(root: Path, host: FakeHost, deps: Deps) -> None:
    installed(deps, root, host)
    code, out, err = invoke(deps, root, "uninstall")
    assert code == 0, err
    assert host.changes() == [
        ("systemctl", "disable", "--now", TUNE_SERVICE, SERVICE),
        ("systemctl", "daemon-reload"),
    ]
    assert not (root / UNIT_DIR.lstrip("/") / SERVICE).exists()
    assert (root / "var/lib/orin-llm/models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf").is_file()
    assert (root / "etc/orin-llm/profile.yaml").is_file()
    assert "kept /etc/orin-llm, /var/lib/orin-llm" in out
    assert "orin-llm" in host.users


def test_uninstall_purge_reverts_tuning_and_removes_everything(
    root: Path, host: FakeHost, deps: Deps
) -> None:
    installed(deps, root, host)
    (root / "var/lib/orin-llm-root").mkdir(mode=0o700)
    (root / "var/lib/orin-llm-root/state.json").write_text("{}")
    (root / "var/cache/orin-llm").mkdir(parents=True)
    code, out, err = invoke(deps, root, "uninstall", "--purge")
    assert code == 0, err
    assert host.changes() == [
        ("systemctl", "disable", "--now", TUNE_SERVICE, SERVICE),
        ("systemctl", "daemon-reload"),
        (EXECUTABLE, "tune", "system", "--revert"),
        ("userdel", "orin-llm"),
    ]
    assert out.index("tune system --revert") < out.index("rm -rf /var/lib/orin-llm-root")
    for gone in ("etc/orin-llm", "var/lib/orin-llm", "var/lib/orin-llm-root", "var/cache/orin-llm"):
        assert not (root / gone).exists(), gone
    assert "orin-llm" not in host.users


def test_uninstall_purge_never_removes_root(root: Path, host: FakeHost, deps: Deps) -> None:
    """A server unit edited by hand to run as root: purge removes the units and the data,
    not the root account."""
    installed(deps, root, host)
    unit = root / UNIT_DIR.lstrip("/") / SERVICE
    unit.write_text(unit.read_text().replace("User=orin-llm", "User=root"))
    host.users["root"] = set()
    code, out, err = invoke(deps, root, "uninstall", "--purge")
    assert code == 0, err
    assert not any(c[0] == "userdel" for c in host.changes())
    assert "userdel" not in out and "root" in host.users


def test_uninstall_dry_run_and_nothing_installed(root: Path, host: FakeHost, deps: Deps) -> None:
    installed(deps, root, host)
    code, out, _ = invoke(deps, root, "uninstall", "--purge", "--dry-run")
    assert code == 0 and host.changes() == []
    assert "rm -rf /var/lib/orin-llm" in out and (root / "var/lib/orin-llm").is_dir()
    assert invoke(deps, root, "uninstall")[0] == 0
    code, out, _ = invoke(deps, root, "uninstall")
    assert code == 0 and "not installed: nothing to remove" in out
    code, out, _ = invoke(deps, root, "uninstall", "--dry-run")
    assert code == 0 and out.strip() == "not installed: nothing to remove"


def metrics_body() -> str:
    m = ServerMetrics(4, 4096, "m", CollectorRegistry())
    for ttft_ms, tpot_ms in ((100.0, 40.0), (200.0, 45.0), (300.0, 50.0), (4000.0, 60.0)):
        m.on_finish(
            "r",
            "stop",
            RequestTimings(
                prompt_tokens=10,
                cached_tokens=0,
                generated_tokens=5,
                context_shifts=0,
                queue_ms=1.0,
                prefill_ms=ttft_ms - 1.0,
                ttft_ms=ttft_ms,
                tpot_ms=tpot_ms,
                e2e_ms=ttft_ms + 4 * tpot_ms,
                itl_ms=(tpot_ms,) * 4,
            ),
        )
    return m.render()[0].decode()


def test_latency_from_a_real_metrics_body() -> None:
    lat = parse_latency(metrics_body())
    assert lat["ttft"].count == 4
    assert math.isclose(lat["ttft"].mean_s or 0, 1.15)
    # ranks 2 of 4 falls in (0.15, 0.2]: histogram_quantile interpolates to the bound
    assert math.isclose(lat["ttft"].p50_s or 0, 0.2)
    assert 3.0 < (lat["ttft"].p95_s or 0) <= 5.0
    assert math.isclose(lat["tpot"].mean_s or 0, 0.04875)
    assert 0.045 < (lat["tpot"].p95_s or 0) <= 0.06


def test_histogram_quantile_edges() -> None:
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.5, [(1.0, 2.0), (2.0, 4.0), (math.inf, 4.0)]) == 1.0
    assert histogram_quantile(0.99, [(1.0, 0.0), (math.inf, 5.0)]) == 1.0  # overflow bucket


def test_status_shows_units_health_and_latency(
    root: Path,
    host: FakeHost,
    deps: Deps,
    health: list[HttpResult],
) -> None:
    installed(deps, root, host)
    body = metrics_body()

    def get(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
        assert url.startswith("http://127.0.0.1:8080/")
        return HttpResult(200, body if url.endswith("/metrics") else '{"status": "ok"}')

    serving = dataclasses.replace(deps, http_get=get)
    code, out, err = invoke(serving, root, "status")
    assert code == 0, err
    assert "orin-llm.service" in out and "active/running" in out
    assert "TTFT" in out and "TPOT" in out and "200.0 ms" in out
    code, out, _ = invoke(serving, root, "status", "--json")
    data = json.loads(out)
    assert data["healthy"] and data["latency"]["ttft"]["count"] == 4
    assert host.changes() == []


def test_status_of_the_service_without_its_key_says_the_latency_was_refused(
    root: Path, host: FakeHost, deps: Deps
) -> None:
    installed(deps, root, host)

    def get(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
        if url.endswith("/metrics"):
            return HttpResult(401, '{"error": {"code": "invalid_api_key"}}')
        return HttpResult(200, '{"status": "ok"}')

    code, out, err = invoke(dataclasses.replace(deps, http_get=get), root, "status")
    assert code == 0  # the service is healthy; only its latency was not readable
    assert "active/running" in out and "-> 200" in out and "latency" not in out
    assert "refused the request (401)" in err


def test_status_reads_the_port_with_serves_precedence(
    root: Path, host: FakeHost, deps: Deps
) -> None:
    installed(deps, root, host)
    env = root / "etc/orin-llm/orin-llm.env"
    env.write_text(env.read_text() + "ORIN_LLM_PORT=8181\nORIN_LLM_HOST=0.0.0.0\n")
    seen: list[str] = []

    def get(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
        seen.append(url)
        return HttpResult(None, error="connection refused")

    code, out, _ = invoke(dataclasses.replace(deps, http_get=get), root, "status")
    assert code == 1
    assert seen == ["http://127.0.0.1:8181/health"]
    assert "health: nothing answers at http://127.0.0.1:8181: connection refused" in out


@pytest.mark.parametrize(
    ("dropins", "port"),
    [
        ({"override.conf": "[Service]\nEnvironment=ORIN_LLM_PORT=8282\n"}, 8282),
        (
            {
                "override.conf": "[Service]\n"
                'Environment="ORIN_LLM_HOST=0.0.0.0" ORIN_LLM_PORT=8282\n'
            },
            8282,
        ),
        (
            {
                "10-port.conf": "[Service]\nEnvironment=ORIN_LLM_PORT=8282\n",
                "override.conf": "[Service]\nExecStart=\nExecStart=/opt/orin-llm/venv/bin/orin-llm "
                "serve --profile /etc/orin-llm/profile.yaml --port=8383\n",
            },
            8383,
        ),
        ({"override.conf": "[Service]\nEnvironment=\n", "notes.txt": "Environment=X=1"}, 8080),
        # what systemd would not parse either is passed over, not a traceback
        ({"override.conf": '[Service]\nEnvironment="ORIN_LLM_PORT=8282\n'}, 8080),
        ({"override.conf": "[Service]\nExecStart=\nExecStart=/x serve '--port 8383\n"}, 8080),
    ],
)
def test_status_follows_the_drop_ins_systemctl_edit_writes(
    root: Path, host: FakeHost, deps: Deps, dropins: dict[str, str], port: int
) -> None:
    """Local changes belong in a drop-in (docs/install.md): a port set there is where
    the service listens, and where status must ask."""
    installed(deps, root, host)
    folder = root / "etc/systemd/system/orin-llm.service.d"
    folder.mkdir()
    for name, text in dropins.items():
        (folder / name).write_text(text)
    seen: list[str] = []

    def get(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
        seen.append(url)
        return HttpResult(None, error="connection refused")

    assert invoke(dataclasses.replace(deps, http_get=get), root, "status")[0] == 1
    assert seen == [f"http://127.0.0.1:{port}/health"]


def test_status_follows_the_drop_ins_of_every_unit_folder(
    root: Path, host: FakeHost, deps: Deps
) -> None:
    """``systemctl edit`` writes its drop-in under /etc/systemd/system whatever folder
    holds the unit, and a drop-in of the same name there hides one of /usr/lib's."""
    code, _, err = invoke(
        deps, root, "install", "--profile", PROFILE, "--unit-dir", "/usr/lib/systemd/system"
    )
    assert code == 0, err
    for folder, port in (("usr/lib", 8282), ("etc", 8383)):
        dropins = root / folder / "systemd/system/orin-llm.service.d"
        dropins.mkdir(parents=True)
        (dropins / "override.conf").write_text(f"[Service]\nEnvironment=ORIN_LLM_PORT={port}\n")
    seen: list[str] = []

    def get(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
        seen.append(url)
        return HttpResult(None, error="connection refused")

    args = ("status", "--unit-dir", "/usr/lib/systemd/system")
    assert invoke(dataclasses.replace(deps, http_get=get), root, *args)[0] == 1
    assert seen == ["http://127.0.0.1:8383/health"]


def test_status_when_not_installed(tmp_path: Path, host: FakeHost, deps: Deps) -> None:
    code, out, _ = invoke(deps, tmp_path, "status")
    assert code == 1
    assert "not installed" in out
