"""The persistent prompt cache on real files; llama.cpp's per-sequence state calls are
stood in for at the library boundary (tests/integration/test_promptcache_store.py
runs the real ones)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import pytest

from orin.engine import cachefiles, cacheindex, modeldigest, promptcache
from orin.engine.cachefiles import Entry
from orin.engine.cacheindex import RETRY_S, STALE_S
from orin.engine.cachekey import CacheKey, entry_name, resolved_flash_attn
from orin.engine.config import EngineConfig
from orin.engine.modeldigest import model_digest
from orin.engine.promptcache import PromptCache
from orin.engine.scheduler import ContextPolicy

MAGIC = b"QSGG"  # llama.cpp's LLAMA_FILE_MAGIC_GGSQ, as a little-endian u32
PAYLOAD_PER_TOKEN = 64

KEY = CacheKey(
    model_sha256="ab" * 32,
    type_k="f16",
    type_v="f16",
    flash_attn="on",
    swa_full=False,
    kv_unified=False,
    n_stream=2,
    n_ctx_seq=512,
    rope_freq_base=None,
)


class FakeLlama:
    """The llama.cpp calls the cache makes. A sequence holds tokens at positions
    0..n-1; a state file is laid out as llama.cpp's (magic, version, token count,
    tokens) followed by a payload derived from the sequence's tokens."""

    llama_token = ctypes.c_int32

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}
        self.loaded: list[bytes] = []  # the paths llama_state_seq_load_file was given
        self.refuse = False

    def llama_n_seq_max(self, _ctx: Any) -> int:
        return 4

    def llama_memory_seq_pos_max(self, _mem: Any, seq: int) -> int:
        return len(self.seqs.get(seq, ())) - 1

    def llama_memory_seq_rm(self, _mem: Any, seq: int, p0: int, p1: int) -> bool:
        assert (p0, p1) == (0, -1)
        self.seqs.pop(seq, None)
        return True

    def llama_state_seq_save_file(
        self, _ctx: Any, path: bytes, seq: int, tokens: Any, n: int
    ) -> int:
        held = self.seqs[seq]
        data = MAGIC + struct.pack(f"<II{n}i", 3, n, *tokens[:n]) + payload(held)
        with open(path, "wb") as f:  # fopen(wb): truncates, keeps the mode
            f.write(data)
        return len(data)

    def llama_state_seq_load_file(
        self, _ctx: Any, path: bytes, seq: int, out: Any, capacity: int, n_out: Any
    ) -> int:
        self.loaded.append(path)
        with open(path, "rb") as f:
            data = f.read()
        magic, _version, n = struct.unpack_from("<4sII", data)
        if self.refuse or magic != MAGIC or n > capacity:
            self.seqs[seq] = [0]  # a failed load may leave cells behind
            return 0
        tokens = struct.unpack_from(f"<{n}i", data, 12)
        for i, t in enumerate(tokens):
            out[i] = t
        n_out[0] = n
        self.seqs[seq] = list(tokens)
        return len(data)


def payload(tokens: list[int]) -> bytes:
    return b"".join(bytes([t % 251]) * PAYLOAD_PER_TOKEN for t in tokens)


@dataclass
class Handles:
    lib: FakeLlama = field(default_factory=FakeLlama)
    ctx: Any = None
    memory: Any = None

    def prefill(self, seq: int, tokens: list[int]) -> None:
        self.lib.seqs[seq] = list(tokens)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def cache(tmp_path: Path, key: CacheKey = KEY, max_bytes: int = 1 << 20) -> PromptCache:
    return PromptCache(tmp_path / "pc", key, max_bytes, clock=Clock())


def saved(pc: PromptCache, kv: Handles, tokens: list[int], seq: int = 0) -> Entry:
    kv.prefill(seq, tokens)
    entry = pc.save(kv, seq, tokens)
    assert entry is not None
    kv.lib.seqs.pop(seq)
    return entry


# -- key and names ----------------------------------------------------------------------


def test_each_key_field_changes_the_key_and_the_file_name() -> None:
    tokens = [1, 2, 3]
    other: dict[str, object] = {
        "model_sha256": "cd" * 32,
        "type_k": "q8_0",
        "type_v": "q8_0",
        "flash_attn": "off",
        "swa_full": True,
        "kv_unified": True,
        "n_stream": 4,
        "n_ctx_seq": 1024,
        "rope_freq_base": 20000.0,
        "format": 2,
    }
    assert set(other) == {f.name for f in fields(CacheKey)}
    names = {entry_name(KEY, tokens)}
    for name, value in other.items():
        changed = replace(KEY, **{name: value})  # type: ignore[arg-type]
        assert changed.digest != KEY.digest, name
        names.add(entry_name(changed, tokens))
    assert len(names) == len(other) + 1
    assert entry_name(KEY, [1, 2, 4]) != entry_name(KEY, tokens)
    assert entry_name(KEY, tokens) == entry_name(replace(KEY), list(tokens))
    assert CacheKey.from_json(json.loads(json.dumps(KEY.to_json()))) == KEY


