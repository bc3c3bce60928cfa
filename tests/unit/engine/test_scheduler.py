"""The pure scheduler against a fake runner that keeps a fake KV cache."""

from __future__ import annotations

import contextlib
import copy
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from orin.engine.errors import ContextLengthExceeded, InvalidRequest, QueueFull
from orin.engine.scheduler import (
    LOGITS_CHUNK,
    Batch,
    BatchItem,
    ContextPolicy,
    Copy,
    Load,
    Remove,
    Scheduler,
    Shift,
    SlotState,
)


@dataclass
class Req:
    id: str
    prompt_tokens: list[int]
    all_logits: bool = False
    held: bool = False


@dataclass
class FakeRunner:
    """Applies KV operations and batches like llama.cpp would, per sequence."""

    kv: dict[int, list[int]] = field(default_factory=dict)

    def run(self, batch: Batch) -> dict[int, int]:
        for op in batch.ops:
            if isinstance(op, Copy):  # one stream per slot: the whole stream (p1 = -1)
                cells = self.kv.get(op.src, [])
                self.kv[op.dst] = list(cells if op.p1 < 0 else cells[: op.p1])
                continue
            cells = self.kv.setdefault(op.seq, [])
            if isinstance(op, Remove):
                end = len(cells) if op.p1 < 0 else op.p1
                del cells[op.p0 : end]
            else:
                assert op.n_past == len(cells)
                del cells[op.keep : op.keep + op.n_discard]
        sampled = {}
        for item in batch.items:
            cells = self.kv.setdefault(item.slot, [])
            assert item.pos == len(cells), "tokens must continue the sequence"
            cells.extend(item.tokens)
            if item.sample:
                sampled[item.slot] = (cells[-1] * 7 + 1) % 1000
        return sampled


def step(s: Scheduler, runner: FakeRunner) -> Batch:
    batch = s.schedule()
    s.update(batch, runner.run(batch))
    for slot in s.slots:
        assert runner.kv.get(slot.id, []) == slot.cache
    return batch


def make(slots: int = 2, n_batch: int = 32, window: int = 64, **ctx: int | bool) -> Scheduler:
    return Scheduler(slots, n_batch, ContextPolicy(window=window, **ctx))  # type: ignore[arg-type]


def test_decode_tokens_first_then_prefill_chunks_within_budget() -> None:
    s, r = make(slots=3, n_batch=32, window=512), FakeRunner()
    s.add(Req("a", list(range(1, 6))))
    s.add(Req("b", list(range(10, 14))))
    # llama.cpp would run 4 tokens of each and then a's fifth: the shorter prompt's
    # pass runs as a step of its own, the rest next, in as many passes
    first = step(s, r)
    assert [(i.slot, len(i.tokens), i.sample) for i in first.items] == [(1, 4, True)]
    assert first.passes == 1
    after = step(s, r)
    assert [(i.slot, len(i.tokens), i.sample) for i in after.items] == [(0, 5, True)]
    assert after.passes == 1
    s.add(Req("long", list(range(100, 200))))
    second = step(s, r)
    assert [(i.slot, len(i.tokens), i.prefill) for i in second.items] == [
        (0, 1, False),
        (1, 1, False),
        (2, 30, True),
    ]
    assert second.n_decode == 2 and second.n_prefill == 30
    assert not second.items[2].sample  # no logits until the prompt is complete
    sizes = [len(step(s, r).items[-1].tokens) for _ in range(3)]
    assert sizes == [30, 30, 10]
    assert s.slots[2].state is SlotState.DECODE


def test_the_shortest_prompt_takes_the_budget_first() -> None:
    s, r = make(slots=2, n_batch=40, window=512), FakeRunner()
    s.add(Req("first", list(range(50))))
    s.add(Req("second", list(range(100, 130))))
    b = step(s, r)
    # the 30-token prompt completes in this step; the 50-token one gets what is left
    assert [(i.slot, len(i.tokens), i.sample) for i in b.items] == [(0, 10, False), (1, 30, True)]
    b = step(s, r)
    assert [(i.slot, len(i.tokens), i.prefill) for i in b.items] == [(0, 39, True), (1, 1, False)]


def test_a_short_prompt_is_not_held_behind_a_long_prompts_chunks() -> None:
    s, r = make(slots=3, n_batch=64, window=512), FakeRunner()
    s.chunk_budget = lambda rows: 16  # a TPOT target's budget while streams decode
    s.add(Req("a", [1, 2, 3]))
    step(s, r)  # slot 0 decodes
    s.add(Req("long", list(range(100, 200))))
    step(s, r)  # the long prompt's first chunk
    s.add(Req("short", list(range(300, 306))))
    b = step(s, r)
    prompt = [(i.slot, len(i.tokens), i.sample) for i in b.items if i.prefill]
    assert prompt == [(1, 10, False), (2, 6, True)]  # the short one's first token now


def test_ties_in_remaining_prompt_go_by_admission() -> None:
    s, r = make(slots=2, n_batch=24, window=512), FakeRunner()
    s.add(Req("first", list(range(1, 21))))
    s.add(Req("second", list(range(100, 120))))
    b = step(s, r)
    assert [(i.slot, len(i.tokens)) for i in b.items] == [(0, 20), (1, 4)]


