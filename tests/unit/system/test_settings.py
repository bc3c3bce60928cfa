"""Each setting's plan: current value, target and the exact steps, on the fake boards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orin.profile.board import board_settings
from orin.profile.schema import Profile
from orin.system.actions import Action
from orin.system.changes import board_context, plan_apply
from orin.system.loadmode import LoadSettings, mmap_policy
from orin.system.settings import (
    FASTEST,
    SYSCTL_FILE,
    BoardSettings,
    Change,
    SettingError,
    sysctl_text,
)
from orin.system.statefile import CLOCKS_STORE, ROOT_STATE_DIR, StateFile
from tests.fakes.boards_system import (
    FakeJetson,
    agx_orin_32gb_devkit_tree_jp6,
    agx_orin_32gb_jp5_tuned,
    agx_orin_64gb_jp6,
    nvpmodel_conf,
    orin_nano_8gb_jp6,
    x86_machine,
)

TUNED = {"swappiness": 10, "power_mode": 0, "lock_clocks": True, "disable_zram": True}


def profile(**system: Any) -> BoardSettings:
    return BoardSettings(**system)


def plan(fake: FakeJetson, settings: BoardSettings) -> dict[str, Change]:
    state = StateFile(fake.board.root)
    ctx = board_context(fake.board.root, fake.runner, settings, state)
    return {c.setting: c for c in plan_apply(ctx, state).changes}


def describe(change: Change) -> list[str]:
    return [a.describe() for a in change.actions]


def test_plan_on_stock_jetpack6(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    changes = plan(fake, profile(**TUNED))
    store = str(fake.board.root.path(CLOCKS_STORE))
    assert describe(changes["swappiness"]) == [
        "echo 10 > /proc/sys/vm/swappiness",
        f"write {SYSCTL_FILE} (2 lines)",
    ]
    assert changes["swappiness"].actions[1] == Action.write(SYSCTL_FILE, sysctl_text(10))
    assert describe(changes["zram"]) == [
        "systemctl disable --now nvzramconfig",
        "swapoff /dev/zram0",
        "swapoff /dev/zram1",
    ]
    assert describe(changes["power-mode"]) == ["nvpmodel -m 0"]
    assert (changes["power-mode"].current, changes["power-mode"].target) == (
        "MODE_30W (2)",
        "MAXN (0)",
    )
    assert "may need a reboot" in changes["power-mode"].note
    assert describe(changes["clocks"]) == [
        f"mkdir -p {ROOT_STATE_DIR}",
        f"jetson_clocks --store {store}",
        "jetson_clocks",
    ]
    for report_only in ("numa", "mmap", "drop-caches"):
        assert not changes[report_only].needed
    assert fake.changes() == []  # planning only reads


def test_plan_on_a_tuned_board_changes_nothing(tmp_path: Path) -> None:
    fake = agx_orin_32gb_jp5_tuned(tmp_path)
    changes = plan(fake, profile(**TUNED))
    assert [c.setting for c in changes.values() if c.needed] == []
    assert changes["clocks"].current == "locked"
    assert changes["zram"].current.startswith("0 zram swap device(s)")
    assert changes["power-mode"].note == "already in this mode"  # not a cap to lift


def test_plan_on_x86_reports_jetson_settings_as_absent(tmp_path: Path) -> None:
    board, runner = x86_machine(tmp_path)
    state = StateFile(board.root)
    ctx = board_context(board.root, runner, profile(**TUNED), state)
    changes = {c.setting: c for c in plan_apply(ctx, state).changes}
    assert [c.setting for c in changes.values() if c.needed] == ["swappiness"]
    assert changes["power-mode"].current == "not a Jetson"
    assert changes["clocks"].current == "not a Jetson"
    assert changes["mmap"].target == "load_mode=mmap"
    assert runner.calls == []


def test_profile_without_system_targets_plans_nothing(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    changes = plan(fake, profile(swappiness=None))
    assert [c.setting for c in changes.values() if c.needed] == []
    assert changes["swappiness"].note == "the profile leaves vm.swappiness unchanged"
    assert "system.lock_clocks" in changes["clocks"].note


def test_swappiness_already_set_but_not_persisted(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.board.write("/proc/sys/vm/swappiness", "10\n")
    change = plan(fake, profile(swappiness=10))["swappiness"]
    assert describe(change) == [f"write {SYSCTL_FILE} (2 lines)"]
    assert change.saved == {"value": 10, "sysctl_swappiness": None}


def test_power_mode_the_board_lacks_is_refused(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    with pytest.raises(SettingError, match=r"no mode 7 .*0 MAXN, 1 MODE_15W"):
        plan(fake, profile(power_mode=7))


def test_clocks_relocked_when_the_mode_changes(tmp_path: Path) -> None:
    """A mode switch resets the clocks, so a lock from before must be taken again."""
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.locked = True
    changes = plan(fake, profile(power_mode=0, lock_clocks=True))
    assert changes["clocks"].needed
    assert changes["power-mode"].saved["clocks_locked"] is True
    assert not plan(fake, profile(lock_clocks=True))["clocks"].needed


@pytest.mark.parametrize("power_mode", [None, 0, FASTEST])
def test_a_board_locked_by_jetson_clocks_plans_no_clock_steps(
    tmp_path: Path, power_mode: int | str | None
) -> None:
    """The real --show of a locked board (EMC min at its floor) counts as locked; a
    profile that asks for the mode the board is in (by id, or as ``fastest``) switches
    nothing, so the lock stays, not stored as orin-llm's."""
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.mode = 0  # MAXN, this board's fastest
    fake.locked = True  # jetson_clocks run by hand (or by jtop) before orin-llm
    change = plan(fake, profile(lock_clocks=True, power_mode=power_mode))["clocks"]
    assert (change.current, change.target, change.needed) == ("locked", "locked", False)
    assert change.note == "already locked (jetson_clocks --show): no steps"
    assert change.saved == {}  # nothing recorded: revert leaves their lock alone


