"""What /metrics carries besides the serving figures: the process collector, the
board's memory and temperatures from a fake tree, GPU series only with a GPU,
and no ``*_created`` series."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from orin.engine.types import RequestTimings
from orin.server.metrics import ServerMetrics
from orin.system.root import SysRoot
from orin.telemetry.metrics import PhaseMetrics, read_temperatures
from orin.telemetry.phases import Share
from orin.telemetry.sources.base import Sample
from tests.fakes.board import FakeBoard, GiB
from tests.fakes.boards_system import thermal_zone

KB = 1024


def samples(m: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a render: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(m.render()[0].decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def names(m: ServerMetrics) -> set[str]:
    return {name for name, _ in samples(m)}


def board(
    tmp_path: Path, swap_total_kb: int = 8_388_604, swap_free_kb: int = 6_291_452
) -> FakeBoard:
    b = FakeBoard(tmp_path)
    b.write(
        "/proc/meminfo",
        f"MemTotal:       {62 * GiB // KB} kB\n"
        f"MemFree:        {20 * GiB // KB} kB\n"
        f"MemAvailable:   {54 * GiB // KB} kB\n"
        f"Cached:         {30 * GiB // KB} kB\n"
        f"SwapTotal:      {swap_total_kb} kB\n"
        f"SwapFree:       {swap_free_kb} kB\n",
    )
    return b


def test_the_process_collector_is_on_the_servers_registry() -> None:
    found = names(ServerMetrics(2, 1024, "m"))
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= found
    assert "process_open_fds" in found


def test_memory_and_swap_from_meminfo(tmp_path: Path) -> None:
    m = ServerMetrics(2, 1024, "m", root=board(tmp_path).root)
    values = samples(m)
    assert values[("orin_llm_memory_available_bytes", ())] == 54 * GiB
    assert values[("orin_llm_memory_total_bytes", ())] == 62 * GiB
    assert values[("orin_llm_swap_used_bytes", ())] == (8_388_604 - 6_291_452) * KB


def test_memory_is_read_at_each_scrape(tmp_path: Path) -> None:
    b = board(tmp_path)
    m = ServerMetrics(2, 1024, "m", root=b.root)
    assert samples(m)[("orin_llm_swap_used_bytes", ())] > 0
    board(tmp_path, swap_free_kb=8_388_604)  # swapped back in
    assert samples(m)[("orin_llm_swap_used_bytes", ())] == 0


def test_no_meminfo_no_memory_series(tmp_path: Path) -> None:
    found = names(ServerMetrics(2, 1024, "m", root=SysRoot(tmp_path)))
    assert not {"orin_llm_memory_available_bytes", "orin_llm_swap_used_bytes"} & found


def test_temperatures_by_zone(tmp_path: Path) -> None:
    b = board(tmp_path)
    thermal_zone(b, 0, "cpu-thermal", 47.5, [("passive", 99.0)])
    thermal_zone(b, 1, "gpu-thermal", 45.25, [])
    thermal_zone(b, 2, "cv0-thermal", -256.0, [])  # switched off
    values = samples(ServerMetrics(2, 1024, "m", root=b.root))
    temps = {
        dict(labels)["zone"]: v
        for (name, labels), v in values.items()
        if name == "orin_llm_temperature_celsius"
    }
    assert temps == {"cpu-thermal": 47.5, "gpu-thermal": 45.25}


def test_zones_of_the_same_type_get_distinct_labels(tmp_path: Path) -> None:
    b = board(tmp_path)
    thermal_zone(b, 0, "acpitz", 30.0, [])
    thermal_zone(b, 10, "acpitz", 35.0, [])
    thermal_zone(b, 2, "acpitz", 32.0, [])
    b.write("/sys/class/thermal/thermal_zone3/type", "x86_pkg_temp\n")  # no temp file
    assert read_temperatures(b.root) == {
        "acpitz": 30.0,
        "acpitz/thermal_zone2": 32.0,
        "acpitz/thermal_zone10": 35.0,
    }


def test_a_board_without_thermal_zones_has_no_temperature_series(tmp_path: Path) -> None:
    found = names(ServerMetrics(2, 1024, "m", root=board(tmp_path).root))
    assert "orin_llm_temperature_celsius" not in found


def gpu_series(m: ServerMetrics) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {k for k in samples(m) if k[0].startswith("orin_llm_gpu_")}


def test_no_gpu_series_without_a_gpu() -> None:
    m = ServerMetrics(2, 1024, "m")
    phases = PhaseMetrics(m.registry, "cpu")
    cpu_only = Sample(t_ns=1, cpu_util=0.5, proc_cpu_util=0.4)
    phases.observe(cpu_only, (Share("decode", 1.0),), 0.02)
    phases.observe(cpu_only, (Share("idle", 1.0),), 0.02)
    assert gpu_series(m) == set()
    values = samples(m)
    assert values[("orin_llm_process_cpu_busy_seconds_total", (("phase", "decode"),))] > 0


def test_energy_series_appear_with_the_first_power_reading() -> None:
    """A source without power rails has no energy series (not 0 J: a per-token energy
    query would read 0 otherwise); the first reading makes every phase's, from 0."""
    m = ServerMetrics(2, 1024, "m")
    phases = PhaseMetrics(m.registry, "cpu")
    phases.observe(Sample(t_ns=1, cpu_util=0.5), (Share("decode", 1.0),), 0.5)
    energy = "orin_llm_energy_joules_total"
    assert not {k for k in samples(m) if k[0] == energy}
    phases.observe(Sample(t_ns=2, power_mw={"VDD_IN": 4000.0}), (Share("decode", 1.0),), 0.5)
    values = samples(m)
    assert values[(energy, (("phase", "decode"),))] == 2.0  # 4 W for 0.5 s
    assert values[(energy, (("phase", "prefill"),))] == 0.0