def test_a_stream_of_short_prompts_cannot_starve_a_long_one() -> None:
    s, r = make(slots=8, n_batch=64, window=512), FakeRunner()
    s.chunk_budget = lambda rows: 8
    s.add(Req("long", list(range(1000, 1100))))
    step(s, r)  # nothing decodes: its first chunk (the budget's rows == 0 is still 8 here)
    fed: list[int] = []
    for k in range(6):
        s.add(Req(f"short{k}", [k + 1] * 8))  # each alone fills the budget
        b = step(s, r)
        fed.append(sum(len(i.tokens) for i in b.items if i.prefill and i.slot == 0))
    # the long prompt is passed over at most one step in two
    assert all(a or b for a, b in itertools.pairwise(fed)), fed
    assert sum(fed) >= 3 * 8


def test_prefill_chunk_caps_the_prompt_tokens_of_a_step() -> None:
    s = Scheduler(3, 64, ContextPolicy(window=512), prefill_chunk=16)
    s.prompts_first = False  # the last chunk would run before the decode rows
    r = FakeRunner()
    s.add(Req("a", [1, 2, 3]))
    step(s, r)  # slot 0 now decodes
    s.add(Req("long", list(range(100, 140))))
    s.add(Req("next", list(range(200, 210))))
    prompt_sizes = []
    while any(sl.state is SlotState.PREFILL for sl in s.slots) or s.queue:
        b = step(s, r)
        assert not b.items[0].prefill  # the running stream is never held back by the cap
        prompt_sizes.append([(i.slot, len(i.tokens)) for i in b.items if i.prefill])
    # 16 prompt tokens per step, all slots together, though n_batch has room for 63;
    # the shorter prompt first
    assert prompt_sizes == [[(1, 6), (2, 10)], [(1, 16)], [(1, 16)], [(1, 2)]]


def test_a_cancelled_prompt_is_fed_no_further_chunk() -> None:
    """On a GPU a step cannot be interrupted: the cancel lands between steps."""
    s, r = Scheduler(2, 64, ContextPolicy(window=512), prefill_chunk=8), FakeRunner()
    s.add(Req("long", list(range(1, 101))))
    first = step(s, r)
    assert [len(i.tokens) for i in first.items] == [8]
    s.cancel("long")
    after = step(s, r)
    assert after.items == () and after.ops == (Remove(0, 0, -1),)
    assert r.kv[0] == []


def test_a_cancel_that_keeps_the_cache_leaves_the_computed_prompt_as_a_prefix() -> None:
    """A prompt cancelled after two of its chunks keeps those 16 cells, the cells of a
    step that ran while it was cancelled are removed, and the same prompt asked
    again (stop, then regenerate) takes the 16 instead of computing them."""
    s, r = Scheduler(2, 64, ContextPolicy(window=512), prefill_chunk=8), FakeRunner()
    prompt = list(range(1, 41))
    s.add(Req("long", prompt))
    step(s, r)
    step(s, r)
    running = s.schedule()  # its third chunk is being decoded when the cancel comes
    assert s.cancel("long", keep_cache=True) is s.slots[0]
    s.update(running, r.run(running))
    assert r.kv[0] == prompt[:24] and s.slots[0].cache == prompt[:16]
    assert s.busy_slots == 0 and s.kv_cells_used == 0
    s.add(Req("again", prompt))
    b = step(s, r)
    assert b.ops == (Remove(0, 16, -1),)
    assert [(i.slot, i.pos, i.tokens) for i in b.items] == [(0, 16, tuple(prompt[16:24]))]
    assert s.slots[0].cached_prompt == 16


def test_prefill_chunk_must_fit_the_batch() -> None:
    with pytest.raises(ValueError, match="prefill_chunk"):
        Scheduler(2, 32, ContextPolicy(window=64), prefill_chunk=33)
    assert Scheduler(2, 32, ContextPolicy(window=64)).prefill_chunk == 32


def test_queue_is_bounded_and_fifo() -> None:
    s = Scheduler(1, 32, ContextPolicy(window=64), max_queue=2)
    for name in ("a", "b", "c"):  # one goes to the idle slot at the next step
        s.add(Req(name, [1, 2]))
    with pytest.raises(QueueFull):
        s.add(Req("d", [1, 2]))
    s.schedule()
    assert s.slots[0].request is not None and s.slots[0].request.id == "a"
    assert [q.id for q in s.queue] == ["b", "c"]


def test_prefix_reuse_picks_longest_common_prefix() -> None:
    s, r = make(slots=3, window=512), FakeRunner()
    s.add(Req("x", [1, 2, 3, 4, 5, 6]))
    s.add(Req("y", [9, 9, 9]))
    step(s, r)
    while any(x.state is SlotState.PREFILL for x in s.slots):  # y's pass ran alone, then x's
        step(s, r)
    for slot in list(s.slots[:2]):
        s.release(slot, keep_cache=True)
    s.add(Req("z", [1, 2, 3, 4, 7, 8]))
    b = step(s, r)
    slot = s.slot_of("z")
    assert slot is not None and slot.id == 0
    assert slot.cached_prompt == 4
    assert Remove(0, 4, -1) in b.ops
    assert b.items == (BatchItem(0, (7, 8), 4, True, prefill=True),)


