"""The sampler: ticks capture, batches decode, readers and observers see every sample in order."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from orin.telemetry.sampler import Sampler
from orin.telemetry.sources import cpu
from orin.telemetry.sources import jetson_sysfs as js
from orin.telemetry.sources.base import Availability, Sample, SplitSource, SplitTicks
from tests.fakes.boards_telemetry import LAYOUTS, FakeClock, FileReads, agx_orin_64gb


class Counting(SplitTicks):
    """A SplitSource whose fast captures count up; every 2nd tick also captures "slow"."""

    name = "counting"
    default_hz = 50.0
    slow_every = 2

    def __init__(self, fail_capture_at: int = -1, fail_decode_at: int = -1) -> None:
        self.captures = 0
        self.slow_captures = 0
        self.decoded: list[tuple[int, object]] = []
        self.fail_capture_at = fail_capture_at
        self.fail_decode_at = fail_decode_at
        self.closed = False
        self.capture_fast = self._count

    def availability(self) -> Availability:
        return Availability(True, "test")

    def _count(self) -> int:
        self.captures += 1
        if self.captures == self.fail_capture_at:
            raise ValueError("device went away")
        return self.captures

    def capture_slow(self) -> object:
        self.slow_captures += 1
        return f"slow{self.slow_captures}"

    def decode(self, t_ns: int, fast: object, slow: object | None) -> Sample:
        assert isinstance(fast, int)
        if fast == self.fail_decode_at:
            raise ValueError("junk")
        self.decoded.append((fast, slow))
        return Sample(t_ns=t_ns, gpu_util=fast / 100)

    def close(self) -> None:
        self.closed = True


class Plain:
    """A source without the capture/decode split."""

    name = "plain"
    default_hz = 50.0

    def __init__(self) -> None:
        self.n = 0

    def availability(self) -> Availability:
        return Availability(True, "test")

    def sample(self) -> Sample:
        self.n += 1
        return Sample(t_ns=time.perf_counter_ns(), gpu_util=self.n / 100)

    def close(self) -> None:
        pass


def test_the_real_sources_split_capture_from_decode(tmp_path: Path) -> None:
    assert isinstance(cpu.CpuSource(), SplitSource)
    assert isinstance(js.JetsonSysfsSource(agx_orin_64gb(tmp_path, 6).root), SplitSource)
    assert not isinstance(Plain(), SplitSource)


def test_flush_every_defaults_to_two_batches_a_second() -> None:
    assert Sampler(Counting(), 50).flush_every == 25
    assert Sampler(Counting(), 10).flush_every == 5
    assert Sampler(Counting(), 1).flush_every == 1


def test_ticks_only_capture_until_a_batch_is_full() -> None:
    source = Counting()
    sampler = Sampler(source, 50, flush_every=3)
    seen: list[float | None] = []
    sampler.observers.append(lambda s: seen.append(s.gpu_util))
    for _ in range(3):
        sampler.capture_once()
    assert source.captures == 3 and source.decoded == [] and seen == []
    sampler.flush()
    assert source.decoded == [(1, "slow1"), (2, None), (3, "slow2")]  # slow every 2nd tick
    assert seen == [0.01, 0.02, 0.03]


def test_readers_see_captures_not_yet_decoded() -> None:
    source = Counting()
    sampler = Sampler(source, 50, flush_every=100)
    for _ in range(4):
        sampler.capture_once()
    latest = sampler.latest()
    assert latest is not None and latest.gpu_util == 0.04
    assert [s.gpu_util for s in sampler.samples()] == [0.01, 0.02, 0.03, 0.04]
    ts = [s.t_ns for s in sampler.samples()]
    assert ts == sorted(ts)  # stamped at the tick, not at the decode
    window = sampler.samples(since_ns=ts[1], until_ns=ts[2])
    assert [s.gpu_util for s in window] == [0.02, 0.03]


def test_failing_capture_or_decode_is_counted_and_skipped() -> None:
    source = Counting(fail_capture_at=2, fail_decode_at=4)
    sampler = Sampler(source, 50, flush_every=100)
    for _ in range(5):
        sampler.capture_once()
    assert [s.gpu_util for s in sampler.samples()] == [0.01, 0.03, 0.05]
    assert sampler.errors == 2


def test_a_failing_observer_does_not_stop_the_others() -> None:
    sampler = Sampler(Counting(), 50)
    seen: list[Sample] = []

    def broken(_: Sample) -> None:
        raise RuntimeError("bug")

    sampler.observers += [broken, seen.append]
    assert sampler.sample_once() is not None
    assert sampler.sample_once() is not None
    assert [s.gpu_util for s in seen] == [0.01, 0.02]


def test_sample_once_returns_none_when_the_source_fails() -> None:
    sampler = Sampler(Counting(fail_capture_at=1), 50)
    assert sampler.sample_once() is None
    assert sampler.errors == 1
    sample = sampler.sample_once()
    assert sample is not None and sample.gpu_util == 0.02


def test_a_plain_source_is_sampled_at_the_tick() -> None:
    source = Plain()
    sampler = Sampler(source, 50, flush_every=10)
    sampler.capture_once()
    assert source.n == 1  # its sample() ran at the tick
    assert [s.gpu_util for s in sampler.samples()] == [0.01]


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll until ``condition`` holds: a real thread's progress, with no assumption on
    how fast the machine runs it."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the sampler thread made no progress"
        time.sleep(0.01)


def test_the_thread_samples_on_schedule_and_stop_flushes_the_rest() -> None:
    source = Counting()
    sampler = Sampler(source, 200, flush_every=7)
    seen: list[Sample] = []
    sampler.observers.append(seen.append)
    sampler.start()
    wait_for(lambda: source.captures >= 10)  # however long a loaded machine takes
    sampler.stop()
    samples = sampler.samples()
    assert source.closed
    assert len(samples) == source.captures >= 10  # every capture stored, none left behind
    assert [s.gpu_util for s in seen] == [s.gpu_util for s in samples]
    gaps = [b.t_ns - a.t_ns for a, b in itertools.pairwise(samples)]
    assert min(gaps) > 0


def test_ring_buffer_is_bounded() -> None:
    sampler = Sampler(Counting(), 50, seconds=0.1)  # floor of 16 samples
    for _ in range(40):
        sampler.capture_once()
    samples = sampler.samples()
    assert len(samples) == 16 and samples[-1].gpu_util == 0.4


@pytest.mark.parametrize("hz", [-5.0, -1e-9])
def test_rate_must_be_positive(hz: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        Sampler(Plain(), hz)


class Vanishing(Counting):
    """A fast capture that raises OSError, like pread on a device that went away."""

    def _count(self) -> int:
        self.captures += 1
        if self.captures == 2:
            raise OSError(19, "No such device")
        return self.captures

    def decode(self, t_ns: int, fast: object, slow: object | None) -> Sample:
        return Sample(t_ns=t_ns, gpu_util=None if fast is None else int(fast) / 100)  # type: ignore[call-overload]


def test_a_fast_capture_that_raises_oserror_gives_a_sample_without_the_field() -> None:
    sampler = Sampler(Vanishing(), 50, flush_every=100)
    for _ in range(3):
        sampler.capture_once()
    assert [s.gpu_util for s in sampler.samples()] == [0.01, None, 0.03]
    assert sampler.errors == 0
    vanishing = Vanishing()
    thread = Sampler(vanishing, 500, flush_every=1)  # the thread's fast path: tick 1
    thread.start()
    wait_for(lambda: vanishing.captures >= 3)
    thread.stop()
    utils = [s.gpu_util for s in thread.samples()]
    assert None in utils and thread.errors == 0


def test_sample_once_does_not_return_an_older_sample_when_the_source_fails() -> None:
    sampler = Sampler(Counting(fail_capture_at=2), 50)
    first = sampler.sample_once()
    assert first is not None and first.gpu_util == 0.01
    assert sampler.sample_once() is None  # not the first one again


# -- full rate while the engine works, the idle rate otherwise -------------------------


class Engine:
    """The busy/idle signal the sampler is given, switched by the test's script."""

    def __init__(self) -> None:
        self.working = False

    def busy(self) -> bool:
        return self.working

    def set(self, working: bool) -> Callable[[], None]:
        def action() -> None:
            self.working = working

        return action


