"""Waiting for /health after install: success, a failing unit, and the timeout."""

from __future__ import annotations

from orin.install.layout import SERVICE
from orin.install.probe import HttpResult, wait_healthy
from tests.fakes.host import FakeHost


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_times_out_with_the_last_answer_and_the_journal() -> None:
    host, clock = FakeHost(), Clock()
    host.active.add(SERVICE)

    def loading(url: str, timeout: float) -> HttpResult:
        return HttpResult(503, '{"status": "loading"}')

    out = wait_healthy(loading, "http://127.0.0.1:8080", host.runner, 5.0, clock.sleep, clock)
    assert not out.ok
    assert out.detail.startswith("not healthy after 5 s (unit active)")
    assert '{"status": "loading"}' in out.detail
    assert out.journal == host.journal.rstrip()
    assert clock.now == 5.0


def test_a_failed_load_stops_the_wait_at_once() -> None:
    host, clock = FakeHost(), Clock()

    def failed(url: str, timeout: float) -> HttpResult:
        return HttpResult(503, '{"status": "failed", "error": "out of memory"}')

    out = wait_healthy(failed, "http://x", host.runner, 300.0, clock.sleep, clock)
    assert not out.ok and "out of memory" in out.detail and clock.now == 0.0


def test_healthy_at_once() -> None:
    host, clock = FakeHost(), Clock()
    out = wait_healthy(
        lambda url, t: HttpResult(200, '{"status": "ok"}'), "http://x", host.runner, 9, clock.sleep
    )
    assert out.ok and out.detail == '{"status": "ok"}'
    assert host.calls == []  # no systemctl query needed