def test_gpu_series_appear_with_the_first_gpu_reading() -> None:
    m = ServerMetrics(2, 1024, "m")
    phases = PhaseMetrics(m.registry, "jetson_sysfs")
    phases.observe(Sample(t_ns=1, gpu_util=0.8), (Share("decode", 1.0),), 0.5)
    values = samples(m)
    busy = "orin_llm_gpu_busy_seconds_total"
    assert values[(busy, (("phase", "decode"),))] == 0.4
    assert values[(busy, (("phase", "prefill"),))] == 0.0  # every phase counts from 0
    gauges = {k for k in gpu_series(m) if k[0] == "orin_llm_gpu_utilization_ratio"}
    assert gauges == {("orin_llm_gpu_utilization_ratio", (("phase", "decode"),))}


def test_no_created_series(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    m = ServerMetrics(2, 1024, "m", registry, root=board(tmp_path).root)
    PhaseMetrics(registry, "jetson_sysfs").observe(
        Sample(t_ns=1, gpu_util=0.5, power_mw={"VDD_GPU": 5000.0}), (Share("prefill", 1.0),), 0.1
    )
    t = RequestTimings(
        queue_ms=1, prefill_ms=10, ttft_ms=11, tpot_ms=5, e2e_ms=21, itl_ms=(5, 5),
        prompt_tokens=10, cached_tokens=2, generated_tokens=3, context_shifts=0,
    )  # fmt: skip
    m.on_finish("r", "stop", t)
    m.observe_http("GET", "/health", 200, 0.001)
    text = m.render()[0].decode()
    assert "orin_llm_requests_total" in text and "orin_llm_energy_joules_total" in text
    assert "_created" not in text


def test_energy_of_an_orin_nx_is_its_input_rails() -> None:
    """VDD_IN feeds VDD_CPU_GPU_CV and VDD_SOC: the three summed would count those twice."""
    m = ServerMetrics(2, 1024, "m")
    phases = PhaseMetrics(m.registry, "jetson_sysfs")
    rails = {"VDD_IN": 6000.0, "VDD_CPU_GPU_CV": 1000.0, "VDD_SOC": 1500.0}
    phases.observe(Sample(t_ns=1, power_mw=rails), (Share("decode", 1.0),), 0.5)
    assert samples(m)[("orin_llm_energy_joules_total", (("phase", "decode"),))] == 3.0
