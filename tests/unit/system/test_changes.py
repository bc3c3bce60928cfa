"""apply / revert as a transaction: exact commands, the state file, rollback, root, idempotence."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orin.system.changes import (
    ApplyError,
    RevertError,
    RootRequiredError,
    apply_plan,
    board_context,
    plan_apply,
    plan_revert,
    revert_plan,
)
from orin.system.commands import CommandResult
from orin.system.platform import detect
from orin.system.settings import (
    FASTEST,
    SYSCTL_FILE,
    BoardSettings,
    SettingError,
    sysctl_text,
)
from orin.system.statefile import (
    CLOCKS_STORE,
    DEFAULT_STATE_PATH,
    LEGACY_STATE_PATH,
    ROOT_STATE_DIR,
    StateEntry,
    StateError,
    StateFile,
    UnsafeStateError,
)
from tests.fakes.boards_system import FakeJetson, agx_orin_64gb_jp6, x86_machine

TUNED = BoardSettings(swappiness=10, power_mode=0, lock_clocks=True, disable_zram=True)


def root_uid() -> int:
    return 0


def user_uid() -> int:
    return 1000


def apply(
    fake: FakeJetson, settings: BoardSettings = TUNED, uid: Any = root_uid
) -> tuple[str, ...]:
    state = StateFile(fake.board.root)
    ctx = board_context(fake.board.root, fake.runner, settings, state)
    return apply_plan(ctx, plan_apply(ctx, state), state, uid)


def revert(fake: FakeJetson, uid: Any = root_uid) -> tuple[str, ...]:
    state = StateFile(fake.board.root)
    ctx = board_context(fake.board.root, fake.runner, TUNED, state)
    return revert_plan(ctx, plan_revert(ctx, state), state, uid)


def restore_calls(store: str) -> list[tuple[str, ...]]:
    """What reverting the TUNED settings on the JetPack 6 board runs, in order."""
    return [
        ("jetson_clocks", "--restore", store),
        ("nvpmodel", "-m", "2"),
        ("systemctl", "enable", "nvzramconfig"),
        ("swapon", "-p", "5", "/dev/zram0"),
        ("swapon", "-p", "5", "/dev/zram1"),
    ]


def board_values(fake: FakeJetson) -> dict[str, Any]:
    root = fake.board.root
    return {
        "swappiness": (root.read_text("/proc/sys/vm/swappiness") or "").strip(),
        "sysctl_file": root.read_text(SYSCTL_FILE),
        "mode": fake.mode,
        "locked": fake.locked,
        "zram_service": fake.zram_service,
        "zram": sorted(fake.zram),
    }


def test_apply_runs_the_exact_commands_and_records_the_state(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    store = str(fake.board.root.path(CLOCKS_STORE))
    assert apply(fake) == ("swappiness", "zram", "power-mode", "clocks")
    assert fake.changes() == [
        ("systemctl", "disable", "--now", "nvzramconfig"),
        ("swapoff", "/dev/zram0"),
        ("swapoff", "/dev/zram1"),
        ("nvpmodel", "-m", "0"),
        ("jetson_clocks", "--store", store),
        ("jetson_clocks",),
    ]
    assert board_values(fake) == {
        "swappiness": "10",
        "sysctl_file": sysctl_text(10),
        "mode": 0,
        "locked": True,
        "zram_service": "disabled",
        "zram": [],
    }
    doc = json.loads(fake.board.root.path(DEFAULT_STATE_PATH).read_text())
    saved = {e["setting"]: e["saved"] for e in doc["settings"]}
    assert saved["swappiness"] == {"value": 60, "sysctl_swappiness": None}
    assert saved["power-mode"] == {"mode_id": 2, "name": "MODE_30W", "clocks_locked": False}
    assert saved["zram"]["service"] == "enabled"
    assert detect(fake.board.root, fake.runner).describe().endswith("MAXN")


@pytest.mark.parametrize("power_mode", [0, FASTEST])
def test_applying_twice_is_a_no_op(tmp_path: Path, power_mode: int | str) -> None:
    """Also with the built-in profiles' ``power_mode: fastest``: a board already in its
    fastest mode keeps the lock it has (no jetson_clocks at every apply)."""
    fake = agx_orin_64gb_jp6(tmp_path)
    settings = replace(TUNED, power_mode=power_mode)
    apply(fake, settings)
    state_before = fake.board.root.path(DEFAULT_STATE_PATH).read_text()
    fake.runner.calls.clear()
    assert apply(fake, settings, uid=user_uid) == ()  # nothing to do: not even root is needed
    assert fake.changes() == []
    assert fake.board.root.path(DEFAULT_STATE_PATH).read_text() == state_before


def test_revert_after_a_reboot_restores_zram(tmp_path: Path) -> None:
    """With nvzramconfig disabled the next boot sets up no zram device, so there is
    nothing to swap on: the service, enabled and started again, sets them up as it
    does at boot. A swapon of the vanished devices failed, and the setting stayed in
    the state file whatever --revert was run again."""
    fake = agx_orin_64gb_jp6(tmp_path)
    before = board_values(fake)
    apply(fake)
    fake.reboot()
    assert fake.zram == {} and fake.mode == 0 and not fake.locked
    fake.runner.calls.clear()
    store = str(fake.board.root.path(CLOCKS_STORE))
    assert revert(fake) == ("clocks", "power-mode", "zram", "swappiness")
    assert fake.changes() == [
        ("jetson_clocks", "--restore", store),
        ("nvpmodel", "-m", "2"),
        ("systemctl", "enable", "--now", "nvzramconfig"),
    ]
    assert board_values(fake) == before
    assert not fake.board.root.exists(DEFAULT_STATE_PATH)


def test_revert_restores_exactly_what_was_there(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    before = board_values(fake)
    apply(fake)
    fake.runner.calls.clear()
    store = str(fake.board.root.path(CLOCKS_STORE))
    assert revert(fake) == ("clocks", "power-mode", "zram", "swappiness")
    assert fake.changes() == restore_calls(store)
    assert board_values(fake) == before
    assert not fake.board.root.exists(DEFAULT_STATE_PATH)
    assert not fake.board.root.exists(CLOCKS_STORE)
    assert revert(fake) == ()  # nothing left to revert


def test_revert_restores_an_existing_sysctl_file(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.board.write(SYSCTL_FILE, "vm.swappiness = 30\n")
    apply(fake, BoardSettings(swappiness=10))
    assert fake.board.root.read_text(SYSCTL_FILE) == sysctl_text(10)
    revert(fake)
    assert fake.board.root.read_text(SYSCTL_FILE) == sysctl_text(30, restored=True)


def test_a_sysctl_file_with_other_settings_is_refused(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.board.write(SYSCTL_FILE, "vm.swappiness = 30\nkernel.panic = 10\n")
    with pytest.raises(SettingError, match=r"sets more than vm.swappiness \('kernel.panic"):
        apply(fake, BoardSettings(swappiness=10))
    assert fake.board.root.read_text("/proc/sys/vm/swappiness") == "60\n"


def test_reverting_a_locked_board_relocks_after_the_mode_switch(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.locked = True  # someone ran jetson_clocks in MODE_30W
    apply(fake)
    assert (fake.mode, fake.locked) == (0, True)
    revert(fake)
    assert (fake.mode, fake.locked) == (2, True)


def test_failure_half_way_reverts_what_was_applied(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    before = board_values(fake)
    fake.fail[("jetson_clocks",)] = "jetson_clocks: cannot write /sys/kernel/nvpmodel_emc_cap"
    with pytest.raises(ApplyError) as err:
        apply(fake)
    assert err.value.setting == "clocks"
    assert str(err.value) == (
        "clocks failed at `jetson_clocks`: exit status 1: jetson_clocks: cannot write "
        "/sys/kernel/nvpmodel_emc_cap; rolled back: clocks, power-mode, zram, swappiness"
    )
    store = str(fake.board.root.path(CLOCKS_STORE))
    assert fake.changes() == [
        ("systemctl", "disable", "--now", "nvzramconfig"),
        ("swapoff", "/dev/zram0"),
        ("swapoff", "/dev/zram1"),
        ("nvpmodel", "-m", "0"),
        ("jetson_clocks", "--store", store),
        ("jetson_clocks",),  # fails: from here on, the rollback
        *restore_calls(store),
    ]
    assert board_values(fake) == before
    assert not fake.board.root.exists(DEFAULT_STATE_PATH)
    assert not fake.board.root.exists(CLOCKS_STORE)


def test_failure_in_the_middle_of_a_setting_undoes_its_own_steps(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    before = board_values(fake)
    fake.fail[("swapoff", "/dev/zram1")] = "swapoff: /dev/zram1: Cannot allocate memory"
    with pytest.raises(ApplyError, match=r"zram failed at `swapoff /dev/zram1`: .*memory"):
        apply(fake)
    assert board_values(fake) == before  # zram0 is back on, the service enabled again
    assert ("swapon", "-p", "5", "/dev/zram0") in fake.calls


def test_a_mode_switch_that_needs_a_reboot_is_a_failure(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.mode_needs_reboot = True
    with pytest.raises(ApplyError, match=r"power-mode failed at `nvpmodel -m 0`: .*reboot"):
        apply(fake)
    assert fake.mode == 2 and fake.zram_service == "enabled"


def test_refused_without_root_naming_the_settings(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    with pytest.raises(RootRequiredError) as err:
        apply(fake, uid=user_uid)
    message = str(err.value)
    assert "needs root for: swappiness (echo 10 > /proc/sys/vm/swappiness)" in message
    assert "power-mode (nvpmodel -m 0)" in message and "sudo" in message
    store = fake.board.root.path(CLOCKS_STORE)
    assert f"clocks (jetson_clocks --store {store}); run it with sudo" in message
    assert fake.changes() == []
    assert board_values(fake)["swappiness"] == "60"


def test_revert_without_root_is_refused(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    apply(fake)
    with pytest.raises(RootRequiredError, match="--revert needs root for: clocks"):
        revert(fake, uid=user_uid)
    assert fake.mode == 0


def test_reapply_with_another_target_keeps_the_first_saved_value(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    apply(fake, BoardSettings(swappiness=10))
    apply(fake, BoardSettings(swappiness=5))
    entries = StateFile(fake.board.root).entries()
    assert entries["swappiness"].saved["value"] == 60
    assert entries["swappiness"].target == "5"
    revert(fake)
    assert board_values(fake)["swappiness"] == "60"


def test_drop_caches_runs_every_time_and_is_not_recorded(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    p = BoardSettings(drop_caches=True)
    assert apply(fake, p) == ("drop-caches",)
    assert fake.changes() == [("sync",)]
    assert fake.board.root.read_text("/proc/sys/vm/drop_caches") == "3\n"
    assert not fake.board.root.exists(DEFAULT_STATE_PATH)


def test_a_failed_revert_step_keeps_its_entry(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    apply(fake)
    fake.fail[("nvpmodel", "-m", "2")] = "NVPM ERROR: failed"
    with pytest.raises(RevertError, match="could not restore power-mode"):
        revert(fake)
    assert list(StateFile(fake.board.root).entries()) == ["power-mode"]


def test_x86_apply_sets_swappiness_only(tmp_path: Path) -> None:
    board, runner = x86_machine(tmp_path)
    state = StateFile(board.root)
    ctx = board_context(board.root, runner, TUNED, state)
    assert apply_plan(ctx, plan_apply(ctx, state), state, root_uid) == ("swappiness",)
    assert runner.calls == []
    assert board.root.read_text("/proc/sys/vm/swappiness") == "10\n"


def test_state_file_round_trip_and_corruption(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    state = StateFile(fake.board.root)
    assert state.load() == []
    state.record(StateEntry("swappiness", "10", {"value": 60, "sysctl_swappiness": None}))
    assert state.load()[0].saved["value"] == 60
    state.location.write_text("{not json")
    with pytest.raises(StateError, match="not an orin-llm state file"):
        state.load()


def test_rolled_back_reapply_keeps_the_first_stored_clocks(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    apply(fake)
    fake.locked = False  # someone changed the clocks since
    fake.fail[("sync",)] = "sync: I/O error"
    with_drop = replace(TUNED, drop_caches=True)
    with pytest.raises(ApplyError, match=r"rolled back: clocks$"):
        apply(fake, with_drop)
    assert fake.board.root.exists(CLOCKS_STORE)
    assert StateFile(fake.board.root).entries()["clocks"].saved["stored_before"] is False
    revert(fake)
    assert (fake.mode, fake.locked, fake.zram_service) == (2, False, "enabled")


# -- root reads back only what root wrote ---------------------------------------------

SERVICE_UID = 999  # the orin-llm system user


def tamper(path: Path) -> None:
    """What a write by the service user leaves: its file, or a file it may write."""
    if os.geteuid() == 0:
        os.chown(path, SERVICE_UID, SERVICE_UID)
    else:  # only root can give a file away; a file the user may write is as bad
        path.chmod(0o666)


def test_root_state_lives_in_a_folder_of_roots_own(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    old_umask = os.umask(0o002)  # a umask that would make folders group-writable
    try:
        apply(fake)
    finally:
        os.umask(old_umask)
    root = fake.board.root
    assert DEFAULT_STATE_PATH.startswith(ROOT_STATE_DIR + "/")
    assert CLOCKS_STORE.startswith(ROOT_STATE_DIR + "/")
    assert not ROOT_STATE_DIR.startswith("/var/lib/orin-llm/")  # not the service's folder
    assert root.path(ROOT_STATE_DIR).stat().st_mode & 0o777 == 0o700
    assert root.path(DEFAULT_STATE_PATH).stat().st_mode & 0o777 == 0o600
    assert root.untrusted_reason(DEFAULT_STATE_PATH) is None


def test_revert_refuses_state_the_service_user_tampered_with(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    apply(fake)
    state = fake.board.root.path(DEFAULT_STATE_PATH)
    doc = json.loads(state.read_text())
    doc["settings"][0]["saved"]["value"] = 200  # a valid value, but not root's
    state.write_text(json.dumps(doc))
    tamper(state)
    fake.runner.calls.clear()
    with pytest.raises(
        UnsafeStateError,
        match=r"not reading .*state\.json: .*(owned by uid 999|"
        r"writable by group or others)",
    ):
        revert(fake)
    assert fake.changes() == []
    assert fake.mode == 0 and fake.locked  # nothing was restored from it
    with pytest.raises(UnsafeStateError):  # nor applied on top of it (the boot unit)
        apply(fake)


def test_a_tampered_clocks_store_is_refused(tmp_path: Path) -> None:
    """jetson_clocks --restore writes, as root, whatever sysfs paths the file names."""
    fake = agx_orin_64gb_jp6(tmp_path)
    apply(fake)
    tamper(fake.board.root.path(CLOCKS_STORE))
    fake.runner.calls.clear()
    with pytest.raises(UnsafeStateError, match=r"jetson_clocks\.conf"):
        revert(fake)
    assert fake.changes() == []


@pytest.mark.parametrize("change", ["group-writable folder", "symlink"])
def test_a_folder_others_can_write_or_a_link_is_refused(tmp_path: Path, change: str) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    apply(fake, BoardSettings(swappiness=10))
    state = fake.board.root.path(DEFAULT_STATE_PATH)
    if change == "symlink":
        elsewhere = fake.board.root.path("/var/lib/orin-llm/state.json")
        elsewhere.parent.mkdir(parents=True)
        elsewhere.write_text(state.read_text())
        state.unlink()
        state.symlink_to(elsewhere)
    else:
        state.parent.chmod(0o770)  # e.g. the service user's group
    with pytest.raises(UnsafeStateError, match=r"symbolic link|writable by group or others"):
        revert(fake)
    assert fake.board.root.read_text("/proc/sys/vm/swappiness") == "10\n"


@pytest.mark.parametrize(
    ("setting", "key", "value"),
    [
        ("swappiness", "value", "60; reboot"),
        ("swappiness", "value", 201),
        ("swappiness", "sysctl_swappiness", "kernel.core_pattern=|/tmp/x"),
        ("clocks", "store", "/var/lib/orin-llm/jetson_clocks.conf"),
        ("zram", "devices", [{"path": "/dev/sda1", "priority": 5}]),
        ("power-mode", "mode_id", True),
        ("power-mode", "extra", 1),
    ],
)
def test_only_known_keys_with_checked_values_are_read(
    tmp_path: Path, setting: str, key: str, value: Any
) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    apply(fake)
    state = fake.board.root.path(DEFAULT_STATE_PATH)
    doc = json.loads(state.read_text())
    entry = next(e for e in doc["settings"] if e["setting"] == setting)
    entry["saved"][key] = value
    state.write_text(json.dumps(doc))
    fake.runner.calls.clear()
    with pytest.raises(StateError, match="not an orin-llm state file"):
        revert(fake)
    assert fake.changes() == []


def test_the_old_state_in_the_service_users_folder_is_not_read(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.board.write(LEGACY_STATE_PATH, '{"version": 1, "settings": []}')
    with pytest.raises(
        StateError, match=r"earlier orin-llm .* restore the settings it lists by hand"
    ):
        revert(fake)
    assert fake.changes() == []


def test_a_board_without_jetson_clocks_skips_the_lock_and_applies_the_rest(
    tmp_path: Path,
) -> None:
    """A minimal image without nvidia-l4t-tools: the lock is skipped in the plan, not
    planned as steps that fail and roll back everything else."""
    fake = agx_orin_64gb_jp6(tmp_path)
    del fake.runner.answers[("jetson_clocks",)]
    state = StateFile(fake.board.root)
    ctx = board_context(fake.board.root, fake.runner, TUNED, state)
    plan = plan_apply(ctx, state)
    clocks = next(c for c in plan.changes if c.setting == "clocks")
    assert clocks.actions == () and clocks.note.startswith("jetson_clocks is not installed")
    assert apply_plan(ctx, plan, state, root_uid) == ("swappiness", "zram", "power-mode")
    assert not any(c[0] == "jetson_clocks" for c in fake.changes())
    assert list(state.entries()) == ["swappiness", "zram", "power-mode"]


def test_a_clocks_store_that_fails_has_nothing_to_restore(tmp_path: Path) -> None:
    """Only root's folder was made before the store failed: the rollback runs no
    jetson_clocks --restore of a file that was never written."""
    fake = agx_orin_64gb_jp6(tmp_path)
    before = board_values(fake)
    store = str(fake.board.root.path(CLOCKS_STORE))
    fake.fail[("jetson_clocks", "--store", store)] = "jetson_clocks: cannot open store"
    with pytest.raises(ApplyError) as err:
        apply(fake)
    assert str(err.value) == (
        f"clocks failed at `jetson_clocks --store {store}`: exit status 1: jetson_clocks: "
        "cannot open store; rolled back: power-mode, zram, swappiness"
    )
    assert ("jetson_clocks", "--restore", store) not in fake.calls
    assert board_values(fake) == before
    assert not fake.board.root.exists(DEFAULT_STATE_PATH)


def interrupt_at(fake: FakeJetson, *argv: str) -> None:
    """Ctrl-C while ``argv`` runs (the program had finished its work)."""
    handler = fake.runner.answers[argv[:1]]

    def answer(args: tuple[str, ...]) -> CommandResult:
        assert callable(handler)
        handler(args)
        raise KeyboardInterrupt

    fake.runner.answers[argv] = answer


def test_an_apply_stopped_part_way_through_a_setting_can_be_reverted(tmp_path: Path) -> None:
    """Ctrl-C after nvzramconfig was disabled and one device swapped off: the values
    zram replaced are in the state file, so --revert brings back the service too (it
    was lost, and --revert said there was nothing saved)."""
    fake = agx_orin_64gb_jp6(tmp_path)
    before = board_values(fake)
    interrupt_at(fake, "swapoff", "/dev/zram0")
    with pytest.raises(KeyboardInterrupt):
        apply(fake)
    assert (fake.zram_service, sorted(fake.zram)) == ("disabled", ["/dev/zram1"])
    assert [e.setting for e in StateFile(fake.board.root).load()] == ["swappiness", "zram"]
    fake.runner.calls.clear()
    assert revert(fake) == ("zram", "swappiness")
    assert fake.changes() == [
        ("systemctl", "enable", "nvzramconfig"),
        ("swapon", "-p", "5", "/dev/zram0"),
    ]
    assert board_values(fake) == before


def test_an_apply_stopped_at_the_clocks_store_leaves_nothing_to_restore(tmp_path: Path) -> None:
    """No store, so no lock was taken (jetson_clocks runs after it): --revert clears the
    entry instead of failing at jetson_clocks --restore at every run."""
    fake = agx_orin_64gb_jp6(tmp_path)
    store = str(fake.board.root.path(CLOCKS_STORE))
    fake.runner.answers[("jetson_clocks", "--store", store)] = interrupt
    with pytest.raises(KeyboardInterrupt):
        apply(fake)
    assert not fake.locked and not fake.board.root.exists(CLOCKS_STORE)
    fake.runner.calls.clear()
    assert revert(fake) == ("clocks", "power-mode", "zram", "swappiness")
    assert ("jetson_clocks", "--restore", store) not in fake.calls
    assert not fake.board.root.exists(DEFAULT_STATE_PATH)


def interrupt(args: tuple[str, ...]) -> CommandResult:
    raise KeyboardInterrupt


def test_a_setting_its_rollback_cannot_undo_is_left_for_revert(tmp_path: Path) -> None:
    """The lock failed half-way and so did its restore: the clocks entry is recorded, as
    the error says, and --revert restores them once the cause is fixed."""
    fake = agx_orin_64gb_jp6(tmp_path)
    store = str(fake.board.root.path(CLOCKS_STORE))
    fake.fail[("jetson_clocks",)] = "jetson_clocks: EMC busy"
    fake.fail[("jetson_clocks", "--restore", store)] = "jetson_clocks: EMC busy"
    with pytest.raises(ApplyError) as err:
        apply(fake)
    message = str(err.value)
    assert "rolled back: power-mode, zram, swappiness; could not roll back clocks: " in message
    assert f"(still listed in {fake.board.root.path(DEFAULT_STATE_PATH)}" in message
    entries = StateFile(fake.board.root).entries()
    assert list(entries) == ["clocks"]
    assert entries["clocks"].saved == {"store": CLOCKS_STORE, "stored_before": False}
    fake.locked = True  # the failed lock left them pinned
    fake.fail.clear()
    assert revert(fake) == ("clocks",)
    assert not fake.locked and not fake.board.root.exists(CLOCKS_STORE)
    assert not fake.board.root.exists(DEFAULT_STATE_PATH)


def test_a_zram_rollback_swaps_on_only_what_was_swapped_off(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    before = board_values(fake)
    fake.fail[("swapoff", "/dev/zram1")] = "swapoff: /dev/zram1: Cannot allocate memory"
    with pytest.raises(ApplyError) as err:
        apply(fake)
    assert str(err.value).endswith("rolled back: zram, swappiness")  # swapon zram1 is EBUSY
    assert ("swapon", "-p", "5", "/dev/zram1") not in fake.calls
    assert board_values(fake) == before


def test_a_mode_switch_waiting_for_a_reboot_is_taken_back(tmp_path: Path) -> None:
    """nvpmodel keeps a mode that needs a reboot for the next boot: the rollback switches
    back, so no reboot puts the board in a mode the state file does not list."""
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.mode_needs_reboot = True
    with pytest.raises(ApplyError) as err:
        apply(fake)
    assert str(err.value).endswith("rolled back: power-mode, zram, swappiness")
    assert fake.changes()[3:5] == [("nvpmodel", "-m", "0"), ("nvpmodel", "-m", "2")]
    assert (fake.mode, fake.pending_mode) == (2, None)
    assert not fake.board.root.exists(DEFAULT_STATE_PATH)
