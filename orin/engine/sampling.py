"""Per-slot sampling: a greedy fast path, llama.cpp sampler chains otherwise."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from orin.engine.backend import Backend
from orin.engine.errors import InvalidRequest
from orin.engine.grammar import depth_problem
from orin.engine.types import SamplingParams, TokenLogprob, TopLogprob
from orin.llamacpp import capture_log, client_input, pass_on, with_stderr

PARSE_ERROR = "error parsing grammar: "  # llama.cpp's parser: "parse: " PARSE_ERROR what
WHY_MAX = 200  # characters of the parser's reason in the 400's message
NOT_WHY = {"", "failed to parse grammar"}  # llama.cpp's log lines that say no reason

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp picks a random seed


class SlotSampler:
    """Samples one request's tokens from the logits row the runner points at."""

    def __init__(self, backend: Backend, params: SamplingParams, prompt: Iterable[int]) -> None:
        self.backend = backend
        self.lib = backend.lib
        self.params = params
        self.bias = dict(params.logit_bias)
        if params.ignore_eos:
            for t in backend.eog_tokens():
                self.bias[t] = float("-inf")
        self.chain: Any = None
        self._penalties: Any = None
        needs_chain = not params.greedy or bool(params.grammar) or params.penalized
        # plain argmax over the raw logits: the engine batches these across slots
        self.plain_greedy = not needs_chain and not self.bias
        if needs_chain:
            self.chain = self._build_chain()
            if self._penalties is not None:
                for t in prompt:  # penalties count the prompt as llama.cpp's server does
                    self.lib.llama_sampler_accept(self._penalties, t)

    def _build_chain(self) -> Any:
        lib, p = self.lib, self.params
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        add = lambda s: lib.llama_sampler_chain_add(chain, s)  # noqa: E731
        if self.bias:
            arr = (lib.llama_logit_bias * len(self.bias))()
            for i, (tok, b) in enumerate(self.bias.items()):
                arr[i].token, arr[i].bias = tok, b
            add(lib.llama_sampler_init_logit_bias(self.backend.n_vocab, len(self.bias), arr))
        if p.grammar:
            source = p.grammar
            too_deep = depth_problem(source)  # llama.cpp would overflow its stack on it
            if too_deep is not None:
                lib.llama_sampler_free(chain)
                raise InvalidRequest(p.grammar_field, f"the grammar {too_deep}")
            with client_input(), capture_log() as logged:
                grammar, printed = with_stderr(
                    lambda: lib.llama_sampler_init_grammar(
                        self.backend.vocab, source.encode("utf-8"), b"root"
                    )
                )
            why, rest = parse_error(printed, source)
            pass_on(rest)
            if not grammar:
                lib.llama_sampler_free(chain)
                if why is None:  # a check after parsing says why in llama.cpp's log
                    why = next((ln for ln in map(str.strip, logged) if ln not in NOT_WHY), "")
                said = f": {_short(why)}" if why else ""
                raise InvalidRequest(p.grammar_field, f"the grammar does not parse{said}")
            add(grammar)
        if p.penalized:
            self._penalties = lib.llama_sampler_init_penalties(
                self.backend.n_vocab,
                p.penalty_last_n,
                p.repeat_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            )
            add(self._penalties)
        if p.greedy:
            add(lib.llama_sampler_init_greedy())
            return chain
        if p.top_k > 0:
            add(lib.llama_sampler_init_top_k(p.top_k))
        add(lib.llama_sampler_init_top_p(p.top_p, 1))
        add(lib.llama_sampler_init_min_p(p.min_p, 1))
        add(lib.llama_sampler_init_temp(p.temperature))
        add(lib.llama_sampler_init_dist(DEFAULT_SEED if p.seed is None else p.seed))
        return chain

    def sample(self, row: int, logits: npt.NDArray[np.float32] | None) -> int:
        """The next token from batch position ``row``; ``logits`` (that row's) is only
        read without a llama.cpp chain."""
        if self.chain is not None:
            return int(self.lib.llama_sampler_sample(self.chain, self.backend.ctx, row))
        assert logits is not None
        if not self.bias:
            return int(np.argmax(logits))
        biased = logits.copy()
        for tok, b in self.bias.items():
            biased[tok] += b
        return int(np.argmax(biased))

    def logprob(self, token: int, logits: npt.NDArray[np.float32]) -> TokenLogprob:
        """The sampled token's log-probability and the top-N alternatives (raw model)."""
        return token_logprobs(self.backend, logits[np.newaxis], [token], self.params.logprobs)[0]

    def close(self) -> None:
        if self.chain is not None:
            self.lib.llama_sampler_free(self.chain)
            self.chain = None


