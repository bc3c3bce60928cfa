"""jtop and NVML (neither installed here: their unavailable paths run for real; the
working paths run against stand-in modules), and the psutil CPU source."""

from __future__ import annotations

import importlib.util
import resource
import sys
import time
import types
from datetime import datetime, timedelta
from typing import Any, ClassVar

import psutil
import pytest

from orin.telemetry.sources import cpu, jtop, nvml
from orin.telemetry.sources.base import Sample

# -- jtop -------------------------------------------------------------------------------

# The shape of jetson-stats 4.x ``jtop.stats`` on an AGX Orin (keys as built by
# jtop/jtop.py ``stats``): "CPUn" is 100 - idle or "OFF", RAM/SWAP are fractions,
# EMC and GPU percentages, engines their clock or "OFF", power in mW.
JTOP_STATS: dict[str, Any] = {
    "time": datetime(2024, 7, 19, 12, 0, 0),
    "uptime": timedelta(hours=3),
    **{f"CPU{n}": 10 * (n % 5) for n in range(1, 13)},
    "CPU3": "OFF",
    "RAM": 0.31,
    "SWAP": 0.0,
    "EMC": 3,
    "GPU": 12.5,
    "APE": 174,
    "NVENC": "OFF",
    "NVDEC": "OFF",
    "VIC": 115,
    "Fan pwmfan0": 0.0,
    "Temp cpu": 52.5,
    "Temp gpu": 47.6,
    "Power VDD_GPU_SOC": 5139,
    "Power VDD_CPU_CV": 3268,
    "Power VIN_SYS_5V0": 5500,
    "Power TOT": 13907,
    "jetson_clocks": "OFF",
    "nvp model": "MODE_30W",
}
# ``jetson.gpu``: GPU name -> state; load in %, clocks in kHz (jtop/core/gpu.py).
JTOP_GPUS: dict[str, Any] = {
    "gpu": {
        "type": "integrated",
        "status": {"railgate": False, "tpc_pg_mask": False, "3d_scaling": True, "load": 12.5},
        "freq": {"governor": "nvhost_podgov", "cur": 918000, "max": 1300500, "min": 306000},
        "power_control": "auto",
    }
}
SERVICE_DOWN = "The jtop.service is not active. Please run:\nsudo jtop --install-service"


def test_jtop_parse_of_the_stats_dict() -> None:
    r = jtop.parse(JTOP_STATS, JTOP_GPUS)
    assert r.gpu_util == 0.125 and r.gpu_freq_hz == 918_000_000 and r.emc_util == 0.03
    assert r.cpus[:4] == (0.1, 0.2, None, 0.4)
    assert len(r.cpus) == 12 and r.cpus[9] == 0.0  # CPU10 after CPU9, not after CPU1
    assert r.cpu_util == pytest.approx(sum(10 * (n % 5) for n in range(1, 13) if n != 3) / 1100)
    assert r.power_mw == {"VDD_GPU_SOC": 5139, "VDD_CPU_CV": 3268, "VIN_SYS_5V0": 5500}
    assert r.total_power_mw == 13907 and r.ram_used_fraction == 0.31
    sample = r.to_sample(7)
    assert (sample.t_ns, sample.gpu_util, sample.power_mw) == (7, 0.125, r.power_mw)


def test_jtop_parse_without_gpu_or_emc() -> None:
    r = jtop.parse({"CPU1": "OFF", "RAM": 0.5, "Power TOT": 100})
    assert (r.gpu_util, r.gpu_freq_hz, r.emc_util, r.cpu_util) == (None, None, None, None)
    assert r.power_mw == {} and r.total_power_mw == 100
    assert jtop.parse({"GPU": True, "EMC": "n/a"}).gpu_util is None


@pytest.mark.skipif(importlib.util.find_spec("jtop") is not None, reason="jetson-stats installed")
def test_jtop_not_installed_for_real() -> None:
    source = jtop.JtopSource()
    found = source.availability()
    assert not found.ok
    assert found.reason.startswith("jetson-stats is not installed (No module named 'jtop')")
    assert source.sample().gpu_util is None
    source.close()
    assert jtop.read() is None


class FakeJtopException(Exception):
    pass


def fake_jtop_module(start_error: Exception | None = None) -> types.ModuleType:
    class FakeJtop:
        instances: ClassVar[list[FakeJtop]] = []

        def __init__(self, interval: float = 1.0) -> None:
            self.interval = interval
            self.stats = JTOP_STATS
            self.gpu = JTOP_GPUS
            self.closed = False
            self.error: Exception | None = None
            FakeJtop.instances.append(self)

        def start(self) -> None:
            if start_error is not None:
                raise start_error

        def ok(self, spin: bool = False) -> bool:
            if self.error is not None:
                raise self.error
            return True

        def close(self) -> None:
            self.closed = True

    module = types.ModuleType("jtop")
    module.jtop = FakeJtop  # type: ignore[attr-defined]
    module.JtopException = FakeJtopException  # type: ignore[attr-defined]
    return module


