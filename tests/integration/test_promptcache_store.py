"""The persistent prompt cache with real llama.cpp: a prompt's KV state saved from one
context and restored into another (a restart) continues exactly as a full prefill."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from orin.engine.backend import Backend
from orin.engine.cachefiles import Entry
from orin.engine.cacheindex import RETRY_S
from orin.engine.cachekey import CacheKey, resolved_flash_attn
from orin.engine.config import EngineConfig, engine_config
from orin.engine.modeldigest import model_digest
from orin.engine.promptcache import PromptCache
from orin.engine.runner import Runner
from orin.engine.scheduler import Batch, BatchItem
from orin.llamacpp import capture_log
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile

pytestmark = pytest.mark.llama

N_BATCH = 64
PROMPT_TOKENS = 100


def config(model: Path, unified: bool = False, kv: str = "f16", slots: int = 2) -> EngineConfig:
    engine = (
        f"{{n_ctx: 256, slots: {slots}, n_batch: {N_BATCH}, n_ubatch: {N_BATCH}, "
        f"type_k: {kv}, type_v: {kv}, flash_attn: auto, kv_unified: {str(unified).lower()}}}"
    )
    profile = parse_profile(f"name: t\nengine: {engine}\n")
    return engine_config(profile, model, read_model_info(model))


@contextmanager
def opened(cfg: EngineConfig) -> Iterator[tuple[Backend, Runner, bool | None]]:
    """A context (and its runner) as the engine builds one, with how it resolved
    flash attention."""
    with capture_log() as lines:
        backend = Backend(cfg)
    runner = Runner(backend, N_BATCH)
    try:
        yield backend, runner, resolved_flash_attn(lines, cfg.flash_attn)
    finally:
        runner.close()
        backend.close()


def key_of(backend: Backend, flash_attn: bool | None, memo: Path) -> CacheKey:
    digest = model_digest(backend.cfg.model_path, memo)
    return CacheKey.from_config(backend.cfg, digest, backend.n_ctx_seq, flash_attn)


def feed(runner: Runner, seq: int, tokens: list[int], pos: int = 0) -> npt.NDArray[np.float32]:
    """Decode ``tokens`` into ``seq`` from ``pos`` in batch-sized chunks; the logits
    after the last one."""
    for start in range(0, len(tokens), N_BATCH):
        chunk = tuple(tokens[start : start + N_BATCH])
        last = start + N_BATCH >= len(tokens)
        rows = runner.decode(Batch((), (BatchItem(seq, chunk, pos + start, last, True),)))
    return runner.logits(rows[seq]).copy()


def prompt_of(backend: Backend) -> list[int]:
    text = "The board keeps a long system prompt ready for every request. " * 12
    tokens = backend.tokenize(text)[:PROMPT_TOKENS]
    assert len(tokens) == PROMPT_TOKENS
    return tokens


def saved_prompt(model: Path, directory: Path, unified: bool = False) -> tuple[Entry, int]:
    """Prefill the prompt into sequence 0 of a fresh context and save it; the entry
    and the greedy token after the prompt."""
    with opened(config(model, unified)) as (backend, runner, fa):
        prompt = prompt_of(backend)
        nxt = int(feed(runner, 0, prompt).argmax())
        cache = PromptCache(directory, key_of(backend, fa, directory), 1 << 30)
        entry = cache.save(backend, 0, prompt)
    assert entry is not None and entry.tokens == tuple(prompt)
    return entry, nxt


@pytest.mark.parametrize("unified", [False, True], ids=["kv-per-slot", "kv-unified"])
def test_a_restored_prompt_continues_as_a_full_prefill(
    tiny_f16: Path, tmp_path: Path, unified: bool
) -> None:
    entry, nxt = saved_prompt(tiny_f16, tmp_path, unified)
    with opened(config(tiny_f16, unified)) as (backend, runner, fa):  # a restarted server
        assert fa is not None  # llama.cpp's log said how it resolved auto
        cache = PromptCache(tmp_path, key_of(backend, fa, tmp_path), 1 << 30)
        prompt = list(entry.tokens)
        found = cache.find([*prompt, 11, 12])
        assert found is not None and found.name == entry.name
        assert cache.load(backend, 1, found)  # into another sequence than it came from
        assert (runner.seq_pos_min(1), runner.seq_pos_max(1)) == (0, PROMPT_TOKENS - 1)
        restored = feed(runner, 1, [nxt], pos=PROMPT_TOKENS)
        full = feed(runner, 0, [*prompt, nxt])  # the same tokens computed from scratch
        assert int(restored.argmax()) == int(full.argmax())
        np.testing.assert_allclose(restored, full, atol=0.05)
        assert cache.counters.loads == 1


def test_a_flipped_byte_is_refused_and_the_sequence_left_empty(
    tiny_f16: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    entry, _ = saved_prompt(tiny_f16, tmp_path)
    data = bytearray(entry.state_path.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the K/V data, where llama.cpp checks nothing
    entry.state_path.write_bytes(bytes(data))
    with opened(config(tiny_f16)) as (backend, runner, fa):
        cache = PromptCache(tmp_path, key_of(backend, fa, tmp_path), 1 << 30)
        found = cache.get(list(entry.tokens))
        assert found is not None
        with caplog.at_level(logging.WARNING):
            assert not cache.load(backend, 1, found)
        assert runner.seq_pos_max(1) == -1
        assert str(entry.state_path) in caplog.text and "SHA-256" in caplog.text
        assert cache.counters.rejected == 1 and cache.entries() == []


def test_another_kv_type_neither_finds_nor_loads_the_state(
    tiny_f16: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    entry, _ = saved_prompt(tiny_f16, tmp_path)
    with opened(config(tiny_f16, kv="q8_0")) as (backend, runner, fa):
        cache = PromptCache(tmp_path, key_of(backend, fa, tmp_path), 1 << 30)
        assert cache.key.type_k == "q8_0" and cache.key.model_sha256 == entry.key.model_sha256
        assert cache.find([*entry.tokens, 5]) is None and cache.get(list(entry.tokens)) is None
        with caplog.at_level(logging.WARNING):
            assert not cache.load(backend, 0, entry)
        assert runner.seq_pos_max(0) == -1 and "another model or context" in caplog.text
    assert entry.state_path.exists()  # still good for the context it was saved from


def test_a_state_llama_cpp_cannot_take_leaves_the_sequence_empty(
    tiny_f16: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The number of KV streams is part of the key because llama.cpp refuses a state
    saved with another count: with the key forced equal, the refusal is reported and
    the sequence stays empty."""
    entry, _ = saved_prompt(tiny_f16, tmp_path)
    with opened(config(tiny_f16, slots=3)) as (backend, runner, fa):
        key = key_of(backend, fa, tmp_path)
        assert key.n_stream == 3 and key != entry.key
        cache = PromptCache(tmp_path, entry.key, 1 << 30)
        with caplog.at_level(logging.WARNING):
            assert not cache.load(backend, 2, entry)
        assert runner.seq_pos_max(2) == -1
        assert "llama.cpp refused it" in caplog.text and "n_stream" in caplog.text