def engine_cfg(**changes: Any) -> EngineConfig:
    cfg = EngineConfig(
        model_path=Path("m.gguf"),
        n_ctx=512,
        slots=4,
        n_batch=64,
        n_ubatch=64,
        threads=1,
        threads_batch=1,
        gpu_layers=0,
        flash_attn="auto",
        type_k="q8_0",
        type_v="q8_0",
        load_mode="mmap",
        numa="disabled",
        context=ContextPolicy(window=512),
    )
    return cfg.with_(**changes)


def test_key_from_config_counts_streams_and_takes_the_resolved_flash_attention() -> None:
    key = CacheKey.from_config(engine_cfg(rope_freq_base=5e5), "ab" * 32, 512)
    assert (key.n_stream, key.kv_unified, key.flash_attn) == (4, False, "auto")
    assert (key.type_k, key.type_v, key.rope_freq_base, key.n_ctx_seq) == ("q8_0", "q8_0", 5e5, 512)
    unified = CacheKey.from_config(engine_cfg(kv_unified=True), "ab" * 32, 2048)
    assert (unified.n_stream, unified.kv_unified) == (1, True)
    assert CacheKey.from_config(engine_cfg(), "ab" * 32, 512, flash_attn=False).flash_attn == "off"
    assert CacheKey.from_config(engine_cfg(), "ab" * 32, 512, flash_attn=True).flash_attn == "on"


def test_flash_attention_auto_is_resolved_from_the_context_log() -> None:
    log = [
        "llama_context: flash_attn            = auto\n",
        "resolve_fused_ops: Flash Attention enabled\n",
    ]
    assert resolved_flash_attn(log, "auto") is True
    off = ["resolve_fused_ops: Flash Attention not supported, set to disabled\n"]
    assert resolved_flash_attn(off, "auto") is False
    assert resolved_flash_attn([], "auto") is None
    assert resolved_flash_attn(log, "off") is False and resolved_flash_attn([], "on") is True


# -- lookup and save ----------------------------------------------------------------------


def test_find_takes_the_longest_saved_prefix_and_get_the_exact_prompt(tmp_path: Path) -> None:
    pc, kv = cache(tmp_path), Handles()
    short = saved(pc, kv, [5, 6, 7])
    long = saved(pc, kv, [5, 6, 7, 8, 9])
    saved(pc, kv, [5, 6, 9, 9, 9, 9])
    assert pc.find([5, 6, 7, 8, 9, 10, 11]) == long
    assert pc.find([5, 6, 7, 8]) == short
    assert pc.find([5, 6, 7, 8, 9]) == long  # the whole request is a prefix of itself
    assert pc.find([5, 6]) is None and pc.find([]) is None
    assert pc.get([5, 6, 7]) == short
    assert pc.get([5, 6, 7, 8]) is None
    assert (pc.counters.hits, pc.counters.misses, pc.counters.saves) == (4, 3, 3)
    # a new instance (a restart) reads the same entries back from disk
    assert cache(tmp_path).find([5, 6, 7, 8, 9, 10]) == long


def test_save_writes_private_files_atomically(tmp_path: Path) -> None:
    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [1, 2, 3, 4])
    assert os.stat(pc.directory).st_mode & 0o777 == 0o700
    assert sorted(os.listdir(pc.directory)) == sorted(
        [entry.name + ".state", entry.name + ".json"]
    )  # no temporary file left
    for path in (entry.state_path, entry.sidecar_path):
        assert path.stat().st_mode & 0o777 == 0o600
    doc = json.loads(entry.sidecar_path.read_text())
    assert doc["tokens"] == [1, 2, 3, 4] and doc["key"] == KEY.to_json()
    assert doc["state_bytes"] == entry.state_path.stat().st_size == 12 + 16 + 4 * 64
    assert entry.disk_bytes == pc.total_bytes
    # saving the same prompt again rewrites nothing
    kv.prefill(0, [1, 2, 3, 4])
    assert pc.save(kv, 0, [1, 2, 3, 4]) is not None and pc.counters.saves == 1


def test_save_refuses_a_sequence_that_does_not_hold_the_prompt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pc, kv = cache(tmp_path), Handles()
    kv.prefill(0, [1, 2, 3])
    with caplog.at_level(logging.WARNING):
        assert pc.save(kv, 0, [1, 2, 3, 4]) is None
    assert "holds positions up to 2" in caplog.text
    assert pc.save(kv, 0, []) is None
    assert os.listdir(pc.directory) == []