def run_script(
    sampler: Sampler, clock: FakeClock, engine: Engine, script: list[tuple[float, bool]], end: float
) -> None:
    """Run the sampler's loop on the fake clock: the engine turns busy or idle at the
    given times, and the loop stops at ``end``."""
    for t, working in script:
        clock.at(t, engine.set(working))
    clock.at(end, sampler.stop)
    sampler.run()


def test_the_gpu_load_file_is_read_at_the_full_rate_only_while_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    board = agx_orin_64gb(tmp_path, 6)
    load = board.root.path(board.gpu_path(LAYOUTS[6], "load"))
    source = js.JetsonSysfsSource(board.root)
    reads = FileReads(monkeypatch, load)
    clock, engine = FakeClock(), Engine()
    sampler = Sampler(
        source, 50, busy=engine.busy, clock=clock.clock, clock_ns=clock.clock_ns, sleep=clock.sleep
    )
    counts: dict[str, int] = {}
    clock.at(9.999, lambda: counts.setdefault("idle", reads.count))
    clock.at(19.999, lambda: counts.setdefault("busy", reads.count - counts["idle"]))
    run_script(sampler, clock, engine, [(10.0, True), (20.0, False)], end=60.0)
    after = reads.count - counts["idle"] - counts["busy"]
    assert counts["idle"] == 10  # t = 0, 1, ..., 9: 1 Hz, the GPU can rail-gate
    assert 499 <= counts["busy"] <= 501  # 50 Hz for the 10 s of work
    # 2 s more at 50 Hz after the work (the last step's samples, a burst's gaps), then 1 Hz
    assert 100 + 37 <= after <= 100 + 39
    gpu = [s.gpu_util for s in sampler.samples()]
    assert len(gpu) == reads.count and set(gpu) == {0.123}  # every read is a sample