def test_jtop_service_down_gives_jtops_own_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jtop", fake_jtop_module(FakeJtopException(SERVICE_DOWN)))
    found = jtop.JtopSource().availability()
    assert found == jtop.Availability(
        False, "The jtop.service is not active. Please run: sudo jtop --install-service"
    )


def test_jtop_connected_then_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_jtop_module()
    monkeypatch.setitem(sys.modules, "jtop", module)
    source = jtop.JtopSource(interval_s=0.5)
    assert source.default_hz == 2.0
    assert source.availability() == jtop.Availability(True, "jtop.service, interval 0.5 s")
    assert source.sample().gpu_util == 0.125
    client = module.jtop.instances[0]
    client.error = FakeJtopException("Lost connection with jtop server")
    lost = source.sample()
    assert lost.gpu_util is None and source.error == "Lost connection with jtop server"
    source.close()
    assert client.closed


# -- NVML ------------------------------------------------------------------------------


def test_nvml_parse_plain_numbers() -> None:
    r = nvml.parse(1, util_percent=87, mem_used=40 << 30, mem_total=141 << 30, power_mw=412_345)
    assert r.gpu_util == 0.87 and r.power_mw == 412_345.0 and r.sm_clock_hz is None
    sample = r.to_sample(5)
    assert sample.power_mw == {"GPU1": 412_345.0}
    assert sample.gpu_mem_used_bytes == 40 << 30 and sample.gpu_util == 0.87
    assert nvml.parse(0, clock_mhz=1980).to_sample(0) == Sample(t_ns=0, gpu_freq_hz=1_980_000_000)
    assert nvml.parse(0, util_percent=130).gpu_util == 1.0


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="pynvml installed")
def test_nvml_not_installed_for_real() -> None:
    source = nvml.NvmlSource()
    found = source.availability()
    assert not found.ok
    assert found.reason.startswith("nvidia-ml-py is not installed (No module named 'pynvml')")
    assert "orin-llm[nvml]" in found.reason
    assert source.sample().gpu_util is None
    source.close()
    assert nvml.read() is None


class FakeNVMLError(Exception):
    pass


def fake_pynvml(
    init_error: str | None = None, util_error: str | None = None, count: int = 1
) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    calls: list[str] = []

    def fail_or(value: Any, error: str | None) -> Any:
        if error is not None:
            raise FakeNVMLError(error)
        return value

    def init() -> None:
        calls.append("init")
        fail_or(None, init_error)

    m.calls = calls  # type: ignore[attr-defined]
    m.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    m.NVML_CLOCK_SM = 1  # type: ignore[attr-defined]
    m.nvmlInit = init  # type: ignore[attr-defined]
    m.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: count  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = lambda i: f"handle{i}"  # type: ignore[attr-defined]
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"  # type: ignore[attr-defined]
    m.nvmlDeviceGetUtilizationRates = lambda h: fail_or(  # type: ignore[attr-defined]
        types.SimpleNamespace(gpu=87, memory=40), util_error
    )
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        total=141 << 30, used=40 << 30, free=101 << 30
    )
    m.nvmlDeviceGetPowerUsage = lambda h: fail_or(0, "Not Supported")  # type: ignore[attr-defined]
    m.nvmlDeviceGetClockInfo = lambda h, kind: 1980  # type: ignore[attr-defined]
    return m


