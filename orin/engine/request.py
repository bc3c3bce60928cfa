"""One request inside the engine: its sampler, text state, timings and stream."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from orin.engine.backend import Backend
from orin.engine.costmodel import StepCost
from orin.engine.detok import Detokenizer, StopMatcher
from orin.engine.sampling import SlotSampler, token_logprobs
from orin.engine.stream import RequestStream
from orin.engine.timings import TimingRecorder
from orin.engine.types import FinishReason, SamplingParams, TokenEvent, TokenLogprob
from orin.engine.vision import MediaPrompt, is_image


class Drafter(Protocol):
    """A request's speculative decoding state (orin.engine.specrun)."""

    def draft(
        self, max_tokens: int, cost: Callable[[], StepCost] | None = None
    ) -> Sequence[int]: ...

    def extend(self, token: int) -> None: ...

    def verified(self, drafted: int, accepted: int) -> None: ...

    @property
    def stopped(self) -> bool:
        """Speculation switched itself off for the request (its drafts kept failing)."""
        ...


@dataclass
class ActiveRequest:
    """Implements the scheduler's SchedRequest; everything else is engine-side."""

    id: str
    prompt_tokens: list[int]
    params: SamplingParams
    stream: RequestStream
    timings: TimingRecorder = field(default_factory=TimingRecorder)
    sampler: SlotSampler | None = None
    detok: Detokenizer | None = None
    stop: StopMatcher | None = None
    generated: int = 0
    stop_matched: bool = False
    spec: Drafter | None = None  # speculative decoding, when the profile turns it on
    drafted: int = 0
    accepted: int = 0
    media: MediaPrompt | None = None  # the prompt's images (negative ids in prompt_tokens)
    # logprobs of tokens whose text is held back (``_release``): (where the token's text
    # starts in the detokenized output, its logprob)
    held_logprobs: list[tuple[int, TokenLogprob]] = field(default_factory=list)
    produced: int = 0  # characters the detokenizer has given (stop strings not taken off)
    emitted: int = 0  # characters sent to the client
    # SamplingParams.prompt_logprobs: those of the prompt tokens computed so far (from
    # the second on), sent in one event when the prompt is done (``prompt_done``)
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    # all of them, once the prompt is done: a request scoring the same prompt (another
    # of the ``n`` choices) shares them (``leader``)
    scores: tuple[TokenLogprob, ...] | None = None
    # the request that computes this one's prompt log-probabilities: this one waits
    # for it and copies its cells instead of computing every position again
    leader: ActiveRequest | None = None

    @property
    def all_logits(self) -> bool:
        """The scheduler's hint: every prompt position's logits are needed (not when
        another request computes them for this one)."""
        return self.params.prompt_logprobs and self.leader is None

    @property
    def held(self) -> bool:
        """The scheduler's hint: not to start before the leader's prompt is scored."""
        return self.leader is not None and self.leader.scores is None

    def shares_scores_of(self, other: ActiveRequest) -> bool:
        """Whether ``other`` (or its leader) computes the prompt log-probabilities this
        request asks for: the same prompt, with as many alternatives."""
        return (
            self.params.prompt_logprobs
            and other.params.prompt_logprobs
            and other.params.logprobs == self.params.logprobs
            and other.prompt_tokens == self.prompt_tokens
        )

    def score_prompt(
        self, backend: Backend, logits: npt.NDArray[np.float32], pos: int, n: int
    ) -> None:
        """The log-probabilities of the prompt tokens that the logits of positions
        ``pos`` to ``pos + n - 1`` predict (each row, the token after it); the last
        prompt position's row starts the answer instead."""
        prompt = self.prompt_tokens
        targets = prompt[pos + 1 : min(pos + n + 1, len(prompt))]
        self.prompt_scores += token_logprobs(
            backend, logits[: len(targets)], targets, self.params.logprobs
        )

    def prompt_done(self) -> None:
        """The prompt is computed: its log-probabilities go out, before any token."""
        if self.params.prompt_logprobs:
            if self.leader is not None:
                assert self.leader.scores is not None  # ``held`` until then
                self.scores = self.leader.scores
            else:
                self.scores, self.prompt_scores = tuple(self.prompt_scores), []
            self.stream.put(TokenEvent(self.id, None, "", prompt_logprobs=self.scores))

    def verified(self, drafted: int, accepted: int) -> None:
        """A step checked ``drafted`` speculative tokens and kept ``accepted``."""
        self.drafted += drafted
        self.accepted += accepted
        if self.spec is not None:
            self.spec.verified(drafted, accepted)

    def start(self, backend: Backend) -> None:
        """Builds the sampler and text state; runs at submit, so a grammar that does not
        parse is the client's error (400), not a failure inside the engine loop."""
        if self.sampler is None:
            prompt = self.prompt_tokens
            if self.media is not None:  # penalties count text tokens, not image rows
                prompt = [t for t in prompt if not is_image(t)]
            self.sampler = SlotSampler(backend, self.params, prompt)
            preserve = frozenset(self.params.preserve)

            def piece(t: int) -> bytes:
                return backend.special_piece(t) if t in preserve else backend.piece(t)

            self.detok = Detokenizer(piece if preserve else backend.piece)
            self.stop = StopMatcher(self.params.stop)

    def on_token(
        self, backend: Backend, token: int, logits: npt.NDArray[np.float32] | None, t_ns: int
    ) -> FinishReason | None:
        """Emit the token's event; return a finish reason when the request is done.
        ``logits`` (the row the token came from) is needed only for logprobs."""
        assert self.detok is not None and self.stop is not None and self.sampler is not None
        self.timings.token(t_ns)
        self.generated += 1
        if self.spec is not None:
            self.spec.extend(token)
        if token in self.params.stop_token_ids or (
            not self.params.ignore_eos and backend.is_eog(token)
        ):  # counted and reported by id, but it ends the text rather than adding to it:
            # no logprob either, since the logprobs are those of the text's tokens
            self.stream.put(TokenEvent(self.id, token, ""))
            return "stop"
        piece = self.detok.add(token)
        text, self.stop_matched = self.stop.feed(piece)
        logprob = None
        if self.params.logprobs is not None:
            assert logits is not None
            logprob = self._release(self.sampler.logprob(token, logits), len(piece), len(text))
        self.stream.put(TokenEvent(self.id, token, text, logprob))
        if self.stop_matched:
            self.held_logprobs.clear()  # the stop string's tokens: their text is not sent
            return "stop"
        if self.generated >= self.params.max_tokens:
            return "length"
        return None

    def _release(self, logprob: TokenLogprob, produced: int, sent: int) -> TokenLogprob | None:
        """A token's logprob goes with its text: while a possible stop string holds the
        text back, so is the logprob, and the tokens of a stop string that completes
        never have theirs sent (the logprobs are those of the text the client gets, as
        OpenAI's are). The logprobs of earlier tokens that this token's text releases
        are sent first, as events of their own; the token's own logprob, when its text
        starts within what is sent, rides with its event."""
        start = self.produced
        self.produced += produced
        self.emitted += sent
        if not self.held_logprobs and start < self.emitted:
            return logprob  # the common case: nothing held
        self.held_logprobs.append((start, logprob))
        ready = [lp for at, lp in self.held_logprobs if at < self.emitted]
        if not ready:
            return None
        del self.held_logprobs[: len(ready)]
        own = ready.pop() if ready[-1] is logprob else None
        for lp in ready:
            self.stream.put(TokenEvent(self.id, None, "", lp))
        return own

    def tail_text(self) -> str:
        """Text still held back, released at the end unless a stop string ended it.
        The logprobs held with it are sent first (their text comes with the final
        event)."""
        if self.detok is None or self.stop is None or self.stop_matched:
            return ""
        text, hit = self.stop.feed(self.detok.flush())
        text = text if hit else text + self.stop.flush()
        self.emitted += len(text)
        held, self.held_logprobs = self.held_logprobs, []
        for at, lp in held:  # the tokens of the text sent at the end
            if not hit or at < self.emitted:
                self.stream.put(TokenEvent(self.id, None, "", lp))
        return text

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
