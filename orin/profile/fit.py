"""Memory fit: a profile's context for every slot, beside the weights, in the memory there is.

The one check behind doctor's ``memory-fit`` and ``profile validate``'s: the
memory planner's figures (``orin.model.memplan``: weights + KV cache at full
context for every slot + compute buffers) against the memory available, graded
on the shared severity scale, with the largest per-slot context that fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from orin.errors import KVConfigError, OrinError
from orin.model.gguf import ModelInfo
from orin.model.memplan import MemoryPlan, layer_split, max_context, plan_memory, split_bytes
from orin.profile.schema import EngineSection, Profile
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


def projector_path(profile: Profile) -> Path | None:
    """The vision projector serve would load (model.mmproj, relative paths from the
    profile's folder, or the demo one's cache file), without generating it."""
    m = profile.model
    if m.mmproj is not None:
        return profile.path_from(m.mmproj)
    if m.mmproj_demo and m.demo is not None:
        from orin.model import mmproj
        from orin.paths import models_cache_dir

        return models_cache_dir() / mmproj.file_name(m.demo.size)
    return None


def projector_bytes(profile: Profile) -> int:
    """The projector's weights and compute buffer; 0 without one, or while its file is
    not there or unreadable (doctor's mmproj check reports that)."""
    path = projector_path(profile)
    if path is None or not path.is_file():
        return 0
    from orin.model import mmproj

    try:
        return mmproj.read_projector_info(path).total_bytes
    except (OrinError, OSError, ValueError):
        return 0


def draft_path(profile: Profile) -> Path | None:
    """The speculative draft model serve would load beside the model (relative paths
    from the profile's folder); None unless ``speculative.mode`` is draft."""
    s = profile.speculative
    if s.mode != "draft" or s.draft_model is None:
        return None
    return profile.path_from(s.draft_model)


def draft_info(profile: Profile, named: bool = False) -> ModelInfo | None:
    """The draft model's header, for its weights and KV cache in the memory plans; None
    without one, or while its file is not there or unreadable (doctor's draft-model
    check reports that). ``named``: the file ``speculative.draft_model`` names whatever
    the mode (tune tries it on any profile that names one)."""
    s = profile.speculative
    if named:
        path = None if s.draft_model is None else profile.path_from(s.draft_model)
    else:
        path = draft_path(profile)
    if path is None:
        return None
    from orin.model.gguf import read_model_info

    try:
        return read_model_info(path)
    except (OrinError, OSError):
        return None


def memory_fit(
    info: ModelInfo,
    engine: EngineSection,
    type_k: str,
    type_v: str,
    flash_attn: bool,
    available: int,
    mmproj_bytes: int = 0,
    draft: ModelInfo | None = None,
) -> MemoryFit:
    """Weights + KV at ``engine.n_ctx`` x ``engine.slots`` + compute, against ``available``.

    ``type_k``/``type_v``/``flash_attn`` are the resolved ones (no ``auto``:
    ``orin.profile.kvmatch.resolve_kv``); ``draft``: a speculative draft model's header
    (``draft_info``), its weights and cache counted too.
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
            mmproj_bytes=mmproj_bytes,
            draft=draft,
        )
    except KVConfigError as exc:
        return MemoryFit("fail", str(exc), fix="engine.type_k/type_v: f16 or q8_0")

    def largest(room: int, slots: int = e.slots, draft: ModelInfo | None = draft) -> int | None:
        """The largest per-slot context that ``room`` bytes hold, beside the projector."""
        return max_context(
            info, slots, type_k, type_v, room - mmproj_bytes, e.n_ubatch, flash_attn,
            e.n_batch, e.swa_full, draft,
        )  # fmt: skip

    best = largest(available)
    # the context the fix names leaves the headroom too: the largest that only fits would
    # be a warning again (and, for a fit that warns, no smaller than the context it has)
    roomy = largest(int(available * (1 - HEADROOM)))
    beside = f" + vision projector {gib(plan.mmproj_bytes)}" if plan.mmproj_bytes else ""
    beside += f" + draft model ~{gib(plan.draft_bytes)}" if plan.draft_bytes else ""
    found = (
        f"weights {gib(plan.weights_bytes)} + KV {gib(plan.kv_bytes)} + compute "
        f"~{gib(plan.compute_bytes)}{beside} = {gib(plan.total_bytes)} at n_ctx={e.n_ctx} x "
        f"{e.slots} slots (K={type_k}, V={type_v}); available {gib(available)}; "
        f"largest per-slot context that fits: {best if best is not None else 'none'}"
    )
    if roomy is not None:
        fix = (
            f"engine.n_ctx: {roomy}, the largest that leaves {HEADROOM:.0%} free (or fewer "
            "slots, or a smaller KV type)"
        )
    elif best is not None:
        fix = f"engine.n_ctx: {best} (or fewer slots, or a smaller KV type)"
    else:
        fix = _nothing_fits_fix(e.slots, draft, lambda slots, d: largest(available, slots, d))
    if plan.total_bytes > available and e.rpc:  # part of it goes to the workers' memory
        return MemoryFit(
            "warn",
            f"{found}; engine.rpc lists {len(e.rpc)} RPC worker(s) whose memory holds part "
            "of the layers",
            "the split follows each worker's free memory, known only when the server "
            "connects: its log line 'layers: ...' shows it (docs/fleet.md)",
            "",
            plan,
            best,
        )
    if plan.total_bytes > available:
        return MemoryFit("fail", found, WHY_FAIL, fix, plan, best)
    if plan.total_bytes > available * (1 - HEADROOM):
        return MemoryFit("warn", found, WHY_WARN, fix, plan, best)
    return MemoryFit("ok", found, plan=plan, best_ctx=best)


def _nothing_fits_fix(
    slots: int,
    draft: ModelInfo | None,
    largest: Callable[[int, ModelInfo | None], int | None],
) -> str:
    """The fix when no per-slot context fits at ``slots``: each way out that makes room
    for some context (one slot; no draft model), else smaller weights only (the weights
    and the compute leave no room for any cache). ``largest(slots, draft)``: the
    largest per-slot context that fits with them, None for none."""
    ways = []
    one = largest(1, draft) if slots > 1 else None
    if one is not None:
        ways.append(f"fewer slots (one slot fits engine.n_ctx up to {one})")
    bare = largest(slots, None) if draft is not None else None
    if bare is not None:
        ways.append(f"no draft model (speculative.mode: ngram fits engine.n_ctx up to {bare})")
    if ways:
        return ", or ".join([*ways, "a smaller quantization or model"])
    return (
        "a smaller quantization or model: the weights leave no room for even one slot of "
        "the smallest context"
    )


def rpc_fit(
    plan: MemoryPlan,
    n_layer: int,
    devices: Sequence[tuple[str, int]],
    gpu_layers: int = -1,
) -> MemoryFit:
    """The layers split across ``devices`` ((name, free bytes): the ``engine.rpc``
    workers first, then the local GPU, as llama.cpp orders them) by free memory: fails
    when a device's share of weights and KV cache is more than it has free."""
    cpu, layers = layer_split(n_layer, [free for _, free in devices], gpu_layers)
    shares = split_bytes(plan, n_layer, layers)
    parts = [f"{cpu} layers on the host CPU"] if cpu else []
    over = []
    for (name, free), n, need in zip(devices, layers, shares, strict=True):
        parts.append(f"{name}: {n} layers, {gib(need)} of {gib(free)} free")
        if need > free:
            over.append(name)
    found = "; ".join(parts)
    if over:
        return MemoryFit(
            "fail",
            found,
            "llama.cpp splits the layers by free memory, and a device's share must fit in it",
            f"more workers, or a smaller model or context ({', '.join(over)} over)",
            plan,
        )
    return MemoryFit("ok", found, plan=plan)
