"""The scheduler's step shaping: SLO-aware prompt budget, one llama.cpp pass per step
(packed slots, holes closed), shared cells in one buffer, speculative items, saved
prompts restored from disk."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from orin.engine.costmodel import MIN_CHUNK, ChunkPolicy, StepCostModel
from orin.engine.scheduler import (
    HOLE_GRACE_STEPS,
    Batch,
    ContextPolicy,
    Copy,
    Load,
    Remove,
    Scheduler,
    SlotState,
)
from orin.engine.ubatch import micro_batches


@dataclass
class Req:
    id: str
    prompt_tokens: list[int]
    all_logits: bool = False
    held: bool = False


def sched(n_slots: int = 4, n_batch: int = 64, **kw: object) -> Scheduler:
    return Scheduler(n_slots, n_batch, ContextPolicy(window=256), **kw)  # type: ignore[arg-type]


def run(s: Scheduler, batch: Batch, token: int = 5) -> None:
    """Record a batch as if decoded: every sampled slot gets ``token``."""
    s.update(batch, {i.slot: token for i in batch.items if i.sample})


def decode_all(s: Scheduler) -> None:
    """Steps until the queue is empty and no slot is prefilling."""
    while s.queue or any(x.state is SlotState.PREFILL for x in s.slots):
        run(s, s.schedule())


def users_decoding(n_slots: int, length: int) -> tuple[Scheduler, dict[str, list[int]]]:
    """Users "a", "b" and "c", prompts of ``length`` tokens, decoding in slots 0-2."""
    s = sched(n_slots=n_slots)
    prompts = {name: [ord(name)] * length for name in "abc"}
    for name, prompt in prompts.items():
        s.add(Req(name, prompt))
    decode_all(s)
    return s, prompts


# -- micro-batches (llama.cpp's split rules) ------------------------------------------


def test_streams_one_pass_for_consecutive_slots() -> None:
    assert micro_batches([(0, 1), (1, 1), (2, 1)], 512, unified=False) == 1
    assert micro_batches([(2, 1), (3, 1)], 512, unified=False) == 1


def test_streams_hole_splits_the_step() -> None:
    assert micro_batches([(0, 1), (1, 1), (3, 1)], 512, unified=False) == 2
    assert micro_batches([(0, 1), (2, 1), (4, 1)], 512, unified=False) == 3


def test_streams_prompt_chunk_beside_decode_rows_is_a_pass_of_its_own() -> None:
    # equal split: one token of each of slots 0..2, then the rest of slot 2's chunk
    assert micro_batches([(0, 1), (1, 1), (2, 100)], 512, unified=False) == 2
    # a chunk longer than n_ubatch takes more passes
    assert micro_batches([(0, 1), (1, 300)], 128, unified=False) == 4


def test_unified_counts_tokens_only() -> None:
    assert micro_batches([(0, 1), (2, 1), (5, 100)], 512, unified=True) == 1
    assert micro_batches([(0, 1), (2, 300)], 128, unified=True) == 3
    assert micro_batches([], 128, unified=True) == 0


# -- the cost model and the budget ------------------------------------------------------


def test_cost_model_learns_the_coefficients() -> None:
    model = StepCostModel()
    a, b, c = 8.0, 0.5, 0.05
    shapes = [(1, r, p) for r in (1, 2, 4, 8) for p in (0, 16, 64, 256)]
    shapes += [(2, r, p) for r in (1, 4) for p in (32, 128)]
    for _ in range(20):
        for passes, rows, prompt in shapes:
            model.observe(passes, rows, prompt, a * passes + b * rows + c * prompt)
    got = model.coefficients()
    assert got == pytest.approx((a, b, c), rel=0.05)
    assert model.predict(1, 4, 100) == pytest.approx(a + 4 * b + 100 * c, rel=0.05)


def test_one_slow_step_does_not_set_the_cost_but_a_lasting_slowdown_does() -> None:
    """A step held off the CPU for 2 s among 20 ms ones is learned as at most four
    times its prediction; a board that becomes twice as slow is followed."""

    def train(model: StepCostModel, scale: float, rounds: int) -> None:
        for _ in range(rounds):
            for rows in (1, 2, 4, 8):
                model.observe(1, rows, 0, scale * (8.0 + rows))
            model.observe(2, 4, 64, scale * (2 * 8.0 + 4 + 64 * 0.5))

    model = StepCostModel()
    train(model, 1.0, 20)
    assert model.settled
    before = model.predict(1, 4, 0)
    model.observe(1, 4, 0, 2000.0)
    assert model.predict(1, 4, 0) < 2 * before  # unclipped: 62 ms instead of 12
    model.observe(2, 4, 64, 5000.0)
    assert model.coefficients()[2] < 1.0  # a prompt token stays near its 0.5 ms
    train(model, 2.0, 20)
    assert model.coefficients() == pytest.approx((16.0, 2.0, 1.0), rel=0.1)


def test_budget_keeps_steps_within_the_target() -> None:
    model = StepCostModel()
    for _ in range(50):
        for rows, prompt in ((4, 0), (4, 64), (4, 256), (1, 128), (8, 32)):
            passes = 1 + (prompt > 0)
            model.observe(passes, rows, prompt, 5.0 * passes + 0.5 * rows + 0.1 * prompt)
    policy = ChunkPolicy(40.0, cap=512, passes=lambda r, p: 1 + (p > 0), model=model)
    n = policy.budget(4)
    # 40 ms * margin = 34 ms; 2 passes (10 ms) + 4 rows (2 ms) leave 22 ms: ~220 tokens
    assert 150 <= n <= 230
    assert model.predict(2, 4, n) <= 40.0
    assert policy.budget(0) == 512  # nothing decoding: the whole chunk


def test_budget_has_a_floor_and_no_target_means_the_cap() -> None:
    model = StepCostModel()
    for _ in range(50):
        model.observe(1, 4, 0, 50.0)
        model.observe(2, 4, 100, 150.0)
    tight = ChunkPolicy(10.0, cap=512, passes=lambda r, p: 1 + (p > 0), model=model)
    assert tight.budget(4) == MIN_CHUNK  # the target cannot be met: still progress
    assert ChunkPolicy(None, cap=300, passes=lambda r, p: 1).budget(4) == 300


def test_a_target_below_the_floors_step_is_reported_once_the_model_has_settled() -> None:
    def policy(target: float, model: StepCostModel) -> ChunkPolicy:
        return ChunkPolicy(target, cap=512, passes=lambda r, p: 1 + (p > 0), model=model)

    fresh = StepCostModel()  # a pessimistic prior: no warning from it
    tight = policy(10.0, fresh)
    assert tight.budget(4) == MIN_CHUNK and tight.unmet_ms is None
    model = StepCostModel()
    for _ in range(20):  # a pass 8 ms, a decode row 1 ms, a prompt token 0.5 ms
        for rows in (1, 2, 4, 8):
            model.observe(1, rows, 0, 8.0 + rows)
        model.observe(2, 4, 64, 2 * 8.0 + 4 + 64 * 0.5)  # a chunk is a pass of its own
    assert model.settled
    tight = policy(20.0, model)
    assert tight.budget(4) == MIN_CHUNK
    # the floor's step beside 4 rows: two passes, 4 rows, 16 tokens: 28 ms
    assert tight.unmet_ms == pytest.approx(28.0, rel=0.05)
    roomy = policy(60.0, model)
    assert roomy.budget(4) > MIN_CHUNK and roomy.unmet_ms is None
    tight.target_ms = 30.0  # the floor fits now: the report goes with the next budget
    assert tight.budget(4) == MIN_CHUNK and tight.unmet_ms is None


def test_schedule_uses_the_budget_hook_and_records_it() -> None:
    s = sched(n_slots=2, n_batch=64)
    s.add(Req("a", [1, 2, 3]))
    decode_all(s)
    s.add(Req("b", list(range(10, 60))))
    s.chunk_budget = lambda rows: 8 if rows else 64
    batch = s.schedule()
    assert batch.n_decode == 1 and batch.n_prefill == 8
    assert batch.budget == 8
    assert batch.passes == 2  # one stream per slot: the chunk is a pass of its own


# -- one pass per step -----------------------------------------------------------------


def test_admission_keeps_busy_slots_consecutive_and_copies_a_better_prefix() -> None:
    s = sched(n_slots=4)
    prompt = list(range(100, 140))
    # slot 3 holds the prompt's first 39 tokens as an idle prefix cache
    s.slots[3].cache, s.slots[3].reusable = prompt[:39], 39
    s.add(Req("a", [1, 2, 3]))
    run(s, s.schedule())  # "a" takes slot 0 (slot 3's prefix does not fit it)
    assert s.slots[0].busy
    s.add(Req("b", prompt))
    batch = s.schedule()
    # slot 1 (next to the busy slot), with slot 3's cells copied in
    assert s.slots[1].request is not None and s.slots[1].request.id == "b"
    assert Copy(3, 1) in batch.ops
    assert s.slots[1].cached_prompt == 39
    assert batch.passes == 1  # slot 0's decode token and slot 1's last prompt token


def test_a_short_shared_prefix_is_copied_when_a_copy_costs_less_than_its_tokens() -> None:
    """The previous request's conversation in slot 0 shares 6 tokens with a new
    14-token prompt. With the fixed threshold (16 tokens) the new prompt prefills all
    14 in an empty slot; with a copy measured at 2 prompt tokens' cost it copies
    slot 0's cells and feeds 8, and slot 0 keeps its conversation."""
    shared = [1, 2, 3, 4, 5, 6]
    previous = shared + [7] * 8 + [8] * 20  # its prompt and answer
    new = shared + [9] * 8
    for share_min, copied in ((16, False), (6, True), (7, False), (2, True)):
        s = sched(n_slots=4)
        s.share_min = share_min
        s.slots[0].cache, s.slots[0].reusable = list(previous), len(previous)
        s.add(Req("new", new))
        batch = s.schedule()
        slot = s.slot_of("new")
        assert slot is s.slots[1] and s.slots[0].cache == previous
        assert (Copy(0, 1) in batch.ops) is copied, share_min
        assert slot.cached_prompt == (6 if copied else 0)
        assert batch.n_prefill == (8 if copied else 14)


