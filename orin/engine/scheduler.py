"""The pure scheduler: slots, admission queue, batch composition, context shifts.

No llama.cpp here. ``schedule()`` returns the next ``Batch`` (KV-cache
operations to run first, then the tokens to decode) and ``update()`` records
what the runner sampled. Decode tokens of running slots always go first; prompt
chunks of prefilling slots fill the rest of the n_batch budget (chunked
prefill), so a long prompt never stalls running streams for more than one
chunk. The engine owns everything else (sampling, text, timings).

``prefill_chunk`` caps the prompt tokens of one step, all slots together: a
step is the unit nothing can interrupt on a GPU (llama.cpp's abort callback
only reaches the CPU backend), so the chunk bounds how long a cancelled
prompt keeps running and how long running streams wait for prompts.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from orin.engine.errors import ContextLengthExceeded, InvalidRequest, QueueFull
from orin.engine.ubatch import micro_batches


class SchedRequest(Protocol):
    """What the scheduler needs from a request."""

    @property
    def id(self) -> str: ...

    @property
    def prompt_tokens(self) -> list[int]: ...

    @property
    def all_logits(self) -> bool:
        """True when the request needs the logits of every prompt position (its
        prompt's log-probabilities), so none of its prompt may come from cached or
        copied cells."""
        ...

    @property
    def held(self) -> bool:
        """True while the request may not start: it shares the prompt log-probabilities
        of another request that has not finished computing them (``n`` > 1 choices of
        a scored prompt), whose cells it then copies."""
        ...


def _all_logits(request: SchedRequest | None) -> bool:
    return request is not None and request.all_logits


class SlotState(enum.Enum):
    IDLE = "idle"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Remove:
    """llama_memory_seq_rm(seq, p0, p1): drop cells [p0, p1) (p1 = -1: to the end)."""

    seq: int
    p0: int
    p1: int = -1


@dataclass(frozen=True)
class Shift:
    """Discard ``n_discard`` cells after the first ``keep`` and move the rest down."""

    seq: int
    keep: int
    n_discard: int
    n_past: int


@dataclass(frozen=True)
class Copy:
    """llama_memory_seq_cp(src, dst, 0, p1): ``dst`` takes the cells of ``src`` below
    ``p1`` (-1: all of them).

    With one KV stream per slot llama.cpp copies the whole stream's buffers before
    the next decode (and the cell bookkeeping at once), so the copy is of everything
    and is followed by a ``Remove`` of what ``dst`` does not share. With one buffer
    for all slots a copy only tags the cells with the second sequence: they are
    held once, shared.
    """

    src: int
    dst: int
    p1: int = -1


@dataclass(frozen=True)
class Load:
    """Restore a saved prompt's cells into the empty sequence ``seq`` (the persistent
    prompt cache); ``entry`` is the cache's handle and ``n`` its token count."""

    seq: int
    entry: object
    n: int


KVOp = Remove | Shift | Copy | Load


class LoadFailed(Exception):
    """A saved prompt could not be restored into these sequences (now empty)."""

    def __init__(self, seqs: list[int]) -> None:
        super().__init__(f"could not restore saved prompts into sequences {seqs}")
        self.seqs = seqs


SHARE_MIN = 16
"""Prompt tokens another slot must hold beyond what the chosen slot has before the
scheduler copies its cells, unless the engine measured what a copy costs
(``Scheduler.share_min``): a copy moves a whole KV stream, worth it only when it
saves a prefill. Shorter prompts share when the other slot holds all of it but
the last token. Also the bar for holding a request back for a prefill in
progress, for restoring a saved prompt from disk, and for a cached prompt worth
keeping (a copy aside, a hole left open): costs nothing measures."""

LOGITS_CHUNK = 128
"""Prompt tokens a step feeds at most, all slots together, of prompts whose every
position's logits are asked for (``all_logits``): llama.cpp's output buffer grows to
the most rows of logits one decode has (a row is the vocabulary's floats, 0.5 MiB for
a Llama 3 vocabulary), and keeps that size."""

HOLE_GRACE_STEPS = 2
"""Steps a hole among the busy slots may last before a move closes it, when the move
would overwrite prompt cells no other slot holds (``_close_holes``): in a burst most
holes are gone within a step (the requests that started together finish together,
or a new one takes the hole), and a move then would only have lost a cached prompt.
Short, because each step with a hole costs the running streams one more pass."""


@dataclass(frozen=True, slots=True)
class BatchItem:
    """Consecutive tokens of one sequence, starting at position ``pos``."""

    slot: int
    tokens: tuple[int, ...]
    pos: int
    sample: bool  # logits wanted for the last token: a new token is sampled
    prefill: bool
    draft: int = 0  # the last ``draft`` tokens are speculative: logits for each, and before
    logits_all: bool = False  # a prompt chunk with logits at every position (``all_logits``)

    @property
    def outputs(self) -> int:
        """Positions whose logits are sampled (the last ones of ``tokens``)."""
        return self.draft + 1 if self.sample else 0


@dataclass(frozen=True)
class Batch:
    ops: tuple[KVOp, ...]
    items: tuple[BatchItem, ...]
    length_limited: tuple[int, ...] = ()  # slots at the window with sliding off
    budget: int = 0  # prompt tokens this step could have carried (the chunk budget)
    passes: int = 0  # llama.cpp micro-batches the items cost (ubatch.micro_batches)

    # counted once, in one pass when the batch is made: the engine reads them several
    # times per step (cached properties took a lock on each first read, Python < 3.12)
    n_decode: int = field(init=False, repr=False, compare=False)
    n_drafted: int = field(init=False, repr=False, compare=False)
    n_prefill: int = field(init=False, repr=False, compare=False)
    n_tokens: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        decode = drafted = prefill = 0
        for i in self.items:
            if i.prefill:
                prefill += len(i.tokens)
            else:
                decode += len(i.tokens)
            drafted += i.draft
        put = object.__setattr__  # frozen
        put(self, "n_decode", decode)
        put(self, "n_drafted", drafted)
        put(self, "n_prefill", prefill)
        put(self, "n_tokens", decode + prefill)

    def __bool__(self) -> bool:
        return bool(self.ops or self.items)


