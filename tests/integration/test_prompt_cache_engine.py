"""The persistent prompt cache inside the engine: computed and saved at the first start,
restored after a restart, restored from disk when no slot holds it, and a damaged file
skipped with a warning; the output is the one a cold engine gives."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from orin.engine.config import engine_config
from orin.engine.engine import Engine
from orin.engine.modeldigest import MEMO_NAME
from orin.engine.types import SamplingParams
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile

pytestmark = pytest.mark.llama

SYSTEM = (
    "You are the voice assistant of a delivery robot. Answer in one short sentence, "
    "name the shelf and the box when you know them, and never guess a location. " * 3
)
OTHER = "You are a terse assistant for a warehouse kiosk. " * 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def small() -> Path:
    return demo.ensure("small", "f16")


def engine(
    path: Path,
    cache: Path | None,
    slots: int = 2,
    prompts: tuple[str, ...] = (SYSTEM,),
    max_bytes: int = 1 << 30,
) -> Engine:
    section = ""
    if cache is not None:
        listed = ", ".join(repr(p) for p in prompts)
        section = (
            f"prompt_cache: {{prompts: [{listed}], directory: '{cache}', max_bytes: {max_bytes}}}\n"
        )
    profile = parse_profile(
        f"name: t\nengine: {{n_ctx: 512, slots: {slots}, n_batch: 128, n_ubatch: 128}}\n{section}"
    )
    return Engine(engine_config(profile, path, read_model_info(path)))


def ask(e: Engine, system: str, question: str) -> tuple[list[int], int]:
    chat = e.render_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
    )
    done = e.submit(e.tokenize(chat.prompt), PARAMS).result()
    assert done.timings is not None
    return list(done.token_ids), done.timings.cached_tokens


def test_saved_at_first_start_and_restored_after_a_restart(
    small: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with engine(small, None) as cold:
        want, cached = ask(cold, SYSTEM, "Where is box 7?")
    assert cached == 0
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, "orin.engine"), engine(small, cache) as first:
        got, cached = ask(first, SYSTEM, "Where is box 7?")
    assert "computed and saved" in caplog.text
    assert got == want and cached > 40  # the system prompt's cells were there already
    assert len(list(cache.glob("*.state"))) == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, "orin.engine"), engine(small, cache) as restarted:
        assert "restored" in caplog.text and "computed" not in caplog.text
        got, cached_after = ask(restarted, SYSTEM, "Where is box 7?")
    assert got == want and cached_after == cached


def test_a_prompt_no_slot_holds_is_restored_from_disk(small: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with engine(small, None, slots=1) as cold:
        want, _ = ask(cold, OTHER, "Open hours?")
    # one slot: the second prompt is saved but its cells do not stay in any slot
    with engine(small, cache, slots=1, prompts=(SYSTEM, OTHER)) as e:
        got, cached = ask(e, OTHER, "Open hours?")
        assert got == want and cached > 20
        hits = e.prompt_cache.cache.counters.loads if e.prompt_cache else 0
    assert hits >= 1


def test_a_damaged_file_is_skipped_and_the_prompt_computed(
    small: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    with engine(small, cache) as e:
        want, _ = ask(e, SYSTEM, "Where is box 9?")
    (state,) = cache.glob("*.state")
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    state.chmod(0o600)
    caplog.clear()
    with caplog.at_level(logging.INFO, "orin.engine"), engine(small, cache) as e:
        got, cached = ask(e, SYSTEM, "Where is box 9?")
    assert "computed and saved" in caplog.text
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    assert got == want and cached > 40


def test_another_kv_type_does_not_load_the_saved_state(small: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with engine(small, cache):
        pass
    profile = parse_profile(
        "name: t\nengine: {n_ctx: 512, slots: 2, n_batch: 128, n_ubatch: 128, type_k: q8_0, "
        f"type_v: q8_0, flash_attn: on}}\n"
        f"prompt_cache: {{prompts: [{SYSTEM!r}], directory: '{cache}'}}\n"
    )
    with Engine(engine_config(profile, small, read_model_info(small))) as e:
        assert e.prompt_cache is not None
        assert e.prompt_cache.cache.counters.loads == 0
    assert len(list(cache.glob("*.state"))) == 2  # one per key


def sidecars(cache: Path) -> list[Path]:
    return [p for p in cache.glob("*.json") if p.name != MEMO_NAME]


def foreign_state(small: Path, cache: Path) -> Path:
    """Put into ``cache`` OTHER's state saved by a context with two KV streams, under
    the name and sidecar of OTHER's state for one stream, its digest and size updated:
    every check of the cache's own passes, and llama.cpp refuses it (n_stream mismatch),
    as it would a state another build of it wrote."""
    with engine(small, cache, slots=1, prompts=(SYSTEM, OTHER)):
        pass
    elsewhere = cache.parent / "two-streams"
    with engine(small, elsewhere, slots=2, prompts=(OTHER,)):
        pass
    (theirs,) = sidecars(elsewhere)
    tokens = json.loads(theirs.read_text())["tokens"]
    (ours,) = [p for p in sidecars(cache) if json.loads(p.read_text())["tokens"] == tokens]
    data = theirs.with_suffix(".state").read_bytes()
    ours.with_suffix(".state").write_bytes(data)
    doc = json.loads(ours.read_text())
    doc["state_sha256"], doc["state_bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    ours.write_text(json.dumps(doc))
    return ours.with_suffix(".state")


def test_a_state_llama_cpp_refuses_is_tried_once_and_then_left_alone(
    small: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A saved prompt that is not among the profile's prompts any more is never saved
    again by this server: once llama.cpp has refused its state, requests that start with
    it prefill it, without another failed load and another warning each."""
    with engine(small, None, slots=1) as cold:
        other, _ = ask(cold, OTHER, "Open hours?")
        system, _ = ask(cold, SYSTEM, "Where is box 7?")
    cache = tmp_path / "cache"
    state = foreign_state(small, cache)
    with caplog.at_level(logging.INFO, "orin.engine"), engine(small, cache, slots=1) as e:
        assert e.prompt_cache is not None
        counters = e.prompt_cache.cache.counters
        for _ in range(3):  # the one slot holds each prompt in turn: OTHER is not kept
            assert ask(e, OTHER, "Open hours?")[0] == other
            assert ask(e, SYSTEM, "Where is box 7?")[0] == system
        assert counters.rejected == 1 and counters.loads == 1 + 3  # SYSTEM's, from disk
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1, refused
    assert caplog.text.count("could not restore saved prompts") == 1
    assert str(state) in refused[0] and "n_stream" in refused[0]
    assert refused[0].endswith("; not trying it again until it is saved anew")
    assert state.exists()  # another llama.cpp build may still read it


def test_prompts_that_evict_each_other_at_every_start_are_warned_about(
    small: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each prompt fits max_bytes, both together do not: the second evicts the first
    while the model loads, and at the next start the first evicts the second. Each
    start computes and writes them all: a warning says so, and what to change."""
    cache, longer = tmp_path / "cache", OTHER * 3
    for _ in range(2):
        caplog.clear()
        with (
            caplog.at_level(logging.INFO, "orin.engine"),
            engine(small, cache, prompts=(SYSTEM, longer), max_bytes=1 << 20) as e,
        ):
            assert e.prompt_cache is not None
            assert e.prompt_cache.cache.counters.evicted >= 1
        assert "restored" not in caplog.text
        assert "cannot hold the 2 prompts together" in caplog.text
        assert "1 of them were evicted" in caplog.text and "raise max_bytes" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, "orin.engine"), engine(small, cache, prompts=(SYSTEM,)):
        pass  # one prompt fits: no warning
    assert "prompt 0 computed and saved" in caplog.text and "cannot hold" not in caplog.text