def test_a_hole_is_closed_by_moving_the_highest_busy_slot() -> None:
    s = sched(n_slots=4)
    for name in "abc":
        s.add(Req(name, [ord(name), 1, 2]))
    decode_all(s)
    assert [x.request.id for x in s.slots[:3] if x.request] == ["a", "b", "c"]
    s.release(s.slots[1], keep_cache=True)  # "b" finishes in the middle
    moved_cells = list(s.slots[2].cache)
    batch = s.schedule()
    assert Copy(2, 1) in batch.ops
    assert s.slots[1].request is not None and s.slots[1].request.id == "c"
    assert s.slots[1].cache == moved_cells
    assert not s.slots[2].busy and s.slots[2].cache == moved_cells  # kept as prefix cache
    assert batch.passes == 1 and s.moves == 1
    assert sorted(i.slot for i in batch.items) == [0, 1]


def test_unified_buffer_shares_the_prefix_and_never_moves() -> None:
    s = sched(n_slots=4, n_batch=128, unified=True)
    prompt = list(range(100, 140))
    s.slots[3].cache, s.slots[3].reusable = [*prompt[:30], 9, 9], 32
    s.add(Req("b", prompt))
    batch = s.schedule()
    b = s.slot_of("b")
    assert b is not None and b.id == 3  # the slot holding the prefix: no copy at all
    assert b.cached_prompt == 30
    assert Remove(3, 30, -1) in batch.ops
    run(s, batch)  # "b" holds its whole prompt now
    s.add(Req("c", [*prompt[:35], 7, 7]))
    batch = s.schedule()
    c = s.slot_of("c")
    assert c is not None and Copy(3, c.id, 35) in batch.ops  # only the shared cells
    s.release(s.slots[3], keep_cache=True)
    assert not any(isinstance(op, Copy) for op in s.schedule().ops)  # no hole closing