def test_idle_reads_are_full_reads_flushed_at_once() -> None:
    source, clock, engine = Counting(), FakeClock(), Engine()
    sampler = Sampler(
        source, 50, busy=engine.busy, clock=clock.clock, clock_ns=clock.clock_ns, sleep=clock.sleep
    )
    seen: list[Sample] = []
    sampler.observers.append(seen.append)
    clock.at(2.5, lambda: seen_at.append(len(seen)))
    seen_at: list[int] = []
    run_script(sampler, clock, engine, [], end=5.0)
    assert seen_at == [3]  # t = 0, 1, 2 observed by t = 2.5, not half a minute later
    assert source.captures == 5 and source.slow_captures == 5  # each with the slow fields
    assert sampler.idle and not sampler.missed_ticks


def test_work_is_sampled_from_its_first_tick() -> None:
    source, clock, engine = Counting(), FakeClock(), Engine()
    sampler = Sampler(
        source, 50, busy=engine.busy, clock=clock.clock, clock_ns=clock.clock_ns, sleep=clock.sleep
    )
    run_script(sampler, clock, engine, [(0.5, True), (0.6, False)], end=0.7)
    times = [s.t_ns / 1e9 for s in sampler.samples()]
    assert times[0] == 0.0  # the idle read at the start
    assert min(t for t in times if t > 0) == pytest.approx(0.5)  # the tick the work began
    assert len([t for t in times if 0.5 <= t < 0.6]) == 5


class Paced(Counting):
    """A source with a schedule of its own, told when the engine goes idle."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[bool] = []

    def set_idle(self, idle: bool) -> None:
        self.modes.append(idle)


def test_a_source_with_its_own_schedule_is_told_of_each_change() -> None:
    source, clock, engine = Paced(), FakeClock(), Engine()
    sampler = Sampler(
        source, 50, busy=engine.busy, clock=clock.clock, clock_ns=clock.clock_ns, sleep=clock.sleep
    )
    script = [(1.0, True), (1.5, False), (2.0, True), (3.0, False)]  # the gap is within linger
    run_script(sampler, clock, engine, script, end=10.0)
    assert source.modes == [True, False, True]


def test_without_a_busy_signal_every_tick_reads() -> None:
    source, clock = Counting(), FakeClock()
    sampler = Sampler(source, 50, clock=clock.clock, clock_ns=clock.clock_ns, sleep=clock.sleep)
    clock.at(2.0, sampler.stop)
    sampler.run()
    assert 100 <= source.captures <= 101 and not sampler.idle
    assert sampler.idle_hz == 50


def test_the_idle_rate_is_positive_and_not_above_the_full_rate() -> None:
    with pytest.raises(ValueError, match="positive"):
        Sampler(Counting(), 50, busy=lambda: False, idle_hz=0.0)
    assert Sampler(Counting(), 0.5, busy=lambda: False).idle_every == 1
    assert Sampler(Counting(), 50, busy=lambda: False, idle_hz=0.2).idle_every == 250