def test_identical_prompt_refeeds_its_last_token() -> None:
    s, r = make(slots=1, window=512), FakeRunner()
    s.add(Req("a", [1, 2, 3]))
    step(s, r)
    s.release(s.slots[0], keep_cache=True)
    s.add(Req("b", [1, 2, 3]))
    b = step(s, r)
    assert s.slots[0].cached_prompt == 2
    assert b.items == (BatchItem(0, (3,), 2, True, prefill=True),)


def test_release_without_cache_and_cancel_remove_every_cell() -> None:
    s, r = make(slots=2, window=512), FakeRunner()
    s.add(Req("a", [1, 2, 3]))
    s.add(Req("b", [4, 5]))
    step(s, r)
    step(s, r)
    assert s.cancel("a") is s.slots[0]
    s.release(s.slots[1], keep_cache=False)
    assert s.busy_slots == 0
    b = step(s, r)
    assert set(b.ops) == {Remove(0, 0, -1), Remove(1, 0, -1)}
    assert r.kv[0] == [] and r.kv[1] == [] and s.kv_cells_used == 0


def test_cancel_while_queued() -> None:
    s = make(slots=1)
    s.add(Req("a", [1]))
    s.add(Req("b", [2]))
    assert s.cancel("b") is None
    assert [q.id for q in s.queue] == ["a"]


def test_context_shift_keeps_head_and_discards_half() -> None:
    s, r = make(slots=1, window=16, keep=4), FakeRunner()
    s.add(Req("a", list(range(1, 11))))
    for _ in range(7):  # prefill, then cache grows to 16
        step(s, r)
    assert len(s.slots[0].cache) == 16
    b = step(s, r)
    assert b.ops == (Shift(0, keep=4, n_discard=6, n_past=16),)
    assert b.items[0].pos == 10
    assert s.slots[0].cache[:4] == [1, 2, 3, 4]
    assert len(s.slots[0].cache) == 11
    for _ in range(200):  # runs far past the window, positions stay inside it
        b = step(s, r)
        assert all(i.pos < 16 for i in b.items)
    assert s.slots[0].shifts > 10


def test_fixed_discard_count() -> None:
    s, r = make(slots=1, window=16, keep=2, discard=3), FakeRunner()
    s.add(Req("a", list(range(1, 17))))
    step(s, r)
    b = step(s, r)
    assert b.ops == (Shift(0, keep=2, n_discard=3, n_past=16),)


def test_sliding_off_stops_at_the_window() -> None:
    s, r = make(slots=1, window=16, sliding=False), FakeRunner()
    s.add(Req("a", list(range(1, 16))))
    step(s, r)
    b = step(s, r)
    assert b.length_limited == () and len(s.slots[0].cache) == 16
    b = step(s, r)
    assert b.length_limited == (0,)
    assert b.items == ()


def test_over_long_prompt_rejected_or_truncated() -> None:
    strict = make(window=16, keep=4)
    with pytest.raises(ContextLengthExceeded) as exc:
        strict.check_prompt(list(range(20)))
    assert (exc.value.prompt_tokens, exc.value.limit) == (20, 16)
    # cut as a shift of a full window would leave it: the first 4 and the most recent
    # 6 (half of the 12 after keep), so the answer has 6 cells before the next shift
    lenient = make(window=16, keep=4, truncate_prompt=True)
    assert lenient.check_prompt(list(range(20))) == [0, 1, 2, 3, *range(14, 20)]
    assert lenient.check_prompt(list(range(16))) == list(range(16))  # it fits: not cut
    assert lenient.check_prompt([1, 2]) == [1, 2]
    fixed = make(window=16, keep=4, discard=10, truncate_prompt=True)
    assert fixed.check_prompt(list(range(20))) == [0, 1, 2, 3, 18, 19]
    with pytest.raises(InvalidRequest):
        lenient.check_prompt([])


def test_discard_after_abort_removes_partial_cells() -> None:
    s, r = make(slots=2, window=512), FakeRunner()
    s.prompts_first = False  # a step of a decode row and a prompt, in two passes
    s.add(Req("a", [1, 2, 3]))
    step(s, r)
    s.add(Req("b", list(range(10, 40))))
    b = s.schedule()
    r.run(Batch(b.ops, b.items[:1]))  # only the first micro-batch made it
    s.discard(b)
    again = s.schedule()
    assert Remove(0, 3, -1) in again.ops and Remove(1, 0, -1) in again.ops
    assert [(i.slot, i.pos, len(i.tokens)) for i in again.items] == [(0, 3, 1), (1, 0, 30)]
    s.update(again, r.run(again))
    assert r.kv[0] == s.slots[0].cache and r.kv[1] == s.slots[1].cache


def test_n_batch_must_cover_all_slots() -> None:
    with pytest.raises(ValueError, match="n_batch"):
        Scheduler(8, 4, ContextPolicy(window=64))