# -- speculative items ----------------------------------------------------------------


def test_drafted_tokens_ride_with_the_decode_token_and_rejected_cells_go() -> None:
    s = sched(n_slots=2)
    s.add(Req("a", [1, 2, 3]))
    run(s, s.schedule(), token=50)
    s.drafts = lambda slot, room: [51, 52, 53]
    batch = s.schedule()
    (item,) = batch.items
    assert item.tokens == (50, 51, 52, 53) and item.draft == 3 and item.outputs == 4
    # the model confirmed 51 and then sampled 60 instead of 52
    s.update(batch, {0: 60}, {0: 1})
    slot = s.slots[0]
    assert slot.cache == [1, 2, 3, 50, 51]
    assert slot.pending == [60]
    assert slot.generated == 3  # 50, 51 and 60
    assert Remove(0, 5, -1) in s.take_ops()


def test_drafts_fit_the_window_and_the_batch() -> None:
    s = Scheduler(2, 4, ContextPolicy(window=8, sliding=False))
    s.add(Req("a", [1, 2, 3]))
    run(s, s.schedule())
    seen: list[int] = []
    s.drafts = lambda slot, room: seen.append(room) or list(range(room + 5))  # type: ignore[func-returns-value]
    batch = s.schedule()
    assert seen == [3]  # n_batch 4 minus the decode token
    assert batch.items[0].draft == 3
    s.update(batch, {0: 9}, {0: 3})
    seen.clear()
    batch = s.schedule()
    assert seen == [0] or not seen  # the window (8) is full but one token
    assert batch.items[0].draft == 0


# -- saved prompts ------------------------------------------------------------------------


def test_a_saved_prompt_is_loaded_when_it_beats_every_slot() -> None:
    s = sched(n_slots=2)
    system = list(range(200, 240))
    s.stored = lambda prompt: (40, "entry-1") if prompt[:40] == system else None
    s.add(Req("a", [*system, 1, 2]))
    batch = s.schedule()
    assert Load(0, "entry-1", 40) in batch.ops
    slot = s.slot_of("a")
    assert slot is not None and slot.cached_prompt == 40
    assert batch.items[0].tokens == (1, 2) and batch.items[0].pos == 40


def test_a_failed_load_prefills_the_whole_prompt() -> None:
    s = sched(n_slots=2)
    system = list(range(200, 240))
    s.stored = lambda prompt: (40, "entry-1")
    s.add(Req("a", [*system, 1, 2]))
    s.schedule()
    s.load_failed([0])
    batch = s.schedule()
    assert batch.items[0].pos == 0 and len(batch.items[0].tokens) == 42
    assert s.slots[0].cached_prompt == 0


