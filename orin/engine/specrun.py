"""The engine's side of speculative decoding and of the persistent prompt cache.

``Speculation`` gives each request its drafter (n-gram lookup in its own
context, or a draft model shared by all slots) and the acceptance record that
switches it off when its drafts keep failing; the scheduler asks it for drafts
through ``Engine._drafts`` and the engine verifies them (``Engine._sample``).

``WarmCache`` restores the profile's saved system prompts into idle slots when
the model loads (computing and saving those not on disk yet), and afterwards
restores a saved prompt whenever a request starts with one that no slot holds.
Everything here runs on the engine thread.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from orin.engine.backend import Backend
from orin.engine.chat import ChatTemplate
from orin.engine.config import EngineConfig
from orin.engine.costmodel import StepCost, draft_length
from orin.engine.scheduler import BatchItem, Scheduler, SlotState
from orin.engine.speculative import (
    Acceptance,
    DraftModel,
    NgramDrafter,
    NgramState,
    load_draft_model,
)

if TYPE_CHECKING:
    from orin.engine.cachefiles import Entry
    from orin.engine.promptcache import PromptCache
    from orin.engine.runner import Runner

log = logging.getLogger("orin.engine")


class RequestSpec:
    """One request's drafts: implements request.Drafter."""

    def __init__(self, context: NgramState, acceptance: Acceptance, ngram: bool) -> None:
        self.context = context  # prompt + emitted tokens (and its n-gram index)
        self.acceptance = acceptance
        self.ngram = ngram
        self.proposed: list[int] = []  # the draft model's tokens for the next step
        self.stops = 0  # drafts that ended in a rejected token

    def draft(self, max_tokens: int, cost: Callable[[], StepCost] | None = None) -> Sequence[int]:
        """Up to ``max_tokens`` drafted tokens; with ``cost`` (giving ms per llama.cpp
        pass, per decode row, and the rows in the step), only as many as pay for their
        rows at this request's acceptance rate so far (``costmodel.draft_length``).
        The lookup comes first: most steps of a text that does not repeat itself find
        nothing to draft, and then pay for no cost figures."""
        k = min(self.acceptance.budget(), max_tokens)
        if k <= 0:
            return ()
        proposal = self.context.draft(k) if self.ngram else self.proposed[:k]
        if not proposal or cost is None:
            return proposal
        a, b, rows = cost()
        return proposal[: draft_length(self.continue_chance, a, b, rows, len(proposal))]

    def extend(self, token: int) -> None:
        self.context.extend((token,))
        if self.proposed:
            self.proposed = []

    @property
    def continue_chance(self) -> float:
        """The chance that a drafted token is accepted given the ones before it were: the
        accepted tokens over the accepted tokens and the rejections (a draft that ran to
        its end tested no token after it, so drafted tokens past a rejection do not
        count against it, as accepted/drafted would). A new request starts at 0.9, as if
        it had two drafted tokens behind it, one of them nine tenths accepted: so it
        drafts, and its own record takes over after a few drafts (a stingier start
        would never draft where a row costs as much as a pass, and never learn)."""
        accepted = self.acceptance.accepted
        return (accepted + 1.8) / (accepted + self.stops + 2)

    @property
    def stopped(self) -> bool:
        return not self.acceptance.enabled

    def verified(self, drafted: int, accepted: int) -> None:
        if accepted < drafted:
            self.stops += 1
        self.acceptance.record(drafted, accepted)


class Speculation:
    def __init__(self, cfg: EngineConfig, backend: Backend) -> None:
        spec = cfg.speculative
        self.cfg = spec
        # the n-gram index also keeps each request's context, which a draft model reads
        self.ngram = NgramDrafter.from_config(spec)
        self.model: DraftModel | None = (
            load_draft_model(cfg, backend) if spec.mode == "draft" else None
        )

    def for_request(self, request_id: str, prompt: Sequence[int]) -> RequestSpec:
        return RequestSpec(
            self.ngram.new(prompt), Acceptance.from_config(self.cfg), self.model is None
        )

    def prepare(self, scheduler: Scheduler) -> None:
        """Before a step: the draft model drafts for every decoding slot that still
        speculates, all slots in one llama_decode per drafted position."""
        if self.model is None:
            return
        contexts: dict[int, Sequence[int]] = {}
        wanted: dict[int, int] = {}
        specs: dict[int, RequestSpec] = {}
        for slot in scheduler.slots:
            spec = getattr(slot.request, "spec", None)
            if slot.state is not SlotState.DECODE or not isinstance(spec, RequestSpec):
                continue
            k = spec.acceptance.budget()
            if k > 0:
                contexts[slot.id], wanted[slot.id], specs[slot.id] = spec.context.tokens, k, spec
        if not contexts:
            return
        for seq, tokens in self.model.draft(contexts, wanted).items():
            specs[seq].proposed = tokens

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
            self.model = None


