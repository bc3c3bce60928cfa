"""llama.cpp model and context created from an EngineConfig.

Every llama.cpp failure becomes a typed error carrying llama.cpp's own reason
(taken from its log), never a crash: the model file is checked with the GGUF
reader before llama.cpp sees it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from orin.engine.cachekey import resolved_flash_attn
from orin.engine.config import EngineConfig
from orin.engine.errors import BackendError, ContextShiftUnsupported
from orin.llamacpp import capture_log, expected_warnings, llama
from orin.model.gguf import ModelInfo, read_model_info

log = logging.getLogger("orin.engine")

LOAD_MODES = {
    "auto": "LLAMA_LOAD_MODE_AUTO",
    "none": "LLAMA_LOAD_MODE_NONE",
    "mmap": "LLAMA_LOAD_MODE_MMAP",
    "mlock": "LLAMA_LOAD_MODE_MLOCK",
    "mmap+mlock": "LLAMA_LOAD_MODE_MMAP_MLOCK",
    "direct_io": "LLAMA_LOAD_MODE_DIRECT_IO",
}
NUMA = {"disabled": 0, "distribute": 1, "isolate": 2, "numactl": 3, "mirror": 4}
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
_numa_lock = threading.Lock()
_numa_done = False


def _reason(lines: list[str]) -> str:
    """llama.cpp's last error or warning line: the why behind a NULL."""
    text = [ln.strip() for ln in "".join(lines).splitlines() if ln.strip()]
    errors = [ln for ln in text if "error" in ln.lower() or "failed" in ln.lower()]
    return (errors or text or ["no reason given"])[-1]


def ggml_type(name: str) -> int:
    """llama.cpp's ggml_type number of a type name such as ``q8_0``."""
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[name.upper()].value)