def test_draft_length_follows_the_cost_of_a_row() -> None:
    from orin.engine.costmodel import draft_length

    # a row nearly free beside the pass (bandwidth-bound GPU): the whole draft pays
    assert draft_length(0.5, a=20.0, b=0.1, rows=1, k_max=8) >= 5
    assert draft_length(0.9, a=20.0, b=0.1, rows=1, k_max=8) == 8
    # a row as dear as the pass (a small model on a CPU): only likely drafts pay
    assert draft_length(0.5, a=3.0, b=3.0, rows=1, k_max=8) == 0
    assert draft_length(0.95, a=3.0, b=3.0, rows=1, k_max=8) > 4
    assert draft_length(0.0, a=20.0, b=0.1, rows=1, k_max=8) == 0


def test_a_burst_in_another_order_finds_every_prompt_where_it_was() -> None:
    """Four users send their prompts again, in another order: the first starts alone,
    the other three arrive during its step. Each is admitted to the slot holding its
    prompt, even where that splits the busy slots for a moment, so no copy overwrites
    another user's cells and every prompt is reused whole."""
    s = sched(n_slots=8)
    prompts = {name: [1, 2, 3, 50 + i, 60 + i, 70 + i] for i, name in enumerate("abcd")}
    for name, prompt in prompts.items():
        s.add(Req(name, prompt))
    decode_all(s)
    for slot in s.slots[:4]:
        s.release(slot, keep_cache=True)
    s.add(Req("d2", prompts["d"]))
    run(s, s.schedule())
    for name in "acb":
        s.add(Req(f"{name}2", prompts[name]))
    batch = s.schedule()
    assert not any(isinstance(op, Copy) for op in batch.ops)
    assert [x.request.id for x in s.slots[:4] if x.request] == ["a2", "b2", "c2", "d2"]
    assert all(x.cached_prompt == 5 for x in s.slots[:4])
    assert batch.passes == 1


def test_a_new_prompt_overwrites_the_cells_another_slot_also_holds() -> None:
    """Two packed slots share nothing with the new prompt: the one whose cells are
    duplicated elsewhere is overwritten, not the only copy of a prompt."""
    s = sched(n_slots=6)
    only, twice = [7, 7, 7, 7], [9, 9, 9, 9]
    for i, cells in ((0, only), (2, twice), (5, twice)):
        s.slots[i].cache, s.slots[i].reusable = list(cells), len(cells)
    s.add(Req("x", [1, 2]))
    s.slots[1].state = SlotState.DECODE  # a busy slot between the two candidates
    s.slots[1].request, s.slots[1].cache, s.slots[1].pending = Req("x", [1, 2]), [1, 2], [3]
    s.queue.clear()
    s.add(Req("new", [4, 5, 6]))
    s.schedule()
    assert s.slot_of("new") is s.slots[2]
    assert s.slots[0].cache == only


def test_a_hole_over_a_cached_prompt_waits_before_a_move_overwrites_it() -> None:
    """The middle request finishes and its slot holds a long prompt no other slot has,
    and no other slot is free: the hole costs a pass per step for a while rather than
    losing that prompt at once. A hole that lasts is closed; one that a new request
    fills costs no move."""
    s, long = users_decoding(3, 30)
    s.release(s.slots[1], keep_cache=True)  # "b" finishes in the middle
    for _ in range(HOLE_GRACE_STEPS):
        batch = s.schedule()
        run(s, batch)
        assert batch.passes == 2 and s.moves == 0
    assert s.slots[1].cache[:30] == long["b"]
    batch = s.schedule()
    assert Copy(2, 1) in batch.ops and batch.passes == 1 and s.moves == 1

    s2, _ = users_decoding(3, 30)
    s2.release(s2.slots[1], keep_cache=True)
    run(s2, s2.schedule())
    s2.add(Req("b2", long["b"]))  # "b" comes back: its prompt is still there
    batch = s2.schedule()
    assert s2.slot_of("b2") is s2.slots[1] and s2.slots[1].cached_prompt == 29
    assert s2.moves == 0 and batch.passes == 1


def test_a_hole_is_closed_by_a_move_onto_a_free_slot_when_there_is_one() -> None:
    """Busy 0 and 2 around a finished 1 that holds its user's prompt, slot 3 empty:
    slot 0 moves to 3, so the steps are one pass at once and 1's prompt stays."""
    s, long = users_decoding(4, 30)
    s.release(s.slots[1], keep_cache=True)
    batch = s.schedule()
    assert Copy(0, 3) in batch.ops and batch.passes == 1 and s.moves == 1
    assert s.slots[3].request is not None and s.slots[3].request.id == "a"
    assert s.slots[1].cache[:30] == long["b"] and not s.slots[1].busy


