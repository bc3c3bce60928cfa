"""tegrastats lines from JetPack 5, 6 and 7, and the source that follows the program.

The JetPack 5 and 6 lines are real, one per file in tests/fixtures/tegrastats/
(its README says where they come from). The JetPack 7 lines are built by hand
from the format description in that README (``cpu@52.968C/52.968C``
temperatures, three values per rail, ``GR3D_FREQ 12%@[1300,1300]``): no real
JetPack 7 line was captured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from orin.system.commands import LineStream
from orin.telemetry.sources import tegrastats as ts
from orin.telemetry.sources.base import Availability
from tests.fakes.runner import FakeRunner

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tegrastats"
MB = 1 << 20


def fixture_line(name: str) -> str:
    return (FIXTURES / name).read_text().strip()


# Built from the JetPack 7 description (README.md / jetson.md), not captured on a board.
JP7_ROOT = (
    "07-25-2026 09:08:28 RAM 20642/62817MB (lfb 1x2MB) SWAP 0/31408MB (cached 0MB) "
    "CPU [23%@2201,10%@2201,off,off,30%@2201,18%@2201,10%@2201,10%@2201,33%@2201,7%@2201,"
    "5%@2201,27%@2201] EMC_FREQ 3%@3199 GR3D_FREQ 12%@[1300,1300] NVENC0 off APE 174 "
    "cpu@52.968C/52.968C soc2@48.406C/48.406C gpu@47.625C/47.625C tj@-256C/-256C "
    "VDD_GPU_SOC 5139mW/5139mW/5139mW VDD_CPU_CV 3268mW/3268mW/3268mW "
    "VIN_SYS_5V0 5500mW/5500mW/5500mW"
)
# JetPack 7 as a normal user: no EMC_FREQ, and (as on JP6) a zero GPU array.
JP7_USER = (
    "07-25-2026 09:08:29 RAM 20650/62817MB (lfb 1x2MB) "
    "CPU [2%@729,1%@729,0%@729,0%@729,1%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729] "
    "GR3D_FREQ 0%@[0,0] cpu@50.1C/50.0C VDD_GPU_SOC 3001mW/3010mW/3100mW"
)


@dataclass(frozen=True)
class Expect:
    ram_mb: tuple[int, int]
    gpu_util: float | None
    gpu_freq_mhz: int | None
    emc_util: float | None
    rails: dict[str, float]
    temps: dict[str, float | None]  # a few that must be present
    cpu_util: float
    timestamp: datetime


EXPECT = {
    "agx-orin-32gb-jp5.txt": Expect(
        (1205, 30623),
        0.0,
        114,
        0.0,
        {"VDD_GPU_SOC": 4788, "VDD_CPU_CV": 798, "VIN_SYS_5V0": 3842, "VDDQ_VDD2_1V8AO": 707},
        {"cpu": 43.5, "cv0": None, "gpu": 38.156},
        0.01 / 12,
        datetime(2023, 10, 16, 10, 59, 22),
    ),
    "agx-orin-64gb-jp5-root.txt": Expect(
        (1282, 62795),
        0.0,
        0,  # GR3D_FREQ 0%@0: clock 0 while the GPU is rail-gated
        0.0,
        {"VDD_GPU_SOC": 2399, "VDD_CPU_CV": 400, "VIN_SYS_5V0": 4032, "VDDQ_VDD2_1V8AO": 301},
        {"cpu": 42.593, "gpu": None, "tboard": 32.0, "tj": 42.593},
        0.0,
        datetime(2023, 4, 24, 0, 1, 24),
    ),
    "agx-orin-64gb-jp6-root.txt": Expect(
        (18207, 62841),
        0.0,
        0,  # GR3D_FREQ 0%@[0,0]
        0.03,
        {"VDD_GPU_SOC": 2412, "VDD_CPU_CV": 1607, "VIN_SYS_5V0": 4707},
        {"cpu": 52.562, "tj": 52.562, "soc1": 49.656},
        1.71 / 12,
        datetime(2026, 5, 9, 18, 42, 6),
    ),
    "agx-orin-64gb-jp6-user.txt": Expect(
        (5137, 62841),
        0.0,
        None,  # GR3D_FREQ 0%: no clock without root
        None,  # no EMC_FREQ without root
        {"VDD_GPU_SOC": 3178, "VDD_CPU_CV": 794, "VIN_SYS_5V0": 4543},
        {"cpu": 52.875, "soc2": 48.656},
        0.48 / 12,
        datetime(2026, 10, 5, 21, 3, 35),
    ),
}


def check(reading: ts.TegrastatsReading | None, want: Expect) -> None:
    assert reading is not None
    assert reading.ram == ts.MemoryUse(want.ram_mb[0] * MB, want.ram_mb[1] * MB)
    assert reading.timestamp == want.timestamp
    assert len(reading.cpus) == 12 and all(c.online and c.freq_mhz for c in reading.cpus)
    assert reading.cpu_util == pytest.approx(want.cpu_util)
    assert reading.gpu_util == want.gpu_util
    assert reading.gpu_freq_mhz == want.gpu_freq_mhz
    assert reading.emc_util == want.emc_util
    assert {r.label: r.current_mw for r in reading.rails} == want.rails
    assert all(r.average_mw == r.current_mw for r in reading.rails)
    for label, celsius in want.temps.items():
        assert reading.temps_c[label] == celsius
    sample = reading.to_sample(42)
    assert sample.t_ns == 42
    assert sample.power_mw == want.rails
    freq = want.gpu_freq_mhz
    assert sample.gpu_freq_hz == (None if freq is None else freq * 1_000_000)


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_fixture_file(name: str) -> None:
    check(ts.parse(fixture_line(name)), EXPECT[name])


def test_every_fixture_has_its_expectations() -> None:
    """A line added to tests/fixtures/tegrastats/ is tested, not skipped over."""
    assert sorted(p.name for p in FIXTURES.glob("*.txt")) == sorted(EXPECT)


def test_jp7_root_line_built_from_the_description() -> None:
    r = ts.parse(JP7_ROOT)
    assert r is not None
    assert r.gpu_util == 0.12 and r.gpu_freq_mhz == 1300 and r.gpc_freqs_mhz == (1300, 1300)
    assert (r.emc_util, r.emc_freq_mhz) == (0.03, 3199)
    assert r.swap == ts.MemoryUse(0, 31408 * MB)
    assert r.temps_c == {"cpu": 52.968, "soc2": 48.406, "gpu": 47.625, "tj": None}
    gpu_soc = r.rails[0]
    assert gpu_soc.label == "VDD_GPU_SOC" and gpu_soc.values_mw == (5139.0, 5139.0, 5139.0)
    assert [c.online for c in r.cpus].count(False) == 2
    assert r.cpu_util == pytest.approx(1.73 / 10)  # the two offline cores are left out
    assert r.to_sample(0).power_mw == {
        "VDD_GPU_SOC": 5139.0,
        "VDD_CPU_CV": 3268.0,
        "VIN_SYS_5V0": 5500.0,
    }


def test_jp7_user_line_built_from_the_description() -> None:
    r = ts.parse(JP7_USER)
    assert r is not None
    assert r.swap is None and r.emc_util is None
    assert (r.gpu_util, r.gpu_freq_mhz) == (0.0, 0)
    assert r.temps_c == {"cpu": 50.1}
    assert r.rails == (ts.RailPower("VDD_GPU_SOC", (3001.0, 3010.0, 3100.0)),)
    assert r.rails[0].average_mw == 3010.0


@pytest.mark.parametrize(
    ("field", "util", "freq", "gpcs"),
    [
        ("GR3D_FREQ 0%@0", 0.0, 0, ()),
        ("GR3D_FREQ 57%@1300", 0.57, 1300, ()),
        ("GR3D_FREQ 0%", 0.0, None, ()),
        ("GR3D_FREQ 0%@[0,0]", 0.0, 0, (0, 0)),
        ("GR3D_FREQ 12%@[1300,1300]", 0.12, 1300, (1300, 1300)),
        ("GR3D_FREQ 99%@[918,1300]", 0.99, 1300, (918, 1300)),
        ("GR3D_FREQ @[1000,1000,1000]", None, 1000, (1000, 1000, 1000)),
        ("GR3D2_FREQ 5%@114", None, None, ()),  # the second GPC alone is not GR3D_FREQ
    ],
)
def test_gr3d_forms(field: str, util: float | None, freq: int | None, gpcs: tuple[int]) -> None:
    assert ts.parse_gr3d(f"RAM 1/2MB {field} APE 174") == (util, freq, gpcs)


def test_cpu_cores_off_and_without_clock() -> None:
    cores = ts.parse_cpus("CPU [10%@729,off,20%,junk]")
    assert cores == (
        ts.CpuCore(True, 0.10, 729),
        ts.CpuCore(False),
        ts.CpuCore(True, 0.20, None),
        ts.CpuCore(True, None, None),
    )
    assert ts.parse("RAM 1/2MB CPU [off,off]") is not None
    assert ts.parse("RAM 1/2MB CPU [off,off]").cpu_util is None  # type: ignore[union-attr]


def test_sensor_off_is_none_and_labels_are_lower_case() -> None:
    assert ts.parse_temps("CV0@-256C CPU@42.5C tj@-256C/-256C") == {
        "cv0": None,
        "cpu": 42.5,
        "tj": None,
    }


@pytest.mark.parametrize(
    "line",
    [
        "",
        "NVPM WARN: power mode is not set",
        "garbage 12%@[1300",
        "04-24-2023 00:01:24 SWAP 0/31398MB",  # truncated before RAM
        "VDD_GPU_SOC 2399mW/2399mW",
    ],
)
def test_not_a_line(line: str) -> None:
    assert ts.parse(line) is None


def test_bad_date_keeps_the_rest() -> None:
    r = ts.parse("13-45-2023 25:00:00 RAM 1/2MB")
    assert r is not None and r.timestamp is None and r.ram.total_bytes == 2 * MB


# -- the source -------------------------------------------------------------------------


def runner_with(lines: list[str]) -> FakeRunner:
    return FakeRunner(streams={("tegrastats",): lines})


def test_source_skips_and_counts_malformed_lines() -> None:
    lines = [
        "NVPM WARN: something",
        fixture_line("agx-orin-64gb-jp6-root.txt"),
        "",
        "RAM garbage",
        fixture_line("agx-orin-64gb-jp6-user.txt"),
        "\x00\x01 binary noise",
    ]
    runner = runner_with(lines)
    source = ts.TegrastatsSource(runner, interval_ms=100)
    assert source.availability().ok
    source.start()
    assert source.join(timeout=5)
    assert runner.calls == [("tegrastats", "--interval", "100")]
    assert (source.lines, source.malformed) == (5, 3)
    latest = source.latest
    assert latest is not None and latest.timestamp == datetime(2026, 10, 5, 21, 3, 35)
    sample = source.sample()
    assert sample.power_mw["VDD_GPU_SOC"] == 3178.0
    assert sample.gpu_util == 0.0 and sample.emc_util is None
    source.close()


def test_source_starts_on_first_sample_and_not_before() -> None:
    runner = runner_with([JP7_ROOT])
    source = ts.TegrastatsSource(runner, interval_ms=250)
    assert source.default_hz == 4.0
    source.availability()
    assert runner.calls == []
    source.sample()
    assert source.join(timeout=5)
    assert runner.calls == [("tegrastats", "--interval", "250")]
    assert source.sample().gpu_util == 0.12
    source.close()
    source.sample()
    assert len(runner.calls) == 1  # closed: not started again


def test_idle_restarts_the_program_at_the_idle_interval() -> None:
    """tegrastats reads the GPU load on its own interval: while the engine is idle it
    runs at 1 s, so the GPU can rail-gate, and at its own interval again with work."""
    runner = runner_with([JP7_ROOT])
    source = ts.TegrastatsSource(runner, interval_ms=100)
    source.set_idle(True)  # before the first sample: it starts at the idle interval
    assert runner.calls == []
    source.sample()
    assert source.join(timeout=5)
    assert source.sample().gpu_util == 0.12 and source.stale_after_s == 3.0
    source.set_idle(True)  # no change: no restart
    source.set_idle(False)
    assert source.join(timeout=5)
    source.set_idle(True)
    assert source.join(timeout=5)
    assert runner.calls == [
        ("tegrastats", "--interval", "1000"),
        ("tegrastats", "--interval", "100"),
        ("tegrastats", "--interval", "1000"),
    ]
    assert source.interval_ms == 1000 and source.default_hz == 10.0  # the sampler's rate
    source.close()


def test_stale_reading_is_not_reported_as_current() -> None:
    source = ts.TegrastatsSource(runner_with([JP7_ROOT]))
    source.start()
    source.join(timeout=5)
    assert source.sample().gpu_util == 0.12
    source.stale_after_s = 0.0
    time.sleep(0.001)
    assert source.sample().gpu_util is None
    source.close()


def test_unavailable_without_the_program() -> None:
    found = ts.TegrastatsSource(FakeRunner()).availability()
    assert found == Availability(False, "tegrastats not found on PATH")


def test_a_program_that_cannot_start_gives_empty_samples() -> None:
    class Failing(FakeRunner):
        def stream(self, argv: object) -> LineStream:  # type: ignore[override]
            raise FileNotFoundError(2, "No such file or directory", "tegrastats")

    source = ts.TegrastatsSource(Failing())
    sample = source.sample()
    assert sample.gpu_util is None and sample.power_mw == {}
    assert source.error is not None and "cannot run tegrastats" in source.error


def test_read_returns_the_first_parseable_line() -> None:
    runner = runner_with(["warming up", fixture_line("agx-orin-32gb-jp5.txt"), JP7_ROOT])
    reading = ts.read(runner, interval_ms=500)
    assert reading is not None and reading.gpu_freq_mhz == 114
    assert runner.calls == [("tegrastats", "--interval", "500")]
    assert ts.read(runner_with(["nothing"])) is None
