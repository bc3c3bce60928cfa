"""Speculative decoding: what proposes draft tokens, and how well the drafts fare.

A speculating slot feeds ``[last_token, d1..dk]`` in one step and samples every
position with the request's own sampler; draft ``d(i+1)`` is accepted while the
token sampled at position ``i`` equals it (llama-server's rule). Each step then
emits the accepted drafts plus the one token sampled after them, so the output
is the one decoding without speculation gives, greedy or seeded: drafters only
propose, and nothing here touches logits or samplers.

Two drafters:

- ``NgramDrafter`` copies from the request's own context (prompt and output):
  where the context's last few tokens occurred before, the tokens that followed
  them then are proposed now. It costs a dictionary lookup per step and pays off
  where text repeats (quoting, editing, code).
- ``DraftModel`` runs a small model with the served model's vocabulary, one KV
  sequence per slot, and proposes its greedy continuation.

``Acceptance`` keeps one request's record: it sizes the next draft and turns
speculation off for a request whose drafts are mostly rejected, where
verifying them only costs.

Per step, for a speculating request: ``k = acceptance.budget(remaining)``; the
drafts come from ``state.draft(k)`` (n-gram) or ``DraftModel.draft`` (all
slots at once); the target samples the positions; ``accepted = verify(drafts,
sampled)``; ``acceptance.record(len(drafts), accepted)``; the emitted tokens
``sampled[:accepted + 1]`` go to ``state.extend``, and the KV cells of the
rejected drafts are removed from the target's sequence.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from orin.engine.backend import FLASH_ATTN, LOAD_MODES, Backend, _reason, ggml_type
from orin.engine.config import EngineConfig, SpecConfig, default_threads
from orin.engine.errors import BackendError
from orin.engine.scheduler import common_prefix
from orin.errors import OrinError
from orin.llamacpp import capture_log, llama
from orin.model.gguf import read_model_info
from orin.model.vocabmatch import (
    TOKENIZER_FIELD,
    TOKENIZER_NAMES,
    TOKENS_FIELD,
    VOCAB_MAX_SIZE_DIFFERENCE,
    vocab_sample,
)

log = logging.getLogger("orin.engine")


class DraftModelError(BackendError):
    """The draft model cannot be used: missing, corrupt, not loadable, or its
    vocabulary differs from the served model's."""


# -- verification -----------------------------------------------------------------


def verify(drafted: Sequence[int], sampled: Sequence[int]) -> int:
    """How many drafted tokens the target accepted.

    ``sampled[i]`` is the token the request's sampler drew at the position that
    follows ``drafted[:i]``: ``sampled[0]`` from the logits of the last context
    token, ``sampled[i]`` from those of ``drafted[i - 1]``. Draft ``i`` is
    accepted while ``sampled[i] == drafted[i]`` for it and every draft before it;
    the first disagreement ends the run. The tokens the step emits are
    ``sampled[:accepted + 1]``: the accepted drafts (equal to what was sampled
    there) and the token sampled after them, which replaces the first rejected
    draft or, when all were accepted, extends them.

    ``sampled`` normally has ``len(drafted) + 1`` entries. It may stop early at
    the first disagreement: a stateful sampler (grammar, penalties, a seeded
    distribution) must not draw past it, since positions after a rejected draft
    were computed on a context the output will not have. What it may not do is
    stop early while still agreeing: then the token to emit after the accepted
    run is missing.
    """
    if not 0 < len(sampled) <= len(drafted) + 1:
        raise ValueError(
            f"{len(sampled)} sampled tokens for {len(drafted)} drafted: "
            f"expected 1..{len(drafted) + 1}"
        )
    accepted = 0
    for d, s in zip(drafted, sampled, strict=False):
        if d != s:
            return accepted
        accepted += 1
    if len(sampled) <= accepted:
        raise ValueError(
            f"all {len(sampled)} sampled tokens agree with the draft, so the token "
            "sampled after them is missing"
        )
    return accepted