def test_a_short_common_prefix_does_not_take_another_users_cached_prompt() -> None:
    """A prompt that shares two tokens with a finished user's 30 cached cells takes
    an empty slot: reusing two tokens there would lose the other 28."""
    s = sched(n_slots=3)
    s.add(Req("a", [1, 2, *range(100, 128)]))
    decode_all(s)
    s.release(s.slots[0], keep_cache=True)
    s.add(Req("b", [1, 2, 3]))
    s.schedule()
    assert s.slot_of("b") is s.slots[1]
    assert s.slots[0].cache[:30] == [1, 2, *range(100, 128)]
    s.add(Req("c", [1, 2, *range(100, 120), 7]))  # most of "a"'s prompt: reused in place
    s.schedule()
    slot = s.slot_of("c")
    assert slot is s.slots[0] and slot.cached_prompt == 22


def test_returning_users_take_their_own_cells_before_a_new_prompt_takes_their_slot() -> None:
    """Slot 0 runs; "b" and "c" return while a new prompt arrives before them. All
    three start in this step, so the returning users are placed first and each
    finds its prompt whole; the new prompt takes a free slot."""
    s, prompts = users_decoding(4, 20)
    s.release(s.slots[1], keep_cache=True)
    s.release(s.slots[2], keep_cache=True)
    run(s, s.schedule())  # "a" decodes on alone; 1 and 2 keep "b" and "c"
    s.add(Req("new", [9, 9, 9]))
    s.add(Req("c2", prompts["c"]))
    s.add(Req("b2", prompts["b"]))
    batch = s.schedule()
    assert s.slot_of("b2") is s.slots[1] and s.slots[1].cached_prompt == 19
    assert s.slot_of("c2") is s.slots[2] and s.slots[2].cached_prompt == 19
    assert s.slot_of("new") is s.slots[3]
    assert not any(isinstance(op, Copy) for op in batch.ops)


@pytest.mark.parametrize("seed", range(6))
def test_a_burst_that_fills_every_slot_puts_each_user_where_most_of_their_prompt_is(
    seed: int,
) -> None:
    """Eight users come back together, in any order, each with a new prompt that
    shares its first 11 tokens with their own last one and 4 with everyone's. Every
    idle slot gets a request in this step, so the busy slots end as one run whoever
    takes which: each user takes the slot that holds their own prefix (no copies),
    and the step is one pass of 8 tokens each, not slots picked next to the busy ones
    (some users then feed 15 tokens, and the tails of two lengths take two passes)."""

    def prompt(user: int, burst: int) -> list[int]:
        return [1, 2, 3, 4, 50 + user, *range(6, 12), 700 + burst, *range(13, 20)]

    s = sched(n_slots=8, n_batch=512)
    order = list(range(8))
    for burst in range(3):
        random.Random(seed * 10 + burst).shuffle(order)
        for user in order:
            s.add(Req(f"u{user}-{burst}", prompt(user, burst)))
        batch = s.schedule()
        if burst > 0:  # the first burst finds nothing cached
            assert not any(isinstance(op, Copy) for op in batch.ops)
            assert sorted(x.cached_prompt for x in s.slots) == [11] * 8
            assert batch.n_prefill == 8 * 8 and batch.passes == 1
        run(s, batch)
        decode_all(s)
        for slot in s.slots:
            s.release(slot, keep_cache=True)


def test_a_request_that_leaves_idle_slots_still_takes_one_next_to_the_busy_ones() -> None:
    """Two users decode in slots 0 and 1; slot 3 holds most of a new prompt, slot 2
    nothing. With two idle slots and one request, slot 3 would leave a hole (a second
    pass every step): the request takes slot 2 and copies the prefix from slot 3."""
    s = sched(n_slots=4, n_batch=64)
    for name in "ab":
        s.add(Req(name, [ord(name)] * 4))
    decode_all(s)
    s.slots[3].cache, s.slots[3].reusable = [7] * 20, 20
    s.add(Req("c", [7] * 20 + [8]))
    batch = s.schedule()
    assert s.slot_of("c") is s.slots[2]
    assert Copy(3, 2) in batch.ops and s.slots[2].cached_prompt == 20
    assert batch.passes == 1


