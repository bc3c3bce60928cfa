"""Quantization <-> KV-cache type policy.

``auto`` picks the cache type from the weights' precision, and explicit
choices are checked against what llama.cpp really does:
- a quantized V cache needs flash attention (without it llama.cpp refuses to
  create the context);
- on CUDA, flash attention follows ggml-cuda's fattn.cu: f32, f16, bf16,
  q4_0, q4_1, q5_0, q5_1 and q8_0 are supported; a supported pair without its
  own vector kernel (the build's FA_QUANTS) is converted to f16 and stays on
  the GPU, slower; a type outside that set (iq4_nl) has no CUDA flash-attention
  kernel at all, so llama.cpp runs the op on the CPU (or, with flash_attn auto,
  turns flash attention off);
- a cache of lower precision than the weights adds error on top of the
  quantization, so it is allowed but reported with the memory it saves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from orin.llamacpp import BuildInfo
from orin.model.gguf import ModelInfo, weight_bits
from orin.model.memplan import kv_cache_bytes, kv_cells_per_seq
from orin.profile.fit import HEADROOM
from orin.profile.schema import EngineSection
from orin.severity import Severity

QUANTIZED_KV = frozenset({"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"})
# ggml-cuda fattn.cu ggml_cuda_fattn_kv_type_supported(): types with CUDA flash attention
CUDA_FA_ORDER = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
CUDA_FA_TYPES = frozenset(CUDA_FA_ORDER)
CUDA_FA_AS = {"f32": "f16"}  # f32 K or V uses the f16 instance, converted
ALWAYS_COMPILED = ("f16", "f16")  # ggml_cuda_fattn_vec_instances adds f16-f16 to any list
KV_BITS = {
    "f32": 32.0,
    "f16": 16.0,
    "bf16": 16.0,
    "q8_0": 8.5,
    "q5_1": 6.0,
    "q5_0": 5.5,
    "q4_1": 5.0,
    "q4_0": 4.5,
    "iq4_nl": 4.5,
}


@dataclass(frozen=True)
class KVFinding:
    rule: str
    severity: Severity
    message: str


@dataclass(frozen=True)
class KVDecision:
    """Concrete cache types and flash-attention mode, with the reasons."""

    type_k: str
    type_v: str
    flash_attn: Literal["auto", "on", "off"]
    findings: tuple[KVFinding, ...] = field(default_factory=tuple)

    @property
    def errors(self) -> list[KVFinding]:
        """The findings that make llama.cpp refuse or misrun this configuration."""
        return [f for f in self.findings if f.severity == "fail"]


def auto_kv_type(
    quantization: str | None, q8_fits: Callable[[], bool] | None = None
) -> tuple[str, str]:
    """The cache type for ``auto`` and why.

    Full-precision weights keep an f16 cache; 8- and 6-bit weights take q8_0
    (half the memory, error well below the weights'); weights of 5 bits and fewer
    take q8_0 too, or q4_0 when the planned context does not fit with q8_0 and the
    headroom memory-fit asks for (``orin.profile.fit.HEADROOM``): q8_0 there would be
    a fit that warns, where q4_0 passes.
    """
    bits = weight_bits(quantization) if quantization else None
    if bits is None:
        return "f16", "the weights' quantization is unknown, so the cache stays f16"
    if bits >= 16:
        return "f16", f"{quantization} weights are full precision: f16 cache"
    if bits >= 6:
        return "q8_0", f"{quantization} weights are {bits}-bit: q8_0 cache"
    if q8_fits is not None and not q8_fits():
        return (
            "q4_0",
            f"{quantization} weights and the planned context does not fit with q8_0 and "
            f"{HEADROOM:.0%} of the memory left free",
        )
    return "q8_0", f"{quantization} weights are {bits}-bit: q8_0 cache"


def resolve_kv(
    engine: EngineSection,
    quantization: str | None,
    info: ModelInfo | None = None,
    build: BuildInfo | None = None,
    available: int | None = None,
) -> KVDecision:
    """Turn ``auto`` into concrete types and check the result against the rules."""
    findings: list[KVFinding] = []
    q8_fits = _q8_fits(engine, info, available)
    types: dict[str, str] = {"type_k": engine.type_k, "type_v": engine.type_v}
    for which, chosen in types.items():
        if chosen != "auto":
            continue
        kv, why = auto_kv_type(quantization, q8_fits)
        if kv in QUANTIZED_KV and engine.flash_attn == "off":
            kv, why = "f16", why + "; flash attention is off, so f16 instead"
        types[which] = kv
        findings.append(KVFinding("kv-auto", "info", f"{which}=auto -> {kv} ({why})"))
    type_k, type_v = types["type_k"], types["type_v"]
    flash: Literal["auto", "on", "off"] = engine.flash_attn
    if flash == "auto" and type_v in QUANTIZED_KV:
        flash = "on"
    findings += check_kv(type_k, type_v, flash, engine, quantization, info, build)
    return KVDecision(type_k, type_v, flash, tuple(findings))


def _q8_fits(
    engine: EngineSection, info: ModelInfo | None, available: int | None
) -> Callable[[], bool] | None:
    if info is None or available is None:
        return None

    def fits() -> bool:
        from orin.model.memplan import total_bytes

        need = total_bytes(
            info,
            engine.n_ctx,
            engine.slots,
            "q8_0",
            "q8_0",
            engine.n_ubatch,
            True,
            engine.n_batch,
            engine.swa_full,
        )
        return need <= available * (1 - HEADROOM)

    return fits


def check_kv(
    type_k: str,
    type_v: str,
    flash_attn: str,
    engine: EngineSection,
    quantization: str | None,
    info: ModelInfo | None = None,
    build: BuildInfo | None = None,
) -> list[KVFinding]:
    """Findings for concrete K/V types (no ``auto`` left)."""
    out: list[KVFinding] = []
    if type_v in QUANTIZED_KV and flash_attn == "off":
        out.append(
            KVFinding(
                "kv-quant-v-needs-fa",
                "fail",
                f"a quantized V cache ({type_v}) needs flash attention: llama.cpp refuses to "
                "create the context with flash_attn off; set engine.flash_attn to on or auto, "
                "or type_v to f16",
            )
        )
    if build is not None and build.cuda and engine.gpu_layers != 0 and flash_attn != "off":
        finding = cuda_fa_finding(type_k, type_v, flash_attn, build.fa_quants)
        if finding is not None:
            out.append(finding)
    out += _precision_findings(type_k, type_v, engine, quantization, info)
    return out


def cuda_fa_pair(type_k: str, type_v: str) -> tuple[str, str]:
    """The vector-kernel instance a K/V pair looks for: f32 runs as f16 (fattn.cu's
    FATTN_VEC_CASE accepts F32 where the instance is F16, after a conversion)."""
    return (CUDA_FA_AS.get(type_k, type_k), CUDA_FA_AS.get(type_v, type_v))


def cuda_fa_finding(
    type_k: str,
    type_v: str,
    flash_attn: str,
    fa_quants: frozenset[tuple[str, str]] | None,
) -> KVFinding | None:
    """What CUDA flash attention does with this K/V pair, per vendored ``fattn.cu``.

    ``fa_quants`` is the build's FA_QUANTS (None: all). Three cases:
    - a type outside ``CUDA_FA_TYPES``: ``ggml_cuda_get_best_fattn_kernel`` returns
      NONE, so ``supports_op`` is false and the scheduler puts FLASH_ATTN_EXT on the
      CPU, copying K and V from the GPU for every layer of every step. With
      flash_attn auto (V not quantized, or llama.cpp would have forced it on)
      llama.cpp's own probe sees the op leave the layer's device and turns flash
      attention off for the context instead;
    - supported types whose pair has no compiled vector kernel: the op stays on
      the GPU; the vector kernel (single-token decode) converts K and V to f16
      first and uses the f16/f16 instance, which is always compiled;
    - a compiled pair: nothing to report.
    """
    outside = [t for t in (type_k, type_v) if t not in CUDA_FA_TYPES]
    if outside:
        names = "/".join(dict.fromkeys(outside))
        if flash_attn == "auto" and type_v not in QUANTIZED_KV:
            return KVFinding(
                "kv-cuda-fa-kernels",
                "warn",
                f"CUDA has no flash-attention kernel for {names} (supported: "
                f"{', '.join(CUDA_FA_ORDER)}): with flash_attn auto llama.cpp turns flash "
                f"attention off for K={type_k}/V={type_v}, and attention runs on the GPU "
                "without it",
            )
        return KVFinding(
            "kv-cuda-fa-kernels",
            "fail",
            f"CUDA has no flash-attention kernel for {names} (supported: "
            f"{', '.join(CUDA_FA_ORDER)}): with K={type_k}/V={type_v} llama.cpp runs "
            "attention on the CPU, copying K and V from the GPU every layer of every step",
        )
    pair = cuda_fa_pair(type_k, type_v)
    if fa_quants is None or pair in fa_quants or pair == ALWAYS_COMPILED:
        return None
    compiled = ", ".join(f"{k}/{v}" for k, v in sorted(fa_quants | {ALWAYS_COMPILED}))
    return KVFinding(
        "kv-cuda-fa-kernels",
        "warn",
        f"this CUDA build has no flash-attention vector kernel for K={pair[0]}/V={pair[1]} "
        f"(compiled: {compiled}): decode steps convert K and V to f16 first; attention "
        "stays on the GPU, slower, with a larger compute buffer. Use a compiled pair or "
        "rebuild with scripts/install-llama-cpp.sh (GGML_CUDA_FA_QUANTS=all)",
    )


def _precision_findings(
    type_k: str,
    type_v: str,
    engine: EngineSection,
    quantization: str | None,
    info: ModelInfo | None,
) -> list[KVFinding]:
    bits = weight_bits(quantization) if quantization else None
    kv_bits = min(KV_BITS[type_k], KV_BITS[type_v])
    if bits is None or kv_bits >= bits:
        return []
    saved = ""
    if info is not None:
        cells = kv_cells_per_seq(engine.n_ctx, engine.slots) * engine.slots
        full = kv_cache_bytes(info, cells, "f16", "f16").total
        this = kv_cache_bytes(info, cells, type_k, type_v).total
        saved = f"; it saves {(full - this) / 2**20:.1f} MiB against an f16 cache"
    return [
        KVFinding(
            "kv-below-weights",
            "warn",
            f"the KV cache (K={type_k}, V={type_v}) has lower precision than the "
            f"{quantization} weights, adding error on top of the quantization{saved}",
        )
    ]