def test_random_traffic_keeps_runner_and_scheduler_in_step() -> None:
    rng = random.Random(7)
    s, r = make(slots=4, n_batch=24, window=48, keep=3), FakeRunner()
    s.max_queue = 1000
    live: set[str] = set()
    for n in range(400):
        if rng.random() < 0.3:
            rid = f"r{n}"
            prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 60))]
            try:
                s.add(Req(rid, s.check_prompt(prompt)))
                live.add(rid)
            except ContextLengthExceeded:
                pass
        if live and rng.random() < 0.1:
            s.cancel(rng.choice(sorted(live)))
        b = step(s, r)
        assert b.n_tokens <= 24
        for slot in s.slots:
            if slot.busy and slot.generated >= rng.randrange(1, 80):
                live.discard(slot.request.id)  # type: ignore[union-attr]
                s.release(slot, keep_cache=rng.random() < 0.5)
        assert all(len(c) <= 48 for c in r.kv.values())


def test_without_a_shared_prefix_the_lowest_idle_slot_is_taken() -> None:
    s, r = make(slots=4, window=512), FakeRunner()
    for name in "abcd":
        s.add(Req(name, [ord(name)]))
    step(s, r)
    s.release(s.slots[0], keep_cache=True)
    s.release(s.slots[2], keep_cache=True)
    s.add(Req("e", [5, 6]))  # shares nothing: packed at the lowest free id
    step(s, r)
    slot = s.slot_of("e")
    assert slot is not None and slot.id == 0


def test_a_prompt_another_slot_holds_is_copied_not_prefilled() -> None:
    """A busy slot's prompt cells serve a new request with the same prefix: one
    copy of its stream, then only the tokens that differ are fed."""
    s, r = make(slots=2, n_batch=64, window=512), FakeRunner()
    system = list(range(100, 140))
    s.add(Req("a", [*system, 1, 2]))
    step(s, r)
    step(s, r)  # "a" decodes: its slot is busy
    s.add(Req("b", [*system, 3]))
    b = step(s, r)
    slot = s.slot_of("b")
    assert slot is not None and slot.id == 1
    assert b.ops == (Copy(0, 1), Remove(1, 40, -1))
    assert slot.cached_prompt == 40
    assert [i for i in b.items if i.slot == 1] == [BatchItem(1, (3,), 40, True, prefill=True)]


def test_identical_prompts_wait_for_one_prefill_and_share_it() -> None:
    """n choices of one prompt: the first prefills, the others wait for it and take
    its cells, each feeding the last prompt token again for its own logits."""
    s, r = make(slots=3, n_batch=16, window=512), FakeRunner()
    prompt = list(range(1, 41))
    for rid in ("c0", "c1", "c2"):
        s.add(Req(rid, prompt))
    fed = 0
    while any(sl.state is not SlotState.DECODE for sl in s.slots):
        fed += step(s, r).n_prefill
    assert fed == 40 + 2  # one prefill, then one token per other choice
    assert sorted(sl.cached_prompt for sl in s.slots) == [0, 39, 39]


def test_a_short_shared_gain_is_not_worth_a_copy() -> None:
    s, r = make(slots=2, n_batch=64, window=512), FakeRunner()
    s.add(Req("a", list(range(100, 140))))
    step(s, r)
    s.add(Req("b", [100, 101, *range(1, 40)]))  # 2 tokens in common
    b = step(s, r)
    assert not any(isinstance(op, Copy) for op in b.ops)
    assert s.slot_of("b").cached_prompt == 0  # type: ignore[union-attr]


def test_a_slot_holding_the_whole_prompt_is_copied_whatever_the_gain() -> None:
    """The idle slot shares a 20-token template with the prompt and a busy one holds
    all of it: a short gain, but the copy leaves only the last token to feed."""
    s, r = make(slots=2, n_batch=64, window=512), FakeRunner()
    template = list(range(100, 120))
    s.add(Req("a", [*template, 1, 2, 3, 4, 5]))
    s.add(Req("r", [*template, 9, 9, 9]))
    while any(sl.state is not SlotState.DECODE for sl in s.slots):
        step(s, r)
    s.release(s.slots[1], keep_cache=True)
    s.add(Req("c", [*template, 1, 2, 3, 4, 5]))
    b = step(s, r)
    slot = s.slot_of("c")
    assert slot is not None and slot.id == 1
    assert b.ops[0] == Copy(0, 1) and slot.cached_prompt == 24
    assert [i for i in b.items if i.slot == 1] == [BatchItem(1, (5,), 24, True, prefill=True)]


def test_requests_behind_a_held_one_are_not_blocked() -> None:
    s, r = make(slots=3, n_batch=8, window=512), FakeRunner()
    prompt = list(range(1, 41))
    s.add(Req("a", prompt))
    step(s, r)  # "a" is prefilling
    s.add(Req("same", prompt))
    s.add(Req("other", list(range(500, 504))))
    step(s, r)
    assert s.slot_of("same") is None and s.slot_of("other") is not None
    assert [q.id for q in s.queue] == ["same"]


