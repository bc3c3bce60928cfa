"""How long an engine step takes, learned from the engine's own steps, and the prompt
tokens a step may carry so running streams keep their time per output token.

A step's time is modelled as

    t = a * passes + b * decode_rows + c * prompt_tokens

``passes`` are llama.cpp's micro-batches (each reads every weight once: the
bandwidth-bound part), ``decode_rows`` the tokens of running streams and
``prompt_tokens`` the prompt chunk (the compute-bound part). The three
coefficients are fitted online by recursive least squares with a forgetting
factor, so the model follows a board whose clocks change (power mode, thermal
throttling) within a few dozen steps. It starts from a prior that makes prompt
tokens expensive, so the first mixed steps are short rather than long, and the
prior is replaced as soon as steps have been seen.

``prompt_budget`` answers: with ``rows`` streams decoding, how many prompt
tokens fit in a step that must end within the target (the profile's
``slo.tpot_p90_ms`` less a margin, since one step is one inter-token gap of
each running stream)? Never fewer than a floor, so a long prompt still
progresses when the target cannot be met, and the whole chunk when nothing is
decoding.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

FORGET = 0.98
"""Weight of past steps per new step: about the last 50 steps count."""
MARGIN = 0.85
"""Fraction of the TPOT target a step may take: the 90th percentile must hold with
the model's error and the time outside the step (sampling, text) on top."""
MIN_CHUNK = 16
"""Prompt tokens per step at least, whatever the target: a long prompt progresses."""


class StepCostModel:
    def __init__(self, forget: float = FORGET) -> None:
        # prior: 10 ms per pass, 0.2 ms per decode row, 1 ms per prompt token; weak
        self.theta = np.array([10.0, 0.2, 1.0])
        self.p = np.diag([100.0, 1.0, 1.0])
        self.forget = forget
        self.steps = 0

    def observe(self, passes: int, rows: int, prompt: int, ms: float) -> None:
        """One finished step: its shape and its duration in milliseconds."""
        if passes <= 0 or ms <= 0:
            return
        x = np.array([float(passes), float(rows), float(prompt)])
        px = self.p @ x
        gain = px / (self.forget + x @ px)
        self.theta = self.theta + gain * (ms - x @ self.theta)
        self.p = (self.p - np.outer(gain, px)) / self.forget
        # keep P bounded when a feature never varies (decode-only stretches)
        np.clip(self.p, -1e6, 1e6, out=self.p)
        self.steps += 1

    def coefficients(self) -> tuple[float, float, float]:
        """(ms per pass, per decode row, per prompt token), each at least a small
        positive figure (a fit on collinear steps may wander below zero)."""
        a, b, c = (float(v) for v in self.theta)
        return max(a, 0.01), max(b, 0.0), max(c, 1e-4)

    def predict(self, passes: int, rows: int, prompt: int) -> float:
        a, b, c = self.coefficients()
        return a * passes + b * rows + c * prompt


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
        return n

    def observe(self, passes: int, rows: int, prompt: int, ms: float) -> None:
        self.model.observe(passes, rows, prompt, ms)
