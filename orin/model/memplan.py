"""Memory planner: weights + KV cache + compute buffers against free memory.

On Jetson the GPU allocates from the same DRAM as the CPU, so the figure to
compare with is MemAvailable from /proc/meminfo. The KV figures follow what
llama.cpp allocates byte for byte (same padding of the context, one KV stream
per slot, row sizes of the quantized cache types); the compute-buffer figure is
an estimate and is labelled as one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from orin.errors import KVConfigError
from orin.model.gguf import ModelInfo

# The cache types llama.cpp accepts for --cache-type-k/--cache-type-v.
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")

KV_PAD = 256  # llama.cpp pads the context and each sequence's cells to 256
CONTEXT_LIMIT = 1 << 20  # search bound for the largest context that fits


def kv_type_size(kv_type: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a cache type, from gguf's table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name = kv_type.lower()
    if name not in KV_TYPES:
        raise KVConfigError(f"unknown KV cache type '{kv_type}' (one of {', '.join(KV_TYPES)})")
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]
    return int(block), int(size)


def bytes_per_element(kv_type: str) -> float:
    block, size = kv_type_size(kv_type)
    return size / block


def row_bytes(kv_type: str, n_heads: int, head_dim: int) -> int:
    """Bytes of one cell's K or V row for ``n_heads`` heads of ``head_dim`` values.

    llama.cpp quantizes each head separately, so a block type must divide the
    head dimension (it refuses the context otherwise).
    """
    block, size = kv_type_size(kv_type)
    if head_dim % block:
        raise KVConfigError(
            f"KV type {kv_type} quantizes blocks of {block} values, which does not divide "
            f"this model's head dimension {head_dim}"
        )
    return n_heads * head_dim // block * size


def _pad(n: int, to: int = KV_PAD) -> int:
    return (n + to - 1) // to * to


def kv_cells_per_seq(ctx: int, slots: int) -> int:
    """Cells llama.cpp gives each sequence for a per-slot context ``ctx``.

    The engine asks llama.cpp for n_ctx = ctx * slots with one KV stream per
    slot; llama.cpp pads n_ctx to 256, divides by the slots and pads again.
    """
    if ctx < 1 or slots < 1:
        raise KVConfigError("context and slots must be at least 1")
    return _pad(_pad(ctx * slots) // slots)


@dataclass(frozen=True)
class KVBytes:
    k: int
    v: int

    @property
    def total(self) -> int:
        return self.k + self.v


def kv_cache_bytes(info: ModelInfo, cells: int, type_k: str, type_v: str) -> KVBytes:
    """Bytes of the K and V caches for ``cells`` cells in total, layer by layer."""
    k = v = 0
    for n_kv in info.n_head_kv:
        if n_kv == 0:  # a layer without attention caches nothing
            continue
        k += row_bytes(type_k, n_kv, info.head_dim_k) * cells
        v += row_bytes(type_v, n_kv, info.head_dim_v) * cells
    return KVBytes(k=k, v=v)


def compute_bytes_estimate(
    info: ModelInfo, cells_per_seq: int, slots: int, n_ubatch: int, flash_attn: bool
) -> int:
    """Estimate of llama.cpp's compute and output buffers (f32 activations).

    One micro-batch keeps a few n_embd-wide and two n_ff-wide activations per
    token plus the logits, and an attention mask of tokens x cells; without
    flash attention the KQ score matrix of one layer (heads x tokens x cells)
    is materialised too. The output buffer holds one row of logits per
    sequence. Checked against llama.cpp's reported CPU buffers in the tests: it
    errs on the high side.
    """
    n_ff = info.n_ff or 4 * info.n_embd
    act = 4 * n_ubatch * (4 * info.n_embd + 2 * n_ff + info.vocab_size)
    mask = 4 * n_ubatch * cells_per_seq
    kq = 0 if flash_attn else 4 * n_ubatch * cells_per_seq * max(info.n_head)
    output = 4 * info.vocab_size * slots
    return act + mask + kq + output


@dataclass(frozen=True)
class MemoryPlan:
    ctx: int
    slots: int
    cells: int
    type_k: str
    type_v: str
    n_ubatch: int
    flash_attn: bool
    weights_bytes: int
    kv_k_bytes: int
    kv_v_bytes: int
    compute_bytes: int
    available_bytes: int | None
    max_ctx_by_kv_type: dict[str, int | None]
    unsupported_kv_types: dict[str, str]

    @property
    def kv_bytes(self) -> int:
        return self.kv_k_bytes + self.kv_v_bytes

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    @property
    def fits(self) -> bool | None:
        if self.available_bytes is None:
            return None
        return self.total_bytes <= self.available_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(kv_bytes=self.kv_bytes, total_bytes=self.total_bytes, fits=self.fits)
        return d


def total_bytes(
    info: ModelInfo,
    ctx: int,
    slots: int,
    type_k: str,
    type_v: str,
    n_ubatch: int,
    flash_attn: bool,
) -> int:
    per_seq = kv_cells_per_seq(ctx, slots)
    kv = kv_cache_bytes(info, per_seq * slots, type_k, type_v)
    compute = compute_bytes_estimate(info, per_seq, slots, n_ubatch, flash_attn)
    return info.weights_bytes + kv.total + compute


def max_context(
    info: ModelInfo,
    slots: int,
    type_k: str,
    type_v: str,
    available: int,
    n_ubatch: int = 512,
    flash_attn: bool = True,
) -> int | None:
    """Largest per-slot context (a multiple of 256) that fits; None if even 256 does not."""

    def fits(ctx: int) -> bool:
        return total_bytes(info, ctx, slots, type_k, type_v, n_ubatch, flash_attn) <= available

    lo, hi = 0, CONTEXT_LIMIT // KV_PAD
    if not fits(KV_PAD):
        return None
    while lo < hi:  # largest k with fits(k * 256)
        mid = (lo + hi + 1) // 2
        if fits(mid * KV_PAD):
            lo = mid
        else:
            hi = mid - 1
    return lo * KV_PAD


def plan_memory(
    info: ModelInfo,
    ctx: int,
    slots: int = 1,
    type_k: str = "f16",
    type_v: str = "f16",
    available: int | None = None,
    n_ubatch: int = 512,
    flash_attn: bool = True,
) -> MemoryPlan:
    """The memory a configuration needs, and the largest context per KV type."""
    type_k, type_v = type_k.lower(), type_v.lower()
    per_seq = kv_cells_per_seq(ctx, slots)
    kv = kv_cache_bytes(info, per_seq * slots, type_k, type_v)
    max_ctx: dict[str, int | None] = {}
    unsupported: dict[str, str] = {}
    for t in KV_TYPES:
        try:
            kv_cache_bytes(info, KV_PAD, t, t)
        except KVConfigError as exc:
            unsupported[t] = str(exc)
            continue
        if available is not None:
            max_ctx[t] = max_context(info, slots, t, t, available, n_ubatch, flash_attn)
    return MemoryPlan(
        ctx=ctx,
        slots=slots,
        cells=per_seq * slots,
        type_k=type_k,
        type_v=type_v,
        n_ubatch=n_ubatch,
        flash_attn=flash_attn,
        weights_bytes=info.weights_bytes,
        kv_k_bytes=kv.k,
        kv_v_bytes=kv.v,
        compute_bytes=compute_bytes_estimate(info, per_seq, slots, n_ubatch, flash_attn),
        available_bytes=available,
        max_ctx_by_kv_type=max_ctx,
        unsupported_kv_types=unsupported,
    )
