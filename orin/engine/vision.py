"""Images in prompts through llama.cpp's multimodal library (tools/mtmd).

The engine thread owns the mtmd context next to the llama context. A request's
prompt text carries one ``MEDIA_MARKER`` per image; ``Vision.tokenize`` (any
thread: it only preprocesses pixels) splits it into text tokens and image
chunks. In the prompt the scheduler sees, an image of n tokens is n negative
ids derived from a hash of its pixels (``image_ids``), so:

* the scheduler stays token-based: prefix reuse, copies between slots and the
  chunk budget work on images unchanged, and a repeated image followed by a
  new question reuses its cells the way llama-server's image chunk ids do;
* a prompt chunk never mixes text with image rows (``is_image``; the
  scheduler cuts chunks where the kind changes), so a step's image items go
  into one ``llama_batch`` of embeddings and its text into another.

An image is encoded lazily, on the engine thread, in the first step that feeds
one of its rows (``MediaPrompt.rows``): its own phase of that step. The
embeddings stay with the prompt (all of a request's choices share it) until
the request ends, so a chunk cut in the middle of an image, or fed again after
an aborted step, does not encode it twice.

Only projectors whose image tokens take one position each with causal
attention are served (LLaVA-style and most others); those that need
non-causal attention over an image or M-RoPE positions (Gemma 3, Qwen-VL) are
refused when the model loads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import secrets
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from orin.engine.errors import BackendError, InvalidRequest
from orin.llamacpp import capture_log, llama

log = logging.getLogger("orin.engine")

MEDIA_MARKER = f"<__media_{secrets.token_hex(8)}__>"
"""Where an image goes in the rendered prompt text (mtmd's marker, set for each
context). Not mtmd's default ``<__media__>``: one no client can know, so a message
whose text says ``<__media__>`` (a question about llama.cpp) beside an image is
served as written instead of refused for a marker without an image."""

_ID_SPAN = 1 << 20  # image tokens one image may have at most (ids of one image)
_ID_BITS = 128  # of the image's SHA-256 in every one of its ids
_CHUNK_TEXT, _CHUNK_IMAGE = 0, 1  # mtmd_input_chunk_type


def is_image(token: int) -> bool:
    """Whether a prompt id stands for an image row rather than a vocabulary token."""
    return token < 0


def image_ids(digest: bytes, n: int) -> list[int]:
    """The ``n`` prompt ids of an image with this hash: negative, distinct per
    image and row, the same for the same pixels (the prefix cache's key).

    Every id carries 128 bits of the hash, so that a prefix match of even one row
    means the same pixels: with fewer (40 bits were once used), whoever knows
    another client's image could make one whose ids collide with it in reach of a
    GPU and be served that client's cached cells. The ids are Python ints (up to
    2**148) and never leave the scheduler's lists: image rows go to llama.cpp as
    embeddings, and a prompt with images is neither saved to the prompt cache nor
    scored nor drafted from."""
    if n > _ID_SPAN:
        raise InvalidRequest("messages", f"an image of {n} tokens; at most {_ID_SPAN}")
    base = int.from_bytes(digest[: _ID_BITS // 8], "big") * _ID_SPAN
    return [-(base + i + 1) for i in range(n)]


@dataclass(frozen=True)
class RGBImage:
    """A decoded picture: width x height RGB pixels, 3 bytes each, row by row."""

    width: int
    height: int
    pixels: bytes

    @functools.cached_property
    def digest(self) -> bytes:
        h = hashlib.sha256()
        h.update(f"{self.width}x{self.height}:".encode())
        h.update(self.pixels)
        return h.digest()


@dataclass
class ImageSpan:
    """One image of a prompt: where its ids start, how many, and its embeddings
    once encoded (rows x n_embd float32)."""

    start: int
    ids: list[int]
    chunk: Any  # an mtmd_input_chunk this span owns (freed with the prompt)
    embeddings: npt.NDArray[np.float32] | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


@dataclass
class MediaPrompt:
    """A prompt with images: ``tokens`` is what the scheduler sees (image rows as
    negative ids), ``spans`` the images behind them."""

    tokens: list[int]
    spans: list[ImageSpan]
    _where: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for k, span in enumerate(self.spans):
            for row, t in enumerate(span.ids):
                self._where[t] = (k, row)

    def locate(self, ids: Sequence[int]) -> list[tuple[ImageSpan, int, int]]:
        """The images behind a run of image ids, in order: each one's span, the row of
        its first id in the run and how many of its rows the run holds. A run goes on
        from one image into the next where two images follow each other in the prompt
        (two image parts with no text between); the same image twice has the same ids,
        and either span gives its rows."""
        out: list[tuple[ImageSpan, int, int]] = []
        i = 0
        while i < len(ids):
            where = self._where.get(ids[i])
            if where is None:
                raise BackendError(f"image id {ids[i]} is not part of this prompt")
            span, row = self.spans[where[0]], where[1]
            n = min(len(ids) - i, span.n_tokens - row)
            if list(ids[i : i + n]) != span.ids[row : row + n]:
                raise BackendError("a prompt chunk holds an image's rows out of order")
            out.append((span, row, n))
            i += n
        return out

    @property
    def image_tokens(self) -> int:
        return sum(s.n_tokens for s in self.spans)


class Vision:
    """The mtmd context of a loaded model (engine thread for ``encode``)."""

    def __init__(self, path: Path, model: Any, threads: int, use_gpu: bool, n_embd: int) -> None:
        self.path = Path(path)
        self.n_embd = n_embd
        self.mtmd = _mtmd()
        m = self.mtmd
        params = m.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = max(1, threads)
        params.print_timings = False
        params.warmup = True  # the first image is not slower than the others
        params.media_marker = MEDIA_MARKER.encode()
        with capture_log() as lines:
            ctx = m.mtmd_init_from_file(str(self.path).encode(), model, params)
        if not ctx:
            raise BackendError(
                f"{self.path}: llama.cpp could not load the projector: {_why(lines)}"
            )
        self.ctx = ctx
        try:
            if not m.mtmd_support_vision(ctx):
                raise BackendError(f"{self.path}: this projector has no vision encoder")
            if m.mtmd_decode_use_non_causal(ctx, None):
                raise BackendError(
                    f"{self.path}: this projector needs non-causal attention over an image, "
                    "which the engine does not support"
                )
            if m.mtmd_decode_use_mrope(ctx):
                raise BackendError(
                    f"{self.path}: this projector places image tokens with M-RoPE "
                    "positions, which the engine does not support"
                )
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()  # tokenize runs on worker threads; encode does not

    def tokenize(self, text: str, images: Sequence[RGBImage], add_special: bool) -> MediaPrompt:
        """Split ``text`` (one MEDIA_MARKER per image) into text tokens and image chunks;
        InvalidRequest when the markers and images do not pair up, or the prompt ends
        with an image (its last position must be text: its logits start the answer)."""
        m = self.mtmd
        if text.count(MEDIA_MARKER) != len(images):
            raise InvalidRequest(
                "messages",
                f"the prompt has {text.count(MEDIA_MARKER)} image markers for {len(images)} images",
            )
        bitmaps = []
        keep: list[Any] = []
        chunks = m.mtmd_input_chunks_init()
        try:
            for img in images:
                data = (ctypes.c_ubyte * len(img.pixels)).from_buffer_copy(img.pixels)
                keep.append(data)
                bm = m.mtmd_bitmap_init(img.width, img.height, data)
                if not bm:
                    raise InvalidRequest("messages", "llama.cpp could not take an image")
                bitmaps.append(bm)
                m.mtmd_bitmap_set_id(bm, img.digest.hex().encode())
            raw = text.encode()
            inp = m.mtmd_input_text()
            inp.text, inp.text_len = raw, len(raw)
            inp.add_special, inp.parse_special = add_special, True
            arr = (m.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            with self._lock:
                rc = m.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc != 0:
                raise InvalidRequest("messages", f"llama.cpp could not tokenize the images ({rc})")
            return self._prompt(chunks, images)
        finally:
            m.mtmd_input_chunks_free(chunks)
            for bm in bitmaps:
                m.mtmd_bitmap_free(bm)

    def _prompt(self, chunks: Any, images: Sequence[RGBImage]) -> MediaPrompt:
        m = self.mtmd
        tokens: list[int] = []
        spans: list[ImageSpan] = []
        digests = iter([img.digest for img in images])
        for i in range(m.mtmd_input_chunks_size(chunks)):
            chunk = m.mtmd_input_chunks_get(chunks, i)
            kind = m.mtmd_input_chunk_get_type(chunk)
            if kind == _CHUNK_TEXT:
                n = ctypes.c_size_t()
                ptr = m.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                tokens.extend(ptr[j] for j in range(n.value))
            elif kind == _CHUNK_IMAGE:
                n_tokens = int(m.mtmd_input_chunk_get_n_tokens(chunk))
                if int(m.mtmd_input_chunk_get_n_pos(chunk)) != n_tokens:
                    raise InvalidRequest("messages", "this projector's image positions differ")
                if m.mtmd_decode_use_non_causal(self.ctx, chunk):
                    raise InvalidRequest(
                        "messages", "this projector needs non-causal attention over an image"
                    )
                ids = image_ids(next(digests), n_tokens)
                own = m.mtmd_input_chunk_copy(chunk)
                spans.append(ImageSpan(len(tokens), ids, own))
                tokens.extend(ids)
            else:
                raise InvalidRequest("messages", "only images are supported as media")
        if not tokens or is_image(tokens[-1]):
            raise InvalidRequest("messages", "the prompt must end with text after its last image")
        prompt = MediaPrompt(tokens, spans)
        weakref.finalize(prompt, _free_chunks, m, [s.chunk for s in spans])
        return prompt

    def encode(self, span: ImageSpan) -> npt.NDArray[np.float32]:
        """The image's embeddings (engine thread), encoded now unless they already are."""
        if span.embeddings is not None:
            return span.embeddings
        m = self.mtmd
        with capture_log() as lines:
            rc = m.mtmd_encode_chunk(self.ctx, span.chunk)
        if rc != 0:
            raise BackendError(f"llama.cpp could not encode an image: {_why(lines)}")
        ptr = m.mtmd_get_output_embd(self.ctx)
        if not ptr:
            raise BackendError("llama.cpp encoded an image but returned no embeddings")
        rows = np.ctypeslib.as_array(ptr, shape=(span.n_tokens * self.n_embd,))
        span.embeddings = rows.reshape(span.n_tokens, self.n_embd).copy()
        return span.embeddings

    def close(self) -> None:
        if self.ctx:
            self.mtmd.mtmd_free(self.ctx)
            self.ctx = None


