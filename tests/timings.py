"""RequestTimings of a finished request, for tests of what reads them."""

from __future__ import annotations

from orin.engine.types import RequestTimings


def finished(generated: int, ttft_ms: float) -> RequestTimings:
    """A request that produced ``generated`` tokens, the first at ``ttft_ms`` (none: it
    ended then, e.g. cancelled while queued), then one a millisecond."""
    return RequestTimings(
        queue_ms=ttft_ms,
        prefill_ms=0.0,
        ttft_ms=ttft_ms,
        tpot_ms=None,
        e2e_ms=ttft_ms + generated,
        itl_ms=(1.0,) * max(generated - 1, 0),
        prompt_tokens=36,
        cached_tokens=0,
        generated_tokens=generated,
        context_shifts=0,
    )