def test_least_recently_used_entries_go_first_to_stay_within_max_bytes(tmp_path: Path) -> None:
    kv = Handles()
    probe = saved(cache(tmp_path / "probe"), kv, [1] * 10)
    pc = cache(tmp_path, max_bytes=int(probe.disk_bytes * 2.5))  # room for two
    a = saved(pc, kv, [1] * 10)
    b = saved(pc, kv, [2] * 10)
    assert pc.load(kv, 3, a)  # a is now more recent than b
    c = saved(pc, kv, [3] * 10)
    assert [e.name for e in pc.entries()] == [c.name, a.name]
    assert not b.state_path.exists() and not b.sidecar_path.exists()
    assert pc.counters.evicted == 1 and pc.total_bytes <= pc.max_bytes
    # the order survives a restart: last-used times are in the sidecars
    again = cache(tmp_path, max_bytes=pc.max_bytes)
    saved(again, kv, [4] * 10)
    assert {e.tokens[0] for e in again.entries()} == {3, 4}


def test_an_entry_larger_than_max_bytes_alone_is_not_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kv = Handles()
    probe = saved(cache(tmp_path / "probe"), kv, [1])
    pc = cache(tmp_path, max_bytes=probe.disk_bytes + 100)
    small = saved(pc, kv, [1])
    kv.prefill(0, [2] * 10)
    with caplog.at_level(logging.WARNING):
        assert pc.save(kv, 0, [2] * 10) is None
    assert "more than max_bytes" in caplog.text
    assert pc.entries() == [small] and sorted(os.listdir(pc.directory)) == sorted(
        [small.name + ".state", small.name + ".json"]
    )


# -- load and verification ----------------------------------------------------------------


def test_load_restores_the_tokens_into_an_empty_sequence(tmp_path: Path) -> None:
    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [7, 8, 9])
    assert pc.load(kv, 1, entry)
    assert kv.lib.seqs[1] == [7, 8, 9] and pc.counters.loads == 1
    assert kv.lib.loaded[-1].startswith(b"/proc/self/fd/")  # the very file verified
    assert pc.get([7, 8, 9]).last_used > entry.last_used  # type: ignore[union-attr]
    # a sequence that holds cells is not overwritten
    assert not pc.load(kv, 1, entry)
    assert kv.lib.seqs[1] == [7, 8, 9]


def test_altered_or_truncated_state_is_refused_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [7, 8, 9])
    data = bytearray(entry.state_path.read_bytes())
    data[-5] ^= 0x01  # same size, one bit off
    entry.state_path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert not pc.load(kv, 0, entry)
    assert str(entry.state_path) in caplog.text and "SHA-256" in caplog.text
    assert kv.lib.loaded == [] and 0 not in kv.lib.seqs  # llama.cpp never saw it
    assert not entry.state_path.exists() and pc.entries() == []  # ours: removed
    assert pc.counters.rejected == 1

    other = saved(pc, kv, [1, 2])
    other.state_path.write_bytes(other.state_path.read_bytes()[:-10])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert not pc.load(kv, 0, other)
    assert "bytes, the sidecar says" in caplog.text
    # and a restart skips a truncated file without hashing it
    third = saved(pc, kv, [3, 4])
    third.state_path.write_bytes(b"short")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert cache(tmp_path).find([3, 4, 5]) is None
    assert str(third.sidecar_path) in caplog.text


def test_corrupt_sidecar_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pc, kv = cache(tmp_path), Handles()
    good = saved(pc, kv, [1, 2, 3])
    bad = saved(pc, kv, [4, 5, 6])
    forged = saved(pc, kv, [7, 8, 9])
    bad.sidecar_path.write_text('{"key": ')
    doc = json.loads(forged.sidecar_path.read_text())
    doc["tokens"] = [7, 8, 10]  # tokens that do not give the file's name
    forged.sidecar_path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING):
        again = cache(tmp_path)
    assert [e.tokens for e in again.entries()] == [good.tokens]
    assert str(bad.sidecar_path) in caplog.text and str(forged.sidecar_path) in caplog.text
    assert again.counters.rejected == 2
    assert not bad.state_path.exists() and not forged.state_path.exists()
    # a sidecar damaged after the scan is caught when the entry is loaded
    good.sidecar_path.write_text("[]")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert not again.load(kv, 0, again.entries()[0])
    assert "sidecar" in caplog.text and kv.lib.loaded == []


