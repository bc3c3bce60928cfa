"""Memory planner: weights + KV cache + compute buffers against free memory.

On Jetson the GPU allocates from the same DRAM as the CPU, so the figure to
compare with is MemAvailable from /proc/meminfo. The KV figures follow what
llama.cpp allocates byte for byte (same padding of the context, one KV stream
per slot, row sizes of the quantized cache types, per-layer head counts, the
separate sliding-window cache of interleaved-SWA models) for the layouts
ModelInfo marks exact; for recurrent, hybrid, MLA and unknown layouts they are
estimates, and the plan says so. Weights are the tensor table's sum, exact for
mixtures of experts too (every expert is stored and loaded). The
compute-buffer figure is an estimate and is labelled as one.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import accumulate
from typing import Any

from orin.errors import KVConfigError
from orin.model.gguf import (
    KV_LAYOUT_HYBRID,
    KV_LAYOUT_ISWA,
    KV_LAYOUT_MLA,
    KV_LAYOUT_NONE,
    KV_LAYOUT_RECURRENT,
    ModelInfo,
)

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


def effective_ubatch(ctx: int, slots: int, n_ubatch: int, n_batch: int | None = None) -> int:
    """The micro-batch llama.cpp settles on: n_batch is capped by the asked n_ctx
    (causal attention), and n_ubatch by n_batch (llama_context's constructor)."""
    batch = min(ctx * slots, n_batch if n_batch is not None else n_ubatch)
    return min(batch, n_ubatch)


def swa_cells_per_seq(
    info: ModelInfo,
    ctx: int,
    slots: int,
    n_ubatch: int = 512,
    n_batch: int | None = None,
    swa_full: bool = False,
) -> int:
    """Cells per sequence of the sliding-window cache (llama_kv_cache_iswa).

    With ``swa_full`` (the profile's engine.swa_full; off by default, as in
    llama.cpp's server) the window layers get as many cells as the others.
    Without it llama.cpp gives each KV stream
    ``pad256(min(n_ctx_seq, n_swa + n_ubatch))`` cells: the window plus room for one
    micro-batch (n_swa x n_seq_max only for a unified cache, which
    the engine never uses).
    """
    cells = kv_cells_per_seq(ctx, slots)
    if swa_full or info.sliding_window is None:
        return cells
    ubatch = effective_ubatch(ctx, slots, n_ubatch, n_batch)
    return _pad(min(cells, info.sliding_window + ubatch))


@dataclass(frozen=True)
class KVBytes:
    k: int
    v: int

    @property
    def total(self) -> int:
        return self.k + self.v


@dataclass(frozen=True)
class KVCachePlan:
    """One cache llama.cpp creates, as its ``llama_kv_cache: size = ...`` line reports it.

    ``kind`` is ``full`` (every layer, or the full-attention layers of an iSWA model)
    or ``swa`` (the sliding-window layers); ``layers`` counts the layers it holds.
    """

    kind: str
    layers: int
    cells_per_seq: int
    k_bytes: int
    v_bytes: int

    @property
    def total(self) -> int:
        return self.k_bytes + self.v_bytes


def _kv_layers(info: ModelInfo) -> list[int]:
    """Layers whose K and V llama.cpp caches in cells, in layer order."""
    n_main = info.n_layer - info.n_layer_nextn
    if info.kv_layout in (KV_LAYOUT_RECURRENT, KV_LAYOUT_NONE):
        return []
    if info.kv_layout == KV_LAYOUT_HYBRID:
        return [il for il in range(n_main) if info.n_head_kv[il] > 0]
    return list(range(n_main))


def _v_width_max(info: ModelInfo) -> int:
    """Widest V row over all layers (llama_hparams::n_embd_v_gqa_max)."""
    return max(
        (info.n_head_kv[il] * info.head_dims(il)[1] for il in range(info.n_layer)), default=0
    )


def _layers_bytes(
    info: ModelInfo, layers: list[int], cells: int, type_k: str, type_v: str, flash_attn: bool
) -> KVBytes:
    """K and V bytes of ``layers`` for ``cells`` cells in total (all streams together).

    Without flash attention llama.cpp stores V transposed and pads every layer's V
    to the widest one, so a model with per-layer head counts needs more there.
    """
    k = v = 0
    mla = info.kv_layout == KV_LAYOUT_MLA
    v_max = 0 if flash_attn or mla else _v_width_max(info)
    for il in layers:
        n_kv = info.n_head_kv[il]
        head_k, head_v = info.head_dims(il)
        if n_kv:
            k += row_bytes(type_k, n_kv, head_k) * cells
            if not mla and flash_attn:
                v += row_bytes(type_v, n_kv, head_v) * cells
        if v_max:
            v += row_bytes(type_v, 1, v_max) * cells
    return KVBytes(k=k, v=v)


def kv_cache_bytes(
    info: ModelInfo, cells: int, type_k: str, type_v: str, flash_attn: bool = True
) -> KVBytes:
    """Bytes of the K and V caches for ``cells`` cells in total, layer by layer.

    Every cached layer gets all the cells, which is what llama.cpp allocates for a
    sliding-window model too as long as ``swa_full`` is on (see ``kv_caches`` for
    the window-sized variant).
    """
    return _layers_bytes(info, _kv_layers(info), cells, type_k, type_v, flash_attn)


def kv_caches(
    info: ModelInfo,
    ctx: int,
    slots: int,
    type_k: str,
    type_v: str,
    n_ubatch: int = 512,
    n_batch: int | None = None,
    flash_attn: bool = True,
    swa_full: bool = False,
) -> tuple[KVCachePlan, ...]:
    """The caches llama.cpp creates for a configuration, in the order it logs them.

    A model with sliding-window layers gets two (llama-kv-cache-iswa.cpp): one for
    the full-attention layers, then one for the window layers; every other
    attention model one; a recurrent model or one without attention none.
    """
    cells = kv_cells_per_seq(ctx, slots)
    layers = _kv_layers(info)
    if not layers:
        return ()
    if info.kv_layout != KV_LAYOUT_ISWA:
        kv = _layers_bytes(info, layers, cells * slots, type_k, type_v, flash_attn)
        return (KVCachePlan("full", len(layers), cells, kv.k, kv.v),)
    full = [il for il in layers if not info.is_swa(il)]
    swa = [il for il in layers if info.is_swa(il)]
    swa_cells = swa_cells_per_seq(info, ctx, slots, n_ubatch, n_batch, swa_full)
    kv_full = _layers_bytes(info, full, cells * slots, type_k, type_v, flash_attn)
    kv_swa = _layers_bytes(info, swa, swa_cells * slots, type_k, type_v, flash_attn)
    return (
        KVCachePlan("full", len(full), cells, kv_full.k, kv_full.v),
        KVCachePlan("swa", len(swa), swa_cells, kv_swa.k, kv_swa.v),
    )


RECURRENT_STATE_BYTES = 4  # llama.cpp keeps recurrent state rows in f32


def recurrent_state_bytes(info: ModelInfo, slots: int) -> int:
    """Estimate of a recurrent or hybrid model's state: one row set per sequence.

    llama_memory_recurrent allocates, per recurrent layer, an ``r`` and an ``s`` row
    of f32 for each of max(1, n_seq_max) sequences. Hybrid models count the layers
    without KV heads as recurrent, or every layer when the metadata does not tell.
    """
    state = info.recurrent_state
    if state is None:
        return 0
    n_main = info.n_layer - info.n_layer_nextn
    if info.kv_layout == KV_LAYOUT_HYBRID:
        layers = sum(1 for il in range(n_main) if info.n_head_kv[il] == 0) or n_main
    else:
        layers = n_main
    return layers * (state.r + state.s) * RECURRENT_STATE_BYTES * max(1, slots)


def compute_bytes_estimate(
    info: ModelInfo,
    cells_per_seq: int,
    slots: int,
    n_ubatch: int,
    flash_attn: bool,
    swa_cells_per_seq: int = 0,
) -> int:
    """Estimate of llama.cpp's compute and output buffers (f32 activations).

    One micro-batch keeps a few n_embd-wide and two n_ff-wide activations per
    token plus the logits, and an attention mask of tokens x cells (a second one
    for a sliding-window cache); without flash attention the KQ score matrix of
    one layer (heads x tokens x cells) is materialised too; a recurrent model has
    neither. A mixture of experts
    runs n_expert_used expert FFNs per token and scores every expert. The output
    buffer holds one row of logits per sequence. Checked against llama.cpp's
    reported CPU buffers in the tests: it errs on the high side.
    """
    n_ff = info.n_ff or 4 * info.n_embd
    router = 0
    if info.n_expert:
        n_ff = max(n_ff, info.n_expert_used * (info.n_ff_exp or 0))
        router = info.n_expert
    act = 4 * n_ubatch * (4 * info.n_embd + 2 * n_ff + router + info.vocab_size)
    mask = kq = 0
    if info.kv_layout != KV_LAYOUT_RECURRENT:  # no attention, no mask
        mask = 4 * n_ubatch * (cells_per_seq + swa_cells_per_seq)
        kq = 0 if flash_attn else 4 * n_ubatch * cells_per_seq * max(info.n_head)
    output = 4 * info.vocab_size * slots
    return act + mask + kq + output


@dataclass(frozen=True)
class MemoryPlan:
    """What one configuration needs. ``kv_estimated`` marks KV (and state) figures the
    planner cannot compute exactly for this model's layout; ``kv_note`` says why."""

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
    swa_full: bool = False
    kv_caches: tuple[KVCachePlan, ...] = ()
    state_bytes: int = 0
    kv_estimated: bool = False
    kv_note: str | None = None
    ctx_train: int = 0  # the model's training context (0: the file does not say)
    # a vision projector's weights and compute buffer (orin.model.mmproj), 0 without one
    mmproj_bytes: int = 0
    # a speculative draft model's weights, KV cache and compute buffers (draft_bytes),
    # 0 without one
    draft_bytes: int = 0

    @property
    def max_ctx_usable(self) -> dict[str, int | None]:
        """``max_ctx_by_kv_type`` capped at the training context: memory may allow more,
        but past it the model's answers degrade (RoPE was never trained that far)."""
        cap = self.ctx_train
        return {
            t: (min(c, cap) if c is not None and cap > 0 else c)
            for t, c in self.max_ctx_by_kv_type.items()
        }

    @property
    def capped_kv_types(self) -> tuple[str, ...]:
        """The KV types whose largest fitting context is past the training context."""
        cap = self.ctx_train
        return tuple(t for t, c in self.max_ctx_by_kv_type.items() if c is not None and 0 < cap < c)

    @property
    def kv_bytes(self) -> int:
        return self.kv_k_bytes + self.kv_v_bytes

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.kv_bytes
            + self.state_bytes
            + self.compute_bytes
            + self.mmproj_bytes
            + self.draft_bytes
        )

    @property
    def fits(self) -> bool | None:
        if self.available_bytes is None:
            return None
        return self.total_bytes <= self.available_bytes

    @property
    def estimated(self) -> tuple[str, ...]:
        """The figures that are estimates rather than llama.cpp's exact allocation."""
        kv = ("kv_k_bytes", "kv_v_bytes", "state_bytes") if self.kv_estimated else ()
        return (*kv, "compute_bytes")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            kv_bytes=self.kv_bytes,
            total_bytes=self.total_bytes,
            fits=self.fits,
            estimated=list(self.estimated),
            max_ctx_usable_by_kv_type=self.max_ctx_usable,
            max_ctx_capped_by_training=list(self.capped_kv_types),
        )
        return d