def test_nvml_working_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    source = nvml.NvmlSource()
    assert source.availability() == nvml.Availability(True, "GPU 0: NVIDIA H200")
    sample = source.sample()
    assert sample.gpu_util == 0.87 and sample.gpu_freq_hz == 1_980_000_000
    assert sample.gpu_mem_used_bytes == 40 << 30
    assert sample.power_mw == {}  # power NotSupported: left out, not an error
    source.close()
    assert module.calls == ["init", "shutdown"]


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (fake_pynvml(init_error="NVML Shared Library Not Found"), "NVML Shared Library Not Found"),
        (fake_pynvml(init_error="Driver Not Loaded"), "Driver Not Loaded"),
        (fake_pynvml(count=0), "0 GPU(s) visible, no index 0"),
        (fake_pynvml(util_error="Not Supported"), "Not Supported"),  # a Jetson iGPU
    ],
)
def test_nvml_unavailable(
    monkeypatch: pytest.MonkeyPatch, module: types.ModuleType, reason: str
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", module)
    found = nvml.NvmlSource().availability()
    assert found == nvml.Availability(False, f"NVML: {reason}")


# -- CPU --------------------------------------------------------------------------------


def test_cpu_parse_times_leaves_out_guest_time() -> None:
    fields = {"user": 10.0, "nice": 1.0, "system": 4.0, "idle": 80.0, "iowait": 5.0}
    times = cpu.parse_times({**fields, "guest": 3.0, "guest_nice": 1.0})
    assert times == cpu.CpuTimes(busy_s=15.0, total_s=100.0)


def test_cpu_parse_between_snapshots() -> None:
    a = cpu.CpuSnapshot(t_ns=0, system=cpu.CpuTimes(10.0, 100.0), process_s=1.0)
    b = cpu.CpuSnapshot(t_ns=1_000_000_000, system=cpu.CpuTimes(13.0, 104.0), process_s=2.0)
    assert cpu.parse(a, b, n_cpus=4) == cpu.CpuReading(cpu_util=0.75, proc_cpu_util=0.25)
    assert cpu.parse(a, a, n_cpus=4) == cpu.CpuReading(None, None)


def test_cpu_source_values_are_fractions() -> None:
    source = cpu.CpuSource()
    assert source.availability().ok
    time.sleep(0.05)
    for _ in range(5):
        s = source.sample()
        for v in (s.cpu_util, s.proc_cpu_util):
            assert v is None or 0.0 <= v <= 1.0
        time.sleep(0.02)
    source.close()


def process_cpu_s() -> float:
    """This process's user + system CPU seconds as getrusage reports them (all threads):
    a reference independent of the source's clock."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_proc_cpu_util_is_this_process_cpu_time_over_the_interval() -> None:
    """The share a sample reports, times the wall time and the cores it covers, is the
    CPU time this process spent between the two samples, whatever else the machine
    runs: other processes change neither side, so the test holds on a busy machine
    (a fixed threshold on the share would not)."""
    source = cpu.CpuSource(machine_every=1)
    before_a = process_cpu_s()
    a = source.sample()
    after_a = process_cpu_s()
    start = time.process_time()
    while time.process_time() - start < 0.1:  # 0.1 s of CPU, however long that takes
        pass
    before_b = process_cpu_s()
    b = source.sample()
    after_b = process_cpu_s()
    assert b.proc_cpu_util is not None and b.proc_cpu_util < 1.0  # not clamped
    reported = b.proc_cpu_util * source.n_cpus * (b.t_ns - a.t_ns) / 1e9
    tolerance = 0.002  # getrusage's microseconds and its user/system split
    assert before_b - after_a - tolerance <= reported <= after_b - before_a + tolerance
    assert reported >= 0.1 - tolerance  # the loop's CPU time is in it
    assert b.cpu_util is not None and b.cpu_util > 0.0  # /proc/stat saw it too


def test_machine_figure_is_read_at_the_slow_rate() -> None:
    source = cpu.CpuSource()
    time.sleep(0.05)
    first = source.sample().cpu_util
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:
        pass
    carried = [source.sample().cpu_util for _ in range(cpu.MACHINE_EVERY - 1)]
    assert carried == [first] * (cpu.MACHINE_EVERY - 1)  # /proc/stat not read in between
    time.sleep(0.05)
    assert source.sample().proc_cpu_util is not None  # the process share is fresh every time


def test_proc_stat_aggregate_line_in_seconds() -> None:
    text = "cpu  100 20 30 800 50 0 0 0 7 3\ncpu0 50 10 15 400 25 0 0 0 0 0\nintr 1\n"
    assert cpu.parse_proc_stat(text, 100.0) == cpu.CpuTimes(busy_s=1.5, total_s=10.0)
    assert cpu.parse_proc_stat("cpu0 1 2 3 4\n", 100.0) is None  # no aggregate line first
    assert cpu.parse_proc_stat("cpu  1 2 x 4\n", 100.0) is None
    assert cpu.parse_proc_stat("", 100.0) is None


def test_machine_times_agree_with_psutil() -> None:
    machine = cpu.MachineTimes()
    try:
        ours = machine.read()
    finally:
        machine.close()
    theirs = cpu.parse_times(psutil.cpu_times()._asdict())
    assert ours is not None
    assert ours.total_s == pytest.approx(theirs.total_s, rel=0.01)
    assert ours.busy_s == pytest.approx(theirs.busy_s, rel=0.01)


def test_cpu_capture_is_raw_and_decode_does_the_arithmetic() -> None:
    source = cpu.CpuSource(machine_every=1)
    assert source.capture_fast is time.process_time_ns  # the tick runs no Python code
    t0 = time.perf_counter_ns()
    machine = source.capture_slow()
    assert isinstance(machine, str) and machine.startswith("cpu ")
    sample = source.decode(t0 + 50_000_000, source.capture_fast(), machine)
    assert sample.t_ns == t0 + 50_000_000
    assert sample.proc_cpu_util is not None and 0.0 <= sample.proc_cpu_util <= 1.0
    source.close()