@pytest.mark.parametrize("unified", [False, True])
def test_a_steady_step_is_the_step_the_full_path_makes(unified: bool) -> None:
    """Random arrivals, cancellations, finishes (cells kept or not), drafts, windows that
    shift or stop: before every step a copy of the scheduler takes the full path only,
    and the batch (and what the step records) must be the same either way."""
    rng = random.Random(11)
    taken = [0]

    def counting(steady: Callable[[], Batch | None]) -> Callable[[], Batch | None]:
        def wrapper() -> Batch | None:
            out = steady()
            taken[0] += out is not None
            return out

        return wrapper

    for trial in range(30):
        s = Scheduler(
            rng.choice([1, 2, 4, 8]),
            rng.choice([16, 64]),
            ContextPolicy(window=rng.choice([24, 64, 512]), keep=2, sliding=rng.random() < 0.7),
            unified=unified,
            n_ubatch=rng.choice([4, 16, 64]),
        )
        if trial % 3:  # a drafter that depends only on the slot: the copy drafts alike
            s.drafts = lambda slot, room: tuple(range(7, 7 + min(room, slot.generated % 3)))
        s.chunk_budget = lambda rows: 3 + 2 * rows
        s._steady = counting(s._steady)  # type: ignore[method-assign]
        limits: dict[str, int] = {}
        for n in range(80):
            if rng.random() < 0.25:
                prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
                with contextlib.suppress(QueueFull):
                    s.add(Req(f"r{n}", prompt))
                limits[f"r{n}"] = rng.randrange(1, 30)
            busy = [sl.request.id for sl in s.slots if sl.request is not None]
            if busy and rng.random() < 0.05:
                s.cancel(rng.choice(busy))
            twin = copy.deepcopy(s)
            twin._steady = lambda: None  # type: ignore[method-assign]
            want = twin.schedule()
            got = s.schedule()
            assert got == want
            assert (got.passes, got.budget) == (want.passes, want.budget)
            assert (s._hole_steps, s.decoding) == (twin._hole_steps, twin.decoding)
            for slot_id in got.length_limited:
                s.release(s.slots[slot_id], keep_cache=False)
            sampled = {i.slot: (i.tokens[-1] * 7 + 1) % 1000 for i in got.items if i.sample}
            accepted = {i.slot: rng.randrange(i.draft + 1) for i in got.items if i.draft}
            s.update(got, sampled, accepted)
            for slot in s.slots:
                r = slot.request
                if (
                    slot.state is SlotState.DECODE
                    and r is not None
                    and slot.generated >= limits[r.id]
                ):
                    s.release(slot, keep_cache=rng.random() < 0.5)
    assert taken[0] > 100  # the fast path was taken, and often


def test_a_steady_step_forgets_a_hole_that_closed_by_itself() -> None:
    s, r = make(slots=3, n_batch=64, window=512), FakeRunner()
    for i in range(3):
        s.add(Req(f"u{i}", list(range(100 * i + 1, 100 * i + 21))))
    while any(sl.state is not SlotState.DECODE for sl in s.slots):
        step(s, r)
    s.release(s.slots[1], keep_cache=True)  # a hole; a move into it would lose its prompt
    waited = step(s, r)
    assert waited.passes == 2 and s._hole_steps == 1  # the hole is left for a step
    s.release(s.slots[2], keep_cache=True)  # ...and goes away by itself
    steady = step(s, r)
    assert [i.slot for i in steady.items] == [0] and s._hole_steps == 0


def _bursts_of_returning_users(s: Scheduler, seed: int) -> list[Batch]:
    """Bursts of users of two system prompts, some coming back with their whole
    conversation, on slots that keep what they held: every batch, in order."""
    rng = random.Random(seed)
    r = FakeRunner()
    s.max_queue = 1000
    systems = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9]]
    said: list[list[int]] = []
    batches: list[Batch] = []
    for burst in range(30):
        for k in range(rng.randrange(1, len(s.slots) + 1)):
            if said and rng.random() < 0.5:  # one comes back: a retry, or a new question
                prompt = rng.choice(said) + [rng.randrange(10, 14)] * rng.randrange(0, 2)
            else:
                prompt = rng.choice(systems) + [rng.randrange(10, 40) for _ in range(3)]
            s.add(Req(f"{burst}.{k}", s.check_prompt(prompt)))
        while s.queue or any(slot.busy for slot in s.slots):
            batches.append(step(s, r))
            for slot in s.slots:
                if slot.busy and slot.generated >= rng.randrange(1, 4):
                    said.append(list(slot.cache))  # the conversation so far
                    s.release(slot, keep_cache=True)
    return batches