_recent: deque[str] = deque(maxlen=32)  # mtmd's last log lines: the why of a failure
_mtmd_log_cb: Any = None  # keeps the ctypes callback alive
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_llama_log = logging.getLogger("orin.llama")


def _on_mtmd_log(level: int, text: bytes, _user: Any) -> None:
    """mtmd's own log (it does not go through llama.cpp's callback) into Python logging:
    clip.cpp reports every image it preprocesses at its info level, so all but warnings
    and errors go to debug."""
    line = text.decode("utf-8", errors="replace").rstrip("\n")
    if line.strip():
        _recent.append(line)
        lvl = _LEVELS.get(level, logging.DEBUG)
        _llama_log.log(lvl if lvl >= logging.WARNING else logging.DEBUG, "%s", line)


def _free_chunks(m: ModuleType, chunks: list[Any]) -> None:
    for chunk in chunks:
        m.mtmd_input_chunk_free(chunk)


def _mtmd() -> ModuleType:
    llama()  # llama.cpp's log routed and its backends loaded first
    try:
        from llama_cpp import mtmd_cpp
    except (ImportError, OSError) as exc:
        raise BackendError(f"this llama-cpp-python build has no multimodal library: {exc}") from exc
    global _mtmd_log_cb
    if _mtmd_log_cb is None:
        _mtmd_log_cb = llama().llama_log_callback(_on_mtmd_log)
        mtmd_cpp.mtmd_log_set(_mtmd_log_cb, None)
        mtmd_cpp.mtmd_helper_log_set(_mtmd_log_cb, None)
    return mtmd_cpp


def _why(lines: list[str]) -> str:
    text = [ln.strip() for ln in [*"".join(lines).splitlines(), *_recent] if ln.strip()]
    errors = [ln for ln in text if "error" in ln.lower() or "fail" in ln.lower()]
    return (errors or text or ["no reason given"])[-1]