def total_bytes(
    info: ModelInfo,
    ctx: int,
    slots: int,
    type_k: str,
    type_v: str,
    n_ubatch: int,
    flash_attn: bool,
    n_batch: int | None = None,
    swa_full: bool = False,
    draft: ModelInfo | None = None,
) -> int:
    caches = kv_caches(info, ctx, slots, type_k, type_v, n_ubatch, n_batch, flash_attn, swa_full)
    kv = sum(c.total for c in caches)
    compute = _compute(info, ctx, slots, n_ubatch, n_batch, flash_attn, swa_full)
    beside = 0 if draft is None else draft_bytes(draft, ctx, slots, n_ubatch, flash_attn, n_batch)
    return info.weights_bytes + kv + recurrent_state_bytes(info, slots) + compute + beside


DRAFT_KV_TYPE = "f16"  # the draft model's cache type (DraftModel.from_config)


def draft_bytes(
    draft: ModelInfo,
    ctx: int,
    slots: int,
    n_ubatch: int,
    flash_attn: bool,
    n_batch: int | None = None,
) -> int:
    """What a speculative draft model (``speculative.draft_model``) takes beside the
    served model: its weights, KV cache and compute buffers. The engine gives it a
    context of its own with the served model's context per slot, slots and batch
    sizes, an f16 cache, llama.cpp's default of full sliding-window layers, and flash
    attention where the served model has it (orin/engine/speculative.py,
    ``DraftModel.from_config``)."""
    return total_bytes(
        draft, ctx, slots, DRAFT_KV_TYPE, DRAFT_KV_TYPE, n_ubatch, flash_attn, n_batch, True
    )