@pytest.mark.parametrize("unified", [False, True])
def test_slots_told_apart_by_one_token_schedule_as_if_compared_whole(
    unified: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler skips comparing a slot's cells with a prompt (or another slot's
    cells) when one token shows they part too early to matter (_holds_more). Its
    batches and KV operations must be those of comparing every pair in full."""
    import orin.engine.scheduler as scheduler

    def make_one() -> Scheduler:
        return Scheduler(6, 64, ContextPolicy(window=256), unified=unified)

    for seed in range(3):
        pruned = _bursts_of_returning_users(make_one(), seed)
        with monkeypatch.context() as m:
            m.setattr(scheduler, "_holds_more", lambda slot, tokens, n: True)
            whole = _bursts_of_returning_users(make_one(), seed)
        assert pruned == whole
        assert any(isinstance(op, Copy) for b in pruned for op in b.ops)  # cells were shared


# -- prompt tails evened up to save passes ---------------------------------------------

SYSTEM = list(range(100, 120))  # a system prompt every user's request starts with


def _burst_after_a_system_prompt(pass_tokens: float, tails: list[int], **kw: int) -> Scheduler:
    """Four slots that each hold SYSTEM (a first round of requests, released with their
    cache), then four requests of SYSTEM plus user tails of the given lengths."""
    s = Scheduler(4, kw.pop("n_batch", 64), ContextPolicy(window=256), **kw)  # type: ignore[arg-type]
    s.pass_tokens = lambda: pass_tokens
    r = FakeRunner()
    for n in range(4):
        s.add(Req(f"old{n}", [*SYSTEM, 900 + n]))
    while s.queue or any(sl.state is SlotState.PREFILL for sl in s.slots):
        step(s, r)
    assert all(sl.cache[:20] == SYSTEM for sl in s.slots)
    for slot in s.slots:
        s.release(slot, keep_cache=True)
    for n, length in enumerate(tails):
        s.add(Req(f"u{n}", [*SYSTEM, *range(200 + 10 * n, 200 + 10 * n + length)]))
    s._runner = r  # type: ignore[attr-defined]  # the fake KV cache the slots hold
    return s


def test_prompt_tails_of_different_lengths_are_evened_into_one_pass() -> None:
    tails = [3, 4, 5, 6]
    s = _burst_after_a_system_prompt(10.0, tails)
    plain = _burst_after_a_system_prompt(0.0, tails)
    r, pr = s._runner, plain._runner  # type: ignore[attr-defined]
    b, pb = step(s, r), step(plain, pr)
    # without evening llama.cpp would split the tails into a pass per length; the
    # scheduler ran the shortest alone first (_first_pass_alone), the rest after
    assert pb.passes + step(plain, pr).passes == 4
    # evened: every prompt feeds 6 tokens, the shorter ones their last cached cells again
    assert b.passes == 1 and s.retails == 1
    assert [i.slot for i in b.items] == [0, 1, 2, 3]
    assert all(i.sample and i.prefill and len(i.tokens) == 6 for i in b.items)
    for n, tail in enumerate(tails):
        slot = s.slot_of(f"u{n}")
        assert slot is not None
        item = b.items[slot.id]
        assert item.pos == 20 - (6 - tail)
        assert list(item.tokens) == slot.request.prompt_tokens[item.pos :]  # type: ignore[union-attr]
        if tail < 6:
            assert Remove(slot.id, item.pos, -1) in b.ops
    # the same cells and the same first tokens as without evening
    for n in range(4):
        ours, theirs = s.slot_of(f"u{n}"), plain.slot_of(f"u{n}")
        assert ours is not None and theirs is not None
        assert ours.cache == theirs.cache and ours.pending == theirs.pending
        assert r.kv[ours.id] == pr.kv[theirs.id]
    # cached tokens say what was taken from the cache: the cells computed again are not
    assert [s.slot_of(f"u{n}").cached_prompt for n in range(4)] == [17, 18, 19, 20]  # type: ignore[union-attr]
    assert (b.n_prefill, pb.n_prefill) == (24, 3)
    assert [plain.slot_of(f"u{n}").cached_prompt for n in range(4)] == [20] * 4  # type: ignore[union-attr]


def test_tails_stay_as_they_are_where_a_pass_costs_less_than_the_tokens_again() -> None:
    s = _burst_after_a_system_prompt(1.0, [3, 4, 5, 6])  # 6 tokens again to save 3 passes
    b = step(s, s._runner)  # type: ignore[attr-defined]
    assert s.retails == 0 and b.items[0].pos == 20
    assert [s.slot_of(f"u{n}").cached_prompt for n in range(4)] == [20] * 4  # type: ignore[union-attr]


def test_evening_picks_the_target_that_costs_least() -> None:
    # tails 2, 2, 2, 12: evening all to 12 would compute 30 cells again; with a pass
    # worth 8 tokens two passes (16) cost less than one pass and 30 tokens (38)
    s = _burst_after_a_system_prompt(8.0, [2, 2, 2, 12])
    step(s, s._runner)  # type: ignore[attr-defined]
    assert s.retails == 0
    # worth 40 tokens: one pass and 30 tokens (70) beat two passes (80)
    s = _burst_after_a_system_prompt(40.0, [2, 2, 2, 12])
    b = step(s, s._runner)  # type: ignore[attr-defined]
    assert s.retails == 1 and b.passes == 1 and {len(i.tokens) for i in b.items} == {12}


def test_evening_stays_within_the_steps_prompt_budget() -> None:
    # the four tails take 18 tokens of a 20-token budget: evening them to 6 needs 6 more,
    # to 5 three; what fits is the 3 to 4, a pass saved for a token
    s = _burst_after_a_system_prompt(10.0, [3, 4, 5, 6], prefill_chunk=20)
    b = step(s, s._runner)  # type: ignore[attr-defined]
    rest = step(s, s._runner)  # type: ignore[attr-defined]  # what _first_pass_alone split off
    assert s.retails == 1 and b.n_prefill + rest.n_prefill == 19 and b.passes + rest.passes == 3
    assert sorted(len(i.tokens) for i in (*b.items, *rest.items)) == [4, 4, 5, 6]
    s = _burst_after_a_system_prompt(10.0, [3, 4, 5, 6], prefill_chunk=24)
    b = step(s, s._runner)  # type: ignore[attr-defined]
    assert s.retails == 1 and b.n_prefill == 24


def test_no_evening_with_one_buffer_a_sliding_window_cache_or_no_prefix_reuse() -> None:
    for kw in ({"unified": True}, {"swa_window": 64}, {"prefix_reuse": False}):
        s = _burst_after_a_system_prompt(100.0, [3, 4, 5, 6], **kw)  # type: ignore[arg-type]
        step(s, s._runner)  # type: ignore[attr-defined]
        assert s.retails == 0, kw


def test_image_rows_are_never_fed_again() -> None:
    s = Scheduler(2, 64, ContextPolicy(window=256))
    s.pass_tokens = lambda: 100.0
    r = FakeRunner()
    s.add(Req("a", [1, 2, -5, -6, -7]))  # text, then an image's rows (negative ids)
    s.add(Req("b", [1, 2, 3, 4, 5, 6, 7]))
    while any(sl.state is SlotState.PREFILL for sl in s.slots):
        step(s, r)
    for slot in s.slots:
        s.release(slot, keep_cache=True)
    s.add(Req("c", [1, 2, -5, -6, -7, 30, 31]))  # two tokens after the image's rows
    s.add(Req("d", [1, 2, 3, 4, 5, 6, 7, 40, 41, 42, 43]))  # four after cached cells
    b = step(s, r)
    assert s.retails == 0
    assert all(t >= 0 for i in b.items for t in i.tokens)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_bursts_with_evened_tails_keep_every_prompt_and_cell(seed: int) -> None:
    """Bursts of requests that share a head of random length, with random tails and
    cancels: every step the fake KV cache matches the slots, and every request that
    finishes holds its own prompt then what it generated, as without evening."""
    rng = random.Random(seed)
    s, r = Scheduler(4, 64, ContextPolicy(window=128)), FakeRunner()
    s.pass_tokens = lambda: rng.choice((4.0, 16.0, 64.0))
    s.max_queue = 1000
    prompts: dict[str, list[int]] = {}
    for n in range(300):
        if rng.random() < 0.15:
            head = list(range(1, rng.randrange(2, 40)))
            for k in range(rng.randrange(1, 6)):
                rid = f"r{n}.{k}"
                prompts[rid] = head + [rng.randrange(50, 90) for _ in range(rng.randrange(1, 12))]
                s.add(Req(rid, prompts[rid]))
        busy = [sl.request.id for sl in s.slots if sl.request is not None]
        if busy and rng.random() < 0.03:
            s.cancel(rng.choice(busy))
        step(s, r)
        for slot in s.slots:
            if slot.state is SlotState.DECODE and slot.generated >= rng.randrange(1, 12):
                rid = slot.request.id  # type: ignore[union-attr]
                assert slot.cache[: len(prompts[rid])] == prompts[rid]
                assert len(slot.cache) == len(prompts[rid]) + slot.generated - 1
                assert 0 <= slot.cached_prompt < len(prompts[rid])
                s.release(slot, keep_cache=True)
    assert s.retails > 10


# -- prompts whose every position's logits are asked for (echoed prompt logprobs) ------


@dataclass
class Scored(Req):
    """A request that needs the logits of every prompt position (``all_logits``)."""

    all_logits: bool = True


def _fed_with_logits(batches: list[Batch], slot: int) -> list[int]:
    """The positions a slot was fed at with logits each, in order."""
    return [
        i.pos + k
        for b in batches
        for i in b.items
        if i.slot == slot
        for k in range(len(i.tokens))
        if i.logits_all
    ]


def _until_decoding(s: Scheduler, r: FakeRunner, rid: str) -> list[Batch]:
    batches = []
    while (slot := s.slot_of(rid)) is None or slot.state is not SlotState.DECODE:
        batches.append(step(s, r))
    return batches


def test_a_scored_prompt_is_fed_whole_whatever_holds_it() -> None:
    """Its own slot's cached prompt, another slot's cells (busy or idle) and a saved
    prompt on disk would each leave positions without logits: none is taken, and
    every position is fed once, with logits."""
    s, r = make(slots=3, n_batch=64, window=512), FakeRunner()
    prompt = list(range(100, 150))
    s.add(Req("cached", [*prompt, 1]))
    s.add(Req("busy", [*prompt, 2]))
    _until_decoding(s, r, "cached")
    _until_decoding(s, r, "busy")
    s.release(s.slot_of("cached"), keep_cache=True)  # type: ignore[arg-type]
    s.stored = lambda p: (len(p) - 1, "saved")
    s.add(Scored("scored", [*prompt, 1]))
    batches = _until_decoding(s, r, "scored")
    slot = s.slot_of("scored")
    assert slot is not None and slot.cached_prompt == 0
    assert _fed_with_logits(batches, slot.id) == list(range(51))
    ops = [op for b in batches for op in b.ops]
    assert not any(isinstance(op, (Copy, Load)) and _target(op) == slot.id for op in ops)
    # the same prompt without the need is taken from the cells
    s.add(Req("plain", [*prompt, 1]))
    _until_decoding(s, r, "plain")
    assert s.slot_of("plain").cached_prompt == 50  # type: ignore[union-attr]


def _target(op: object) -> int:
    return op.dst if isinstance(op, Copy) else op.seq  # type: ignore[attr-defined,no-any-return]


def test_a_scored_prompt_does_not_wait_for_a_prefill_of_the_same_prompt() -> None:
    """n choices that all score the prompt: none can copy another's cells, so none
    waits for another's prefill; they are prefilled side by side."""
    s, r = make(slots=3, n_batch=128, window=512), FakeRunner()
    prompt = list(range(1, 41))
    for rid in ("c0", "c1", "c2"):
        s.add(Scored(rid, prompt))
    b = step(s, r)
    assert sorted(i.slot for i in b.items) == [0, 1, 2] and not s.queue
    assert all(i.logits_all and i.pos == 0 for i in b.items)


