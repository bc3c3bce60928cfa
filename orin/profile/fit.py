"""Memory fit: a profile's context for every slot, beside the weights, in the memory there is.

The one check behind doctor's ``memory-fit`` and ``profile validate``'s: the
memory planner's figures (``orin.model.memplan``: weights + KV cache at full
context for every slot + compute buffers) against the memory available, graded
on the shared severity scale, with the largest per-slot context that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from orin.errors import KVConfigError
from orin.model.gguf import ModelInfo
from orin.model.memplan import MemoryPlan, max_context, plan_memory
from orin.profile.schema import EngineSection
from orin.severity import Severity

HEADROOM = 0.10  # below this share of available memory left over, the fit warns
WHY_FAIL = (
    "the KV cache for every slot is allocated at load: a model that fits at load but "
    "not at full context fails with cudaMalloc errors or pushes the board into swap"
)
WHY_WARN = f"less than {HEADROOM:.0%} of available memory is left for the CUDA runtime"


@dataclass(frozen=True)
class MemoryFit:
    """ok: fits with headroom; warn: fits with under ``HEADROOM`` left; fail: does not
    fit, or the KV types cannot be planned for this model (``plan`` is then None)."""

    severity: Severity
    found: str
    why: str = ""
    fix: str = ""
    plan: MemoryPlan | None = None
    best_ctx: int | None = None  # the largest per-slot context that fits


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_fit(
    info: ModelInfo,
    engine: EngineSection,
    type_k: str,
    type_v: str,
    flash_attn: bool,
    available: int,
) -> MemoryFit:
    """Weights + KV at ``engine.n_ctx`` x ``engine.slots`` + compute, against ``available``.

    ``type_k``/``type_v``/``flash_attn`` are the resolved ones (no ``auto``:
    ``orin.profile.kvmatch.resolve_kv``).
    """
    e = engine
    try:
        plan = plan_memory(
            info,
            e.n_ctx,
            e.slots,
            type_k,
            type_v,
            None,
            e.n_ubatch,
            flash_attn,
            e.n_batch,
            e.swa_full,
        )
    except KVConfigError as exc:
        return MemoryFit("fail", str(exc), fix="engine.type_k/type_v: f16 or q8_0")
    best = max_context(
        info, e.slots, type_k, type_v, available, e.n_ubatch, flash_attn, e.n_batch, e.swa_full
    )
    found = (
        f"weights {gib(plan.weights_bytes)} + KV {gib(plan.kv_bytes)} + compute "
        f"~{gib(plan.compute_bytes)} = {gib(plan.total_bytes)} at n_ctx={e.n_ctx} x "
        f"{e.slots} slots (K={type_k}, V={type_v}); available {gib(available)}; "
        f"largest per-slot context that fits: {best if best is not None else 'none'}"
    )
    if best is None:
        fix = "a smaller quantization or model, or fewer slots"
    else:
        fix = f"engine.n_ctx: {best} (or fewer slots, or a smaller KV type)"
    if plan.total_bytes > available:
        return MemoryFit("fail", found, WHY_FAIL, fix, plan, best)
    if plan.total_bytes > available * (1 - HEADROOM):
        return MemoryFit("warn", found, WHY_WARN, fix, plan, best)
    return MemoryFit("ok", found, plan=plan, best_ctx=best)
