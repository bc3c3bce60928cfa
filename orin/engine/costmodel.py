"""How long an engine step takes, learned from the engine's own steps, and the prompt
tokens a step may carry so running streams keep their time per output token.

A step's time is modelled as

    t = a * passes + b * decode_rows + c * prompt_tokens

``passes`` are llama.cpp's micro-batches (each reads every weight once: the
bandwidth-bound part), ``decode_rows`` the tokens of running streams and
``prompt_tokens`` the prompt chunk (the compute-bound part).

The coefficients are learned in two parts, so that each is identifiable from
the steps an engine actually runs:

- ``a`` and ``b`` from decode-only steps (``passes`` and ``decode_rows`` vary as
  streams come and go): recursive least squares with a forgetting factor;
- ``c`` from steps that carry prompt tokens: the time left once the decode part
  (``a * passes + b * rows``) is taken off, per prompt token, as an exponentially
  weighted ratio (tokens weigh in proportion to their number).

A single three-way fit would not do: while a long prompt arrives in chunks of
one size beside the same streams, a prompt step always has one more pass and
the same number of prompt tokens, so the fit could not tell a pass from the
tokens, and a pessimistic start would keep the chunks at the floor for good.
The first prompt of a fresh engine is always prefilled alone (nothing decodes
yet), so ``c`` is measured before it is first needed. Forgetting lets both
parts follow a board whose clocks change (power mode, thermal throttling).

``prompt_budget`` answers: with ``rows`` streams decoding, how many prompt
tokens fit in a step that must end within the target (the profile's
``slo.tpot_p90_ms`` less a margin, since one step is one inter-token gap of
each running stream)? Never fewer than a floor, so a long prompt still
progresses when the target cannot be met, and the whole chunk when nothing is
decoding. When even the floor's step is predicted above the target, the policy
says so (``unmet_ms``), and the engine warns: the target is below what a step
with any prompt tokens costs on this machine.
"""

from __future__ import annotations

from collections.abc import Callable

FORGET = 0.98
"""Weight of past steps per new step: about the last 50 steps count."""
MARGIN = 0.85
"""Fraction of the TPOT target a step may take: the 90th percentile must hold with
the model's error and the time outside the step (sampling, text) on top."""
MIN_CHUNK = 16
"""Prompt tokens per step at least, whatever the target: a long prompt progresses."""
SETTLED_STEPS = 16
"""Steps the model must have seen, a prompt step among them, before its predictions
are taken as the machine's (a fresh model's prior is deliberately pessimistic)."""
OUTLIER = 4.0
"""Once settled, a step is learned as taking at most this many times its prediction:
a step the kernel held off the CPU, a garbage collection or a page fault storm
does not set the machine's cost (on the shared 2-core development VM one such step
of the tiny demo model put a pass at 30 ms where whole steps took under 1 ms, and
the prompt budget went to its floor). A lasting slowdown (a power mode,
throttling) is still followed, by up to this factor per step. Before the model
has settled nothing is clipped: there is no prediction to hold a step to yet."""


def _clip(v: float) -> float:
    return -1e6 if v < -1e6 else 1e6 if v > 1e6 else v


