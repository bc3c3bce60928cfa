"""How many llama.cpp passes (micro-batches) one engine step costs.

``llama_decode`` splits a batch into micro-batches and runs the whole model
once per micro-batch, so each one reads every weight again: on a
bandwidth-bound board the number of passes, not the number of tokens, sets a
decode step's time. llama.cpp's rule depends on the KV layout:

- one KV buffer for all slots (``kv_unified``): consecutive tokens, up to
  ``n_ubatch`` each (``split_simple``);
- one KV stream per slot: each micro-batch takes sequences with consecutive
  increasing ids, starting at the first unused token, and the same number of
  tokens from each of them (``split_equal`` with ``sequential``). A hole in the
  busy slot ids, or a prompt chunk beside single decode tokens, starts another
  pass.

``micro_batches`` replays that rule on a batch's items (sequence id, token
count, in batch order); tests/integration/test_ubatch.py checks it against
llama.cpp's own graph computations.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise


def micro_batches(items: Sequence[tuple[int, int]], n_ubatch: int, unified: bool) -> int:
    """Passes llama.cpp makes for a batch of ``(seq_id, n_tokens)`` runs in batch order
    (each run's tokens consecutive, one sequence per token)."""
    total = sum(n for _, n in items)
    if total == 0:
        return 0
    if unified:
        return -(-total // n_ubatch)
    if (  # the steady decode step: one token per slot at consecutive ids is one pass
        len(items) <= n_ubatch
        and all(n == 1 for _, n in items)
        and all(b[0] == a[0] + 1 for a, b in pairwise(items))
    ):
        return 1
    # tokens left per sequence, and the sequences in order of their first unused token
    left: dict[int, int] = {}
    order: list[int] = []
    for seq, n in items:
        if n <= 0:
            continue
        if seq not in left:
            order.append(seq)
            left[seq] = 0
        left[seq] += n
    passes = 0
    while order:
        # sequences of this pass: the first unused one, then each next id in batch order
        chosen = [order[0]]
        for seq in order[1:]:
            if seq == chosen[-1] + 1:
                chosen.append(seq)
            if len(chosen) > n_ubatch:
                break
        # the same number of tokens from each, while all have some and it fits n_ubatch
        per_seq = min(left[s] for s in chosen)
        per_seq = min(per_seq, max(1, n_ubatch // len(chosen)))
        for s in chosen:
            left[s] -= per_seq
        order = [s for s in order if left[s] > 0]
        passes += 1
    return passes
