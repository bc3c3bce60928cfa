"""orin-llm install through typer's CliRunner, on a fake root with a recording fake host."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from orin.cli.deps import Deps
from orin.doctor.findings import Finding
from orin.doctor.report import Report
from orin.install.layout import ENV_FILE, PROFILE_FILE, SERVICE, TUNE_SERVICE
from orin.install.probe import HttpResult
from orin.system.commands import CommandResult
from tests.fakes.board import FakeBoard
from tests.fakes.host import FakeHost
from tests.unit.install.conftest import EXECUTABLE, doctor_report, invoke

PROFILE = "llama3.1-8b-q4_k_m"
UNIT_DIR = "/etc/systemd/system"
FRESH_INSTALL = [
    (
        "useradd",
        "--system",
        "--user-group",
        "--home-dir",
        "/var/lib/orin-llm",
        "--no-create-home",
        "--shell",
        "/usr/sbin/nologin",
        "--groups",
        "video,render",
        "orin-llm",
    ),
    ("chown", "root:orin-llm", ENV_FILE),
    ("chmod", "0640", ENV_FILE),
    ("systemctl", "daemon-reload"),
    ("systemctl", "enable", "--now", "--no-block", TUNE_SERVICE, SERVICE),
]


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def test_fresh_install_runs_the_exact_steps(root: Path, host: FakeHost, deps: Deps) -> None:
    code, out, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 0, err
    assert host.changes() == FRESH_INSTALL
    for path in (PROFILE_FILE, ENV_FILE, f"{UNIT_DIR}/{SERVICE}", f"{UNIT_DIR}/{TUNE_SERVICE}"):
        assert (root / path.lstrip("/")).is_file(), path
    assert (root / "var/lib/orin-llm/models").is_dir()
    profile_copy = (root / PROFILE_FILE.lstrip("/")).read_text()
    assert "name: llama3.1-8b-q4_k_m" in profile_copy
    assert f"+++ {UNIT_DIR}/{SERVICE}" in out  # the diff against nothing installed
    assert "healthy after" in out


def test_dry_run_changes_nothing(root: Path, host: FakeHost, deps: Deps) -> None:
    before = snapshot(root)
    code, out, err = invoke(deps, root, "install", "--profile", PROFILE, "--dry-run")
    assert code == 0, err
    assert snapshot(root) == before
    assert host.changes() == []
    assert "dry run: nothing was changed" in out
    assert "step 1: useradd --system" in out
    assert "systemctl enable --now --no-block orin-llm-tune.service orin-llm.service" in out
    assert "ExecStart=/opt/orin-llm/venv/bin/orin-llm serve" in out  # the diff is shown


def test_second_install_is_a_noop(root: Path, host: FakeHost, deps: Deps) -> None:
    assert invoke(deps, root, "install", "--profile", PROFILE)[0] == 0
    host.calls.clear()
    before = snapshot(root)
    code, out, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 0, err
    assert host.changes() == []
    assert snapshot(root) == before
    assert "already installed and up to date" in out


@pytest.mark.parametrize("mode", [0o644, 0o660, 0o600])
def test_an_environment_file_others_can_read_gets_the_mode_of_a_new_one(
    root: Path, host: FakeHost, deps: Deps, mode: int
) -> None:
    """The environment file holds the API key and is kept as it is, but one made by
    hand (`sudo tee`: 0644) would leave the key readable by every user: install gives
    it root:orin-llm 0640, and a second install then plans nothing."""
    env = root / ENV_FILE.lstrip("/")
    env.parent.mkdir(parents=True)
    env.write_text("ORIN_LLM_API_KEY=secret\n")
    env.chmod(mode)
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 0, err
    secured = [("chown", "root:orin-llm", ENV_FILE), ("chmod", "0640", ENV_FILE)]
    assert all((c in host.changes()) == (mode != 0o600) for c in secured)
    assert env.read_text() == "ORIN_LLM_API_KEY=secret\n"  # the key is kept
    assert env.stat().st_mode & 0o777 == (0o640 if mode != 0o600 else 0o600)
    host.calls.clear()
    assert invoke(deps, root, "install", "--profile", PROFILE)[0] == 0
    assert host.changes() == []


def test_an_environment_file_another_group_can_read_goes_to_the_services_group(
    root: Path, host: FakeHost, deps: Deps
) -> None:
    """0640 but in another group (root:adm, root:users): that group's members could
    read the API key, and install left it so, since only the mode was checked."""
    host.users["orin-llm"] = {"video"}  # installed before: the service's group exists
    env = root / ENV_FILE.lstrip("/")
    env.parent.mkdir(parents=True)
    env.write_text("ORIN_LLM_API_KEY=secret\n")
    env.chmod(0o640)  # the test's own group, not the service's
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 0, err
    assert ("chown", "root:orin-llm", ENV_FILE) in host.changes()
    assert env.read_text() == "ORIN_LLM_API_KEY=secret\n"
    host.calls.clear()
    assert invoke(deps, root, "install", "--profile", PROFILE)[0] == 0
    assert host.changes() == []  # now in the service's group: nothing to do


def test_a_changed_port_rewrites_the_unit_and_restarts_both(
    root: Path, host: FakeHost, deps: Deps
) -> None:
    assert invoke(deps, root, "install", "--profile", PROFILE)[0] == 0
    host.calls.clear()
    code, out, err = invoke(deps, root, "install", "--profile", PROFILE, "--port", "9000")
    assert code == 0, err
    assert host.changes() == [
        ("systemctl", "daemon-reload"),
        ("systemctl", "restart", "--no-block", SERVICE),
    ]
    assert "+ExecStart=/opt/orin-llm/venv/bin/orin-llm serve --profile" in out
    assert "http://127.0.0.1:9000/health" in out


def test_failing_systemctl_is_reported_and_rolled_back(
    root: Path, host: FakeHost, deps: Deps
) -> None:
    host.fail_on[("systemctl", "enable")] = CommandResult(
        (), 1, "", "Failed to enable unit: Unit file orin-llm.service is masked.\nsecond line"
    )
    before = {p: v for p, v in snapshot(root).items() if "etc/" in p}
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 1
    assert "install failed at `systemctl enable --now --no-block" in err
    assert "Unit file orin-llm.service is masked." in err and "second line" in err
    for unit in (SERVICE, TUNE_SERVICE):
        assert not (root / UNIT_DIR.lstrip("/") / unit).exists()
    assert not (root / PROFILE_FILE.lstrip("/")).exists()
    assert {p: v for p, v in snapshot(root).items() if "etc/" in p and v is not None} == {
        p: v for p, v in before.items() if v is not None
    }
    assert host.changes()[-3:] == [
        ("systemctl", "enable", "--now", "--no-block", TUNE_SERVICE, SERVICE),
        ("systemctl", "disable", TUNE_SERVICE, SERVICE),
        ("systemctl", "daemon-reload"),
    ]
    assert "rolled back:" in err


def test_failure_before_enable_does_not_disable(root: Path, host: FakeHost, deps: Deps) -> None:
    host.fail_on[("chown",)] = CommandResult((), 1, "", "chown: invalid group: 'root:orin-llm'")
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 1 and "invalid group" in err
    assert not any(c[:2] == ("systemctl", "disable") for c in host.changes())
    assert not any(c[:2] == ("systemctl", "enable") for c in host.changes())
    assert not (root / UNIT_DIR.lstrip("/") / SERVICE).exists()


def test_failed_upgrade_restores_the_previous_units(root: Path, host: FakeHost, deps: Deps) -> None:
    assert invoke(deps, root, "install", "--profile", PROFILE)[0] == 0
    unit = root / UNIT_DIR.lstrip("/") / SERVICE
    old = unit.read_text()
    host.fail_on[("systemctl", "restart")] = CommandResult((), 1, "", "Job failed.")
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE, "--port", "9001")
    assert code == 1
    assert "Job failed." in err
    assert unit.read_text() == old
    assert ("systemctl", "disable", TUNE_SERVICE, SERVICE) not in host.changes()  # was enabled


def test_not_root_names_the_steps(root: Path, host: FakeHost, deps: Deps) -> None:
    user = dataclasses.replace(deps, effective_uid=lambda: 1000)
    before = snapshot(root)
    code, _, err = invoke(user, root, "install", "--profile", PROFILE)
    assert code == 1
    assert "install needs root for these steps:" in err
    assert "useradd --system" in err and "systemctl daemon-reload" in err
    assert f"write {UNIT_DIR}/{SERVICE}" in err
    assert "run it with sudo" in err
    assert host.changes() == [] and snapshot(root) == before


def test_doctor_fail_refuses_unless_forced(
    root: Path, host: FakeHost, deps: Deps, report: list[Report]
) -> None:
    report[0] = doctor_report(Finding("llama-build", "fail", "CPU-only build", fix="rebuild"))
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 1
    assert "doctor found problems" in err and "llama-build: CPU-only build" in err
    assert host.changes() == []
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE, "--force")
    assert code == 0, err
    assert "ignoring (--force)" in err


def test_a_dry_run_install_would_refuse_shows_the_plan_and_exits_as_install_would(
    root: Path, host: FakeHost, deps: Deps, report: list[Report]
) -> None:
    report[0] = doctor_report(Finding("llama-build", "fail", "CPU-only build", fix="rebuild"))
    before = snapshot(root)
    code, out, err = invoke(deps, root, "install", "--profile", PROFILE, "--dry-run")
    assert code == 1
    assert "install would refuse" in err and "llama-build: CPU-only build" in err
    assert "dry run: nothing was changed" in out and "step 1: useradd --system" in out
    assert host.changes() == [] and snapshot(root) == before
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE, "--dry-run", "--force")
    assert code == 0, err


@pytest.mark.parametrize("writable", ["venv", "package"])
def test_a_program_another_user_can_write_is_not_run_as_root_at_boot(
    root: Path, host: FakeHost, deps: Deps, writable: str
) -> None:
    """orin-llm-tune.service runs the program as root at every boot: a venv, or the
    checkout of an editable install, that another user can write would give that
    user root. Install refuses it unless forced, as a doctor fail."""
    package = "/home/dev/orin-llm/orin"
    doctored: list[object] = []

    def doctor(context: object) -> Report:
        doctored.append(context)
        return doctor_report()

    deps = dataclasses.replace(deps, orin_package=lambda: package, run_doctor=doctor)
    folder = root / (EXECUTABLE.rsplit("/", 1)[0] if writable == "venv" else package).lstrip("/")
    folder.mkdir(parents=True)
    (folder / "orin-llm").write_text("#!/bin/sh\n")
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE, "--dry-run")
    assert code == 0, err  # only root (here: the tree's owner) can write it
    folder.chmod(0o777)
    before = snapshot(root)
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 1
    assert "install found problems" in err
    assert f"root-program: {TUNE_SERVICE} would run" in err
    assert f"{folder.relative_to(root)} is writable by group or others (mode 0777)" in err
    assert host.changes() == [] and snapshot(root) == before
    doctored.clear()
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 1 and doctored == []  # refused before a model is pulled or checked
    code, out, err = invoke(deps, root, "install", "--profile", PROFILE, "--dry-run")
    assert code == 1 and "install would refuse" in err and "step 1: useradd" in out
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE, "--force")
    assert code == 0, err
    assert "ignoring (--force)" in err


@pytest.mark.parametrize(
    ("folder", "setting", "command"),
    [
        ("/srv/prompts", "-/srv/prompts", "/srv/prompts"),
        ("/srv/my prompts", '"-/srv/my prompts"', "'/srv/my prompts'"),  # pasted as it is
    ],
)
def test_a_prompt_cache_folder_of_its_own_is_writable_and_said(
    tmp_path: Path, root: Path, host: FakeHost, deps: Deps, folder: str, setting: str, command: str
) -> None:
    profile = tmp_path / "pc.yaml"
    model = "/var/lib/orin-llm/models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf"
    profile.write_text(
        f"name: pc\nmodel: {{path: {model}, quantization: Q4_K_M}}\n"
        f"prompt_cache: {{prompts: [You are a helpful assistant.], directory: {folder}}}\n"
    )
    code, out, err = invoke(deps, root, "install", "--profile", str(profile), "--dry-run")
    assert code == 0, err
    assert f"+ReadWritePaths={setting}" in out
    assert f"note: prompt_cache.directory {folder} is outside the service's own" in err
    assert f"sudo install -d -o orin-llm -g orin-llm -m 0700 {command})" in " ".join(err.split())


def test_running_service_excuses_memory_fit_and_port(
    root: Path, host: FakeHost, deps: Deps, report: list[Report]
) -> None:
    assert invoke(deps, root, "install", "--profile", PROFILE)[0] == 0
    report[0] = doctor_report(
        Finding("memory-fit", "fail", "the running server holds the memory"),
        Finding("port", "warn", "127.0.0.1:8080: already in use"),
    )
    assert invoke(deps, root, "install", "--profile", PROFILE)[0] == 0


def test_no_start_enables_without_starting_or_waiting(
    root: Path, host: FakeHost, deps: Deps
) -> None:
    code, out, err = invoke(deps, root, "install", "--profile", PROFILE, "--no-start")
    assert code == 0, err
    assert host.changes()[-1] == ("systemctl", "enable", TUNE_SERVICE, SERVICE)
    assert "waiting for" not in out


def test_unit_dir_and_user_options(root: Path, host: FakeHost, deps: Deps) -> None:
    args = ("install", "--profile", PROFILE, "--unit-dir", "/run/systemd/system", "--user", "llm")
    code, _, err = invoke(deps, root, *args)
    assert code == 0, err
    unit = (root / "run/systemd/system" / SERVICE).read_text()
    assert "User=llm" in unit
    assert host.changes()[0][-1] == "llm"


@pytest.mark.parametrize(
    ("user", "says"),
    [
        ("root", "runs as a user of its own"),
        ("llm service", "not a user name"),
        ("--help", "not a user name"),
        ("Orin", "not a user name"),
    ],
)
def test_a_user_the_unit_cannot_run_as_is_a_usage_error(
    root: Path, host: FakeHost, deps: Deps, user: str, says: str
) -> None:
    """Not root (the hardening would be for nothing, and `uninstall --purge` removes the
    user), nor a name useradd or User= would read as something else."""
    before = snapshot(root)
    for extra in ((), ("--dry-run",)):
        code, out, err = invoke(deps, root, "install", "--profile", PROFILE, "--user", user, *extra)
        assert code == 2 and says in err and out == ""
    assert host.changes() == [] and snapshot(root) == before


@pytest.mark.parametrize("command", ["install", "uninstall", "status", "install-rpc-worker"])
@pytest.mark.parametrize("folder", ["/tmp/units", "etc/systemd/system", "/etc/systemd"])
def test_a_unit_dir_systemd_does_not_load_units_from_is_a_usage_error(
    root: Path, host: FakeHost, deps: Deps, command: str, folder: str
) -> None:
    """A unit written elsewhere is not found by `systemctl enable`, and a relative
    folder would be taken from wherever the command runs: refused before anything
    is read or written."""
    before = snapshot(root)
    args = ("--host", "10.0.0.2") if command == "install-rpc-worker" else ()
    code, _, err = invoke(deps, root, command, *args, "--unit-dir", folder)
    assert code == 2
    assert "not a folder systemd loads units from" in err and "/etc/systemd/system" in err
    assert host.calls == [] and snapshot(root) == before
    code, _, err = invoke(deps, root, "status", "--unit-dir", "/etc/systemd/system/")
    assert "--unit-dir" not in err


def test_existing_user_missing_a_group_is_added(root: Path, host: FakeHost, deps: Deps) -> None:
    host.users["orin-llm"] = {"video"}
    assert invoke(deps, root, "install", "--profile", PROFILE)[0] == 0
    assert host.changes()[0] == ("usermod", "--append", "--groups", "render", "orin-llm")


def test_unhealthy_service_reports_the_journal(
    root: Path, host: FakeHost, deps: Deps, health: list[HttpResult]
) -> None:
    health[:] = [HttpResult(None, error="connection refused")]
    host.failed.add(SERVICE)
    host.journal = "orin-llm[7]: model file not found\n"
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 1
    assert "installed but not healthy" in err
    assert "model file not found" in err
    assert (root / UNIT_DIR.lstrip("/") / SERVICE).exists()  # the units stay: the service failed


def test_waits_while_the_model_loads(
    root: Path, host: FakeHost, deps: Deps, health: list[HttpResult]
) -> None:
    health[:] = [
        HttpResult(None, error="connection refused"),
        HttpResult(503, '{"status": "loading"}'),
        HttpResult(200, '{"status": "ok"}'),
    ]
    code, out, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 0, err
    assert 'healthy after 0 s: {"status": "ok"}' in out


def test_missing_model_is_a_clear_error(tmp_path: Path, host: FakeHost, deps: Deps) -> None:
    FakeBoard(tmp_path)  # systemd, and nothing else: no model
    code, _, err = invoke(deps, tmp_path, "install", "--profile", PROFILE)
    assert code == 3  # ModelFileError
    assert "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf: no such file" in err


def test_without_systemd_install_changes_nothing(root: Path, host: FakeHost, deps: Deps) -> None:
    (root / "run/systemd/system").rmdir()
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code != 0 and "systemd is not running on this machine" in err
    assert host.changes() == [] and not (root / "etc/orin-llm").exists()
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE, "--dry-run")
    assert code == 0, err  # a plan needs no systemd