def system_prefix(chat: ChatTemplate, backend: Backend, system: str) -> list[int]:
    """The tokens every conversation with this system message starts with: the common
    prefix of two renders that differ only in the user's message (templates put the
    system message first, and some add text after it only once a user turn follows)."""
    renders = []
    for user in ("a", "b"):
        rendered = chat.render(
            [{"role": "system", "content": system}, {"role": "user", "content": user}]
        )
        renders.append(
            backend.tokenize(rendered.prompt, add_special=rendered.add_bos, parse_special=True)
        )
    a, b = renders
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def skip_reason(n_tokens: int, window: int) -> str | None:
    """Why a kept prompt of ``n_tokens`` (its part every conversation starts with) is
    not kept, or None."""
    if n_tokens < 2:
        return (
            f"the chat template gives it {n_tokens} token(s) that every conversation "
            "starting with it shares: too few to keep"
        )
    if n_tokens > window:
        return f"{n_tokens} tokens, more than the context window of a slot ({window})"
    return None


class WarmCache:
    """The persistent prompt cache as the engine uses it."""

    def __init__(
        self, cfg: EngineConfig, backend: Backend, runner: Runner, chat: ChatTemplate
    ) -> None:
        from orin.engine.cachekey import CacheKey
        from orin.engine.modeldigest import model_digest
        from orin.engine.promptcache import PromptCache

        pc = cfg.prompt_cache
        assert pc is not None
        self.backend, self.runner, self.cfg = backend, runner, cfg
        digest = model_digest(cfg.model_path, pc.directory)
        key = CacheKey.from_config(cfg, digest, backend.n_ctx_seq, backend.flash_attn)
        self.cache: PromptCache = PromptCache(pc.directory, key, pc.max_bytes)
        self.prompts = [system_prefix(chat, backend, text) for text in pc.prompts]

    def warm(self, scheduler: Scheduler) -> None:
        """Restore (or compute and save) each prompt; the first ones stay in idle slots
        as their prefix cache, one slot each, the rest wait on disk."""
        kept: dict[str, int] = {}  # the prompts' entries on disk: name -> bytes
        for i, tokens in enumerate(self.prompts):
            skip = skip_reason(len(tokens), scheduler.context.window)
            if skip is not None:
                log.warning("prompt cache: prompt %d skipped: %s", i, skip)
                continue
            seq = i if i < len(scheduler.slots) else len(scheduler.slots) - 1
            entry = self.cache.get(tokens)
            if entry is not None and self.cache.load(self.backend, seq, entry):
                log.info("prompt cache: prompt %d restored (%d tokens)", i, len(tokens))
            else:
                self._prefill(seq, tokens)
                entry = self.cache.save(self.backend, seq, tokens)
                if entry is not None:
                    log.info(
                        "prompt cache: prompt %d computed and saved (%d tokens)", i, len(tokens)
                    )
                else:  # why is the cache's warning (once, for a disabled cache)
                    log.info(
                        "prompt cache: prompt %d computed (%d tokens), not saved", i, len(tokens)
                    )
            if entry is not None:
                kept[entry.name] = entry.disk_bytes
            if i < len(scheduler.slots):
                slot = scheduler.slots[seq]
                slot.cache, slot.reusable = list(tokens), len(tokens)
            else:
                self.backend.lib.llama_memory_seq_rm(self.backend.memory, seq, 0, -1)
        self._warn_evicted(kept)

    def _warn_evicted(self, kept: dict[str, int]) -> None:
        """Prompts that evicted each other: each start would compute and write them all
        again, which only an INFO line per eviction said."""
        on_disk = {e.name for e in self.cache.entries()}
        evicted = [name for name in kept if name not in on_disk]
        if evicted:
            log.warning(
                "prompt cache: prompt_cache.max_bytes (%d) cannot hold the %d prompts "
                "together (%d bytes): %d of them were evicted to make room for the others "
                "and will be computed again at the next start; raise max_bytes",
                self.cache.max_bytes,
                len(kept),
                sum(kept.values()),
                len(evicted),
            )

    def _prefill(self, seq: int, tokens: list[int]) -> None:
        from orin.engine.scheduler import Batch

        self.backend.lib.llama_memory_seq_rm(self.backend.memory, seq, 0, -1)
        step = self.runner.n_batch
        for start in range(0, len(tokens), step):
            chunk = tuple(tokens[start : start + step])
            self.runner.decode(Batch((), (BatchItem(seq, chunk, start, False, prefill=True),)))

    def stored(self, prompt: list[int]) -> tuple[int, object] | None:
        entry = self.cache.find(prompt)
        return None if entry is None else (len(entry.tokens), entry)

    def counters(self) -> dict[str, int]:
        return dataclasses.asdict(self.cache.counters)

    def load(self, seq: int, entry: object) -> bool:
        return self.cache.load(self.backend, seq, _entry(entry))


def _entry(entry: object) -> Entry:
    return entry  # type: ignore[return-value]
