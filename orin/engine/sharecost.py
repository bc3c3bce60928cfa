"""What copying a KV stream costs, in prompt tokens, measured when the model loads.

A new prompt that shares a prefix with another slot's cells can copy them
(``llama_memory_seq_cp``) instead of computing them again. With one KV stream
per slot the copy moves the whole stream, every layer's K and V for all of the
slot's cells, whatever the prefix's length; llama.cpp does it at the start of
the next decode. So it pays only when the prompt tokens it saves cost more.
Both costs depend on the machine and the model: on the 2-core development VMs
a stream of 512 cells of the medium demo model copied in the time of one or
two prompt tokens, while a fixed threshold of 16 tokens (``SHARE_MIN``) made
a request that shared 6 tokens with the previous one prefill them all
(docs/performance.md, "Another machine; a copy's cost, measured at load").

``measure`` times, on two empty sequences before the engine serves anything:
a one-token decode, the same with a copy of the other sequence pending, and a
16-token prompt chunk (the marginal cost of a short prompt's tokens, the ones
a shared prefix saves; on a GPU they are nearly free beside the pass). The
threshold is the copy's cost over a prompt token's, rounded up, within 1 and
``SHARE_MIN``: a machine that measures high keeps the fixed rule. With one
buffer for all slots a copy only tags cells, and measures close to nothing.
Medians of a few of each, so one slow decode on a busy machine moves little.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass

from orin.engine.runner import Runner
from orin.engine.scheduler import SHARE_MIN, Batch, BatchItem, Copy, KVOp, Remove

log = logging.getLogger(__name__)

CHUNK = 16  # prompt tokens of the chunk a prompt token's cost is taken from
REPEATS = 3  # decodes of each kind; the median counts


@dataclass(frozen=True)
class ShareCost:
    token_ms: float  # one decode of one token
    chunk_ms: float  # one decode of CHUNK prompt tokens
    copy_ms: float  # one decode of one token with a stream copy pending

    @property
    def per_prompt_token_ms(self) -> float:
        return (self.chunk_ms - self.token_ms) / (CHUNK - 1)

    @property
    def per_copy_ms(self) -> float:
        return max(self.copy_ms - self.token_ms, 0.0)

    def threshold(self) -> int:
        """Prompt tokens a copy must save to pay, within 1 and SHARE_MIN."""
        per_token = self.per_prompt_token_ms
        if per_token <= 0:  # noise swamped the chunk: keep the fixed rule
            return SHARE_MIN
        return max(1, min(SHARE_MIN, math.ceil(self.per_copy_ms / per_token)))


def measure(runner: Runner, token: int, src: int = 1, dst: int = 0) -> ShareCost:
    """Time the three decodes on sequences ``src`` and ``dst`` (both empty, left
    empty): ``token`` is any valid token id, fed repeatedly."""
    pos = {src: 0, dst: 0}

    def decode(seq: int, n: int, ops: tuple[KVOp, ...] = ()) -> float:
        item = BatchItem(seq, (token,) * n, pos[seq], True, prefill=n > 1)
        batch = Batch(ops, (item,), ())
        runner.apply(batch.ops)
        t = time.perf_counter_ns()
        runner.decode(batch)
        pos[seq] += n
        return (time.perf_counter_ns() - t) * 1e-6

    try:
        decode(src, CHUNK)  # a stream worth copying, and the first decode's warm-up
        decode(dst, CHUNK)
        tokens = [decode(dst, 1) for _ in range(REPEATS)]
        chunks = [decode(dst, CHUNK) for _ in range(REPEATS)]
        copies = []
        for _ in range(REPEATS):
            pos[dst] = pos[src]  # dst's cells become src's, as when a prompt takes a prefix
            copies.append(decode(dst, 1, (Remove(dst, 0, -1), Copy(src, dst))))
        return ShareCost(*map(statistics.median, (tokens, chunks, copies)))
    finally:
        runner.apply([Remove(src, 0, -1), Remove(dst, 0, -1)])


def share_min(runner: Runner, token: int) -> int:
    """The measured threshold, logged with what it came from."""
    cost = measure(runner, token)
    n = cost.threshold()
    if cost.per_prompt_token_ms <= 0:
        log.info(
            "the copy-cost probe was swamped by other work on this machine (a %d-token chunk "
            "took %.2f ms, one token %.2f ms): prompts copy another slot's cells when that "
            "saves %d tokens or more, the fixed rule",
            CHUNK,
            cost.chunk_ms,
            cost.token_ms,
            n,
        )
        return n
    log.info(
        "a KV stream copy costs %.2f ms, a prompt token %.3f ms: prompts copy another "
        "slot's cells when that saves %d token%s or more",
        cost.per_copy_ms,
        cost.per_prompt_token_ms,
        n,
        "" if n == 1 else "s",
    )
    return n