@dataclass
class Acceptance:
    """One request's record of drafted and accepted tokens.

    ``enabled`` switches off, for good, once ``probation`` tokens have been
    drafted and fewer than ``min_acceptance`` of them were accepted: every
    drafted position is a row of logits the target computes and a sampler call,
    and it takes room in the step's shared ``n_batch`` that prompt chunks of
    other slots could use, so a request whose drafts keep failing is better off
    decoding one token a step.

    ``length`` is the next draft's length, adapted after every verification:

    - after a rejection it becomes ``accepted + 1``. Agreement comes in runs (a
      drafter follows the target through a passage it can predict, then loses
      it), so the run just observed is the best guess of the next one; one token
      beyond it tests whether agreement would have lasted longer. Drafting
      further would mostly buy positions that are computed and thrown away.
    - after a draft accepted in full it doubles, up to ``n_draft``: once the
      drafter has caught up with the text, the full length is back within
      log2(n_draft) steps, so one early rejection costs little.

    It stays within 1..n_draft; ``budget`` also caps it by what the request may
    still emit.
    """

    n_draft: int
    min_acceptance: float = 0.0
    probation: int = 32
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verifications of a non-empty draft
    enabled: bool = True
    length: int = 0  # 0: n_draft

    def __post_init__(self) -> None:
        if self.n_draft < 1:
            raise ValueError(f"n_draft must be at least 1, not {self.n_draft}")
        if not self.length:
            self.length = self.n_draft
        self.length = max(1, min(self.length, self.n_draft))

    @classmethod
    def from_config(cls, spec: SpecConfig) -> Acceptance:
        return cls(spec.n_draft, spec.min_acceptance, spec.probation)

    @property
    def rate(self) -> float:
        """Accepted over drafted tokens; 0.0 before anything was drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def budget(self, remaining: int | None = None) -> int:
        """Tokens to draft for the next step: 0 when switched off, else ``length``,
        capped so that no draft lies beyond the ``remaining`` tokens the request
        may still emit (a step emits up to one token more than it accepts)."""
        if not self.enabled:
            return 0
        if remaining is None:
            return self.length
        return max(0, min(self.length, remaining - 1))

    def record(self, drafted: int, accepted: int) -> None:
        """Count one verification; an empty draft counts nothing."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"{accepted} accepted of {drafted} drafted")
        if drafted == 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        if accepted == drafted:
            self.length = min(self.n_draft, 2 * self.length)
        else:
            self.length = max(1, min(self.n_draft, accepted + 1))
        if self.drafted >= self.probation and self.rate < self.min_acceptance:
            self.enabled = False


# -- n-gram lookup ----------------------------------------------------------------


@dataclass(frozen=True)
class NgramDrafter:
    """Drafts from a request's own context by n-gram lookup.

    The context's last ``n`` tokens are looked up, longest first (``ngram_max``
    down to ``ngram_min``); at their most recent earlier occurrence, the tokens
    that followed are the draft, up to ``n_draft`` and never past the end of
    the context. A longer match is the stronger evidence; the most recent
    occurrence is the likeliest to continue alike (an edit of the text just
    quoted, a loop's latest iteration). This is llama.cpp's lookup decoding
    reduced to the request's own context, without its corpus-wide statistics.
    """

    ngram_min: int = 2
    ngram_max: int = 4
    n_draft: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, not {self.ngram_min}..{self.ngram_max}"
            )
        if self.n_draft < 1:
            raise ValueError(f"n_draft must be at least 1, not {self.n_draft}")

    @classmethod
    def from_config(cls, spec: SpecConfig) -> NgramDrafter:
        return cls(spec.ngram_min, spec.ngram_max, spec.n_draft)

    def new(self, tokens: Iterable[int] = ()) -> NgramState:
        """The state of one request, its context starting with ``tokens``."""
        return NgramState(self, tokens)