LOGPROB_BLOCK = 32
"""Rows of logits turned into log-probabilities at once: a block of float32 copies of
the vocabulary (32 x 128k x 4 bytes = 16 MiB for a Llama 3 vocabulary)."""


def token_logprobs(
    backend: Backend,
    logits: npt.NDArray[np.float32],
    tokens: Sequence[int],
    top_n: int | None,
) -> list[TokenLogprob]:
    """The log-probability of ``tokens[i]`` under row i of ``logits`` (the raw model's
    distribution: the logit less the row's log-sum-exp, whose sum is taken in float64)
    with the ``top_n`` most likely tokens of that row, most likely first.

    Only the values asked for are taken from the row, never a whole row of
    log-probabilities: a prompt's log-probabilities take a row per prompt token, on
    the engine thread between two decodes."""
    out: list[TokenLogprob] = []
    n = top_n or 0
    for start in range(0, len(tokens), LOGPROB_BLOCK):
        block = logits[start : start + LOGPROB_BLOCK]
        rows = np.arange(len(block))
        peak = block.max(axis=1)
        shifted = block - peak[:, np.newaxis]
        np.exp(shifted, out=shifted)
        lse = peak.astype(np.float64) + np.log(shifted.sum(axis=1, dtype=np.float64))
        targets = np.asarray(tokens[start : start + LOGPROB_BLOCK])
        picked = block[rows, targets].astype(np.float64) - lse
        if n == 1:
            best = block.argmax(axis=1)[:, np.newaxis]
        elif n:
            best = np.argpartition(block, -n, axis=1)[:, -n:]
            order = np.argsort(-np.take_along_axis(block, best, axis=1), axis=1, kind="stable")
            best = np.take_along_axis(best, order, axis=1)
        for r, token in enumerate(targets.tolist()):
            top: tuple[TopLogprob, ...] = ()
            if n:
                top = tuple(
                    TopLogprob(i, backend.detokenize([i]), float(block[r, i] - lse[r]))
                    for i in best[r].tolist()
                )
            out.append(TokenLogprob(token, float(picked[r]), top))
    return out


def parse_error(printed: str, source: str) -> tuple[str | None, str]:
    """llama.cpp's grammar parser prints ``parse: error parsing grammar: <why>``, a
    blank line and the whole grammar to stderr (``with_stderr`` caught it): the
    reason (it may run over lines: the rest of the grammar after the error), and
    the text around that block (other threads' writes), to pass on. (None,
    printed) when the block is not there."""
    start = printed.find(PARSE_ERROR)
    tail = "\n\n" + source + "\n"
    end = printed.find(tail, start) if start >= 0 else -1
    if end < 0:
        return None, printed
    line_start = printed.rfind("\n", 0, start) + 1  # the "parse: " prefix too
    why = printed[start + len(PARSE_ERROR) : end]
    return why, printed[:line_start] + printed[end + len(tail) :]


def _short(why: str) -> str:
    """The reason on one line, at most ``WHY_MAX`` characters."""
    why = " ".join(why.split())
    return why if len(why) <= WHY_MAX else why[: WHY_MAX - 1] + "…"