def test_another_keys_entries_are_not_found_nor_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kv = Handles()
    mine = saved(cache(tmp_path), kv, [1, 2, 3])
    other = cache(tmp_path, key=replace(KEY, type_k="q8_0", type_v="q8_0"))
    assert other.find([1, 2, 3, 4]) is None and other.get([1, 2, 3]) is None
    assert other.entries() == [] and other.total_bytes == mine.disk_bytes  # it still counts
    with caplog.at_level(logging.WARNING):
        assert not other.load(kv, 0, mine)
    assert "another model or context" in caplog.text and kv.lib.loaded == []
    assert mine.state_path.exists()  # not ours to judge: kept


def test_entries_of_another_format_are_left_alone(tmp_path: Path) -> None:
    kv = Handles()
    entry = saved(cache(tmp_path), kv, [1, 2, 3])
    doc = json.loads(entry.sidecar_path.read_text())
    doc["key"]["format"] = 99
    doc["extra"] = "from a newer version"
    entry.sidecar_path.write_text(json.dumps(doc))
    again = cache(tmp_path)
    assert again.entries() == [] and again.counters.rejected == 0
    assert entry.sidecar_path.exists() and entry.state_path.exists()


@pytest.mark.parametrize("which", ["state", "sidecar"])
@pytest.mark.parametrize("how", ["group-writable", "world-writable", "other-owner", "symlink"])
def test_a_file_someone_else_could_write_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, which: str, how: str
) -> None:
    if how == "other-owner" and os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [1, 2, 3])
    path = entry.state_path if which == "state" else entry.sidecar_path
    if how == "group-writable":
        os.chmod(path, 0o620)
    elif how == "world-writable":
        os.chmod(path, 0o602)
    elif how == "other-owner":
        os.chown(path, 54321, 54321)
    else:
        real = tmp_path / "elsewhere"
        path.rename(real)
        path.symlink_to(real)
    with caplog.at_level(logging.WARNING):
        assert cache(tmp_path).entries() == []  # a restart skips it...
        assert not pc.load(kv, 0, entry)  # ...and so does a load
    assert kv.lib.loaded == [] and 0 not in kv.lib.seqs
    assert str(path.parent) in caplog.text


def test_a_directory_others_can_write_disables_the_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kv = Handles()
    entry = saved(cache(tmp_path), kv, [1, 2, 3])
    os.chmod(tmp_path / "pc", 0o777)
    with caplog.at_level(logging.WARNING):
        pc = cache(tmp_path)
    assert pc.problem is not None and "writable by group or others" in pc.problem
    assert pc.find([1, 2, 3]) is None and not pc.load(kv, 0, entry)
    kv.prefill(0, [1, 2])
    assert pc.save(kv, 0, [1, 2]) is None
    assert "prompt cache disabled" in caplog.text


def test_a_load_llama_cpp_refuses_leaves_the_sequence_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [1, 2, 3])
    kv.lib.refuse = True
    with caplog.at_level(logging.WARNING):
        assert not pc.load(kv, 2, entry)
    assert "llama.cpp refused it" in caplog.text and 2 not in kv.lib.seqs
    assert entry.state_path.exists()  # the file is fine: the context could not take it


