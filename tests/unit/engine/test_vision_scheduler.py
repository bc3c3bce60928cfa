"""Images in the scheduler's prompts: image rows are negative ids derived from the
image's hash (orin.engine.vision), never mixed with text in one prompt chunk, and a
repeated image is a reusable prefix like repeated text."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from orin.engine.errors import BackendError
from orin.engine.scheduler import Batch, ContextPolicy, Scheduler, SlotState
from orin.engine.vision import ImageSpan, MediaPrompt, RGBImage, image_ids, is_image


@dataclass
class Req:
    id: str
    prompt_tokens: list[int]
    all_logits: bool = False
    held: bool = False


def sched(n_batch: int = 64, chunk: int | None = None) -> Scheduler:
    return Scheduler(2, n_batch, ContextPolicy(window=256), prefill_chunk=chunk)


def run(s: Scheduler, batch: Batch, token: int = 5) -> None:
    s.update(batch, {i.slot: token for i in batch.items if i.sample})


def prefill(s: Scheduler) -> list[tuple[int, ...]]:
    """Every prompt chunk until no slot prefills."""
    chunks = []
    while s.queue or any(x.state is SlotState.PREFILL for x in s.slots):
        batch = s.schedule()
        chunks += [i.tokens for i in batch.items if i.prefill]
        run(s, batch)
    return chunks


def picture(seed: int) -> RGBImage:
    return RGBImage(2, 1, bytes([seed, 1, 2, 3, 4, 5]))


def test_image_ids_are_negative_distinct_and_follow_the_pixels() -> None:
    a = image_ids(picture(1).digest, 16)
    assert all(is_image(t) for t in a) and len(set(a)) == 16
    assert a == image_ids(picture(1).digest, 16)
    assert not set(a) & set(image_ids(picture(2).digest, 16))
    assert not is_image(0)


def test_image_ids_carry_128_bits_of_the_hash_in_every_row() -> None:
    """Hashes that agree on their first 40 bits (what the ids once took) and differ
    in any bit up to the 128th give ids with nothing in common: no row of one image
    is a prefix match for another that a client could craft to collide."""
    same = bytes(32)
    a = image_ids(same, 8)
    for bit in (40, 64, 100, 127):
        other = (int.from_bytes(same, "big") | 1 << (255 - bit)).to_bytes(32, "big")
        assert other[:5] == same[:5]
        assert not set(a) & set(image_ids(other, 8)), bit
    assert a == image_ids(bytes(32), 8)


def test_images_alike_in_40_bits_of_their_hash_share_no_cells() -> None:
    digest = bytes(32)
    twin = bytes(15) + b"\x01" + bytes(16)  # only the 128th bit differs
    s = sched()
    s.add(Req("a", [1, *image_ids(digest, 16), 7]))
    prefill(s)
    s.add(Req("c", [9, 9, 9]))  # the other slot is busy: "b" has to take "a"'s
    prefill(s)
    s.release(s.slots[0], keep_cache=True)
    s.add(Req("b", [1, *image_ids(twin, 16), 7]))
    s.schedule()
    slot = s.slot_of("b")
    assert slot is s.slots[0] and slot.cached_prompt == 1


def test_a_prompt_chunk_never_mixes_text_and_image_rows() -> None:
    img = image_ids(picture(1).digest, 16)
    prompt = [1, 2, 3, *img, 4, 5, 6]
    s = sched()
    s.add(Req("a", prompt))
    chunks = prefill(s)
    assert chunks == [(1, 2, 3), tuple(img), (4, 5, 6)]
    for chunk in chunks:
        assert len({is_image(t) for t in chunk}) == 1


def test_the_chunk_budget_splits_an_image_across_steps() -> None:
    img = image_ids(picture(1).digest, 16)
    s = sched(chunk=8)
    s.add(Req("a", [1, *img, 2]))
    chunks = prefill(s)
    assert chunks == [(1,), tuple(img[:8]), tuple(img[8:]), (2,)]


def test_a_repeated_image_with_a_new_question_reuses_its_cells() -> None:
    img = image_ids(picture(1).digest, 16)
    s = sched()
    s.add(Req("a", [1, *img, 7, 8]))
    prefill(s)
    s.release(s.slots[0], keep_cache=True)
    s.add(Req("b", [1, *img, 9, 10]))
    s.schedule()
    slot = s.slot_of("b")
    assert slot is not None and slot.cached_prompt == 17


def test_a_different_image_reuses_only_the_text_before_it() -> None:
    s = sched()
    s.add(Req("a", [1, *image_ids(picture(1).digest, 16), 7]))
    prefill(s)
    s.add(Req("c", [9, 9, 9]))  # the other slot is busy: "b" has to take "a"'s
    prefill(s)
    s.release(s.slots[0], keep_cache=True)
    s.add(Req("b", [1, *image_ids(picture(2).digest, 16), 7]))
    s.schedule()
    slot = s.slot_of("b")
    assert slot is s.slots[0] and slot.cached_prompt == 1


def test_a_chunk_across_two_adjacent_images_is_located_in_both() -> None:
    """Two image parts with no text between are one run of image ids: a prompt chunk
    that goes on from one image into the next takes rows of both, in order; the same
    image twice has the same ids, and its rows are found either way."""
    a, b = image_ids(picture(1).digest, 4), image_ids(picture(2).digest, 4)
    media = MediaPrompt(
        [7, *a, *b, *a, 9],
        [ImageSpan(1, a, None), ImageSpan(5, b, None), ImageSpan(9, a, None)],
    )
    found = [(s.ids[0], row, n) for s, row, n in media.locate([*a[2:], *b, *a[:3]])]
    assert found == [(a[0], 2, 2), (b[0], 0, 4), (a[0], 0, 3)]
    assert [(row, n) for _, row, n in media.locate(b[1:3])] == [(1, 2)]
    with pytest.raises(BackendError):
        media.locate([a[0], b[1]])  # rows out of order: never a prompt's chunk
    with pytest.raises(BackendError):
        media.locate([-1])
