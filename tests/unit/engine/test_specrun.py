"""A request's drafts (orin.engine.specrun.RequestSpec): the n-gram lookup, the
acceptance budget and the step-cost weighing together."""

from __future__ import annotations

from orin.engine.costmodel import StepCost
from orin.engine.specrun import RequestSpec
from orin.engine.speculative import Acceptance, NgramDrafter

PASSAGE = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def spec(tokens: list[int], n_draft: int = 8) -> RequestSpec:
    return RequestSpec(NgramDrafter(2, 4, n_draft).new(tokens), Acceptance(n_draft), ngram=True)


class Costs:
    """A cost callback that counts its calls."""

    def __init__(self, a: float, b: float, rows: int = 1) -> None:
        self.figures: StepCost = (a, b, rows)
        self.calls = 0

    def __call__(self) -> StepCost:
        self.calls += 1
        return self.figures


def test_nothing_to_look_up_asks_for_no_costs() -> None:
    s = spec([1, 2, 3, 4])
    costs = Costs(10.0, 0.1)
    assert s.draft(8, costs) == []
    assert costs.calls == 0


def test_a_nearly_free_row_drafts_the_whole_continuation() -> None:
    s = spec([*PASSAGE, 99, 5, 6, 7])  # the passage again: 8..14, 99, 5, ... follow
    costs = Costs(10.0, 0.01)
    assert list(s.draft(8, costs)) == [8, 9, 10, 11, 12, 13, 14, 99]
    assert costs.calls == 1
    assert list(s.draft(3, costs)) == [8, 9, 10]  # the room the scheduler gives


def test_a_row_as_dear_as_a_pass_drafts_only_what_is_likely() -> None:
    s = spec([*PASSAGE, 99, 5, 6, 7])
    for _ in range(6):  # six drafts rejected at their first token
        s.verified(4, 0)
    assert s.continue_chance < 0.3
    assert list(s.draft(8, Costs(1.0, 1.0))) == []
    assert list(s.draft(8)) == [8]  # without costs: the acceptance record's length (1)


def test_new_tokens_extend_the_lookup() -> None:
    s = spec([1, 2, 3, 4, 1, 2])
    assert list(s.draft(2)) == [3, 4]
    s.extend(3)
    s.extend(9)
    assert list(s.draft(2)) == []
    assert s.context.tokens[-2:] == [3, 9]