def _compute(
    info: ModelInfo,
    ctx: int,
    slots: int,
    n_ubatch: int,
    n_batch: int | None,
    flash_attn: bool,
    swa_full: bool,
) -> int:
    per_seq = kv_cells_per_seq(ctx, slots)
    swa = 0
    if info.n_swa_layers:
        swa = swa_cells_per_seq(info, ctx, slots, n_ubatch, n_batch, swa_full)
    ubatch = effective_ubatch(ctx, slots, n_ubatch, n_batch)  # what llama.cpp allocates for
    return compute_bytes_estimate(info, per_seq, slots, ubatch, flash_attn, swa)


def max_context(
    info: ModelInfo,
    slots: int,
    type_k: str,
    type_v: str,
    available: int,
    n_ubatch: int = 512,
    flash_attn: bool = True,
    n_batch: int | None = None,
    swa_full: bool = False,
    draft: ModelInfo | None = None,
) -> int | None:
    """Largest per-slot context (a multiple of 256) that fits; None if even 256 does not.
    A ``draft`` model's cache grows with the context too (``draft_bytes``)."""

    def fits(ctx: int) -> bool:
        need = total_bytes(
            info, ctx, slots, type_k, type_v, n_ubatch, flash_attn, n_batch, swa_full, draft
        )
        return need <= available

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
    n_batch: int | None = None,
    swa_full: bool = False,
    mmproj_bytes: int = 0,
    draft: ModelInfo | None = None,
) -> MemoryPlan:
    """The memory a configuration needs, and the largest context per KV type.

    ``mmproj_bytes``: a vision projector loaded beside the model
    (``orin.model.mmproj.ProjectorInfo.total_bytes``), taken from the memory the
    context may use. ``draft``: the header of a speculative draft model loaded beside
    it (``draft_bytes``), whose cache grows with the context.

    ``swa_full`` follows llama.cpp's context parameter of that name (the profile's
    engine.swa_full, off by default); ``n_batch`` (default: n_ubatch) only matters for the
    window cache, whose size includes one micro-batch.
    """
    type_k, type_v = type_k.lower(), type_v.lower()
    per_seq = kv_cells_per_seq(ctx, slots)
    caches = kv_caches(info, ctx, slots, type_k, type_v, n_ubatch, n_batch, flash_attn, swa_full)
    max_ctx: dict[str, int | None] = {}
    unsupported: dict[str, str] = {}
    for t in KV_TYPES:
        try:
            kv_cache_bytes(info, KV_PAD, t, t)
        except KVConfigError as exc:
            unsupported[t] = str(exc)
            continue
        if available is not None:
            max_ctx[t] = max_context(
                info,
                slots,
                t,
                t,
                available - mmproj_bytes,
                n_ubatch,
                flash_attn,
                n_batch,
                swa_full,
                draft,
            )
    return MemoryPlan(
        ctx=ctx,
        slots=slots,
        cells=per_seq * slots,
        type_k=type_k,
        type_v=type_v,
        n_ubatch=effective_ubatch(ctx, slots, n_ubatch, n_batch),  # what llama.cpp runs
        flash_attn=flash_attn,
        weights_bytes=info.weights_bytes,
        kv_k_bytes=sum(c.k_bytes for c in caches),
        kv_v_bytes=sum(c.v_bytes for c in caches),
        compute_bytes=_compute(info, ctx, slots, n_ubatch, n_batch, flash_attn, swa_full),
        available_bytes=available,
        max_ctx_by_kv_type=max_ctx,
        unsupported_kv_types=unsupported,
        swa_full=swa_full,
        kv_caches=caches,
        state_bytes=recurrent_state_bytes(info, slots),
        kv_estimated=not info.kv_exact,
        kv_note=info.kv_note,
        ctx_train=info.n_ctx_train or 0,
        mmproj_bytes=mmproj_bytes,
        draft_bytes=0
        if draft is None
        else draft_bytes(draft, ctx, slots, n_ubatch, flash_attn, n_batch),
    )


