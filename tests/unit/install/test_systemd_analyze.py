"""systemd's own checks on the rendered units: `verify` passes, `security` exposure <= 3.0.

systemd-analyze reads the units from a fake root (--root) holding the rendered
files, the executable they name and a copy of the system's unit folder (for
the targets they refer to); systemd need not run as PID 1. Without
systemd-analyze (Debian's systemd package) the tests skip and say so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from orin.install.layout import SERVICE, TUNE_SERVICE
from orin.install.units import render_units
from tests.unit.install.conftest import EXECUTABLE
from tests.unit.install.test_units import PROFILES, config_for

ANALYZE = shutil.which("systemd-analyze")
SYSTEM_UNITS = next(
    (p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()),
    None,
)
MAX_EXPOSURE = 3.0
EXPOSURE = re.compile(r"Overall exposure level for \S+: (\d+(?:\.\d+)?) (\w+)")

pytestmark = pytest.mark.skipif(
    ANALYZE is None or SYSTEM_UNITS is None,
    reason="systemd-analyze not found: install Debian's systemd package (apt-get install systemd)",
)


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, timeout=60, check=False)


def unit_root(tmp_path: Path, profile_name: str, **overrides: object) -> Path:
    units = render_units(config_for(tmp_path / "board", profile_name, **overrides))
    root = tmp_path / "sysroot"
    assert SYSTEM_UNITS is not None
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    unit_dir = root / "etc/systemd/system"
    unit_dir.mkdir(parents=True)
    for name, text in units.items():
        (unit_dir / name).write_text(text)
    exe = root / EXECUTABLE.lstrip("/")
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return root


@pytest.mark.parametrize("profile_name", PROFILES)
def test_verify_passes_without_a_warning(tmp_path: Path, profile_name: str) -> None:
    root = unit_root(tmp_path, profile_name)
    r = analyze("verify", f"--root={root}", SERVICE, TUNE_SERVICE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_verify_passes_with_a_prompt_cache_folder_of_its_own(tmp_path: Path) -> None:
    root = unit_root(tmp_path, PROFILES[0], writable=("/srv/prompt cache",))
    assert (
        'ReadWritePaths="-/srv/prompt cache"' in (root / "etc/systemd/system" / SERVICE).read_text()
    )
    r = analyze("verify", f"--root={root}", SERVICE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_verify_would_catch_a_broken_unit(tmp_path: Path) -> None:
    root = unit_root(tmp_path, PROFILES[0])
    unit = root / "etc/systemd/system" / SERVICE
    unit.write_text(unit.read_text().replace("Type=notify", "Type=notfy"))
    r = analyze("verify", f"--root={root}", SERVICE)
    assert "Type=notfy" in r.stdout + r.stderr or "notfy" in r.stdout + r.stderr


def test_security_exposure_is_at_most_3(tmp_path: Path) -> None:
    help_text = analyze("security", "--help").stdout
    if "--offline" not in help_text:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    root = unit_root(tmp_path, PROFILES[0])
    r = analyze("security", f"--root={root}", "--offline=true", "--no-pager", SERVICE)
    match = EXPOSURE.search(r.stdout)
    assert match, r.stdout + r.stderr
    exposure, verdict = float(match.group(1)), match.group(2)
    print(f"systemd-analyze security {SERVICE}: exposure {exposure} {verdict}")
    assert exposure <= MAX_EXPOSURE, r.stdout
    assert verdict == "OK"