def test_a_state_the_full_shared_buffer_cannot_take_is_restored_later(
    tiny_f16: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With one KV buffer for all slots, another slot's long conversation can leave no
    room for a saved prompt: llama.cpp refuses it then, and once the cells are free
    (and RETRY_S has passed) the same state is found and restored."""
    entry, nxt = saved_prompt(tiny_f16, tmp_path, unified=True)
    now = [1_000_000.0]
    with opened(config(tiny_f16, unified=True)) as (backend, runner, fa):
        cache = PromptCache(tmp_path, key_of(backend, fa, tmp_path), 1 << 30, clock=lambda: now[0])
        cells = backend.n_ctx_seq  # the one buffer's cells
        filler = (prompt_of(backend) * (cells // PROMPT_TOKENS + 1))[: cells - PROMPT_TOKENS // 2]
        feed(runner, 0, filler)
        with caplog.at_level(logging.WARNING):
            assert not cache.load(backend, 1, entry)
        assert runner.seq_pos_max(1) == -1 and "trying it again in" in caplog.text
        assert cache.get(list(entry.tokens)) is None
        backend.lib.llama_memory_seq_rm(backend.memory, 0, 0, -1)  # the slot ends
        now[0] += RETRY_S
        found = cache.get(list(entry.tokens))
        assert found is not None and cache.load(backend, 1, found)
        restored = feed(runner, 1, [nxt], pos=PROMPT_TOKENS)
        assert int(restored.argmax()) == int(feed(runner, 0, [*entry.tokens, nxt]).argmax())
