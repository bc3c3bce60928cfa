"""Token log-probabilities from rows of logits (generated tokens and a prompt's), held
to a plain float64 log-softmax of each whole row."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from orin.engine.sampling import LOGPROB_BLOCK, token_logprobs

BACKEND = SimpleNamespace(detokenize=lambda ids: f"<{ids[0]}>")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    rows = logits.astype(np.float64)
    rows = rows - rows.max(axis=1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("top_n", [None, 0, 1, 5])
def test_each_row_scores_its_token_and_its_most_likely_ones(top_n: int | None) -> None:
    rng = np.random.default_rng(7)
    n_rows, vocab = 2 * LOGPROB_BLOCK + 5, 3000  # blocks, and a partial one
    logits = (rng.standard_normal((n_rows, vocab)) * 5).astype(np.float32)
    tokens = [int(t) for t in rng.integers(0, vocab, n_rows)]
    want = log_softmax(logits)
    got = token_logprobs(BACKEND, logits, tokens, top_n)  # type: ignore[arg-type]
    assert [lp.token_id for lp in got] == tokens
    np.testing.assert_allclose([lp.logprob for lp in got], want[range(n_rows), tokens], atol=1e-5)
    for row, lp in enumerate(got):
        best = np.argsort(-want[row], kind="stable")[: top_n or 0]
        assert [t.token_id for t in lp.top] == best.tolist()
        np.testing.assert_allclose([t.logprob for t in lp.top], want[row, best], atol=1e-5)
        assert [t.text for t in lp.top] == [f"<{i}>" for i in best]


def test_logits_far_from_zero_keep_their_precision() -> None:
    """The log-sum-exp is taken after the row's peak is taken off: logits in the
    thousands neither overflow nor lose the small differences."""
    logits = np.array([[3000.0, 2999.0, 2990.0]], dtype=np.float32)
    got = token_logprobs(BACKEND, logits, [1], 2)[0]  # type: ignore[arg-type]
    want = log_softmax(logits)[0]
    assert got.logprob == pytest.approx(want[1], abs=1e-6)
    assert [t.token_id for t in got.top] == [0, 1]