def test_a_state_llama_cpp_refused_is_replaced_by_the_next_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A state whose digest matches but which llama.cpp cannot read (written by another
    llama.cpp, or damaged before it was hashed) is computed again at the next start:
    the save of that prompt writes a new state instead of keeping the refused one."""
    kv = Handles()
    entry = saved(cache(tmp_path), kv, [1, 2, 3])
    data = b"XXXX" + entry.state_path.read_bytes()[4:]  # llama.cpp's magic gone
    entry.state_path.write_bytes(data)
    doc = json.loads(entry.sidecar_path.read_text())
    doc["state_sha256"] = hashlib.sha256(data).hexdigest()
    entry.sidecar_path.write_text(json.dumps(doc))
    pc = cache(tmp_path)  # a restart: the entry passes every check of its own
    found = pc.get([1, 2, 3])
    assert found is not None
    with caplog.at_level(logging.WARNING):
        assert not pc.load(kv, 0, found)
    assert "llama.cpp refused it" in caplog.text and 0 not in kv.lib.seqs
    kv.prefill(0, [1, 2, 3])  # the prompt computed instead
    again = pc.save(kv, 0, [1, 2, 3])
    assert again is not None and pc.counters.saves == 1
    assert entry.state_path.read_bytes()[:4] == MAGIC
    kv.lib.seqs.pop(0)
    restarted = cache(tmp_path)
    restored = restarted.get([1, 2, 3])
    assert restored is not None and restarted.load(kv, 1, restored)
    assert kv.lib.seqs[1] == [1, 2, 3]


def test_a_state_llama_cpp_refused_is_not_offered_again_until_saved_anew(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A refusal is said once: find and get leave that state out afterwards (no failed
    load and no warning per request), until a save of the prompt replaces it; a state
    of another digest under the same name (written since) is offered again."""
    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [1, 2, 3])
    kv.lib.refuse = True
    with caplog.at_level(logging.WARNING):
        assert not pc.load(kv, 0, entry)
    assert caplog.text.count("llama.cpp refused it") == 1
    assert caplog.text.rstrip().endswith("; not trying it again until it is saved anew")
    assert pc.find([1, 2, 3, 4]) is None and pc.get([1, 2, 3]) is None
    assert len(kv.lib.loaded) == 1 and pc.counters.rejected == 1
    kv.lib.refuse = False
    again = saved(pc, kv, [1, 2, 3])  # the prompt computed and saved anew
    assert pc.counters.saves == 2
    assert pc.find([1, 2, 3, 4]) == again and pc.load(kv, 1, again)
    # refused again; another process then saves a state of another digest under that
    # name: offered again once the directory is read again
    kv.lib.refuse = True
    kv.lib.seqs.pop(1)
    assert not pc.load(kv, 1, again) and pc.get([1, 2, 3]) is None
    replace_state(again, b"\0")
    pc.refresh()
    found = pc.get([1, 2, 3])
    assert found is not None and found.state_sha256 != again.state_sha256
    # replaced once more behind the index: the state refused is the one left out
    replace_state(again, b"\1")
    assert not pc.load(kv, 1, found) and pc.get([1, 2, 3]) is None
    assert caplog.text.count("llama.cpp refused it") == 3