def test_chunks_with_every_logit_take_at_most_logits_chunk_tokens_a_step() -> None:
    """llama.cpp's output buffer keeps the most rows one decode had: the scored
    prompts of a step feed LOGITS_CHUNK tokens at most, together; a plain prompt
    beside them takes the rest of the budget."""
    s, r = make(slots=3, n_batch=512, window=1024), FakeRunner()
    s.add(Scored("s0", list(range(1000, 1200))))
    s.add(Scored("s1", list(range(2000, 2200))))
    s.add(Req("plain", list(range(3000, 3300))))
    batches = []
    while any(sl.state is not SlotState.DECODE for sl in s.slots):
        batches.append(step(s, r))
    for b in batches:
        assert sum(len(i.tokens) for i in b.items if i.logits_all) <= LOGITS_CHUNK
    first = batches[0]
    assert sum(len(i.tokens) for i in first.items if i.logits_all) == LOGITS_CHUNK
    assert [len(i.tokens) for i in first.items if not i.logits_all] == [300]
    for rid in ("s0", "s1"):
        assert _fed_with_logits(batches, s.slot_of(rid).id) == list(range(200))  # type: ignore[union-attr]


def test_a_scored_chunk_is_never_lengthened_to_even_the_tails() -> None:
    """Evening the tails feeds cached cells again in front of a chunk; a scored
    prompt's cells were computed with their logits, already taken: its chunk stays
    as it is (each position's logits are read once)."""
    s, r = make(slots=2, n_batch=64, window=256), FakeRunner()
    s.pass_tokens = lambda: 100.0
    s.add(Req("old", [*SYSTEM, 900]))
    _until_decoding(s, r, "old")
    s.release(s.slot_of("old"), keep_cache=True)  # type: ignore[arg-type]
    s.add(Scored("scored", list(range(500, 568))))  # 64 tokens in a step, then 4
    first = step(s, r)
    assert [len(i.tokens) for i in first.items] == [64]
    s.add(Req("user", [*SYSTEM, *range(600, 610)]))  # a 10-token tail after the system
    second = step(s, r)
    scored = s.slot_of("scored")
    assert scored is not None
    assert [(i.pos, len(i.tokens)) for i in second.items if i.slot == scored.id] == [(64, 4)]
    assert _fed_with_logits([first, second], scored.id) == list(range(68))