def layer_split(n_layer: int, free: Sequence[int], gpu_layers: int = -1) -> tuple[int, list[int]]:
    """(repeating layers left on the CPU, layers on each device) as llama.cpp assigns
    them: the last ``gpu_layers`` of the n_layer + 1 (the output counts as one) go to
    the devices in order (``engine.rpc`` workers first, then the local GPU), each
    taking a share proportional to its free memory (llama_model::load_tensors)."""
    if not free:
        return n_layer, []
    offload = n_layer + 1 if gpu_layers < 0 else min(gpu_layers, n_layer + 1)
    start = n_layer + 1 - offload
    total = sum(free)
    shares = [f / total for f in free] if total else [1 / len(free)] * len(free)
    cumulative = list(accumulate(shares))
    counts = [0] * len(free)
    for il in range(start, n_layer):
        device = bisect_right(cumulative, (il - start) / offload)  # std::upper_bound
        counts[min(device, len(free) - 1)] += 1
    return min(start, n_layer), counts


def split_bytes(plan: MemoryPlan, n_layer: int, layers: Sequence[int]) -> list[int]:
    """Each device's part of the weights and the KV cache for its layers (the
    repeating layers hold nearly all of both; embeddings stay on the host)."""
    per_layer = (plan.weights_bytes + plan.kv_bytes + plan.state_bytes) / max(n_layer, 1)
    return [int(per_layer * n) for n in layers]
