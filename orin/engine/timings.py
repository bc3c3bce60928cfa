"""Per-request timestamps on one monotonic clock, turned into RequestTimings.

Definitions follow the serving benchmarks most published numbers use: t0 is
the request's arrival at the engine; TTFT includes queueing; TPOT excludes the
first token (it ends prefill, it is not a decode step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orin.engine.types import RequestTimings

now_ns = time.perf_counter_ns  # the clock the telemetry sampler shares


@dataclass
class TimingRecorder:
    arrival_ns: int = field(default_factory=now_ns)
    prefill_start_ns: int | None = None
    token_ns: list[int] = field(default_factory=list)
    encode_ns: int = 0  # images encoded for the request (its own phase, inside prefill)
    images: int = 0

    def prefill_started(self, t: int) -> None:
        if self.prefill_start_ns is None:
            self.prefill_start_ns = t

    def token(self, t: int) -> None:
        self.token_ns.append(t)

    def result(
        self,
        end_ns: int,
        prompt: int,
        cached: int,
        shifts: int,
        drafted: int = 0,
        accepted: int = 0,
        draft_stopped: bool = False,
    ) -> RequestTimings:
        ms = 1e-6
        start = self.prefill_start_ns if self.prefill_start_ns is not None else end_ns
        first = self.token_ns[0] if self.token_ns else end_ns
        last = self.token_ns[-1] if self.token_ns else end_ns
        n = len(self.token_ns)
        itl = tuple((b - a) * ms for a, b in zip(self.token_ns, self.token_ns[1:], strict=False))
        return RequestTimings(
            queue_ms=(start - self.arrival_ns) * ms,
            prefill_ms=(first - start) * ms,
            ttft_ms=(first - self.arrival_ns) * ms,
            tpot_ms=(last - first) * ms / (n - 1) if n >= 2 else None,
            e2e_ms=(last - self.arrival_ns) * ms,
            itl_ms=itl,
            prompt_tokens=prompt,
            cached_tokens=cached,
            generated_tokens=n,
            context_shifts=shifts,
            drafted_tokens=drafted,
            accepted_tokens=accepted,
            draft_stopped=draft_stopped,
            encode_ms=self.encode_ns * ms,
            images=self.images,
            arrival_ns=self.arrival_ns,
            prefill_start_ns=start,
            first_token_ns=first,
            last_token_ns=last,
        )