def test_a_held_request_waits_and_then_copies_the_scored_prompt() -> None:
    """The other choices of a scored prompt share its log-probabilities (the engine
    marks them ``held`` until the first choice has computed them): they wait, the
    requests behind them go first, and then they copy the scored prompt's cells and
    feed its last token only."""
    s, r = make(slots=4, n_batch=32, window=512), FakeRunner()
    prompt = list(range(1, 81))
    follower = Req("c1", prompt, held=True)
    s.add(Scored("c0", prompt))
    s.add(follower)
    s.add(Req("other", [900, 901, 902]))
    step(s, r)
    assert s.slot_of("c1") is None and list(s.queue) == [follower]
    assert s.slot_of("c0") is not None and s.slot_of("other") is not None
    _until_decoding(s, r, "c0")
    step(s, r)
    assert s.slot_of("c1") is None  # still held: the scores are not handed over yet
    follower.held = False
    batches = _until_decoding(s, r, "c1")
    slot = s.slot_of("c1")
    assert slot is not None and slot.cached_prompt == len(prompt) - 1
    assert any(isinstance(op, Copy) and op.dst == slot.id for b in batches for op in b.ops)
    fed = [i for b in batches for i in b.items if i.slot == slot.id and i.prefill]
    assert [(i.pos, len(i.tokens)) for i in fed] == [(len(prompt) - 1, 1)]