def test_a_gpu_only_reading_does_not_skip_the_lock(tmp_path: Path) -> None:
    """Without jetson_clocks --show, a GPU at min = max says nothing about CPU and EMC."""
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.fail[("jetson_clocks", "--show")] = "jetson_clocks: must be run as root"
    fake.board.write("/sys/class/devfreq/17000000.gpu/min_freq", "1300500000\n")
    change = plan(fake, profile(lock_clocks=True))["clocks"]
    assert change.current == "locked" and describe(change)[-1] == "jetson_clocks"


def test_numa_report_against_the_node_count(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    p = BoardSettings(numa="distribute")
    numa = plan(fake, p)["numa"]
    assert not numa.needed
    assert numa.current == "1 node(s)" and "changes nothing" in numa.note
    fake.board.write("/sys/devices/system/node/node1/cpulist", "6-11")
    assert "llama_numa_init" in plan(fake, p)["numa"].note


def test_drop_caches_is_one_shot(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    change = plan(fake, profile(drop_caches=True))["drop-caches"]
    assert describe(change) == ["sync", "echo 3 > /proc/sys/vm/drop_caches"]
    assert not change.revertible


@pytest.mark.parametrize(
    ("engine", "system", "unified", "n_layer", "offload", "mode"),
    [
        ({}, {}, True, None, None, "none"),  # all layers on the iGPU: no mmap
        ({}, {}, False, None, None, "mmap"),  # discrete GPU or CPU: mapping costs nothing
        ({"gpu_layers": 10}, {}, True, 32, None, "mmap"),  # CPU layers read the mapping
        ({"gpu_layers": 33}, {}, True, 32, None, "none"),  # 32 layers + output: all offloaded
        ({}, {}, True, None, False, "mmap"),  # CPU-only build: nothing offloads
        ({}, {"mmap": "on"}, True, None, None, "mmap"),
        ({"gpu_layers": 0}, {"mmap": "off"}, False, None, None, "none"),
        ({"load_mode": "direct_io"}, {}, True, None, None, "direct_io"),
    ],
)
def test_mmap_policy(
    engine: dict[str, Any],
    system: dict[str, Any],
    unified: bool,
    n_layer: int | None,
    offload: bool | None,
    mode: str,
) -> None:
    assert (
        mmap_policy(LoadSettings(**engine, **system), unified, n_layer, offload).load_mode == mode
    )


def test_zram_not_installed_plans_only_swapoff(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.zram_service = "not-found"
    change = plan(fake, profile(disable_zram=True))["zram"]
    assert describe(change) == ["swapoff /dev/zram0", "swapoff /dev/zram1"]
    assert change.saved["service"] is None


def test_default_board_settings_change_nothing(tmp_path: Path) -> None:
    changes = plan(agx_orin_64gb_jp6(tmp_path), BoardSettings())
    assert [c.setting for c in changes.values() if c.needed] == []


def test_board_settings_from_a_profile() -> None:
    """The board layer gets a profile's system section and engine load/NUMA fields."""
    p = Profile(
        name="t",
        system={"swappiness": 5, "power_mode": 0, "lock_clocks": True, "mmap": "on"},
        engine={"numa": "distribute", "gpu_layers": 10, "load_mode": "mlock"},
    )
    assert board_settings(p) == BoardSettings(
        swappiness=5,
        power_mode=0,
        lock_clocks=True,
        numa="distribute",
        load=LoadSettings(load_mode="mlock", mmap="on", gpu_layers=10),
    )
    assert board_settings(Profile(name="d")).swappiness == 10  # the schema's default


def test_a_mode_0_that_is_not_the_boards_fastest_is_noted(tmp_path: Path) -> None:
    """A profile written for an AGX Orin (power_mode: 0, MAXN there) on an Orin Nano with
    JetPack 6.2, where mode 0 is 15W and MAXN_SUPER is 2: planned as asked, and said."""
    fake = orin_nano_8gb_jp6(tmp_path, super_modes=True, mode=1)
    change = plan(fake, profile(power_mode=0))["power-mode"]
    assert (change.current, change.target) == ("25W (1)", "15W (0)")
    assert describe(change) == ["nvpmodel -m 0"]
    assert change.note.endswith(
        "; 15W (0) is not this board's fastest mode: that is MAXN_SUPER (system.power_mode: 2)"
    )
    assert "fastest" not in plan(fake, profile(power_mode=2))["power-mode"].note


@pytest.mark.parametrize(
    ("board", "mode", "target", "actions"),
    [
        (lambda p: orin_nano_8gb_jp6(p, super_modes=True, mode=1), 1, "MAXN_SUPER (2)", ["2"]),
        (lambda p: orin_nano_8gb_jp6(p, super_modes=False, mode=1), 1, "15W (0)", ["0"]),
        (lambda p: orin_nano_8gb_jp6(p, super_modes=True, mode=2), 2, "MAXN_SUPER (2)", []),
        (agx_orin_64gb_jp6, None, "MAXN (0)", ["0"]),
    ],
)
def test_fastest_is_the_boards_own_fastest_mode(
    tmp_path: Path, board: Any, mode: int | None, target: str, actions: list[str]
) -> None:
    """power_mode: fastest plans the switch to the mode the board's nvpmodel table says is
    fastest: one profile for an AGX Orin and an Orin Nano alike."""
    fake = board(tmp_path)
    change = plan(fake, profile(power_mode=FASTEST))["power-mode"]
    assert change.target == target
    assert describe(change) == [f"nvpmodel -m {m}" for m in actions]
    assert "not this board's fastest" not in change.note


def test_fastest_without_a_mode_table_is_skipped_not_guessed(tmp_path: Path) -> None:
    fake = orin_nano_8gb_jp6(tmp_path, mode=1)
    fake.board.write("/etc/nvpmodel.conf", nvpmodel_conf({0: "MODE_A", 1: "MODE_B"}, 1))
    change = plan(fake, profile(power_mode=FASTEST))["power-mode"]
    assert describe(change) == []
    assert "fastest mode is unknown" in change.note
    assert change.note.endswith("set system.power_mode to a mode id")
    # without a table of its own, a known module's table is used
    devkit = plan(agx_orin_32gb_devkit_tree_jp6(tmp_path / "devkit"), profile(power_mode=FASTEST))
    assert describe(devkit["power-mode"]) == ["nvpmodel -m 0"]


def test_a_profile_takes_fastest_and_refuses_other_words(tmp_path: Path) -> None:
    assert board_settings(Profile(name="t", system={"power_mode": "fastest"})).power_mode == (
        FASTEST
    )
    with pytest.raises(ValueError, match="power_mode"):
        Profile(name="t", system={"power_mode": "maxn"})