def test_a_user_repeating_a_whole_prompt_keeps_their_slot_and_nobody_elses_is_taken() -> None:
    """Users a-d left their prompts in slots 0-3 and a new user decodes in slot 4.
    Users a and b send the same prompts again, with two new users: a and b take
    their own slots (one token each) and the new users empty ones, so c's and d's
    prompts stay; slots chosen as one run around slot 4 would have made the new
    users overwrite them, or a and b copy their prompts."""
    s = sched(n_slots=8, n_batch=512)
    prompts = {name: [1, 2] + [ord(name)] * 18 for name in "abcd"}
    for name in "abcd":
        s.add(Req(name, prompts[name]))
    decode_all(s)
    for slot in s.slots:
        s.release(slot, keep_cache=True)
    s.add(Req("e", [1, 2] + [7] * 18))
    run(s, s.schedule())
    assert s.slot_of("e") is s.slots[4]
    for rid, prompt in (("a2", prompts["a"]), ("b2", prompts["b"]), ("f", [1, 2] + [8] * 18),
                        ("g", [1, 2] + [9] * 18)):  # fmt: skip
        s.add(Req(rid, prompt))
    batch = s.schedule()
    assert (s.slot_of("a2"), s.slot_of("b2")) == (s.slots[0], s.slots[1])
    assert {i.slot: len(i.tokens) for i in batch.items if i.prefill}[0] == 1
    assert s.slots[2].cache[:20] == prompts["c"] and s.slots[3].cache[:20] == prompts["d"]
    assert not any(isinstance(op, Copy) for op in batch.ops)


def test_requests_held_for_a_prefix_in_progress_leave_no_hole() -> None:
    """Three requests for one long prompt (``n`` > 1 choices) and one other arrive
    together on idle slots: the first of the three and the other start side by side,
    the two held for the prefill in progress start later by copying its cells, and
    the busy slots are one run at every step."""
    s = sched(n_slots=8, n_batch=512)
    long = list(range(100, 160))
    for name in ("n1", "n2", "n3"):
        s.add(Req(name, long))
    s.add(Req("other", [7] * 10))
    batch = s.schedule()
    busy = [x.id for x in s.slots if x.busy]
    assert busy == [0, 1]
    assert sorted(x.request.id for x in s.slots if x.request is not None) == ["n1", "other"]
    assert [r.id for r in s.queue] == ["n2", "n3"]
    while s.queue or any(x.state is SlotState.PREFILL for x in s.slots):
        run(s, batch)
        batch = s.schedule()
        busy = [x.id for x in s.slots if x.busy]
        assert busy == list(range(busy[0], busy[0] + len(busy)))
    assert sorted(x.cached_prompt for x in s.slots if x.busy)[-2:] == [59, 59]


def test_a_cached_prompt_is_copied_aside_before_a_new_prompt_takes_its_slot() -> None:
    """User "a" runs in slot 0; slot 1, next to it, holds "b"'s prompt. A new prompt
    arrives before "b" comes back and takes slot 1 (packed): "b"'s cells are copied
    into a free slot first, so "b" then feeds one token instead of its prompt."""
    s, prompts = users_decoding(5, 20)
    for slot in s.slots[1:3]:
        s.release(slot, keep_cache=True)
    run(s, s.schedule())  # "a" decodes on in slot 0; 1 and 2 keep "b" and "c"
    s.add(Req("new", [9, 9, 9]))
    batch = s.schedule()
    assert s.slot_of("new") is s.slots[1]
    assert batch.ops[0] == Copy(1, 3) and s.evacuations == 1
    assert s.slots[3].cache[:20] == prompts["b"] and not s.slots[3].busy
    run(s, batch)
    s.add(Req("b2", prompts["b"]))
    s.schedule()
    slot = s.slot_of("b2")
    assert slot is s.slots[3] and slot.cached_prompt == 19
    assert s.slots[2].cache[:20] == prompts["c"]  # nothing else was overwritten


def test_no_copy_aside_without_a_free_slot_or_for_a_short_prompt() -> None:
    """The copy is made only into a slot that loses nothing, and only for a prompt
    worth a copy (SHARE_MIN cells)."""
    s, _ = users_decoding(3, 20)  # "c" fills the last slot: no free one
    for slot in s.slots[1:3]:
        s.release(slot, keep_cache=True)
    run(s, s.schedule())
    s.add(Req("new", [9, 9, 9]))
    batch = s.schedule()
    assert s.slot_of("new") is s.slots[1] and not any(isinstance(o, Copy) for o in batch.ops)
    assert s.evacuations == 0

    short, _ = users_decoding(5, 4)
    for slot in short.slots[1:3]:
        short.release(slot, keep_cache=True)
    run(short, short.schedule())
    short.add(Req("new", [9, 9, 9]))
    batch = short.schedule()
    assert short.slot_of("new") is short.slots[1] and short.evacuations == 0


# -- the first pass alone ------------------------------------------------------------------