class StepCostModel:
    def __init__(self, forget: float = FORGET) -> None:
        # decode part: (ms per pass, ms per decode row) and its 2x2 covariance, in
        # plain floats: the same update with numpy arrays took 24 us a step against
        # 1.5 us (timeit, Zen 3 development VM), 4 % of the engine's gap between two
        # decodes. The prior is weak and optimistic about passes, pessimistic about
        # prompt tokens
        self.t0, self.t1 = 1.0, 0.1
        self.p00, self.p01, self.p11 = 100.0, 0.0, 10.0
        self.forget = forget
        self._token_ms = 0.0  # weighted sums of the prompt part's time and tokens
        self._tokens = 0.0
        self.steps = 0

    @property
    def settled(self) -> bool:
        """Enough steps seen, one with prompt tokens among them, to trust a prediction."""
        return self.steps >= SETTLED_STEPS and self._tokens > 0

    def observe(self, passes: int, rows: int, prompt: int, ms: float) -> None:
        """One finished step: its shape and its duration in milliseconds."""
        if passes <= 0 or ms <= 0:
            return
        if self.settled:
            ms = min(ms, OUTLIER * max(self.predict(passes, rows, prompt), 1e-3))
        self.steps += 1
        if prompt == 0:
            x0, x1, lam = float(passes), float(rows), self.forget
            px0 = self.p00 * x0 + self.p01 * x1
            px1 = self.p01 * x0 + self.p11 * x1
            denom = lam + x0 * px0 + x1 * px1
            g0, g1 = px0 / denom, px1 / denom
            err = ms - (x0 * self.t0 + x1 * self.t1)
            self.t0 += g0 * err
            self.t1 += g1 * err
            # bounded through long steady stretches
            self.p00 = _clip((self.p00 - g0 * px0) / lam)
            self.p01 = _clip((self.p01 - g0 * px1) / lam)
            self.p11 = _clip((self.p11 - g1 * px1) / lam)
            return
        a, b = self._decode()
        rest = max(ms - a * passes - b * rows, 0.0)
        self._token_ms = self._token_ms * self.forget + rest
        self._tokens = self._tokens * self.forget + prompt

    def _decode(self) -> tuple[float, float]:
        return max(self.t0, 0.0), max(self.t1, 0.0)

    def coefficients(self) -> tuple[float, float, float]:
        """(ms per pass, per decode row, per prompt token); a prompt token costs 1 ms
        until a prompt step has been seen."""
        a, b = self._decode()
        c = self._token_ms / self._tokens if self._tokens > 0 else 1.0
        return a, b, max(c, 1e-4)

    def predict(self, passes: int, rows: int, prompt: int) -> float:
        a, b, c = self.coefficients()
        return a * passes + b * rows + c * prompt


StepCost = tuple[float, float, int]
"""What a draft's length weighs: (ms per llama.cpp pass, ms per decode row, the rows
the step has without the draft)."""


def draft_length(p: float, a: float, b: float, rows: int, k_max: int) -> int:
    """The number of tokens to draft for one stream that maximizes its tokens per unit
    of step time: a draft of ``k`` tokens, each accepted with probability ``p`` given
    the ones before, yields ``1 + p + ... + p**k`` tokens in a step that costs ``b * k``
    more than the ``a + b * rows`` of a step without it. Where a row is nearly free
    beside a pass (a GPU reading weights) the whole draft pays; where every row costs
    as much as the pass (a small model on a CPU) only likely drafts do."""
    best_k, best = 0, 1.0 / max(a + b * rows, 1e-9)
    expected, chance = 0.0, 1.0
    for k in range(1, k_max + 1):
        chance *= p
        expected += chance
        rate = (1.0 + expected) / max(a + b * (rows + k), 1e-9)
        if rate > best:
            best_k, best = k, rate
    return best_k


class ChunkPolicy:
    """The prompt-token budget of a step, from the cost model and the TPOT target.

    ``passes(rows, prompt)`` says how many llama.cpp passes a step of that shape
    costs (one KV stream per slot: a prompt chunk beside decode rows is a pass of
    its own; one shared buffer: one pass per n_ubatch tokens).
    """

    def __init__(
        self,
        target_ms: float | None,
        cap: int,
        passes: Callable[[int, int], int],
        model: StepCostModel | None = None,
    ) -> None:
        self.target_ms = target_ms
        self.cap = cap
        self.passes = passes
        self.model = model or StepCostModel()
        self.learn = target_ms is not None  # the engine sets it when speculation reads it too
        # the latest budget's step at the floor, predicted, when it exceeds the target
        # (None: the target holds, or nothing to tell yet)
        self.unmet_ms: float | None = None

    def budget(self, rows: int) -> int:
        """Prompt tokens a step with ``rows`` decoding streams may carry."""
        if self.target_ms is None or rows == 0:
            return self.cap
        floor = min(MIN_CHUNK, self.cap)
        limit = self.target_ms * MARGIN
        _, _, per_token = self.model.coefficients()
        # the passes depend on the chunk (a second pass once it exceeds n_ubatch with
        # one buffer): estimate with the decode-only count, then check the candidate
        base = self.model.predict(self.passes(rows, 1), rows, 0)
        n = int((limit - base) / per_token)
        n = max(floor, min(self.cap, n))
        while n > floor and self.model.predict(self.passes(rows, n), rows, n) > limit:
            n = max(floor, n * 3 // 4)
        self.unmet_ms = None
        if n == floor and self.model.settled:
            step = self.model.predict(self.passes(rows, n), rows, n)
            if step > self.target_ms:
                self.unmet_ms = step
        return n

    def observe(self, passes: int, rows: int, prompt: int, ms: float) -> None:
        """Learn from a step; without a target nothing reads the model, so nothing is
        spent on it."""
        if self.learn:
            self.model.observe(passes, rows, prompt, ms)