def test_a_state_refused_while_the_shared_buffer_was_in_use_is_tried_again_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With one KV buffer for all slots, a state llama.cpp refuses while other
    sequences hold cells may only have found no free cells then: it is left out for
    RETRY_S, then offered (and restored) again."""
    key = replace(KEY, kv_unified=True, n_stream=1)
    pc, kv = cache(tmp_path, key), Handles()
    entry = saved(pc, kv, [1, 2, 3])
    kv.prefill(0, list(range(100, 140)))  # another slot's conversation
    kv.lib.refuse = True
    with caplog.at_level(logging.WARNING):
        assert not pc.load(kv, 1, entry)
    assert caplog.text.rstrip().endswith(
        f"so it may only have found no room: trying it again in {RETRY_S:g} s"
    )
    assert pc.get([1, 2, 3]) is None and pc.find([1, 2, 3, 4]) is None
    assert isinstance(pc.clock, Clock)
    pc.clock.t += RETRY_S
    kv.lib.refuse = False  # the other slot's cells are gone, or room was found
    found = pc.find([1, 2, 3, 4])
    assert found is not None and found.name == entry.name and pc.get([1, 2, 3]) == found
    assert pc.load(kv, 1, found) and kv.lib.seqs[1] == [1, 2, 3]
    assert entry.state_path.exists() and pc.counters.rejected == 1


@pytest.mark.parametrize("unified", [False, True], ids=["kv-per-slot", "kv-unified-empty"])
def test_a_state_refused_with_room_to_spare_is_not_tried_again(
    tmp_path: Path, unified: bool
) -> None:
    """A refusal that no other sequence can have caused (each slot has a KV stream of
    its own, or nothing else held cells of the shared buffer) stays a refusal."""
    key = replace(KEY, kv_unified=True, n_stream=1) if unified else KEY
    pc, kv = cache(tmp_path, key), Handles()
    entry = saved(pc, kv, [1, 2, 3])
    if not unified:
        kv.prefill(0, list(range(100, 140)))  # in a stream of its own
    kv.lib.refuse = True
    assert not pc.load(kv, 1, entry)
    assert isinstance(pc.clock, Clock)
    pc.clock.t += 100 * RETRY_S
    kv.lib.refuse = False
    assert pc.get([1, 2, 3]) is None and pc.find([1, 2, 3, 4]) is None


def replace_state(entry: Entry, tail: bytes) -> None:
    """Another process's state under ``entry``'s name: other bytes, a sidecar to match."""
    data = entry.state_path.read_bytes() + tail
    entry.state_path.write_bytes(data)
    doc = json.loads(entry.sidecar_path.read_text())
    doc["state_sha256"], doc["state_bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    entry.sidecar_path.write_text(json.dumps(doc))


def test_a_refusal_quotes_what_llama_cpp_said_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """llama.cpp's own lines about a refused state go into the one warning (the
    first says why, the last only that it failed), not into the log as errors."""
    from orin import llamacpp

    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [1, 2, 3])
    refuse = kv.lib.llama_state_seq_load_file

    def loud(*args: Any) -> int:
        llamacpp._on_log(1, b"state_read_meta: cell_count = 3\n", None)
        llamacpp._on_log(4, b"state_read_data: mismatched key type (8 != 1, layer 0)\n", None)
        llamacpp._on_log(4, b"llama_state_seq_load_file: failed to restore kv cache\n", None)
        return refuse(*args)

    monkeypatch.setattr(kv.lib, "llama_state_seq_load_file", loud)
    kv.lib.refuse = True
    with caplog.at_level(logging.DEBUG):
        assert not pc.load(kv, 0, entry)
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1
    assert warning[0].endswith(
        "llama.cpp refused it: state_read_data: mismatched key type (8 != 1, layer 0); "
        "llama_state_seq_load_file: failed to restore kv cache; "
        "not trying it again until it is saved anew"
    )
    assert not [r for r in caplog.records if r.name == "orin.llama" and r.levelno > logging.DEBUG]


def test_a_file_in_the_way_of_the_directory_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "afile").write_text("x")
    with caplog.at_level(logging.WARNING):
        pc = PromptCache(tmp_path / "afile" / "pc", KEY, 1 << 20)
    assert pc.problem == (
        f"{tmp_path / 'afile' / 'pc'}: cannot create it: {tmp_path / 'afile'} is not a directory"
    )
    assert pc.find([1, 2]) is None


def test_a_prompt_that_is_not_kept_says_why() -> None:
    from orin.engine.specrun import skip_reason

    assert skip_reason(31, 512) is None and skip_reason(512, 512) is None
    assert skip_reason(600, 512) == "600 tokens, more than the context window of a slot (512)"
    assert "1 token(s)" in (skip_reason(1, 512) or "")


def test_files_an_interrupted_save_left_are_removed_once_stale(tmp_path: Path) -> None:
    pc, kv = cache(tmp_path), Handles()
    saved(pc, kv, [1, 2, 3])
    orphan = pc.directory / (entry_name(KEY, [4, 5]) + ".state")
    temp = pc.directory / ".tmp-x.state.1.ab"
    fresh = pc.directory / ".tmp-y.state.1.cd"
    for path in (orphan, temp, fresh):
        path.write_bytes(b"x")
    old = pc.clock() - STALE_S - 10
    for path in (orphan, temp):
        os.utime(path, (old, old))
    pc.refresh()
    assert not orphan.exists() and not temp.exists()
    assert fresh.exists()  # perhaps a save in progress in another process
    assert pc.get([1, 2, 3]) is not None


# -- model digest -------------------------------------------------------------------------


def test_model_digest_is_remembered_until_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    hashed: list[Path] = []
    real = modeldigest.file_sha256

    def counting(path: Path) -> str:
        hashed.append(path)
        return real(path)

    monkeypatch.setattr(modeldigest, "file_sha256", counting)
    memo_dir = tmp_path / "memo"
    first = model_digest(model, memo_dir)
    assert model_digest(model, memo_dir) == first and len(hashed) == 1
    link = tmp_path / "link.gguf"
    link.symlink_to(model)
    assert model_digest(link, memo_dir) == first and len(hashed) == 1  # the resolved path
    assert (memo_dir / "model-digests.json").stat().st_mode & 0o777 == 0o600

    model.write_bytes(b"GGUF" + bytes(range(256)) * 64)  # same bytes, new mtime
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert model_digest(model, memo_dir) == first and len(hashed) == 2
    model.write_bytes(b"GGUF changed")
    assert model_digest(model, memo_dir) != first and len(hashed) == 3

    # a memo someone else could have written is not believed
    os.chmod(memo_dir / "model-digests.json", 0o666)
    assert model_digest(model, memo_dir) == real(model) and len(hashed) == 4


# -- passing errors -------------------------------------------------------------------------


def failing_open(monkeypatch: pytest.MonkeyPatch, path: Path, code: int) -> dict[str, bool]:
    """Opening ``path`` fails with ``code`` while the returned switch is on."""
    real = cachefiles.open_file
    switch = {"on": True}

    def opener(p: Path) -> int:
        if switch["on"] and Path(p) == path:
            raise OSError(code, os.strerror(code), str(p))
        return real(p)

    for module in (cachefiles, promptcache):  # sidecars are read by one, states by the other
        monkeypatch.setattr(module, "open_file", opener)
    return switch


PASSING = [errno.EMFILE, errno.ENOMEM, errno.EINTR, errno.EIO, errno.EACCES]


@pytest.mark.parametrize("code", PASSING, ids=errno.errorcode.get)
@pytest.mark.parametrize("which", ["state", "sidecar"])
def test_a_file_that_cannot_be_opened_now_is_kept_and_loaded_later(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    which: str,
    code: int,
) -> None:
    """Too many open files, no memory, an interrupted call, a flaky card, a permission
    taken away: the entry is not damaged, so it is kept, said once, and tried again."""
    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [1, 2, 3])
    path = entry.state_path if which == "state" else entry.sidecar_path
    switch = failing_open(monkeypatch, path, code)
    with caplog.at_level(logging.DEBUG, logger="orin.engine"):
        assert not pc.load(kv, 0, entry)
        assert entry.state_path.exists() and entry.sidecar_path.exists()
        assert kv.lib.loaded == [] and 0 not in kv.lib.seqs
        assert pc.get([1, 2, 3]) is None and pc.find([1, 2, 3, 4]) is None  # not at once
        assert isinstance(pc.clock, Clock)
        pc.clock.t += RETRY_S
        found = pc.get([1, 2, 3])
        assert found is not None and not pc.load(kv, 0, found)  # still failing: no new warning
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"prompt cache: cannot read {path}: {os.strerror(code)}; kept, trying it again in "
        f"{RETRY_S:g} s"
    ]
    switch["on"] = False
    pc.clock.t += RETRY_S
    found = pc.find([1, 2, 3, 4])
    assert found is not None and pc.load(kv, 0, found) and kv.lib.seqs[0] == [1, 2, 3]


@pytest.mark.parametrize("code", PASSING, ids=errno.errorcode.get)
def test_a_sidecar_that_cannot_be_read_at_start_is_kept_and_read_later(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    code: int,
) -> None:
    kv = Handles()
    entry = saved(cache(tmp_path), kv, [1, 2, 3])
    switch = failing_open(monkeypatch, entry.sidecar_path, code)
    with caplog.at_level(logging.WARNING):
        pc = cache(tmp_path)  # a restart
    assert f"cannot read {entry.sidecar_path}: {os.strerror(code)}; kept" in caplog.text
    assert pc.get([1, 2, 3]) is None and pc.counters.rejected == 0
    assert entry.state_path.exists() and entry.sidecar_path.exists()
    switch["on"] = False
    assert isinstance(pc.clock, Clock)
    pc.clock.t += RETRY_S
    found = pc.find([1, 2, 3, 4])
    assert found is not None and pc.load(kv, 0, found)


def test_an_io_error_while_the_state_is_checked_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read that fails half-way (an NVMe or SD card hiccup) is not a damaged file,
    and it must not fail the engine's step either."""
    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [1, 2, 3])

    def flaky(fd: int) -> Any:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
        yield b""

    monkeypatch.setattr(cachefiles, "blocks", flaky)
    with caplog.at_level(logging.WARNING):
        assert not pc.load(kv, 0, entry)
    assert f"cannot read {entry.state_path}: {os.strerror(errno.EIO)}; kept" in caplog.text
    assert entry.state_path.exists() and entry.sidecar_path.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