class NgramState:
    """One request's context and its n-gram index.

    The index maps, for each n, every n-gram of the context to the position of
    its last token at its most recent occurrence, and grows as tokens are
    appended: a lookup costs a few dictionary probes whatever the context's
    length. The n-grams ending at the context's last token stay out of the
    index until the next token arrives, so a lookup of the context's suffix
    finds an earlier occurrence, never the suffix itself, and at least one token
    follows it.
    """

    __slots__ = ("_index", "_indexed", "_sizes", "n_draft", "tokens")

    def __init__(self, drafter: NgramDrafter, tokens: Iterable[int] = ()) -> None:
        self.n_draft = drafter.n_draft
        self._sizes = tuple(range(drafter.ngram_max, drafter.ngram_min - 1, -1))
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self._sizes}
        self._indexed = 0  # n-grams ending before this position are in the index
        self.tokens: list[int] = []
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the context (prompt, then emitted output)."""
        toks = self.tokens
        toks.extend(tokens)
        stop = len(toks) - 1  # the last token's n-grams wait for the next one
        start = self._indexed
        if stop <= start:
            return
        if stop == start + 1:  # one token more (every decode step): one n-gram per n
            for n, index in self._index.items():
                if start >= n - 1:
                    index[tuple(toks[start - n + 1 : stop])] = start
            self._indexed = stop
            return
        for n, index in self._index.items():
            first = max(start, n - 1)  # end positions of the n-grams to add
            if first >= stop:
                continue
            s0, s1 = first - n + 1, stop - n + 1  # their start positions
            grams = zip(*(toks[s0 + j : s1 + j] for j in range(n)), strict=True)
            index.update(zip(grams, range(first, stop), strict=True))  # later ones win
        self._indexed = stop

    def draft(self, max_tokens: int | None = None) -> list[int]:
        """The proposed continuation, at most ``max_tokens`` (and ``n_draft``)
        tokens; empty when no suffix of the context occurred before."""
        k = self.n_draft if max_tokens is None else min(max_tokens, self.n_draft)
        toks = self.tokens
        size = len(toks)
        if k <= 0:
            return []
        for n in self._sizes:
            if size <= n:
                continue
            end = self._index[n].get(tuple(toks[size - n :]))
            if end is not None:
                return toks[end + 1 : end + 1 + k]
        return []


# -- draft model ------------------------------------------------------------------


@dataclass
class _SlotCells:
    """What one slot's KV sequence holds: ``tokens`` at positions 0.., being the
    context from index ``base`` on, then the drafts fed after it."""

    base: int = 0
    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Feed:
    """Tokens of one sequence for the decode, at positions from ``pos``; the last
    one's logits are wanted."""

    seq: int
    tokens: Sequence[int]
    pos: int


