"""Deterministic random-weight llama models that llama.cpp loads and runs.

Every test of the project and the demo server needs a real GGUF model, and
none may be downloaded, so they are generated: a seeded numpy Generator fills
f32 tensors laid out exactly as llama.cpp's llama loader expects, gguf's
writer stores them with a trained SentencePiece-style vocabulary and a ChatML
template, and llama.cpp's own quantizer turns the f32 file into the asked
type. Same size, quant and seed always give a byte-identical file.

The weights are random but not shapeless. Tests compare greedy output token
for token between code paths (batched vs sequential, f16 vs quantized KV), so
greedy decoding must not hinge on rounding. Each token's embedding is read
out by the output matrix as one designated successor, with all successors of
normal tokens forming a single cycle through the vocabulary; the inner
layers, initialised much smaller, only shift logits by context. That gives a
top-1 logit several units above the runner-up at every step, long
non-repeating greedy output, and a softmax still wide enough that sampling
with a temperature varies with the seed. A fixed direction shared by all
embeddings lets control, unknown and byte tokens get strongly negative
logits, so a model never ends (EOS, ``<|im_end|>``) or emits raw bytes by
itself: generation always runs to max_tokens.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from orin.errors import DemoModelError, os_error_text
from orin.llamacpp import capture_log, llama
from orin.model import vocab as vocab_mod
from orin.paths import models_cache_dir

FORMAT_VERSION = 2
"""Part of cached file names: bump on any change to weights, vocab, corpus or metadata."""

ARCH = "llama"
RMS_EPS = 1e-5

# Weight design (see module docstring). Logit scales are for the un-quantized model.
TOP_LOGIT = 8.0  # the successor's logit; the runner-up sits several units lower
BLOCK_LOGIT = -25.0  # logit of control/unknown/byte tokens
COMMON = 0.6  # norm of the shared embedding direction relative to the random part
RESIDUAL_GAIN = 0.25  # total norm of all layer outputs relative to an embedding
QK_GAIN = 2.0  # q/k entry variance; scaled scores then have std ~2: peaked, position-aware heads
MARGIN_GOAL = 0.5  # wanted runner-up gap, as a fraction of the median top logit
MARGIN_ROUNDS = 200
MARGIN_STEP = 0.05


@dataclass(frozen=True)
class DemoShape:
    """Hyperparameters of one demo size; n_vocab comes from the shared vocabulary.

    head_dim is stored (as llama.attention.key_length/value_length) rather than
    derived from n_embd / n_head: quantized KV caches need it to be a multiple
    of the 32-value block, and CUDA's flash-attention kernels exist only for
    head sizes such as 64 and 128, which a 64-wide tiny model could otherwise
    not have together with grouped-query attention.
    """

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    rope_freq_base: float = 10000.0
    head_dim: int = 64


SIZES: dict[str, DemoShape] = {
    # < 1 MB even in f32 (2 heads of 64 over a 64-wide model, as Gemma does it);
    # rows of 64 are too short for k-quants, which fall back to 32-blocks.
    "tiny": DemoShape(n_embd=64, n_layer=2, n_head=2, n_head_kv=1, n_ff=128, n_ctx_train=4096),
    # Every row a multiple of 256, so k-quant files really hold k-quant tensors.
    "small": DemoShape(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, n_ff=512, n_ctx_train=4096),
    # ~100 MB in f16: big enough for throughput and memory measurements.
    "medium": DemoShape(n_embd=768, n_layer=8, n_head=12, n_head_kv=4, n_ff=2048, n_ctx_train=8192),
}

# llama.cpp's llama_ftype values (include/llama.h), kept literal so importing this
# module does not load llama.cpp.
QUANTS: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q8_0": 7,
    "q5_0": 8,
    "q5_1": 9,
    "q3_k_m": 12,
    "q4_k_s": 14,
    "q4_k_m": 15,
    "q5_k_s": 16,
    "q5_k_m": 17,
    "q6_k": 18,
    "iq4_nl": 25,
    "bf16": 32,
}


def _check(size: str, quant: str) -> tuple[DemoShape, int]:
    if size not in SIZES:
        raise DemoModelError(f"unknown demo model size {size!r}; valid: {', '.join(SIZES)}")
    if quant not in QUANTS:
        raise DemoModelError(f"unknown demo model quant {quant!r}; valid: {', '.join(QUANTS)}")
    return SIZES[size], QUANTS[quant]


def file_name(size: str, quant: str) -> str:
    """Cache file name; carries FORMAT_VERSION so a changed generator never reuses old files."""
    _check(size, quant)
    return f"orin-demo-{size}-{quant}-v{FORMAT_VERSION}.gguf"


def ensure(size: str, quant: str, cache: Path | None = None) -> Path:
    """The cached demo model (seed 0), generated on first use.

    Concurrent callers may both generate; each renames a complete file into
    place, and the files are identical, so readers never see a partial one.
    """
    path = (cache if cache is not None else models_cache_dir()) / file_name(size, quant)
    if path.is_file():
        return path
    return generate(size, quant, path)  # which makes the folder


def generate(size: str, quant: str, out: Path, seed: int = 0) -> Path:
    """Write the demo model to out atomically (temp file in the same folder, then rename)."""
    shape, ftype = _check(size, quant)
    if not 0 <= seed < 2**32:
        raise DemoModelError(f"demo model seed must be in [0, 2**32), not {seed}")
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with _temp_path(out, ".f32") as raw:
            _write_f32(raw, size, shape, seed)
            if ftype == QUANTS["f32"]:
                _publish(raw, out)
            else:
                with _temp_path(out, f".{quant}") as quantized:
                    _quantize(raw, quantized, ftype)
                    _publish(quantized, out)
    except OSError as exc:  # a cache folder under a file, a full or read-only disk
        where = f" {exc.filename}:" if exc.filename else ""
        raise DemoModelError(
            f"cannot write the demo model {out}:{where} {os_error_text(exc.strerror or str(exc))}"
        ) from exc
    return out


@contextlib.contextmanager
def _temp_path(out: Path, tag: str) -> Iterator[Path]:
    """A fresh path next to out, removed afterwards unless it was renamed away."""
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=f"{tag}.tmp", dir=out.parent)
    os.close(fd)
    path = Path(name)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _publish(src: Path, out: Path) -> None:
    with open(src, "rb+") as f:
        os.fsync(f.fileno())
    os.chmod(src, 0o644)  # mkstemp makes 0600; cached models are shared like any file
    os.replace(src, out)


class _DemoteWhileQuantizing(logging.Filter):
    """Turns llama.cpp's per-tensor quantizer report into debug records.

    The report is noise for a generated model, and its warnings are expected
    (tiny rows are too short for k-quants, so llama.cpp falls back). Only
    records from a thread inside ``_quantize`` are demoted.
    """

    active = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self.active, "on", False):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


_demote = _DemoteWhileQuantizing()


def convert(src: Path, out: Path, quant: str) -> Path:
    """``src`` (any GGUF model) converted to ``quant`` by llama.cpp's quantizer and
    written to ``out`` atomically. A quantized source is dequantized first, so going
    to a type with as many bits or more (q4_1 to f16 or q8_0) keeps its weights up
    to rounding, and going to fewer bits loses precision. Benchmarks use it to run
    one model's weights in a format with other CPU kernels."""
    if quant not in QUANTS or quant == "f32":
        valid = ", ".join(q for q in QUANTS if q != "f32")
        raise DemoModelError(f"unknown conversion type {quant!r}; valid: {valid}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _temp_path(out, f".{quant}") as converted:
        _quantize(Path(src), converted, QUANTS[quant], requantize=True, what=Path(src).name)
        _publish(converted, out)
    return out


def _quantize(
    src: Path, dst: Path, ftype: int, requantize: bool = False, what: str = "the demo model"
) -> None:
    """Convert with llama.cpp's own quantizer, which also sets general.file_type."""
    lib = llama()
    params = lib.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = requantize
    params.nthread = max(1, min(os.cpu_count() or 1, 8))
    logger = logging.getLogger("orin.llama")
    if _demote not in logger.filters:
        logger.addFilter(_demote)
    _demote.active.on = True
    try:
        with capture_log() as lines:
            rc = lib.llama_model_quantize(
                str(src).encode(), str(dst).encode(), ctypes.byref(params)
            )
    finally:
        _demote.active.on = False
    if rc != 0:
        said = [ln.strip() for ln in lines if ln.strip()]
        detail = next((ln for ln in reversed(said) if "fail" in ln or "error" in ln), "")
        raise DemoModelError(f"llama.cpp could not quantize {what} to ftype {ftype}: {detail}")


def _write_f32(path: Path, size: str, shape: DemoShape, seed: int) -> None:
    voc = vocab_mod.build_vocab()
    writer = gguf.GGUFWriter(path, ARCH)
    _add_model_metadata(writer, size, shape, len(voc), seed)
    _add_tokenizer_metadata(writer, voc)
    for name, tensor in weights(shape, voc, seed).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_model_metadata(
    w: gguf.GGUFWriter, size: str, shape: DemoShape, n_vocab: int, seed: int
) -> None:
    w.add_name(f"orin-llm demo {size}")
    w.add_file_type(QUANTS["f32"])
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_freq_base(shape.rope_freq_base)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(n_vocab)
    w.add_uint32("orin_llm.demo.format_version", FORMAT_VERSION)
    w.add_string("orin_llm.demo.size", size)
    w.add_uint32("orin_llm.demo.seed", seed)


def _add_tokenizer_metadata(w: gguf.GGUFWriter, voc: vocab_mod.Vocab) -> None:
    w.add_tokenizer_model("llama")
    w.add_token_list(list(voc.tokens))
    w.add_token_scores(list(voc.scores))
    w.add_token_types([int(t) for t in voc.types])
    w.add_bos_token_id(vocab_mod.BOS_ID)
    w.add_eos_token_id(vocab_mod.EOS_ID)
    w.add_unk_token_id(vocab_mod.UNK_ID)
    w.add_eot_token_id(vocab_mod.IM_END_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(vocab_mod.CHAT_TEMPLATE)


def weights(shape: DemoShape, voc: vocab_mod.Vocab, seed: int) -> dict[str, np.ndarray]:
    """All tensors, f32, named and shaped (rows = ne1, columns = ne0) for llama.cpp."""
    rng = np.random.default_rng(seed)
    n, n_vocab = shape.n_embd, len(voc)
    signs = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    common = (signs / np.sqrt(n)).astype(np.float32)  # the shared unit direction
    embd = _perp(_normal(rng, n_vocab, n, 1.0), common)
    successor = _successors(rng, voc)
    out: dict[str, np.ndarray] = {"token_embd.weight": embd + COMMON * np.sqrt(n) * common}
    for layer in range(shape.n_layer):
        for name, tensor in _block(rng, shape, common).items():
            out[f"blk.{layer}.{name}.weight"] = tensor
    out["output_norm.weight"] = np.ones(n)
    out["output.weight"] = _readout(embd, successor, common, voc)
    return {name: t.astype(np.float32) for name, t in out.items()}


def _normal(rng: np.random.Generator, rows: int, cols: int, var: float) -> np.ndarray:
    return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(np.sqrt(var))


def _perp(rows: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """rows with their component along the unit vector direction removed."""
    return rows - np.outer((rows * direction).sum(axis=1), direction)


def _successors(rng: np.random.Generator, voc: vocab_mod.Vocab) -> np.ndarray:
    """The token greedy decoding emits after each token.

    Normal tokens form one cycle, so greedy output runs through the whole
    vocabulary before repeating; every other token leads into the cycle.
    """
    normal = np.array(voc.normal_ids)
    order = rng.permutation(normal)
    successor = rng.choice(normal, size=len(voc))
    successor[order] = np.roll(order, -1)
    return successor


def _readout(
    embd: np.ndarray, successor: np.ndarray, common: np.ndarray, voc: vocab_mod.Vocab
) -> np.ndarray:
    """Output matrix: each token's successor row points along that token's embedding.

    Rows of normal tokens are scaled so the successor's logit is about
    TOP_LOGIT; the other rows point against the shared direction, which
    every hidden state carries, so their logits sit near BLOCK_LOGIT.
    """
    n = embd.shape[1]
    unit = embd / np.linalg.norm(embd, axis=1, keepdims=True)
    rows = np.zeros_like(embd)
    np.add.at(rows, successor, unit)
    rows = _widen_margins(rows, unit, successor, np.array(voc.normal_ids))
    # After the final RMS norm the hidden state has norm sqrt(n) and, the inner layers
    # aside, cos ~ 1/sqrt(1 + COMMON^2) with its token's (perpendicular) embedding.
    cos_own = 1.0 / np.sqrt(1.0 + COMMON**2 + RESIDUAL_GAIN**2)
    out = rows * (TOP_LOGIT / (cos_own * np.sqrt(n)))
    blocked = np.array([i for i in range(len(voc)) if i not in voc.normal_ids])
    out[blocked] = common * (BLOCK_LOGIT / (COMMON * cos_own * np.sqrt(n)))
    return out


def _widen_margins(
    rows: np.ndarray, unit: np.ndarray, successor: np.ndarray, normal: np.ndarray
) -> np.ndarray:
    """Nudge readout rows apart where two embeddings are too alike (a margin perceptron).

    With fewer dimensions than tokens, some random embeddings nearly coincide
    and the plain readout barely tells them apart. Each round moves the
    target row toward, and the strongest rival row away from, every token
    whose margin is short. Fixed rounds keep the result deterministic. Returns
    rows scaled so the median target logit (for unit inputs) is 1.
    """
    w = rows[normal].copy()
    target_col = np.searchsorted(normal, successor)
    idx = np.arange(len(unit))
    for _ in range(MARGIN_ROUNDS):
        logits = unit @ w.T
        target = logits[idx, target_col]
        logits[idx, target_col] = -np.inf
        rival = logits.argmax(axis=1)
        short = target - logits[idx, rival] < MARGIN_GOAL * np.median(target)
        if not short.any():
            break
        np.add.at(w, target_col[short], MARGIN_STEP * unit[short])
        np.subtract.at(w, rival[short], MARGIN_STEP * unit[short])
    out = np.zeros_like(rows)
    out[normal] = w / np.median((unit * w[target_col]).sum(axis=1))
    return out


def _block(rng: np.random.Generator, shape: DemoShape, common: np.ndarray) -> dict[str, np.ndarray]:
    """One transformer block, small next to the embeddings so it shifts but never decides.

    Layer outputs are kept perpendicular to the shared direction, which the
    readout of blocked tokens depends on.
    """
    n, hd = shape.n_embd, shape.head_dim
    n_q, n_kv = shape.n_head * hd, shape.n_head_kv * hd
    # Each of the 2 * n_layer residual writes adds about gain * sqrt(n) in norm (random
    # directions), so the total stays near RESIDUAL_GAIN times an embedding's norm.
    gain = RESIDUAL_GAIN / np.sqrt(2 * shape.n_layer)

    def normal(rows: int, cols: int, var: float) -> np.ndarray:
        return _normal(rng, rows, cols, var)

    return {
        "attn_norm": np.ones(n),
        "attn_q": normal(n_q, n, QK_GAIN / n),
        "attn_k": normal(n_kv, n, QK_GAIN / n),
        "attn_v": normal(n_kv, n, 1.0 / n),
        "attn_output": _perp(normal(n, n_q, gain**2 / n_q).T, common).T,
        "ffn_norm": np.ones(n),
        "ffn_gate": normal(shape.n_ff, n, 1.0 / n),
        "ffn_up": normal(shape.n_ff, n, 1.0 / n),
        # x4 offsets SwiGLU's small output variance (about 0.36 for unit-variance inputs).
        "ffn_down": _perp(normal(n, shape.n_ff, 4.0 * gain**2 / shape.n_ff).T, common).T,
    }