@pytest.mark.parametrize("which", ["state", "sidecar"])
def test_a_file_made_unreadable_by_chmod_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, which: str
) -> None:
    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [1, 2, 3])
    path = entry.state_path if which == "state" else entry.sidecar_path
    os.chmod(path, 0)
    with caplog.at_level(logging.WARNING):
        assert not pc.load(kv, 0, entry)
        restarted = cache(tmp_path)  # the sidecar is read at start, the state at a load
        assert (restarted.get([1, 2, 3]) is None) == (which == "sidecar")
    assert f"cannot read {path}: Permission denied; kept" in caplog.text
    os.chmod(path, 0o600)
    assert entry.state_path.exists() and entry.sidecar_path.exists()
    again = cache(tmp_path).get([1, 2, 3])
    assert again is not None and pc.load(kv, 0, again)


# -- power cuts and full disks ----------------------------------------------------------------


def test_a_save_reaches_the_disk_before_its_names_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both files are flushed under their temporary names, then renamed, then the
    directory is flushed: a power cut leaves no name whose bytes never reached the disk."""
    pc, kv = cache(tmp_path), Handles()
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    entry = saved(pc, kv, [1, 2, 3])
    temp = str(pc.directory / ".tmp-") + entry.name
    assert [p.startswith(temp + ".state.") for p in synced[:2]] == [True, False]
    assert synced[1].startswith(temp + ".json.") and synced[2:] == [str(pc.directory)]


def test_a_state_llama_cpp_could_not_flush_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """llama.cpp closes its file without checking the last flush: on a full disk it
    reports every byte written while the file is short. Such a state is not kept."""
    pc, kv = cache(tmp_path), Handles()
    real = kv.lib.llama_state_seq_save_file

    def full_disk(ctx: Any, path: bytes, *args: Any) -> int:
        written = real(ctx, path, *args)
        os.truncate(path, written - 100)
        return written

    monkeypatch.setattr(kv.lib, "llama_state_seq_save_file", full_disk)
    kv.prefill(0, [1, 2, 3])
    with caplog.at_level(logging.WARNING):
        assert pc.save(kv, 0, [1, 2, 3]) is None
    assert "a write was lost: is the disk full?" in caplog.text
    assert os.listdir(pc.directory) == [] and pc.get([1, 2, 3]) is None


def test_a_sidecar_that_cannot_be_written_leaves_no_state_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pc, kv = cache(tmp_path), Handles()

    def full(path: Path, data: bytes, tmp: Path | None = None) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    monkeypatch.setattr(promptcache, "write_atomic", full)
    kv.prefill(0, [1, 2, 3])
    with caplog.at_level(logging.WARNING):
        assert pc.save(kv, 0, [1, 2, 3]) is None
    assert "No space left on device" in caplog.text
    assert os.listdir(pc.directory) == []  # the state's room is given back at once


# -- the size bound -----------------------------------------------------------------------------


def test_two_services_sharing_a_directory_keep_it_within_max_bytes(tmp_path: Path) -> None:
    """Each counts what the other saved: the bound is the directory's, and the least
    recently used of all entries go first, whichever service saved them."""
    kv = Handles()
    probe = saved(cache(tmp_path / "probe"), kv, [1] * 10)
    bound = int(probe.disk_bytes * 2.5)  # room for two
    one = cache(tmp_path, max_bytes=bound)
    two = cache(tmp_path, key=replace(KEY, model_sha256="cd" * 32), max_bytes=bound)
    a = saved(one, kv, [1] * 10)  # both started before anything was saved
    b = saved(two, kv, [2] * 10)
    assert one.load(kv, 1, a)  # a is used after b was saved
    c = saved(two, kv, [3] * 10)
    on_disk = sorted(p.name for p in one.directory.iterdir())
    assert on_disk == sorted(f"{e.name}{s}" for e in (a, c) for s in (".state", ".json"))
    assert sum(p.stat().st_size for p in one.directory.iterdir()) <= bound
    assert not b.sidecar_path.exists() and two.counters.evicted == 1


def test_the_entry_just_restored_is_not_evicted_when_the_clock_went_back(tmp_path: Path) -> None:
    """A board without a kept clock starts at an old time until NTP sets it: the entry
    restored then must still count as the most recently used, not as the oldest."""
    kv = Handles()
    probe = saved(cache(tmp_path / "probe"), kv, [1] * 10)
    bound = int(probe.disk_bytes * 2.5)
    before = cache(tmp_path, max_bytes=bound)
    saved(before, kv, [2] * 10)  # the profile's prompt
    stale = saved(before, kv, [1] * 10)  # another one, used after it
    assert before.load(kv, 1, stale)
    kv.lib.seqs.pop(1)
    behind = Clock()
    behind.t = 1000.0
    after = PromptCache(tmp_path / "pc", KEY, bound, clock=behind)  # the next boot
    restored = after.get([2] * 10)
    assert restored is not None and after.load(kv, 1, restored)
    saved(after, kv, [3] * 10)  # a new prompt: one entry must go
    assert {e.tokens[0] for e in after.entries()} == {2, 3}
    assert not stale.state_path.exists()


def test_a_directory_that_cannot_be_written_is_said_once_not_at_every_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """States computed elsewhere on a read-only file system are restored; only their
    last-use times cannot be recorded, which is one warning, not one per request."""
    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [1, 2, 3])

    def read_only(path: Path, data: bytes, tmp: Path | None = None) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp))

    monkeypatch.setattr(cacheindex, "write_atomic", read_only)
    with caplog.at_level(logging.WARNING):
        for seq in (0, 1, 2):
            assert pc.load(kv, seq, entry)
    assert caplog.text.count("Read-only file system") == 1


def test_a_save_whose_earlier_files_cannot_be_checked_writes_them_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error while the save looks for the files it wrote before is no reason to
    fail the engine's start: the prompt is saved again."""
    pc, kv = cache(tmp_path), Handles()
    entry = saved(pc, kv, [1, 2, 3])
    for name in ("stat", "lstat"):
        real = getattr(Path, name)

        def flaky(self: Path, *args: Any, real: Any = real, **kw: Any) -> os.stat_result:
            if self == entry.state_path:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
            return real(self, *args, **kw)

        monkeypatch.setattr(Path, name, flaky)
    kv.prefill(0, [1, 2, 3])
    assert pc.save(kv, 0, [1, 2, 3]) is not None and pc.counters.saves == 2
