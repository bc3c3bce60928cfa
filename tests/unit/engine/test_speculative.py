"""Drafting by n-gram lookup, draft verification and the acceptance record (no llama.cpp)."""

from __future__ import annotations

import random

import pytest

from orin.engine.config import SpecConfig
from orin.engine.scheduler import common_prefix
from orin.engine.speculative import Acceptance, NgramDrafter, verify
from orin.model.vocabmatch import vocab_sample


def naive_draft(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The n-gram rule by rescanning: longest suffix first, most recent earlier occurrence."""
    size = len(tokens)
    for n in range(hi, lo - 1, -1):
        if size <= n:
            continue
        suffix = tokens[size - n :]
        for end in range(size - 2, n - 2, -1):  # the suffix itself ends at size - 1
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


# -- n-gram lookup ----------------------------------------------------------------


def test_the_tokens_after_the_earlier_occurrence_are_drafted() -> None:
    state = NgramDrafter(2, 3, 4).new([1, 2, 3, 4, 5, 6, 7, 9, 2, 3])
    assert state.draft() == [4, 5, 6, 7]


def test_the_longest_suffix_is_tried_first() -> None:
    # "5 6" last occurred before 9, but "4 5 6" occurred before 7: the longer match wins
    tokens = [4, 5, 6, 7, 1, 5, 6, 9, 2, 4, 5, 6]
    assert NgramDrafter(2, 3, 1).new(tokens).draft() == [7]
    assert NgramDrafter(2, 2, 1).new(tokens).draft() == [9]


def test_the_most_recent_occurrence_is_used() -> None:
    tokens = [1, 2, 10, 0, 1, 2, 20, 0, 1, 2]
    assert NgramDrafter(2, 2, 1).new(tokens).draft() == [20]


def test_no_draft_without_an_earlier_occurrence() -> None:
    drafter = NgramDrafter(2, 4, 8)
    assert drafter.new([1, 2, 3, 4, 5, 6]).draft() == []
    assert drafter.new([]).draft() == []
    assert drafter.new([7, 7]).draft() == []  # "7 7" has no earlier occurrence
    # a match shorter than ngram_min does not count
    assert drafter.new([1, 2, 3, 9, 3]).draft() == []


def test_draft_is_capped_by_n_draft_by_the_caller_and_by_the_context_end() -> None:
    tokens = [*range(20), 0, 1]
    state = NgramDrafter(2, 2, 5).new(tokens)
    assert state.draft() == [2, 3, 4, 5, 6]
    assert state.draft(3) == [2, 3, 4]
    assert state.draft(50) == [2, 3, 4, 5, 6]
    assert state.draft(0) == []
    # the continuation runs into the suffix itself: it stops at the context's end
    assert NgramDrafter(2, 2, 8).new([5, 6, 5, 6]).draft() == [5, 6]
    assert NgramDrafter(1, 1, 8).new([3, 3]).draft() == [3]


def test_extend_makes_the_new_tokens_searchable() -> None:
    state = NgramDrafter(2, 2, 3).new([1, 2])
    assert state.draft() == []
    state.extend([3, 4])
    assert state.draft() == []
    state.extend([1, 2])
    assert state.draft() == [3, 4, 1]
    state.extend([])
    assert state.draft() == [3, 4, 1]
    assert len(state) == 6 and state.tokens == [1, 2, 3, 4, 1, 2]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_equals_a_full_rescan(seed: int) -> None:
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 5)
    k = rng.randint(1, 8)
    alphabet = rng.randint(2, 6)  # small alphabets repeat often
    drafter = NgramDrafter(lo, hi, k)
    tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 10))]
    state = drafter.new(tokens)
    for _ in range(150):
        chunk = [rng.randrange(alphabet) for _ in range(rng.choice([0, 1, 1, 1, 2, 5]))]
        tokens += chunk
        state.extend(chunk)
        limit = rng.randint(0, k + 2)
        assert state.draft(limit) == naive_draft(tokens, lo, hi, min(limit, k))
        assert state.draft() == naive_draft(tokens, lo, hi, k)
    assert drafter.new(tokens).draft() == state.draft()


def test_a_long_context_is_indexed_once() -> None:
    """Appending a token indexes its own n-grams only: the index size grows by one
    entry per n per new distinct n-gram, never by a rescan."""
    rng = random.Random(3)
    tokens = [rng.randrange(50_000) for _ in range(8000)]
    state = NgramDrafter(2, 4, 8).new(tokens)
    sizes = {n: len(index) for n, index in state._index.items()}
    state.extend([rng.randrange(50_000)])
    assert all(len(state._index[n]) == sizes[n] + 1 for n in sizes)
    state.extend(tokens[100:104])
    assert state.draft() == tokens[104:112]


def test_drafter_checks_its_bounds_and_reads_the_profile_section() -> None:
    with pytest.raises(ValueError):
        NgramDrafter(3, 2, 4)
    with pytest.raises(ValueError):
        NgramDrafter(0, 2, 4)
    with pytest.raises(ValueError):
        NgramDrafter(1, 2, 0)
    spec = SpecConfig(mode="ngram", n_draft=5, ngram_min=1, ngram_max=3)
    assert NgramDrafter.from_config(spec) == NgramDrafter(1, 3, 5)


# -- verification -----------------------------------------------------------------


def test_verify_counts_the_agreeing_prefix() -> None:
    assert verify([5, 6, 7], [5, 6, 7, 8]) == 3  # all accepted: 4 tokens emitted
    assert verify([5, 6, 7], [5, 9, 7, 8]) == 1  # 5 accepted, 9 replaces 6
    assert verify([5, 6, 7], [4, 6, 7, 8]) == 0
    assert verify([], [3]) == 0  # no draft: the plain decode step
    # agreement after a rejection does not count
    assert verify([1, 2, 3, 4], [1, 0, 3, 4, 5]) == 1


def test_verify_takes_sampling_stopped_at_the_first_disagreement() -> None:
    assert verify([5, 6, 7], [5, 9]) == 1
    assert verify([5, 6, 7], [4]) == 0


@pytest.mark.parametrize(
    ("drafted", "sampled"),
    [([5, 6], []), ([5, 6], [5, 6, 7, 8]), ([5, 6], [5]), ([5, 6], [5, 6]), ([], [])],
)
def test_verify_refuses_an_inconsistent_sample(drafted: list[int], sampled: list[int]) -> None:
    with pytest.raises(ValueError):
        verify(drafted, sampled)


def test_emitted_tokens_are_the_sample_up_to_the_first_rejection() -> None:
    rng = random.Random(0)
    for _ in range(200):
        drafted = [rng.randrange(3) for _ in range(rng.randrange(0, 6))]
        sampled = [rng.randrange(3) for _ in range(len(drafted) + 1)]
        accepted = verify(drafted, sampled)
        emitted = sampled[: accepted + 1]
        assert emitted[:accepted] == drafted[:accepted]
        assert accepted == len(drafted) or sampled[accepted] != drafted[accepted]


# -- acceptance record --------------------------------------------------------------


def test_acceptance_counts_and_rate() -> None:
    a = Acceptance(n_draft=4)
    assert a.rate == 0.0 and a.enabled
    a.record(4, 3)
    a.record(0, 0)  # an empty draft counts nothing
    a.record(2, 0)
    assert (a.drafted, a.accepted, a.steps) == (6, 3, 2)
    assert a.rate == pytest.approx(0.5)
    with pytest.raises(ValueError):
        a.record(2, 3)


def test_speculation_switches_off_after_probation_and_stays_off() -> None:
    a = Acceptance(n_draft=4, min_acceptance=0.5, probation=8)
    a.record(4, 0)
    assert a.enabled  # 4 drafted: still on probation
    a.record(4, 1)
    assert not a.enabled  # 8 drafted, 1/8 accepted
    assert a.budget() == 0 and a.budget(100) == 0
    a.record(4, 4)
    a.record(4, 4)
    assert a.rate > 0.5 and not a.enabled


def test_a_good_rate_keeps_speculation_on() -> None:
    a = Acceptance(n_draft=8, min_acceptance=0.2, probation=8)
    for _ in range(20):
        a.record(5, 1)  # 20% accepted: not below the threshold
    assert a.enabled
    off = Acceptance(n_draft=8, min_acceptance=0.0, probation=1)
    for _ in range(20):
        off.record(8, 0)
    assert off.enabled  # min_acceptance 0 never switches off


def test_draft_length_shrinks_after_rejections_and_grows_after_full_acceptance() -> None:
    a = Acceptance(n_draft=8)
    assert a.budget() == 8
    a.record(8, 5)
    assert a.length == 6  # one beyond the run that agreed
    a.record(6, 0)
    assert a.length == 1
    a.record(1, 1)
    assert a.length == 2
    a.record(2, 2)
    assert a.length == 4
    a.record(3, 3)  # the drafter offered fewer than asked, all accepted
    assert a.length == 8
    a.record(8, 8)
    assert a.length == 8


@pytest.mark.parametrize("seed", range(4))
def test_draft_length_stays_within_bounds(seed: int) -> None:
    rng = random.Random(seed)
    n_draft = rng.randint(1, 16)
    a = Acceptance(n_draft=n_draft)
    for _ in range(300):
        drafted = rng.randint(0, a.budget())
        a.record(drafted, rng.randint(0, drafted))
        assert 1 <= a.length <= n_draft


def test_budget_leaves_room_for_the_token_after_the_drafts() -> None:
    a = Acceptance(n_draft=8)
    assert a.budget(100) == 8
    assert a.budget(3) == 2  # 2 drafts + the token sampled after them: 3 tokens
    assert a.budget(1) == 0 and a.budget(0) == 0


def test_acceptance_reads_the_profile_section() -> None:
    a = Acceptance.from_config(SpecConfig(n_draft=6, min_acceptance=0.3, probation=10))
    assert (a.n_draft, a.min_acceptance, a.probation, a.length) == (6, 0.3, 10, 6)
    with pytest.raises(ValueError):
        Acceptance(n_draft=0)


# -- helpers of the draft model -------------------------------------------------------


def testcommon_prefix() -> None:
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    long = list(range(1000))
    for cut in (0, 1, 255, 256, 257, 700, 999):
        other = [*long[:cut], -1, *long[cut + 1 :]]
        assert common_prefix(long, other) == cut
        assert common_prefix(tuple(long), other) == cut


def test_vocab_sample_covers_small_vocabularies_and_bounds_large_ones() -> None:
    assert vocab_sample(800) == list(range(5, 800))
    big = vocab_sample(150_000)
    assert big[:3] == [5, 6, 7] and big[-1] == 149_999
    assert len(big) < 7000 and big == sorted(set(big))