def test_returning_users_tokens_run_before_the_new_prompts_in_as_many_passes() -> None:
    """A burst: two users whose whole prompt a slot holds (one token each to feed) and
    two new 12-token prompts. llama.cpp would run one token of each sequence and then
    11 of each new one (two passes): the returning users' pass runs as a step of its
    own and the new prompts as the next, alone, so the returning users have their
    first token after one pass and nobody waits longer."""
    s = sched(n_slots=4)
    for slot, user in ((0, 1), (1, 2)):
        s.slots[slot].cache = [user] * 8
        s.slots[slot].reusable = 8
    for name, prompt in (("u1", [1] * 8), ("u2", [2] * 8), ("n3", [3] * 12), ("n4", [4] * 12)):
        s.add(Req(name, prompt))
    whole = micro_batches([(0, 1), (1, 1), (2, 12), (3, 12)], s.n_ubatch, unified=False)
    assert whole == 2
    first = s.schedule()
    assert [(i.slot, len(i.tokens), i.sample) for i in first.items] == [(0, 1, True), (1, 1, True)]
    assert first.passes == 1 and s.split_pending
    run(s, first)
    second = s.schedule()  # the new prompts alone: the returning users' next tokens wait
    assert not s.split_pending
    assert [(i.slot, len(i.tokens)) for i in second.items] == [(2, 12), (3, 12)]
    assert second.passes == 1 and second.n_decode == 0
    run(s, second)
    third = s.schedule()
    assert [(i.slot, len(i.tokens), i.prefill) for i in third.items] == [
        (n, 1, False) for n in range(4)
    ]


def test_a_prompt_that_ends_runs_before_the_decode_rows_that_would_split_it() -> None:
    """Three streams decoding and a new 20-token prompt: one token of each sequence,
    then 19 of the prompt, is two passes. The prompt alone is one, and the streams'
    rows go with the new stream's first row in the next step's one pass."""
    s, _ = users_decoding(4, 6)
    s.add(Req("new", [7] * 20))
    whole = micro_batches([(0, 1), (1, 1), (2, 1), (3, 20)], s.n_ubatch, unified=False)
    assert whole == 2
    b = s.schedule()
    assert [(i.slot, len(i.tokens), i.sample) for i in b.items] == [(3, 20, True)]
    assert b.passes == 1 and b.n_decode == 0 and not s.split_pending
    run(s, b)
    after = s.schedule()
    assert [(i.slot, len(i.tokens), i.prefill) for i in after.items] == [
        (n, 1, False) for n in range(4)
    ]
    assert after.passes == 1


def test_a_burst_whose_first_request_started_alone() -> None:
    """The first of four requests started alone and decodes in slot 0; the other
    three prompts (8 tokens each) run as a step of their own (one pass instead of
    two), then all four decode together."""
    s = sched(n_slots=4)
    s.add(Req("first", [1] * 8))
    run(s, s.schedule())
    for k in range(3):
        s.add(Req(f"late{k}", [k + 2] * 8))
    b = s.schedule()
    assert [(i.slot, len(i.tokens)) for i in b.items] == [(1, 8), (2, 8), (3, 8)]
    assert b.passes == 1
    run(s, b)
    assert s.schedule().n_decode == 4


def test_decode_rows_wait_one_step_at_most() -> None:
    """Prompts that end in two steps one after the other (a second arrival, or one
    that waited to copy the first one's prefix): the decode rows wait for the first,
    not for the second too."""
    s, _ = users_decoding(4, 6)
    s.add(Req("new", [7] * 20))
    first = s.schedule()
    assert first.n_decode == 0 and first.n_prefill == 20
    s.add(Req("next", [8] * 12))  # arrives meanwhile: slot 3 is the only idle one
    run(s, first)
    s.release(s.slots[2], keep_cache=False)  # a stream ends: its slot is free
    second = s.schedule()
    assert second.n_prefill == 12 and second.n_decode == 3  # the rows do not wait again
    run(s, second)


def test_decode_rows_stay_beside_a_chunk_that_does_not_end_its_prompt() -> None:
    """A prompt longer than the step's room: the streams would wait for every chunk,
    so the step stays whole; with a TPOT target (prompts_first off) too, since the
    chunk budget was set for a step that carries the decode rows."""
    s, _ = users_decoding(4, 6)
    s.add(Req("long", [7] * 100))  # more than the 61 tokens left beside 3 rows
    b = s.schedule()
    assert b.n_decode == 3 and 0 < b.n_prefill < 100 and b.passes == 2

    slo, _ = users_decoding(4, 6)
    slo.prompts_first = False
    slo.add(Req("new", [7] * 20))
    b = slo.schedule()
    assert b.n_decode == 3 and b.n_prefill == 20 and b.passes == 2


def test_no_split_when_drafts_would_wait() -> None:
    """A prompt's last token beside a stream's drafted tokens: the drafts would
    wait, so the step stays whole."""

    d, _ = users_decoding(4, 6)
    d.drafts = lambda slot, room: (5, 5) if slot.id == 0 else ()
    d.slots[3].cache, d.slots[3].reusable = [9] * 6, 6
    d.add(Req("back", [9] * 6))  # one token to feed
    b = d.schedule()
    assert {i.slot for i in b.items} == {0, 1, 2, 3} and b.n_drafted == 2


def test_a_prompt_split_off_and_cancelled_meanwhile_is_not_fed() -> None:
    s = sched(n_slots=2)
    s.slots[0].cache, s.slots[0].reusable = [1] * 8, 8
    s.add(Req("back", [1] * 8))
    s.add(Req("new", [2] * 12))
    first = s.schedule()
    assert [i.slot for i in first.items] == [0]
    run(s, first)
    s.cancel("new")
    after = s.schedule()
    assert [(i.slot, i.prefill) for i in after.items] == [(0, False)]
    assert not s.slots[1].busy and s.slots[1].cache == []