class DraftModel:
    """A small model with the served model's vocabulary that drafts greedily.

    It owns its llama.cpp model and context, with one KV sequence per slot (the
    engine's slot numbers), and keeps, per slot, the tokens its cells hold.
    ``draft`` first brings every slot's cells in line with that slot's context,
    keeping the longest common prefix (after a step, the context differs from
    the cells from the first rejected draft on), then drafts all slots together,
    one ``llama_decode`` per drafted position. Used from the engine thread only.

    A context longer than the draft context's window is drafted from its tail:
    when it no longer fits, the slot restarts from the last half window, so the
    refeed costs about one token per generated token over time.
    """

    def __init__(
        self,
        path: Path,
        *,
        slots: int,
        n_ctx: int,
        n_batch: int = 512,
        n_ubatch: int = 512,
        gpu_layers: int = -1,
        threads: int = 0,
        threads_batch: int = 0,
        flash_attn: str = "auto",
        type_k: str = "f16",
        type_v: str = "f16",
        load_mode: str = "auto",
    ) -> None:
        self.path = Path(path)
        self.lib = lib = llama()
        self.model: Any = None
        self.ctx: Any = None
        self.batch: Any = None
        try:
            self.info = read_model_info(self.path)
        except OrinError as exc:
            raise DraftModelError(f"draft model {exc}") from exc
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = gpu_layers if gpu_layers >= 0 else 0x7FFFFFFF
        mp.load_mode = getattr(lib, LOAD_MODES[load_mode])
        with capture_log() as lines:
            self.model = lib.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self.model:
            raise DraftModelError(
                f"draft model {self.path}: llama.cpp could not load it: {_reason(lines)}"
            )
        try:
            cp = lib.llama_context_default_params()
            cp.n_ctx = n_ctx * slots
            cp.n_seq_max = slots
            cp.n_batch = n_batch
            cp.n_ubatch = min(n_ubatch, n_batch)
            cp.n_threads = threads or default_threads()
            cp.n_threads_batch = threads_batch or cp.n_threads
            cp.flash_attn_type = FLASH_ATTN[flash_attn]
            cp.type_k = ggml_type(type_k)
            cp.type_v = ggml_type(type_v)
            cp.kv_unified = False  # one stream per slot, as the served model's
            cp.no_perf = True
            cp.embeddings = False
            with capture_log() as lines:
                self.ctx = lib.llama_init_from_model(self.model, cp)
            if not self.ctx:
                raise DraftModelError(
                    f"draft model {self.path}: llama.cpp could not create its context "
                    f"(n_ctx={n_ctx}x{slots}): {_reason(lines)}"
                )
        except BaseException:
            self.close()
            raise
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.n_out = self.n_vocab  # ids a draft may hold: both vocabularies' common range
        self.n_ctx_seq = int(lib.llama_n_ctx_seq(self.ctx))
        self.n_batch = n_batch
        self.slots = slots
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self._cells = [_SlotCells() for _ in range(slots)]
        self.fed = 0  # context tokens fed to bring cells in line, over the model's life

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> DraftModel:
        """The draft model of the profile's ``speculative`` section, sized like the
        served model's context (slots, n_ctx, batch) and run with its threads; its
        KV cache is f16 (a small model's cells cost little)."""
        spec = cfg.speculative
        if spec.draft_model is None:
            raise DraftModelError("speculative mode draft needs speculative.draft_model")
        return cls(
            spec.draft_model,
            slots=cfg.slots,
            n_ctx=cfg.n_ctx,
            n_batch=cfg.n_batch,
            n_ubatch=cfg.n_ubatch,
            gpu_layers=spec.draft_gpu_layers,
            threads=cfg.threads,
            threads_batch=cfg.threads_batch,
            # the served model's "on" was checked against its own head size, not this one's
            flash_attn="off" if cfg.flash_attn == "off" else "auto",
            load_mode=cfg.load_mode,
        )

    # -- vocabulary ---------------------------------------------------------------

    def _text(self, vocab: Any, token: int) -> bytes:
        return bytes(self.lib.llama_vocab_get_text(vocab, token) or b"")

    def check_vocab(self, target: Backend) -> None:
        """Refuse a draft model whose tokens do not mean what the served model's do.

        llama-server's rules: the same tokenizer type; the same BOS (EOS) token
        where the tokenizer adds one to a prompt; sizes within
        VOCAB_MAX_SIZE_DIFFERENCE; the same text for every id compared (a
        sample, see ``vocabmatch.vocab_sample``). Each refusal names the draft
        model's file and the GGUF field that differs (``orin.model.vocabmatch``
        checks the same fields before anything loads). An EOS that is never added may differ: a
        base draft model for an instruct target ends text with another token,
        and a drafted end is verified like any other token. Drafts are then kept
        to the ids both vocabularies have.
        """
        lib, mine, theirs = self.lib, self.vocab, target.vocab
        name = f"draft model {self.path}"
        must = "a draft model must share the served model's vocabulary"
        kind_mine, kind_theirs = lib.llama_vocab_type(mine), lib.llama_vocab_type(theirs)
        if kind_mine != kind_theirs:
            raise DraftModelError(
                f"{name}: {TOKENIZER_FIELD} is {_tokenizer(kind_mine)!r}, the served "
                f"model's {_tokenizer(kind_theirs)!r}; {must}"
            )
        for what, add, tok in (
            ("bos", lib.llama_vocab_get_add_bos, lib.llama_vocab_bos),
            ("eos", lib.llama_vocab_get_add_eos, lib.llama_vocab_eos),
        ):
            a, b = bool(add(mine)), bool(add(theirs))
            if a != b or (a and tok(mine) != tok(theirs)):
                raise DraftModelError(
                    f"{name}: its {what.upper()} token differs from the served model's "
                    f"(tokenizer.ggml.add_{what}_token {a}, tokenizer.ggml.{what}_token_id "
                    f"{tok(mine)}; served: {b}, {tok(theirs)}); {must}"
                )
        n_mine, n_theirs = self.n_vocab, target.n_vocab
        if abs(n_mine - n_theirs) > VOCAB_MAX_SIZE_DIFFERENCE:
            raise DraftModelError(
                f"{name}: {TOKENS_FIELD} has {n_mine} tokens, the served model's "
                f"{n_theirs} (sizes may differ by {VOCAB_MAX_SIZE_DIFFERENCE} at most); {must}"
            )
        n = min(n_mine, n_theirs)
        for token in vocab_sample(n):
            a_text, b_text = self._text(mine, token), self._text(theirs, token)
            if a_text != b_text:
                raise DraftModelError(
                    f"{name}: {TOKENS_FIELD}[{token}] is {a_text!r}, the served model's "
                    f"{b_text!r}; {must}"
                )
        self.n_out = n

    # -- drafting (engine thread) -------------------------------------------------

    def cells(self, seq: int) -> tuple[int, ...]:
        """The tokens slot ``seq``'s cells hold, from position 0."""
        return tuple(self._cells[seq].tokens)

    def draft(
        self, seq_contexts: Mapping[int, Sequence[int]], max_tokens: Mapping[int, int]
    ) -> dict[int, list[int]]:
        """Up to ``max_tokens[seq]`` greedy draft tokens for every slot's context.

        A slot missing from ``max_tokens``, or given 0, drafts nothing and keeps
        its cells. A draft stops early at an end-of-generation token and at an id
        the served model's vocabulary lacks; a context holding an id the draft
        model's vocabulary lacks gets no draft. A failed decode raises
        BackendError with the slots involved emptied, so the next call starts
        them afresh.
        """
        wanted: dict[int, int] = {}
        feeds: list[_Feed] = []
        for seq in seq_contexts:
            if not 0 <= seq < self.slots:
                raise ValueError(f"slot {seq} out of range 0..{self.slots - 1}")
        for seq, context in seq_contexts.items():
            k = min(max_tokens.get(seq, 0), self.n_ctx_seq // 4)
            if k <= 0 or not context:
                continue
            feed = self._sync(seq, context, k)
            if feed is not None:
                feeds.append(feed)
                wanted[seq] = k
        drafts: dict[int, list[int]] = {seq: [] for seq in seq_contexts}
        try:
            for seq, token in self._decode(feeds).items():
                drafts[seq].append(token)
            active = [s for s in wanted if self._continues(drafts[s], wanted[s])]
            while active:
                steps = [_Feed(s, (drafts[s][-1],), len(self._cells[s].tokens)) for s in active]
                for seq, token in self._decode(steps).items():
                    drafts[seq].append(token)
                active = [s for s in active if self._continues(drafts[s], wanted[s])]
        except BackendError:
            for seq in wanted:
                self.release(seq)
            raise
        for tokens in drafts.values():  # an id the served model lacks ends a draft
            cut = next((i for i, t in enumerate(tokens) if t >= self.n_out), None)
            if cut is not None:
                del tokens[cut:]
        return drafts

    def _continues(self, tokens: list[int], k: int) -> bool:
        last = tokens[-1]
        return (
            len(tokens) < k
            and last < self.n_out
            and not self.lib.llama_vocab_is_eog(self.vocab, last)
        )

    def _sync(self, seq: int, context: Sequence[int], k: int) -> _Feed | None:
        """Drop the slot's cells from where they leave ``context`` and return the
        tokens to feed (at least the last one: its logits give the first draft);
        None when the context holds an id this vocabulary lacks."""
        cells = self._cells[seq]
        n, cap = len(context), self.n_ctx_seq
        base = cells.base
        if n + k <= cap:
            base = 0
        elif not (base < n and n - base + k <= cap):
            base = n + k - cap // 2
        if base != cells.base:
            self._drop(seq, 0)
            cells.base = base
        window = context[base:] if base else context
        keep = min(common_prefix(cells.tokens, window), len(window) - 1)
        tail = window[keep:]
        if any(t >= self.n_vocab or t < 0 for t in tail):
            self._drop(seq, keep)
            return None
        keep = self._drop(seq, keep)
        tail = window[keep:]
        self.fed += len(tail)
        return _Feed(seq, tail, keep)

    def _drop(self, seq: int, keep: int) -> int:
        """Remove slot ``seq``'s cells from position ``keep`` on; return how many
        remain (0 where the memory only drops whole sequences, as a recurrent one)."""
        lib, mem, cells = self.lib, self.memory, self._cells[seq]
        if keep >= len(cells.tokens):
            return len(cells.tokens)
        # a recurrent state refuses a partial removal, or drops itself whole when the
        # removal starts at its last position: either way, nothing is left
        if not lib.llama_memory_seq_rm(mem, seq, keep, -1) or (
            keep and lib.llama_memory_seq_pos_max(mem, seq) != keep - 1
        ):
            lib.llama_memory_seq_rm(mem, seq, -1, -1)
            keep = 0
        del cells.tokens[keep:]
        return keep

    def _decode(self, feeds: Sequence[_Feed]) -> dict[int, int]:
        """Feed every sequence's tokens, n_batch at a time; return each sequence's
        greedy token after its last one. The cells' bookkeeping follows each
        decode."""
        b = self.batch
        out: dict[int, int] = {}
        rows: list[tuple[int, int]] = []  # (batch index, seq) of wanted logits
        n = 0
        for feed in feeds:
            cells = self._cells[feed.seq].tokens
            for j, token in enumerate(feed.tokens):
                b.token[n] = token
                b.pos[n] = feed.pos + j
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = feed.seq
                last = j == len(feed.tokens) - 1
                b.logits[n] = last
                if last:
                    rows.append((n, feed.seq))
                cells.append(token)
                n += 1
                if n == self.n_batch:
                    self._run(n, rows, out)
                    n, rows = 0, []
        if n:
            self._run(n, rows, out)
        return out

    def _run(self, n: int, rows: list[tuple[int, int]], out: dict[int, int]) -> None:
        lib, ctx = self.lib, self.ctx
        self.batch.n_tokens = n
        ret = lib.llama_decode(ctx, self.batch)
        lib.llama_synchronize(ctx)
        if ret != 0:
            raise BackendError(f"the draft model's llama_decode failed with status {ret}")
        for i, seq in rows:
            ptr = lib.llama_get_logits_ith(ctx, i)
            if not ptr:
                raise BackendError(f"the draft model returned no logits for slot {seq}")
            logits = np.ctypeslib.as_array(
                ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
            )
            out[seq] = int(logits[: self.n_out].argmax())

    def release(self, seq: int) -> None:
        """Forget slot ``seq``'s cells (its request ended or failed)."""
        if self.memory is not None:
            self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self._cells[seq] = _SlotCells()

    def close(self) -> None:
        """Free the batch, context and model (idempotent)."""
        batch, self.batch = self.batch, None
        if batch is not None:
            self.lib.llama_batch_free(batch)
        ctx, self.ctx = self.ctx, None
        self.memory = None
        if ctx:
            self.lib.llama_free(ctx)
        model, self.model = self.model, None
        if model:
            self.lib.llama_model_free(model)


def _tokenizer(vocab_type: int) -> str:
    """The tokenizer.ggml.model value of a llama_vocab_type."""
    return TOKENIZER_NAMES.get(vocab_type, str(vocab_type))


def load_draft_model(cfg: EngineConfig, target: Backend) -> DraftModel:
    """The profile's draft model, loaded and checked against the served model's
    vocabulary; closed again when the check fails."""
    draft = DraftModel.from_config(cfg)
    try:
        draft.check_vocab(target)
    except BaseException:
        draft.close()
        raise
    log.info(
        "draft model %s: %d tokens, %d slots of %d cells",
        draft.path.name,
        draft.n_vocab,
        draft.slots,
        draft.n_ctx_seq,
    )
    return draft
