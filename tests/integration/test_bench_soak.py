"""benchmarks/soak.py against a real `orin-llm serve` on the tiny demo model: every
round's traffic is served (its 400 and 404 included), the server process is read
after each round, and the server's own counters show the shared system prompt
reused and kept in the prompt cache. Memory figures are not asserted (a
benchmark's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks import soak

pytestmark = pytest.mark.llama


def test_every_round_is_served_and_the_server_read_after_each(tiny_f16: Path) -> None:
    result = soak.run(tiny_f16, rounds=3, settle_s=0.0, prompt_cache=True, quiet=True)
    assert [s.round for s in result.samples] == [0, 1, 2]
    # 4 concurrent streams, a chat, a dropped stream, a 400 and a 404 per round
    assert [s.requests for s in result.samples] == [8, 16, 24]
    assert all(s.rss > 0 and s.fds > 0 and s.threads > 0 for s in result.samples)
    assert [s.t for s in result.samples] == sorted(s.t for s in result.samples)
    c = result.counters
    # the engine finished at least the five requests a round that were read to the end
    # (the dropped stream's cancellation may land after the last read)
    assert c["orin_llm_requests"] >= 15
    # the system prompt was saved once at start and its cells served later rounds
    assert c["orin_llm_prompt_cache_saves"] == 1
    assert c["orin_llm_prompt_tokens_cached"] > 0
    g = soak.growth(result.samples, warmup=1)
    assert g.samples == 2


def test_the_profile_turns_on_what_was_asked(tmp_path: Path) -> None:
    assert soak.profile(tmp_path, speculative=False, prompt_cache=False) is None
    path = soak.profile(tmp_path, speculative=True, prompt_cache=True)
    assert path is not None
    written = yaml.safe_load(path.read_text())
    assert written["speculative"]["mode"] == "ngram"
    assert written["prompt_cache"]["prompts"] == [soak.SHARED]
    assert written["prompt_cache"]["directory"] == str(tmp_path / "prompt-cache")
    only_spec = soak.profile(tmp_path, speculative=True, prompt_cache=False)
    assert only_spec is not None
    assert "prompt_cache" not in yaml.safe_load(only_spec.read_text())