# -- a burst's prompts in two steps for a lower mean TTFT ---------------------------------


def linear_cost(per_pass: float, per_token: float):  # type: ignore[no-untyped-def]
    """A settled step-cost model: ``per_pass`` ms a llama.cpp pass, ``per_token`` a
    prompt token, 0.3 ms a decode row."""
    return lambda passes, rows, prompt: per_pass * passes + 0.3 * rows + per_token * prompt


def burst(s: Scheduler, lengths: list[int]) -> None:
    for k, n in enumerate(lengths):
        s.add(Req(f"r{k}", [k + 1] * n))


def test_a_burst_runs_as_two_steps_where_the_mean_ttft_falls() -> None:
    """Four 8-token prompts where a pass costs 5 ms and a prompt token 1 ms: one step of
    32 tokens gives all four their first token at 37 ms (mean 37); two of them first
    (21 ms) and the other two next (42 ms) give a mean of 31.5, 5.5 ms less, for the
    last ones 5 ms more. The second step runs alone, and then the four streams decode
    together."""
    s = sched(n_slots=4)
    s.step_ms = linear_cost(5.0, 1.0)
    burst(s, [8, 8, 8, 8])
    first = s.schedule()
    assert [(i.slot, len(i.tokens), i.sample) for i in first.items] == [(0, 8, True), (1, 8, True)]
    assert first.passes == 1 and s.split_pending and s.prompt_splits == 1
    run(s, first)
    second = s.schedule()
    assert [(i.slot, len(i.tokens)) for i in second.items] == [(2, 8), (3, 8)]
    assert second.n_decode == 0 and not s.split_pending
    run(s, second)
    assert s.schedule().n_decode == 4 and s.prompt_splits == 1


def test_the_shorter_prompts_go_first_and_the_cut_minimizes_the_sum() -> None:
    """Prompts of 30, 4, 30 and 6 tokens in one KV buffer (any lengths are one pass):
    the two short ones first, the cut at two: 4 x 15 + 2 x 65 = 190 ms of TTFT in all,
    against 4 x 75 = 300 whole, and 249 and 215 for the other cuts."""
    s = sched(n_slots=4, n_batch=128, unified=True)
    s.step_ms = linear_cost(5.0, 1.0)
    burst(s, [30, 4, 30, 6])
    first = s.schedule()
    assert sorted(len(i.tokens) for i in first.items) == [4, 6]
    run(s, first)
    assert sorted(len(i.tokens) for i in s.schedule().items) == [30, 30]


def test_no_split_where_the_mean_gains_less_than_the_last_prompt_loses() -> None:
    """Four 4-token prompts, 5 ms a pass and 1 ms a token: whole, 21 ms each; two and
    two, 13 and 26 ms, a mean 1.5 ms lower (the sum alone would split) for 5 ms more
    on the last two. One step."""
    s = sched(n_slots=4)
    s.step_ms = linear_cost(5.0, 1.0)
    burst(s, [4, 4, 4, 4])
    assert len(s.schedule().items) == 4 and s.prompt_splits == 0


def test_no_split_where_a_pass_outweighs_the_prompts() -> None:
    """Where a pass costs 40 ms and a prompt token 0.1 ms (short prompts on a GPU), a
    second pass costs more than the prompts' time it saves: one step."""
    s = sched(n_slots=4)
    s.step_ms = linear_cost(40.0, 0.1)
    burst(s, [8, 8, 8, 8])
    b = s.schedule()
    assert len(b.items) == 4 and not s.split_pending and s.prompt_splits == 0


def test_no_split_before_the_model_settles_or_beside_decode_rows_or_chunks() -> None:
    unsettled = sched(n_slots=4)  # step_ms answers None: no prediction yet
    burst(unsettled, [8, 8, 8, 8])
    assert len(unsettled.schedule().items) == 4

    # a chunk that does not end its prompt: the later prompts would gain nothing
    chunked = sched(n_slots=4, n_batch=64)
    chunked.step_ms = linear_cost(5.0, 1.0)
    burst(chunked, [40, 40])
    b = chunked.schedule()
    assert [(len(i.tokens), i.sample) for i in b.items] == [(40, True), (24, False)]
    assert not chunked.split_pending and chunked.prompt_splits == 0

    # streams decoding beside the prompts: the step is not a burst's alone
    s, _ = users_decoding(6, 6)
    s.step_ms = linear_cost(5.0, 1.0)
    s.prompts_first = False  # keep the decode rows in the step
    burst(s, [8, 8])
    b = s.schedule()
    assert b.n_decode == 3 and b.n_prefill == 16 and s.prompt_splits == 0
