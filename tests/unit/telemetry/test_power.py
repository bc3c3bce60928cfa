"""The board's power from its rails: the input rail where the module has one."""

from __future__ import annotations

from pathlib import Path

import pytest

from orin.telemetry.phases import summarize
from orin.telemetry.power import board_power_mw
from orin.telemetry.sources import jtop, tegrastats
from orin.telemetry.sources.jetson_sysfs import JetsonSysfsSource
from tests.fakes.boards_telemetry import ORIN_NX_JP6, ORIN_NX_RAILS, agx_orin_64gb, rail_mw

MS = 1_000_000
# tegrastats on an Orin NX 16GB, JetPack 6 (as root): VDD_IN feeds the other two rails
ORIN_NX_LINE = (
    "11-02-2025 10:12:31 RAM 3468/15388MB (lfb 2x4MB) SWAP 0/7694MB (cached 0MB) "
    "CPU [2%@729,1%@729,0%@729,0%@729,3%@729,0%@729,1%@729,0%@729] EMC_FREQ 1%@2133 "
    "GR3D_FREQ 0%@[306] NVENC off NVDEC off NVJPG off NVJPG1 off VIC off OFA off "
    "NVDLA0 off NVDLA1 off PVA0_FREQ off APE 200 cpu@48.25C soc2@46.593C soc0@46.75C "
    "gpu@46.031C tj@48.25C soc1@46.843C VDD_IN 5823mW/5823mW VDD_CPU_GPU_CV 1046mW/1046mW "
    "VDD_SOC 1643mW/1643mW"
)


def test_the_input_rail_is_the_boards_power_and_the_agx_rails_add_up() -> None:
    assert board_power_mw({"VDD_IN": 5823.0, "VDD_CPU_GPU_CV": 1046.0, "VDD_SOC": 1643.0}) == 5823
    agx = {"VDD_GPU_SOC": 2399.0, "VDD_CPU_CV": 400.0, "VIN_SYS_5V0": 4032.0}
    assert board_power_mw(agx) == pytest.approx(6831.0)
    assert board_power_mw({}) is None and board_power_mw(None) is None


def test_an_orin_nx_tegrastats_line() -> None:
    reading = tegrastats.parse(ORIN_NX_LINE)
    assert reading is not None and reading.gpu_util == 0.0 and reading.gpu_freq_mhz == 306
    sample = reading.to_sample(1)
    assert sample.power_mw == {"VDD_IN": 5823, "VDD_CPU_GPU_CV": 1046, "VDD_SOC": 1643}
    assert board_power_mw(sample.power_mw) == 5823


def test_orin_nx_energy_counts_the_input_rail_once(tmp_path: Path) -> None:
    """10 ms samples through a 100 ms prefill: the energy is VDD_IN's, not the three
    rails' sum (which counts the two VDD_IN feeds twice)."""
    board = agx_orin_64gb(tmp_path, layout=ORIN_NX_JP6)
    source = JetsonSysfsSource(board.root)
    power = source.sample().power_mw
    assert set(power) == {"VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"}
    vdd_in = rail_mw(ORIN_NX_RAILS[0])
    assert board_power_mw(power) == pytest.approx(vdd_in)

    class Step:
        start_ns, end_ns, prefill_tokens, decode_tokens = 0, 100 * MS, 100, 0

    class S:
        def __init__(self, t: int) -> None:
            self.t_ns, self.power_mw = t * MS, power
            self.gpu_util = self.emc_util = self.cpu_util = self.proc_cpu_util = None

    out = summarize([S(t) for t in range(5, 100, 10)], [Step()])
    assert out["prefill"].energy_j == pytest.approx(vdd_in * 1e-3 * 0.1)
    source.close()


def test_jtop_on_an_orin_nx_puts_the_input_rail_back() -> None:
    """jtop takes VDD_IN out of its rails into "Power TOT"; AGX Orin's TOT is the sum."""
    nx = jtop.parse({"Power VDD_CPU_GPU_CV": 1046, "Power VDD_SOC": 1643, "Power TOT": 5823})
    sample = nx.to_sample(1)
    assert sample.power_mw == {"VDD_CPU_GPU_CV": 1046, "VDD_SOC": 1643, "VDD_IN": 5823}
    assert board_power_mw(sample.power_mw) == 5823
    agx = jtop.parse({"Power VDD_GPU_SOC": 5139, "Power VDD_CPU_CV": 3268, "Power TOT": 8407})
    assert agx.to_sample(1).power_mw == {"VDD_GPU_SOC": 5139, "VDD_CPU_CV": 3268}