class Backend:
    """Owns the llama.cpp model, context, vocabulary and memory handles."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.info: ModelInfo = read_model_info(cfg.model_path)
        self.lib = lib = llama()
        _init_numa(lib, cfg.numa)
        self.model = self._load_model()
        try:
            self.ctx = self._create_context()
        except BaseException:
            lib.llama_model_free(self.model)
            raise
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_seq = int(lib.llama_n_ctx_seq(self.ctx))
        self.can_shift = bool(lib.llama_memory_can_shift(self.memory))
        if cfg.context.sliding and not self.can_shift:
            self.close()
            raise ContextShiftUnsupported(
                f"{cfg.model_path}: this model's KV memory cannot shift positions, so the "
                "sliding window is unavailable; set context.sliding: false (or --window off)"
                + ("" if cfg.swa_full or not cfg.swa_window else ", or engine.swa_full: true")
            )
        self._pieces: dict[int, bytes] = {}
        self._is_eog: dict[int, bool] = {}
        self._eog: tuple[int, ...] | None = None

    def _load_model(self) -> Any:
        lib, cfg = self.lib, self.cfg
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = cfg.gpu_layers if cfg.gpu_layers >= 0 else 0x7FFFFFFF
        mp.load_mode = getattr(lib, LOAD_MODES[cfg.load_mode])
        if cfg.rpc:  # the workers become devices llama.cpp splits the layers across
            from orin.engine.rpc import register_workers

            register_workers(cfg.rpc, self.info.n_layer, cfg.gpu_layers)
        with capture_log() as lines:
            model = lib.llama_model_load_from_file(str(cfg.model_path).encode(), mp)
        if not model:
            raise BackendError(f"{cfg.model_path}: llama.cpp could not load it: {_reason(lines)}")
        return model

    def _create_context(self) -> Any:
        lib, cfg = self.lib, self.cfg
        cp = lib.llama_context_default_params()
        cp.n_ctx = cfg.n_ctx * cfg.slots
        cp.n_seq_max = cfg.slots
        cp.n_batch = cfg.n_batch
        cp.n_ubatch = cfg.n_ubatch
        cp.n_threads = cfg.threads
        cp.n_threads_batch = cfg.threads_batch
        cp.flash_attn_type = FLASH_ATTN[cfg.flash_attn]
        cp.type_k = ggml_type(cfg.type_k)
        cp.type_v = ggml_type(cfg.type_v)
        # one KV stream per slot (a slot never takes another's cells), or one buffer for
        # all (shared prefixes held once, one llama.cpp pass per step): docs/engine.md
        cp.kv_unified = cfg.kv_unified
        cp.swa_full = cfg.swa_full
        cp.no_perf = True
        # pooling for /v1/embeddings: the profile's, else the GGUF's ({arch}.pooling_type);
        # embeddings output stays off except around embedding decodes (set_embeddings)
        cp.pooling_type = getattr(
            lib, f"LLAMA_POOLING_TYPE_{(cfg.pooling or 'unspecified').upper()}"
        )
        cp.embeddings = False
        if cfg.rope_freq_base is not None:
            cp.rope_freq_base = cfg.rope_freq_base
        # llama.cpp warns that a pooling asked for differs from the model's own: the
        # profile asked for it, so it is news, not a warning
        chosen = ("pooling_type",) if cfg.pooling else ()
        with capture_log() as lines, expected_warnings(*chosen):
            ctx = lib.llama_init_from_model(self.model, cp)
        if not ctx:
            raise BackendError(
                f"llama.cpp could not create the context (n_ctx={cfg.n_ctx}x{cfg.slots}, "
                f"K={cfg.type_k}, V={cfg.type_v}, flash_attn={cfg.flash_attn}): {_reason(lines)}"
            )
        # how ``auto`` was resolved (llama.cpp only logs it): keys the prompt cache
        self.flash_attn: bool | None = resolved_flash_attn(lines, cfg.flash_attn)
        return ctx

    # -- vocabulary (immutable after load: safe from any thread) ----------------

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 8
        buf = (self.lib.llama_token * size)()
        n = self.lib.llama_tokenize(
            self.vocab, data, len(data), buf, size, add_special, parse_special
        )
        if n < 0:
            size = -n
            buf = (self.lib.llama_token * size)()
            n = self.lib.llama_tokenize(
                self.vocab, data, len(data), buf, size, add_special, parse_special
            )
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The raw bytes a token stands for (control tokens render as nothing)."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self.lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def special_piece(self, token: int) -> bytes:
        """A token's bytes with control tokens rendered as their text (``<s>``), as
        llama-server's /tokenize and /detokenize show them; not cached (not on the
        generation path)."""
        buf = ctypes.create_string_buffer(64)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, 64, 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, True)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation; remembered per token like ``piece``
        (asked once per generated token: a dict lookup instead of a ctypes call)."""
        known = self._is_eog.get(token)
        if known is None:
            known = self._is_eog[token] = bool(self.lib.llama_vocab_is_eog(self.vocab, token))
        return known

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token; one ctypes call per vocabulary entry, so it
        is computed once per loaded model, when a request first needs it
        (``ignore_eos``). Two threads that ask at once both compute the same answer."""
        eog = self._eog
        if eog is None:
            is_eog, vocab = self.lib.llama_vocab_is_eog, self.vocab
            eog = self._eog = tuple(t for t in range(self.n_vocab) if is_eog(vocab, t))
        return eog

    def chat_template(self) -> str | None:
        raw = self.lib.llama_model_chat_template(self.model, None)
        return raw.decode("utf-8") if raw else None

    # -- embeddings (engine thread) ----------------------------------------------

    @property
    def pooling(self) -> int:
        """The context's pooling type (llama.cpp's enum llama_pooling_type): the
        profile's model.pooling, else the model's own."""
        return int(self.lib.llama_pooling_type(self.ctx))

    @property
    def n_embd_out(self) -> int:
        """The width of a pooled embedding."""
        return int(self.lib.llama_model_n_embd_out(self.model))

    def embed(self, seqs: Sequence[tuple[int, Sequence[int]]]) -> list[npt.NDArray[np.float32]]:
        """The pooled embedding of each (sequence id, tokens), from one llama_decode,
        as raw (unnormalized) copies; every sequence must be empty and at most
        n_ubatch tokens long.

        Embeddings output is switched on for this decode only, and the sequences'
        cells are removed before returning, whatever happens. Every token is marked
        as an output (llama.cpp wants them all when embedding). The sequences go in
        decreasing id order: with one KV stream per sequence llama.cpp splits a
        batch into micro-batches of consecutive increasing ids and equal lengths,
        and pools each sequence per micro-batch, so in this order every sequence is
        pooled whole in a micro-batch of its own.
        """
        lib, ctx = self.lib, self.ctx
        ordered = sorted(seqs, key=lambda s: -s[0])
        n_tokens = sum(len(t) for _, t in ordered)
        batch = lib.llama_batch_init(max(n_tokens, 1), 0, 1)
        lib.llama_set_embeddings(ctx, True)
        try:
            n = 0
            for seq, tokens in ordered:
                for pos, token in enumerate(tokens):
                    batch.token[n] = token
                    batch.pos[n] = pos
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = seq
                    batch.logits[n] = True
                    n += 1
            batch.n_tokens = n
            ret = lib.llama_decode(ctx, batch)
            lib.llama_synchronize(ctx)
            if ret != 0:
                raise BackendError(f"llama_decode failed with status {ret} on an embedding pass")
            width = self.n_embd_out
            out = []
            for seq, _ in seqs:
                ptr = lib.llama_get_embeddings_seq(ctx, seq)
                if not ptr:
                    raise BackendError(f"llama.cpp returned no embedding for sequence {seq}")
                out.append(np.ctypeslib.as_array(ptr, shape=(width,)).copy())
            return out
        finally:
            lib.llama_set_embeddings(ctx, False)
            for seq, _ in seqs:
                lib.llama_memory_seq_rm(self.memory, seq, 0, -1)
            lib.llama_batch_free(batch)

    def close(self) -> None:
        """Free the context and the model (idempotent)."""
        ctx, self.ctx = getattr(self, "ctx", None), None
        if ctx:
            self.lib.llama_free(ctx)
        model, self.model = getattr(self, "model", None), None
        if model:
            self.lib.llama_model_free(model)


def _init_numa(lib: Any, strategy: str) -> None:
    """llama.cpp's NUMA setting is process-wide and may be set once."""
    global _numa_done
    if strategy == "disabled":
        return
    with _numa_lock:
        if not _numa_done:
            lib.llama_numa_init(NUMA[strategy])
            _numa_done = True
