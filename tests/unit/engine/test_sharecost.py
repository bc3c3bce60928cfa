"""The copy threshold from the three measured decodes (orin.engine.sharecost)."""

from __future__ import annotations

import logging

import pytest

from orin.engine import sharecost
from orin.engine.scheduler import SHARE_MIN
from orin.engine.sharecost import CHUNK, ShareCost


def cost(per_token: float, copy: float, one: float = 8.0) -> ShareCost:
    return ShareCost(token_ms=one, chunk_ms=one + per_token * (CHUNK - 1), copy_ms=one + copy)


def test_the_threshold_is_a_copy_over_a_prompt_token_rounded_up() -> None:
    assert cost(per_token=1.0, copy=1.15).threshold() == 2
    assert cost(per_token=1.0, copy=3.0).threshold() == 3
    assert cost(per_token=2.0, copy=0.5).threshold() == 1


def test_it_stays_within_one_and_the_fixed_rule() -> None:
    assert cost(per_token=0.05, copy=3.0).threshold() == SHARE_MIN  # a GPU: tokens nearly free
    assert cost(per_token=1.0, copy=-0.4).threshold() == 1  # one buffer: a copy only tags
    assert cost(per_token=0.0, copy=1.0).threshold() == SHARE_MIN  # noise: no measure
    assert cost(per_token=-0.1, copy=1.0).threshold() == SHARE_MIN


def test_a_swamped_probe_says_so_and_keeps_the_fixed_rule(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    swamped = ShareCost(token_ms=9.0, chunk_ms=3.0, copy_ms=9.5)  # a chunk faster than a token
    monkeypatch.setattr(sharecost, "measure", lambda runner, token: swamped)
    with caplog.at_level(logging.INFO, "orin.engine"):
        assert sharecost.share_min(None, 0) == SHARE_MIN  # type: ignore[arg-type]
    assert "swamped" in caplog.text and "-0." not in caplog.text