@dataclass
class Slot:
    id: int
    state: SlotState = SlotState.IDLE
    request: SchedRequest | None = None
    cache: list[int] = field(default_factory=list)  # tokens in the KV cache, by position
    pending: list[int] = field(default_factory=list)  # tokens still to feed
    reusable: int = 0  # leading cache tokens valid as a prefix for a new prompt
    cached_prompt: int = 0  # prompt tokens taken from the cache instead of prefilled
    generated: int = 0
    shifts: int = 0
    admitted_seq: int = 0  # admission order: ties in the prefill order
    passed_over: bool = False  # prefilling, and the last step left it no prompt budget

    @property
    def busy(self) -> bool:
        return self.state is not SlotState.IDLE


@dataclass(frozen=True)
class ContextPolicy:
    """The sliding-window KV limit of one slot (see ContextSection in the profile)."""

    window: int  # cells a slot may hold
    keep: int = 0  # first tokens never discarded
    discard: int = 0  # cells discarded per shift; 0 = half of those after keep
    sliding: bool = True  # False: stop with finish reason "length" at the window
    truncate_prompt: bool = False  # over-long prompt: keep head + tail instead of rejecting

    @property
    def discarded(self) -> int:
        """Cells a context shift of a full window discards."""
        n_left = self.window - self.keep
        return max(min(self.discard or n_left // 2, n_left), 1)

    @property
    def cut_length(self) -> int:
        """The tokens an over-long prompt is cut to (``truncate_prompt``): what a context
        shift of a full window leaves, its first ``keep`` and the most recent ones,
        as llama-server cuts one. The answer then has room (``discarded`` tokens)
        before the next shift or, with sliding off, before the window ends; a prompt
        cut to the whole window would be shifted at its first generated token, its
        middle computed only to be discarded, and without sliding have no room."""
        return max(self.window - self.discarded, self.keep + 1)


class Scheduler:
    def __init__(
        self,
        n_slots: int,
        n_batch: int,
        context: ContextPolicy,
        max_queue: int = 64,
        prefill_chunk: int | None = None,
        prefix_reuse: bool = True,
        swa_window: int = 0,
        unified: bool = False,
        n_ubatch: int | None = None,
    ) -> None:
        """``prefix_reuse`` off (a recurrent model, whose state cannot lose its tail):
        every prompt is prefilled from its start, in a slot whose cells are cleared.
        ``swa_window`` (a window-sized cache of sliding-window layers): a prefix of n
        tokens is reused only while the sequence still holds the cells from n minus
        the window on, which ``pos_min`` (the runner's, set by the engine) tells.
        ``unified``: one KV buffer for all slots (copies share cells, any slot ids make
        one llama.cpp pass); otherwise one stream per slot, where busy slots are kept
        at consecutive ids (a hole costs a pass of its own).

        Hooks the engine sets: ``chunk_budget(rows)`` (prompt tokens a step with
        ``rows`` decode tokens may carry: the SLO-aware chunking), ``drafts(slot,
        room)`` (speculative tokens for a decoding slot, at most ``room``) and
        ``stored(prompt)`` (the persistent prompt cache's longest saved prefix of a
        prompt: (tokens, handle), or None), ``pass_tokens()`` (the prompt tokens
        one llama.cpp pass costs as much as: ``_even_tails``) and ``step_ms(passes,
        rows, prompt)`` (a step's predicted time: ``_split_for_mean``)."""
        if n_batch < n_slots:
            raise ValueError(f"n_batch ({n_batch}) must be at least the slot count ({n_slots})")
        if prefill_chunk is not None and not 1 <= prefill_chunk <= n_batch:
            raise ValueError(f"prefill_chunk ({prefill_chunk}) must be within 1..n_batch")
        if context.keep >= context.window:
            raise ValueError("keep must be smaller than the window")
        self.slots = [Slot(i) for i in range(n_slots)]
        self.n_batch = n_batch
        self.prefill_chunk = prefill_chunk or n_batch  # prompt tokens per step, at most
        self.context = context
        self.max_queue = max_queue
        self.queue: deque[SchedRequest] = deque()
        self.prefix_reuse = prefix_reuse
        self.swa_window = swa_window
        self.pos_min: Callable[[int], int] = lambda seq: -1
        self.unified = unified
        self.n_ubatch = n_ubatch or n_batch
        self.chunk_budget: Callable[[int], int] = lambda rows: self.prefill_chunk
        self.drafts: Callable[[Slot, int], Sequence[int]] = lambda slot, room: ()
        self.stored: Callable[[list[int]], tuple[int, object] | None] = lambda prompt: None
        # prompt tokens one llama.cpp pass costs as much as (``_even_tails``); 0: never
        # compute cached cells again to save a pass. The engine sets it from its
        # step-cost model
        self.pass_tokens: Callable[[], float] = lambda: 0.0
        # predicted ms of a step of (passes, decode rows, prompt tokens), or None: the
        # engine's step-cost model has not settled, or splits are off (``_split_for_mean``)
        self.step_ms: Callable[[int, int, int], float | None] = lambda p, r, t: None
        self.prompt_splits = 0  # steps of starting prompts split to lower their mean TTFT
        self.retails = 0  # steps whose prompt tails were evened up to save passes
        # prompts that end in a step run before the decode rows that would cost them
        # passes (``_prompts_first``); the engine turns it off with a TPOT target
        self.prompts_first = True
        self._rows_waited = False  # the last step left decode rows for the next one
        # prompt tokens a copy of another slot's cells must save (``_start``):
        # the engine sets it from a copy's measured cost (orin.engine.sharecost)
        self.share_min = SHARE_MIN
        self.moves = 0  # busy slots moved down to close a hole (one stream per slot)
        self.evacuations = 0  # cached prompts copied aside before a new prompt took their slot
        self._hole_steps = 0  # consecutive steps with a hole among the busy slots
        self.decoding = 0  # slots decoding in the step being built (read by the hooks)
        self._ops: list[KVOp] = []
        self._admissions = 0
        # prompt chunks split off the last step, to run next (``_first_pass_alone``)
        self._after: tuple[tuple[BatchItem, ...], int] | None = None

    # -- admission -----------------------------------------------------------

    def check_prompt(self, prompt: Sequence[int]) -> list[int]:
        """The prompt as it will be run: rejected or truncated when over the window."""
        ctx = self.context
        if not prompt:
            raise InvalidRequest("prompt", "the prompt has no tokens")
        if len(prompt) <= ctx.window:
            return list(prompt)
        if not ctx.truncate_prompt:
            raise ContextLengthExceeded(len(prompt), ctx.window)
        tail = ctx.cut_length - ctx.keep
        return list(prompt[: ctx.keep]) + list(prompt[len(prompt) - tail :])

    def check_room(self, others_waiting: int = 0) -> None:
        """QueueFull when one more request would wait beyond ``max_queue``: the queued
        requests and ``others_waiting`` (jobs that share the bound, embedding jobs no
        pass has started) beyond the idle slots."""
        idle = sum(1 for s in self.slots if not s.busy)
        if len(self.queue) + others_waiting - idle >= self.max_queue:
            raise QueueFull(self.max_queue)

    def add(self, request: SchedRequest, others_waiting: int = 0) -> None:
        """Queue a request (its prompt already passed ``check_prompt``), if there is room
        (``check_room``)."""
        self.check_room(others_waiting)
        self.queue.append(request)

    def _admit(self) -> None:
        """Start queued requests in arrival order while slots are idle. A request
        whose prompt prefix another slot is prefilling right now waits for that
        prefill to end and then copies its cells (``n`` > 1 choices, users of one
        system prompt arriving together); the requests behind it go first. So does a
        request ``held`` for another's prompt log-probabilities.

        When every queued request has an idle slot, so that all start in this step
        whatever the order, those whose whole prompt an idle slot holds go first:
        each takes its own cells before a request that has none could be given
        that slot (a burst of returning users, the first of whom started alone)."""
        held: list[SchedRequest] = []
        idle_now = sum(1 for s in self.slots if not s.busy)
        if self.prefix_reuse and 1 < len(self.queue) <= idle_now:
            self.queue = deque(sorted(self.queue, key=lambda r: not self._whole_prompt_cached(r)))
        # when every idle slot gets a request now, the busy slots end as one run whoever
        # takes which, so each request may take the slot that holds most of its prompt
        fills = len(self.queue) >= idle_now
        while self.queue:
            idle = [s for s in self.slots if not s.busy]
            if not idle:
                break
            request = self.queue.popleft()
            if request.held or (
                not _all_logits(request) and self._prefix_in_progress(request.prompt_tokens)
            ):
                held.append(request)
                continue
            slot = self._pick_slot(idle, request.prompt_tokens, packed_only=not fills)
            self._start(slot, request)
        self.queue.extendleft(reversed(held))

    def _whole_prompt_cached(self, request: SchedRequest) -> bool:
        """Whether an idle slot holds all of the request's prompt but its last token."""
        prompt = request.prompt_tokens
        need = len(prompt) - 1
        return need > 0 and any(
            not s.busy and _holds_more(s, prompt, need - 1) and _reusable_prefix(s, prompt) >= need
            for s in self.slots
        )

    def _pick_slot(self, idle: list[Slot], prompt: list[int], packed_only: bool = True) -> Slot:
        """The idle slot whose cache shares the longest prefix with the prompt, net of
        the cells taking it would lose (its cells past the shared prefix that no
        other slot holds as well); ties: the lowest id. So a prompt sharing two
        tokens with another user's cached conversation takes an empty slot rather
        than overwrite that conversation (llama-server asks for a similarity of at
        least half the prompt for the same reason).

        With one KV stream per slot, llama.cpp splits a batch into one pass per run
        of consecutive sequence ids, and every pass reads all the weights again: only
        the idle slots that do not split the busy ones into more runs are candidates
        (a better prefix elsewhere is copied in by ``_start``). One exception keeps
        other users' cached prompts, which matters when a burst of users repeats
        its prompts in another order: an idle slot holding the whole prompt is
        taken even where it splits the busy slots (a copy into a packed slot would
        overwrite that slot's prompt). The rest of the burst usually fills the
        gap; if not, ``_close_holes`` moves a slot to close it. When the queue
        fills every idle slot (``packed_only`` False), the busy slots end as one
        run whatever each request takes, so every idle slot is a candidate.

        Taking an empty slot away from the busy ones, rather than overwrite a
        packed slot's cached prompt, is not done. The hole it leaves costs a pass
        per step, or a move that overwrites a cached prompt anyway. In 6
        alternating runs of the burst benchmark (docs/performance.md), its TTFT
        could not be told from the spread. Instead ``_start`` copies such a prompt
        into a free slot before overwriting it (``_evacuate``).
        """
        held = {s.id: _reusable_prefix(s, prompt) for s in idle}
        if not self.unified and packed_only:
            busy = {s.id for s in self.slots if s.busy}
            now = _runs(busy)
            packed = [s for s in idle if _runs(busy | {s.id}) <= max(now, 1)]
            whole = [s for s in idle if self.prefix_reuse and held[s.id] >= len(prompt) - 1 > 0]
            holder_unpacked = whole and not any(s in packed for s in whole)
            idle = whole if holder_unpacked else packed or idle
        if len(idle) == 1:
            return idle[0]
        return max(idle, key=lambda s: (held[s.id] - self._lost(s, held[s.id]), -s.id))

    def _lost(self, slot: Slot, kept: int = 0) -> int:
        """How many of ``slot``'s reusable cells overwriting it from position ``kept``
        would lose: those past ``kept`` that no other slot holds as well."""
        mine = min(slot.reusable, len(slot.cache))
        if mine <= kept:
            return 0
        shared = _longest_prefix((o for o in self.slots if o is not slot), slot.cache, kept)
        return mine - min(shared, mine)

    def _loses_nothing(self, slot: Slot) -> bool:
        """``_lost(slot) == 0``, told without finding how much the others hold: whether
        the slot has no reusable cells or another slot holds all of them."""
        mine = min(slot.reusable, len(slot.cache))
        return mine == 0 or any(
            _holds_more(o, slot.cache, mine - 1) and _reusable_prefix(o, slot.cache) >= mine
            for o in self.slots
            if o is not slot
        )

    def _worth_sharing(self, gain: int, prompt: Sequence[int], bar: int = SHARE_MIN) -> bool:
        """Whether taking ``gain`` more prompt tokens from elsewhere pays: at least
        ``bar`` tokens, or the whole prompt but its last token. A copy from another
        slot now passes ``share_min`` (a copy's measured cost in prompt tokens)."""
        return gain > 0 and gain >= min(bar, len(prompt) - 1)

    def _prefix_in_progress(self, prompt: list[int]) -> bool:
        """Whether a prefilling slot will soon hold more of ``prompt`` than any slot
        holds now, enough to be worth a copy. Waiting costs nothing: the prompt
        tokens of a step are one budget, so prefilling the same tokens alongside
        would not end sooner."""
        if not self.prefix_reuse:
            return False
        limit = len(prompt) - 1
        now = _longest_prefix(self.slots, prompt)
        for s in self.slots:
            if s.state is SlotState.PREFILL and s.shifts == 0:
                soon = min(common_prefix(s.cache + s.pending, prompt), limit)
                if soon > min(now, limit) and self._worth_sharing(soon, prompt):
                    return True
        return False

    def _usable(self, slot: Slot, n: int) -> int:
        """``n`` cached tokens of ``slot`` as a prefix, or 0 when a window cache has
        dropped cells the last window of them needs (llama-server's rule)."""
        if n and self.swa_window and self.pos_min(slot.id) > max(0, n - self.swa_window):
            return 0
        return n

    def _start(self, slot: Slot, request: SchedRequest) -> None:
        prompt = request.prompt_tokens
        # at least the last prompt token is fed again: its logits start the generation
        whole = len(prompt) - 1 if self.prefix_reuse else 0
        held = self._usable(slot, min(_reusable_prefix(slot, prompt), whole))
        if held < whole:  # a slot holding the whole prompt is the same request again
            self._evacuate(slot, held)
        # a prompt whose every position's logits are asked for is fed whole: no cells
        # of its own slot, another slot's or the disk's stand in for any of it
        limit = 0 if _all_logits(request) else whole
        reuse = min(held, limit)
        donor, shared = None, reuse
        for other in self.slots if self.prefix_reuse else ():
            if other is not slot and _holds_more(other, prompt, shared):
                n = min(_reusable_prefix(other, prompt), limit)
                if n > shared and self._usable(other, n) == n:
                    donor, shared = other, n
        stored = self.stored(prompt) if self.prefix_reuse else None
        if (
            stored is not None
            and min(stored[0], limit) > max(shared, reuse)
            and (self._worth_sharing(min(stored[0], limit) - max(shared, reuse), prompt))
        ):  # a saved prompt beats every slot's cells: restore it from disk
            if slot.cache:
                self._ops.append(Remove(slot.id, 0, -1))
            n, handle = stored
            self._ops.append(Load(slot.id, handle, n))
            slot.cache = list(prompt[:n])
            reuse = min(n, limit)
        elif donor is not None and (
            self._worth_sharing(shared - reuse, prompt, self.share_min) or shared == limit
        ):  # a copy of the whole prompt leaves one token to feed, as llama-server does
            if self.unified:  # cells are shared, not copied: tag the prefix only
                if slot.cache:
                    self._ops.append(Remove(slot.id, 0, -1))
                self._ops.append(Copy(donor.id, slot.id, shared))
                slot.cache = list(donor.cache[:shared])
            else:
                self._ops.append(Copy(donor.id, slot.id))
                slot.cache = list(donor.cache)
            reuse = shared
        if reuse < len(slot.cache):
            self._ops.append(Remove(slot.id, reuse, -1))
        self._admissions += 1
        slot.state = SlotState.PREFILL
        slot.request = request
        slot.cache = slot.cache[:reuse]
        slot.reusable = reuse
        slot.pending = list(prompt[reuse:])
        slot.cached_prompt = reuse
        slot.generated = 0
        slot.shifts = 0
        slot.admitted_seq = self._admissions
        slot.passed_over = False

    def _evacuate(self, slot: Slot, kept: int) -> None:
        """Before a new prompt overwrites ``slot`` past its first ``kept`` cells, copy
        the slot's cached prompt into a free slot (one whose cells another slot also
        holds, or none) when overwriting would lose at least ``SHARE_MIN`` cells that
        no other slot holds: the user who comes back a moment later finds the prompt
        whole instead of prefilling it again. Of the free slots, the one that keeps
        the busy slots in the fewest runs, then the lowest. Not when the slot holds
        the whole new prompt: that is the same prompt again (a retry), and what it
        overwrites is its own earlier answer.

        This is what the packing costs otherwise (``_pick_slot``): the slot next to
        the busy ones is the one a new prompt takes, whatever it holds. A copy moves
        a whole KV stream, which is cheaper than the prefill it saves when the user
        returns (and wasted when nobody does). One KV stream per slot only: with one
        buffer for all slots nothing forces a new prompt onto a cached one."""
        if self.unified or not self.prefix_reuse or self._lost(slot, kept) < SHARE_MIN:
            return
        busy = {s.id for s in self.slots if s.busy} | {slot.id}
        free = [d for d in self.slots if d is not slot and not d.busy and self._loses_nothing(d)]
        if not free:
            return
        dst = min(free, key=lambda d: (_runs(busy | {d.id}), d.id))
        self._ops.append(Copy(slot.id, dst.id))
        dst.cache, dst.reusable = list(slot.cache), slot.reusable
        self.evacuations += 1

    # -- cancellation and completion ------------------------------------------

    def cancel(self, request_id: str, keep_cache: bool = False) -> Slot | None:
        """Drop a queued request, or free its slot now. ``keep_cache`` keeps the cells
        its finished steps computed as a prefix for the next prompt, as a finished
        request's are kept (a client that stops an answer and asks again, or the
        requests that waited for its prompt, find it computed), and removes any
        others: those of a step that ran while it was cancelled, or of the finished
        micro-batches of an aborted one. Otherwise every cell is removed."""
        for r in self.queue:
            if r.id == request_id:
                self.queue.remove(r)
                return None
        slot = self.slot_of(request_id)
        if slot is not None:
            self.release(slot, keep_cache=keep_cache)
            if keep_cache:
                self._ops.append(Remove(slot.id, len(slot.cache), -1))
        return slot

    def release(self, slot: Slot, keep_cache: bool) -> None:
        """Free a slot. ``keep_cache`` keeps its cells as a prefix for the next prompt
        (a slot's cells are reserved for it either way); otherwise they are removed."""
        if not keep_cache and slot.cache:
            self._ops.append(Remove(slot.id, 0, -1))
            slot.cache = []
        slot.state = SlotState.IDLE
        slot.request = None
        slot.pending = []
        slot.reusable = min(slot.reusable, len(slot.cache))

    def clear_idle_cache(self) -> None:
        """Remove the cells that idle slots keep for prefix reuse."""
        for slot in self.slots:
            if not slot.busy and slot.cache:
                self._ops.append(Remove(slot.id, 0, -1))
                slot.cache = []
                slot.reusable = 0

    def slot_of(self, request_id: str) -> Slot | None:
        for s in self.slots:
            if s.request is not None and s.request.id == request_id:
                return s
        return None

    def take_ops(self) -> list[KVOp]:
        """KV operations decided outside ``schedule`` (cancellations), to run now."""
        ops, self._ops = self._ops, []
        return ops

    # -- one step ---------------------------------------------------------------

    def schedule(self) -> Batch:
        steady = self._steady()
        if steady is not None:
            return steady
        after = self._run_after()
        if after is not None:
            self._rows_waited = True  # the decode rows of those who just started wait
            return after
        self._admit()
        if not self.unified:
            self._close_holes()
        decoding: list[Slot] = []
        finished_by_length: list[Slot] = []
        for slot in self.slots:
            if slot.state is not SlotState.DECODE:
                continue
            if len(slot.cache) + 1 > self.context.window and not self._make_room(slot):
                finished_by_length.append(slot)
                continue
            decoding.append(slot)
        items: list[BatchItem] = []
        self.decoding = len(decoding)
        spare = self.n_batch - len(decoding)  # batch room for drafted tokens
        for slot in decoding:
            room = min(spare, self.context.window - len(slot.cache) - 1)
            draft = tuple(self.drafts(slot, room)[:room]) if room > 0 else ()
            spare -= len(draft)
            tokens = (slot.pending[0], *draft)
            items.append(
                BatchItem(slot.id, tokens, len(slot.cache), True, prefill=False, draft=len(draft))
            )
        rows = sum(len(i.tokens) for i in items)
        allowed = min(self.prefill_chunk, max(0, self.chunk_budget(rows)))
        budget = min(self.n_batch - rows, allowed)
        left = budget
        logits_left = LOGITS_CHUNK  # of the prompt tokens, those with logits each
        for slot in _prefill_order(self.slots):
            every = _all_logits(slot.request)
            room = min(left, logits_left) if every else left
            if room <= 0:
                slot.passed_over = True
                continue
            chunk = _one_kind(slot.pending, room)
            done = len(chunk) == len(slot.pending)
            items.append(
                BatchItem(
                    slot.id, tuple(chunk), len(slot.cache), done, prefill=True, logits_all=every
                )
            )
            slot.passed_over = False
            left -= len(chunk)
            if every:
                logits_left -= len(chunk)
        if not self.unified:  # llama.cpp's split takes increasing ids in batch order
            items.sort(key=lambda i: i.slot)
        passes = self._passes(items)
        if passes > 1 and not self.unified and left > 0:
            evened = self._even_tails(items, passes, left)
            if evened is not None:
                items, passes = evened
        waited, self._rows_waited = self._rows_waited, False
        if passes > 1 and not self.unified:
            split = self._first_pass_alone(items, passes)
            if split is not None:
                items, rest = split
                self._after = (rest, budget)
                passes = self._passes(items)
            elif not waited and (prompts := self._prompts_first(items, passes)) is not None:
                items = prompts
                passes = self._passes(items)
                self._rows_waited = True
        if self._after is None and (halves := self._split_for_mean(items, passes)) is not None:
            items, rest = halves
            self._after = (rest, budget)
            passes = self._passes(items)
        return Batch(
            tuple(self.take_ops()),
            tuple(items),
            tuple(s.id for s in finished_by_length),
            budget=budget,
            passes=passes,
        )

    def _steady(self) -> Batch | None:
        """The step between two steps like it, built in one pass over the slots: nothing
        queued, no KV operations or split-off chunks due, no slot prefilling, and the
        busy slots decoding at consecutive ids (no hole to close). That is every step
        of a stream decoding on its own and most of a steady load, and the step's
        Python runs after each decode, on caches the decode has just filled with
        weights, so every step pays for what it touches (docs/performance.md,
        "Single-stream TPOT in pairs"). The batch is the one ``schedule``'s full path
        makes in that state; None: take the full path."""
        if self.queue or self._ops or self._after is not None:
            return None
        decoding: list[Slot] = []
        last = -2
        decode, idle = SlotState.DECODE, SlotState.IDLE
        for slot in self.slots:
            state = slot.state
            if state is idle:
                continue
            if state is not decode or (decoding and slot.id != last + 1):
                return None  # a prompt to feed, or a hole
            if len(slot.cache) + 1 > self.context.window:
                return None  # a shift or the length limit: the full path decides
            decoding.append(slot)
            last = slot.id
        if not decoding or len(decoding) > self.n_ubatch:
            return None
        if not self.unified:
            self._hole_steps = 0  # what _close_holes records for a step without a hole
        self.decoding = len(decoding)
        items: list[BatchItem] = []
        spare = self.n_batch - len(decoding)  # batch room for drafted tokens
        window = self.context.window
        drafted = 0
        for slot in decoding:
            room = min(spare, window - len(slot.cache) - 1)
            draft = tuple(self.drafts(slot, room)[:room]) if room > 0 else ()
            spare -= len(draft)
            drafted += len(draft)
            tokens = (slot.pending[0], *draft) if draft else (slot.pending[0],)
            items.append(BatchItem(slot.id, tokens, len(slot.cache), True, False, len(draft)))
        rows = len(decoding) + drafted
        budget = min(self.n_batch - rows, self.prefill_chunk, max(0, self.chunk_budget(rows)))
        passes = self._passes(items) if drafted else 1  # one token per slot, consecutive ids
        self._rows_waited = False
        return Batch((), tuple(items), (), budget=budget, passes=passes)

    def _passes(self, items: Sequence[BatchItem]) -> int:
        return micro_batches([(i.slot, len(i.tokens)) for i in items], self.n_ubatch, self.unified)

    def _even_tails(
        self, items: list[BatchItem], passes: int, room: int
    ) -> tuple[list[BatchItem], int] | None:
        """With one KV stream per slot llama.cpp splits a step whose prompts feed
        different numbers of tokens into one pass per length (``micro_batches``), and
        each pass reads every weight: a burst whose prompts share a cached system
        prompt and differ in the user's words costs a pass per distinct tail. A
        shorter prompt can feed the same number of tokens as a longer one by
        computing again some of its cached cells: the cells are removed, the slot's
        last cached tokens go back in front of its prompt, and its chunk starts that
        many positions earlier. Same tokens at the same positions, so the same cells.

        The longest tail to even up to is the one that minimizes ``pass_tokens`` (the
        prompt tokens one pass costs as much as: the engine's step-cost model) times
        the passes, plus the tokens computed again; those fit the step's unused
        prompt budget ``room``. Only text cells of a prompt that has not been shifted;
        not with a sliding-window cache (its cells below the window are gone) or
        without prefix reuse (a recurrent state cannot lose its tail). None: no
        target costs less than the step as it is."""
        worth = self.pass_tokens()
        if worth <= 0 or self.swa_window or not self.prefix_reuse:
            return None
        # a chunk with logits at every position is not lengthened: its logits are taken
        text = {
            i.slot
            for i in items
            if i.prefill and i.tokens and i.tokens[0] >= 0 and not i.logits_all
        }
        lengths = sorted({len(i.tokens) for i in items if i.slot in text})
        if len(lengths) < 2:
            return None
        best: tuple[float, list[BatchItem], int] | None = None
        for target in lengths[1:]:
            added = 0
            trial: list[BatchItem] = []
            for item in items:
                d = target - len(item.tokens)
                if item.slot in text and d > 0 and self._refeedable(item, d):
                    added += d
                    fed = (*self.slots[item.slot].cache[item.pos - d : item.pos], *item.tokens)
                    item = BatchItem(item.slot, fed, item.pos - d, item.sample, True)
                trial.append(item)
            if added == 0 or added > room:
                continue
            n = self._passes(trial)
            cost = worth * n + added
            if cost < worth * passes and (best is None or cost < best[0]):
                best = (cost, trial, n)
        if best is None:
            return None
        _, trial, n = best
        for old, new in zip(items, trial, strict=True):
            if new.pos != old.pos:
                slot = self.slots[new.slot]
                self._ops.append(Remove(slot.id, new.pos, -1))
                slot.pending[:0] = slot.cache[new.pos :]
                del slot.cache[new.pos :]
                slot.reusable = min(slot.reusable, new.pos)
                slot.cached_prompt = min(slot.cached_prompt, new.pos)
        self.retails += 1
        return trial, n

    def _refeedable(self, item: BatchItem, d: int) -> bool:
        """The ``d`` cells before the item's chunk can be computed again: they exist,
        are text, and the slot's positions are its cache's indices (no shift)."""
        slot = self.slots[item.slot]
        if slot.shifts or d > item.pos or len(slot.cache) != item.pos:
            return False
        return min(slot.cache[item.pos - d : item.pos]) >= 0

    def _first_pass_alone(
        self, items: list[BatchItem], passes: int
    ) -> tuple[list[BatchItem], tuple[BatchItem, ...]] | None:
        """With one KV stream per slot llama.cpp splits a step whose sequences feed
        different numbers of tokens into passes of equal shares (``micro_batches``):
        the first pass takes as many tokens of every sequence as the shortest feeds.
        When the items of that length include a prompt's last token (a returning
        user's one token, the shortest prompt of a burst) and everything longer is
        prompt, running those items as a step of their own and the rest as the next
        step costs no more passes: the same tokens, split where llama.cpp would
        split them anyway, and the shortest prompts get their first token after the
        first pass instead of after the whole step. The rest runs next, alone
        (``_run_after``), so that the decode rows of those who just started do not
        split it again. None when that would cost a pass or give no first token."""
        shortest = min(len(i.tokens) for i in items)
        first = [i for i in items if len(i.tokens) == shortest]
        rest = tuple(i for i in items if len(i.tokens) != shortest)
        if not rest or any(not i.prefill for i in rest):
            return None
        if not any(i.prefill and i.sample for i in first):
            return None
        if self._passes(first) + self._passes(rest) > passes:
            return None
        return first, rest

    def _split_for_mean(
        self, items: list[BatchItem], passes: int
    ) -> tuple[list[BatchItem], tuple[BatchItem, ...]] | None:
        """A step that only starts prompts (each ends in it: a burst of requests) gives
        every one of them its first token when the whole step ends. Run as two steps,
        the shorter prompts first, the first ones get theirs after the first step and
        the rest after both: one more llama.cpp pass, the same prompt tokens. Where a
        prompt token costs much beside a pass (a prompt's compute on a CPU, or long
        prompts on a GPU) that lowers the prompts' mean TTFT; where a pass dominates
        (short prompts on a GPU) it does not. The split point is the one that
        minimizes the sum of the prompts' predicted first-token times by the engine's
        step-cost model (``step_ms``; nothing is split until the model has settled),
        shortest first as in the classic batching rule for the total completion time,
        and only where the mean falls by more than the last prompt's TTFT rises (the
        pass added and the first group's tokens): a small gain in the mean is not
        bought with the tail. One split at most (the second step runs next, alone, as
        ``_first_pass_alone``'s does). None: the step stays whole."""
        if len(items) < 2 or any(not (i.prefill and i.sample) for i in items):
            return None
        whole = self.step_ms(passes, 0, sum(len(i.tokens) for i in items))
        if whole is None:
            return None
        order = sorted(items, key=lambda i: (len(i.tokens), i.slot))
        k = len(order)
        best, cut = k * whole, 0
        for m in range(1, k):
            first, rest = order[:m], order[m:]
            t1 = self.step_ms(self._passes(first), 0, sum(len(i.tokens) for i in first))
            t2 = self.step_ms(self._passes(rest), 0, sum(len(i.tokens) for i in rest))
            if t1 is None or t2 is None:
                return None
            total = k * t1 + (k - m) * t2  # every prompt waits for the first step
            # worth it only where the mean falls by more than the last prompt's TTFT rises
            if total < best and (k * whole - total) / k >= t1 + t2 - whole:
                best, cut = total, m
        if cut == 0:
            return None
        self.prompt_splits += 1
        first = sorted(order[:cut], key=lambda i: i.slot)  # llama.cpp's order of ids
        return first, tuple(sorted(order[cut:], key=lambda i: i.slot))

    def _prompts_first(self, items: list[BatchItem], passes: int) -> list[BatchItem] | None:
        """With one KV stream per slot, decode rows beside prompts that end in this step
        cost llama.cpp extra passes: one token of every sequence, then the rest of
        the prompts. The prompts alone take fewer passes, and the decode rows run
        next, with the new streams' first decode rows, in the pass that step makes
        anyway: where a pass costs a read of the weights the running streams get
        their tokens when they would have, and the new prompts their first token a
        step sooner (a burst whose first request started alone).

        Only when the next step decodes only: every prompt being fed ends here (a
        chunk of a longer prompt would make the streams wait for every chunk), none
        is queued or left to feed, and the decode rows did not wait in the step
        before (prompts arriving one after another would hold the streams back step
        after step). Not with drafts, and not with a TPOT target (``prompts_first``
        off: the chunk budget was set for a step that carries the decode rows).
        None: the step stays whole."""
        if not self.prompts_first or self.queue:
            return None
        prompts = [i for i in items if i.prefill]
        if not prompts or len(prompts) == len(items):
            return None
        if any(i.draft for i in items) or not all(i.sample for i in prompts):
            return None
        fed = {i.slot for i in prompts}
        if any(s.state is SlotState.PREFILL and s.id not in fed for s in self.slots):
            return None  # another prompt is still to feed: the next step is not decode only
        return prompts if self._passes(prompts) < passes else None

    @property
    def split_pending(self) -> bool:
        """The next step is the prompt chunks split off the last one (no decode rows)."""
        return self._after is not None

    def _run_after(self) -> Batch | None:
        """The prompt chunks ``_first_pass_alone`` left for this step, those still due
        (a cancel may have freed a slot since); None when none are."""
        if self._after is None:
            return None
        rest, budget = self._after
        self._after = None
        due = [
            i
            for i in rest
            if (slot := self.slots[i.slot]).state is SlotState.PREFILL
            and len(slot.cache) == i.pos
            and tuple(slot.pending[: len(i.tokens)]) == i.tokens
        ]
        if not due:
            return None
        return Batch(tuple(self.take_ops()), tuple(due), budget=budget, passes=self._passes(due))

    def passes_for(self, rows: int, prompt: int) -> int:
        """llama.cpp passes of a step with ``rows`` decode tokens (one per slot, at
        consecutive ids) and a prompt chunk of ``prompt`` tokens in one other slot:
        the shape the chunk budget is chosen for."""
        items = [(i, 1) for i in range(rows)] + ([(rows, prompt)] if prompt else [])
        return micro_batches(items, self.n_ubatch, self.unified)

    def _close_holes(self) -> None:
        """One KV stream per slot: while the busy slots do not have consecutive ids
        (a slot between them finished), move one busy slot into an idle one so that
        they do, and a step stays one llama.cpp pass. The move copies the stream
        (``Copy``); the slot it left keeps the same cells as an idle prefix cache.

        A move overwrites the cells of the slot it goes to, so a move onto a slot
        whose prompt no other slot holds comes last: busy 0 and 2 around a finished
        1 holding its user's prompt, slot 0 goes to an empty 3 rather than 2 onto 1.
        Otherwise the highest busy slot goes to the lowest hole. When every move
        that joins the busy slots would lose a cached prompt, the hole is left for
        up to ``HOLE_GRACE_STEPS`` steps first (a step with a hole costs one more
        pass): most holes close by themselves."""
        while True:
            busy = {s.id for s in self.slots if s.busy}
            runs = _runs(busy)
            if runs <= 1:
                self._hole_steps = 0
                return
            lossy = {d.id: self._lost(d) >= SHARE_MIN for d in self.slots if not d.busy}
            # (loses a prompt, runs after, the highest source first, the lowest target)
            moves = [
                (lossy[dst], after, -src, dst)
                for src in busy
                for dst in lossy
                if (after := _runs((busy - {src}) | {dst})) < runs
            ]
            if not moves:
                return
            loses, _, minus_src, dst = min(moves)
            if loses and self._hole_steps < HOLE_GRACE_STEPS:
                self._hole_steps += 1
                return
            self._move(self.slots[-minus_src], self.slots[dst])

    def _move(self, src: Slot, dst: Slot) -> None:
        self._ops.append(Copy(src.id, dst.id))
        dst.state, dst.request = src.state, src.request
        dst.cache, dst.pending = list(src.cache), src.pending
        dst.reusable, dst.cached_prompt = src.reusable, src.cached_prompt
        dst.generated, dst.shifts, dst.admitted_seq = src.generated, src.shifts, src.admitted_seq
        dst.passed_over = src.passed_over
        src.state, src.request, src.pending = SlotState.IDLE, None, []
        src.reusable = min(src.reusable, len(src.cache))
        self.moves += 1

    def _make_room(self, slot: Slot) -> bool:
        """Shift the slot's context to take one more token; False when sliding is off."""
        ctx = self.context
        if not ctx.sliding:
            return False
        n_discard = ctx.discarded  # the slot's cells fill the window
        self._ops.append(Shift(slot.id, ctx.keep, n_discard, len(slot.cache)))
        del slot.cache[ctx.keep : ctx.keep + n_discard]
        slot.reusable = min(slot.reusable, ctx.keep)
        slot.shifts += 1
        return True

    def update(
        self, batch: Batch, sampled: dict[int, int], accepted: dict[int, int] | None = None
    ) -> None:
        """Record the decoded tokens and the token sampled for each ``sample`` item.

        A speculating item: ``accepted[slot]`` of its drafted tokens matched what the
        model sampled, and ``sampled[slot]`` is the token sampled after the last of
        them; the cells of the rejected drafts are removed before the next step."""
        for item in batch.items:
            slot = self.slots[item.slot]
            if not slot.busy:  # cancelled while the batch ran
                continue
            kept = len(item.tokens)
            if item.draft:
                ok = (accepted or {}).get(item.slot, 0)
                kept = len(item.tokens) - item.draft + ok
                if kept < len(item.tokens):
                    self._ops.append(Remove(item.slot, item.pos + kept, -1))
                slot.generated += ok
            slot.cache.extend(item.tokens[:kept])
            slot.reusable = len(slot.cache) if slot.shifts == 0 else slot.reusable
            del slot.pending[: len(item.tokens)]
            if item.sample:
                token = sampled[item.slot]
                slot.state = SlotState.DECODE
                slot.pending = [token]
                slot.generated += 1

    def load_failed(self, seqs: Sequence[int]) -> None:
        """Saved prompts could not be restored into these slots' sequences (now empty):
        their requests prefill the whole prompt instead."""
        for seq in seqs:
            slot = self.slots[seq]
            slot.cache, slot.reusable, slot.cached_prompt = [], 0, 0
            if slot.state is SlotState.PREFILL and slot.request is not None:
                slot.pending = list(slot.request.prompt_tokens)

    def discard(self, batch: Batch) -> None:
        """Forget a batch whose decode was aborted: llama.cpp may have kept the cells
        of the micro-batches it finished, so remove them; the next step feeds the
        same tokens again."""
        for item in batch.items:
            if self.slots[item.slot].busy:
                self._ops.append(Remove(item.slot, item.pos, -1))

    # -- views -------------------------------------------------------------------

    @property
    def busy_slots(self) -> int:
        return self.usage()[0]

    @property
    def kv_cells_used(self) -> int:
        """Cells held by running requests."""
        return self.usage()[1]

    def usage(self) -> tuple[int, int]:
        """(busy_slots, kv_cells_used) in one pass over the slots (once per step)."""
        busy = cells = 0
        idle = SlotState.IDLE
        for s in self.slots:
            if s.state is not idle:
                busy += 1
                cells += len(s.cache)
        return busy, cells

    @property
    def kv_cells_cached(self) -> int:
        """Cells idle slots keep as a prefix for the next prompt (inside their own stream)."""
        return sum(len(s.cache) for s in self.slots if not s.busy)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def has_work(self) -> bool:
        if self.queue or self._ops:
            return True
        idle = SlotState.IDLE
        return any(s.state is not idle for s in self.slots)

    # -- embeddings

    def idle_slot_ids(self) -> list[int]:
        """The idle slots an embedding pass may borrow, those keeping the fewest cells
        for prefix reuse first (the least reuse lost), then by id."""
        idle = [s for s in self.slots if not s.busy]
        return [s.id for s in sorted(idle, key=lambda s: (len(s.cache), s.id))]

    def lend_idle(self, slot_ids: Sequence[int]) -> list[KVOp]:
        """Hand idle slots to an embedding pass for one step; the KV operations to run
        before it: the pending ones, then the removal of every cell of each borrowed
        slot (an embedding starts on an empty sequence). Their prefix cache is
        forgotten, so the next prompt does not reuse cells that are gone; the slots
        stay idle, and the pass removes its own cells when it ends."""
        for slot_id in slot_ids:
            slot = self.slots[slot_id]
            if slot.busy:
                raise ValueError(f"slot {slot_id} is busy; only idle slots can be lent")
            self._ops.append(Remove(slot_id, 0, -1))
            slot.cache = []
            slot.reusable = 0
        return self.take_ops()


def _prefill_order(slots: Sequence[Slot]) -> list[Slot]:
    """The prefilling slots in the order they share a step's prompt budget: the
    fewest prompt tokens left first (a short prompt is not held behind a long one's
    chunks: its first token comes a step later instead of after the whole long
    prefill, and the long one loses only the short one's tokens), ties by
    admission. Slots the previous step passed over go first, oldest first, so a
    stream of short prompts cannot starve a long one: it gets a chunk at least every
    other step."""
    prefilling = [s for s in slots if s.state is SlotState.PREFILL]
    if len(prefilling) > 1:
        prefilling.sort(key=_prefill_rank)
    return prefilling


def _prefill_rank(slot: Slot) -> tuple[int, int, int]:
    if slot.passed_over:
        return (0, slot.admitted_seq, 0)
    return (1, len(slot.pending), slot.admitted_seq)


def _runs(ids: set[int]) -> int:
    """Runs of consecutive ids: llama.cpp's passes for one token per slot."""
    return sum(1 for i in ids if i - 1 not in ids)


def _one_kind(pending: Sequence[int], limit: int) -> list[int]:
    """The next prompt chunk, at most ``limit`` ids, all text or all image rows
    (negative ids, orin.engine.vision): llama.cpp takes a batch of tokens or of
    embeddings, never both, so a chunk ends where the kind changes."""
    chunk = list(pending[:limit])
    if not chunk or min(chunk) >= 0:
        return chunk  # plain text: the common case costs one min()
    image = chunk[0] < 0
    for i, t in enumerate(chunk):
        if (t < 0) != image:
            return chunk[:i]
    return chunk


def _reusable_prefix(slot: Slot, tokens: Sequence[int]) -> int:
    """How many leading ``tokens`` the slot's reusable cells hold."""
    return min(common_prefix(slot.cache, tokens), slot.reusable)


def _holds_more(slot: Slot, tokens: Sequence[int], n: int) -> bool:
    """Whether the slot's reusable cells may hold more than ``n`` leading ``tokens``:
    False when they cannot, told from one token. An admission weighs every slot
    against the prompt and every pair of slots against each other (``_lost``), and
    most pairs part early; this check spares the comparison of those that part
    before ``n``. A burst of 4 new users on 8 slots that held other users'
    conversations took ``schedule`` 1.1-1.2 ms without it and 0.4 ms with it
    (benchmarks/admit_cost.py, docs/performance.md)."""
    return slot.reusable > n and len(slot.cache) > n < len(tokens) and slot.cache[n] == tokens[n]


def _longest_prefix(slots: Iterable[Slot], tokens: Sequence[int], floor: int = 0) -> int:
    """The most leading ``tokens`` any of ``slots``' reusable cells hold, or ``floor``
    when none holds more."""
    best = floor
    for s in slots:
        if _holds_more(s, tokens, best):
            best = max(best, _reusable_prefix(s, tokens))
    return best


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix, compared in blocks that double in
    size: slots that share a long system prompt make a long common run the usual
    case, and an admission compares every pair of slots, so C-level comparisons of
    slices rather than a Python loop over thousands of tokens."""
    n = min(len(a), len(b))
    same = type(a) is type(b)  # a list slice never equals a tuple slice
    lo, block = 0, 32
    while lo < n:
        hi = min(n, lo + block)
        x, y = a[lo:hi], b[lo:hi]
        if (x != y) if same else (list(x) != list(y)):
            return next(i for i in range(lo, hi) if a[i] != b[i])
        lo, block = hi, block * 2
    return n
