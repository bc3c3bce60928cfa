"""tune system --apply stopped part-way by SIGTERM (systemd stopping the tuning unit)
or Ctrl-C: the state file records what was changed, so --revert can restore it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from orin.cli.app import app
from orin.cli.deps import Deps
from orin.system.commands import CommandResult
from orin.system.root import SysRoot
from orin.system.statefile import DEFAULT_STATE_PATH, StateFile
from tests.fakes.boards_system import CUDA_BUILD, FakeJetson, agx_orin_64gb_jp6

REPO = Path(__file__).resolve().parents[3]
PROFILE = """\
name: board-test
system:
  swappiness: 10
  power_mode: 0
  lock_clocks: true
  disable_zram: true
"""


def board_deps(fake: FakeJetson) -> Deps:
    return Deps(runner=fake.runner, effective_uid=lambda: 0, build_info=lambda: CUDA_BUILD)


def stopped_at_swapoff(base: str, profile: str, ready_fd: int) -> None:
    """The child process: ``tune system --apply`` on a fake AGX Orin whose ``swapoff
    /dev/zram0`` does its work, tells the parent on ``ready_fd`` and waits for a signal."""
    fake = agx_orin_64gb_jp6(Path(base))
    swapoff = fake.runner.answers[("swapoff",)]
    assert callable(swapoff)

    def answer(args: tuple[str, ...]) -> CommandResult:
        result = swapoff(args)
        os.write(ready_fd, b"swapped off\n")
        os.close(ready_fd)
        signal.pause()  # until the parent's SIGTERM
        return result

    fake.runner.answers[("swapoff", "/dev/zram0")] = answer
    args = ["tune", "system", "--apply", "--profile", profile, "--root", base]
    app(args, prog_name="orin-llm", obj=board_deps(fake))


def test_sigterm_during_apply_records_what_was_changed(tmp_path: Path) -> None:
    """systemd stops the boot-time tuning unit (or its start times out) while zram is
    half switched off: the process used to die on the spot, zram was never recorded and
    --revert could not bring the service and its swap back."""
    base, profile = tmp_path / "board", tmp_path / "board-test.yaml"
    profile.write_text(PROFILE)
    read, write = os.pipe()
    code = (
        "from tests.unit.system.test_stopped_apply import stopped_at_swapoff; "
        f"stopped_at_swapoff({str(base)!r}, {str(profile)!r}, {write})"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        pass_fds=(write,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    os.close(write)
    with os.fdopen(read, "rb") as ready:
        assert ready.readline() == b"swapped off\n"  # empty: the child ended before
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=120)
    state = StateFile(SysRoot(base))
    assert child.returncode == 143, err.decode()  # 128 + SIGTERM, as for Ctrl-C's 130
    assert err.decode().splitlines()[-1] == (
        f"orin-llm: --apply stopped by SIGTERM; {state.location} lists swappiness, zram: "
        "tune system --revert restores them"
    )
    entries = state.entries()
    assert list(entries) == ["swappiness", "zram"]
    assert entries["zram"].saved["service"] == "enabled"


def test_ctrl_c_during_apply_says_what_to_revert(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    profile = tmp_path / "board-test.yaml"
    profile.write_text(PROFILE)

    def interrupt(args: tuple[str, ...]) -> CommandResult:
        raise KeyboardInterrupt

    fake.runner.answers[("nvpmodel", "-m", "0")] = interrupt
    root = str(fake.board.base)
    result = CliRunner().invoke(
        app,
        ["tune", "system", "--apply", "--profile", str(profile), "--root", root],
        obj=board_deps(fake),
    )
    location = fake.board.root.path(DEFAULT_STATE_PATH)
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines()[-1] == (
        f"orin-llm: --apply stopped by Ctrl-C; {location} lists swappiness, zram, "
        "power-mode: tune system --revert restores them"
    )
    fake.runner.answers.pop(("nvpmodel", "-m", "0"))
    result = CliRunner().invoke(
        app, ["tune", "system", "--revert", "--root", root], obj=board_deps(fake)
    )
    assert result.exit_code == 0, result.output
    assert "restored: power-mode, zram, swappiness" in result.stdout
    assert (fake.mode, fake.zram_service, len(fake.zram)) == (2, "enabled", 2)
