"""Tiny random-weight GGUF models of several architectures that llama.cpp loads and runs.

The llama demo models (orin/model/demo.py) cover one architecture; these cover the
layouts the memory planner and the engine must handle beyond it: biases (qwen2),
per-head Q/K norms (qwen3), a mixture of experts (qwen3moe), interleaved sliding
windows (gemma2: every other layer, gemma3: five local then one global), fused QKV
and gate/up tensors with a sliding window llama.cpp ignores (phi3), per-layer KV head
counts with a layer that has no KV heads (deci), multi-section RoPE whose cache
cannot shift positions (qwen2vl) and a recurrent state instead of a KV cache (mamba).

Tensor names come from gguf's TENSOR_NAMES and are checked against the
architecture's MODEL_TENSORS; shapes follow each architecture's load_arch_tensors
in the pinned llama.cpp (src/models/<arch>.cpp). Every file shares the demo
models' vocabulary, tokenizer metadata and output design, so greedy decoding has
wide margins: the readout maps each token to a designated successor, the layers
only shift logits by context (gemma2 ties its output to the embeddings, so its
greedy continuation repeats the last token instead). Weights are f32, written by
gguf's writer; all of them together take a few seconds to generate.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import gguf
import numpy as np

from orin.model import demo
from orin.model import vocab as vocab_mod

FORMAT_VERSION = 1
"""Part of the file names: bump on any change to what a spec writes."""

RMS_EPS = 1e-6


@dataclass(frozen=True)
class ArchSpec:
    """One test model: hyperparameters as written to the GGUF metadata.

    ``n_head_kv`` may be per layer. ``head_dim`` must equal n_embd / n_head for the
    architectures whose loaders size Q by n_embd (qwen2, qwen2vl, phi3, deci).
    """

    arch: str
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 2
    n_head_kv: int | tuple[int, ...] = 1
    head_dim: int = 32
    n_ff: int = 128
    n_ctx_train: int = 4096
    sliding_window: int | None = None
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    tied_output: bool = False
    extra_metadata: dict[str, object] = field(default_factory=dict)

    def kv_heads(self, layer: int) -> int:
        if isinstance(self.n_head_kv, tuple):
            return self.n_head_kv[layer]
        return self.n_head_kv


SPECS: dict[str, ArchSpec] = {
    "qwen2": ArchSpec("qwen2"),
    "qwen3": ArchSpec("qwen3", head_dim=64),
    "qwen3moe": ArchSpec("qwen3moe", head_dim=64, n_expert=4, n_expert_used=2, n_ff_exp=64),
    "gemma2": ArchSpec("gemma2", n_layer=4, head_dim=64, sliding_window=128, tied_output=True),
    "gemma3": ArchSpec("gemma3", n_layer=6, head_dim=64, sliding_window=128),
    "phi3": ArchSpec("phi3", sliding_window=2047),
    "deci": ArchSpec("deci", n_layer=3, n_head_kv=(1, 2, 0)),
    "qwen2vl": ArchSpec("qwen2vl", extra_metadata={"rope.dimension_sections": [4, 6, 6, 0]}),
    "mamba": ArchSpec("mamba", n_head=0, n_head_kv=0, head_dim=0, n_ff=0),
}

ATTENTION_ARCHS = tuple(a for a in SPECS if a != "mamba")

# mamba's state-space sizes (llama.cpp supports an expansion factor of 2 only)
MAMBA_D_CONV, MAMBA_D_STATE, MAMBA_DT_RANK = 4, 16, 4


def file_name(arch: str) -> str:
    return f"orin-test-{arch}-v{FORMAT_VERSION}.gguf"


def ensure(directory: Path, archs: tuple[str, ...] = tuple(SPECS)) -> dict[str, Path]:
    """Every asked model in ``directory``, generated where missing (atomically)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for arch in archs:
        path = directory / file_name(arch)
        if not path.is_file():
            generate(SPECS[arch], path)
        out[arch] = path
    return out


def generate(spec: ArchSpec, out: Path, seed: int = 0) -> Path:
    """Write one model to ``out`` (a temporary file in the same folder, then renamed)."""
    voc = vocab_mod.build_vocab()
    tensors = weights(spec, voc, seed)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[_model_arch(spec.arch)]}
    for name in tensors:
        base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        generic = _generic_name(base)
        assert generic in allowed, f"{spec.arch}: gguf knows no tensor {generic}"
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, spec.arch)
        _metadata(writer, spec, len(voc), seed)
        demo._add_tokenizer_metadata(writer, voc)
        for name, tensor in tensors.items():
            writer.add_tensor(name, tensor)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def _model_arch(arch: str) -> gguf.MODEL_ARCH:
    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)


def _generic_name(base: str) -> str:
    parts = base.split(".")
    if parts[0] == "blk":
        parts[1] = "{bid}"
    return ".".join(parts)


def _metadata(w: gguf.GGUFWriter, spec: ArchSpec, n_vocab: int, seed: int) -> None:
    # llama.cpp keys some tokenizer quirks on the model name (phi3 wants <|endoftext|>)
    w.add_name("orin-llm generated test model")
    w.add_file_type(0)  # all f32
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(n_vocab)
    if spec.arch == "mamba":
        w.add_head_count(0)
        w.add_ssm_conv_kernel(MAMBA_D_CONV)
        w.add_ssm_inner_size(2 * spec.n_embd)
        w.add_ssm_state_size(MAMBA_D_STATE)
        w.add_ssm_time_step_rank(MAMBA_DT_RANK)
    else:
        w.add_feed_forward_length(spec.n_ff)
        w.add_head_count(spec.n_head)
        if isinstance(spec.n_head_kv, tuple):
            w.add_head_count_kv(list(spec.n_head_kv))
        else:
            w.add_head_count_kv(spec.n_head_kv)
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
        w.add_rope_dimension_count(spec.head_dim)
        w.add_rope_freq_base(10000.0)
    if spec.sliding_window is not None:
        w.add_sliding_window(spec.sliding_window)
    if spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
    for key, value in spec.extra_metadata.items():
        full = f"{spec.arch}.{key}"
        if isinstance(value, list):
            w.add_array(full, value)
        else:
            w.add_uint32(full, int(value))  # type: ignore[call-overload]
    w.add_uint32("orin_llm.test.format_version", FORMAT_VERSION)
    w.add_uint32("orin_llm.test.seed", seed)


def weights(spec: ArchSpec, voc: vocab_mod.Vocab, seed: int) -> dict[str, np.ndarray]:
    """All tensors, f32, numpy shape = llama.cpp's ne reversed."""
    embd, output, common = _io_tensors(spec.n_embd, spec.tied_output, seed)
    out: dict[str, np.ndarray] = {"token_embd.weight": embd}
    if output is not None:
        out["output.weight"] = output
    rng = np.random.default_rng((seed, 1))
    block = _BLOCKS.get(spec.arch, _llama_like)
    for layer in range(spec.n_layer):
        for name, tensor in block(rng, spec, layer, common).items():
            out[f"blk.{layer}.{name}"] = tensor
    out["output_norm.weight"] = np.ones(spec.n_embd)
    return {name: np.ascontiguousarray(t, dtype=np.float32) for name, t in out.items()}


@cache
def _io_tensors(n: int, tied: bool, seed: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Embeddings, output matrix (None when tied) and the shared direction, as the demo
    models build them; computed once per width, the readout being the slow part."""
    voc = vocab_mod.build_vocab()
    rng = np.random.default_rng(seed)
    signs = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    common = (signs / np.sqrt(n)).astype(np.float32)
    if tied:
        # the output reads the embeddings themselves: no shared direction to offset
        return demo._normal(rng, len(voc), n, 1.0), None, common
    embd = demo._perp(demo._normal(rng, len(voc), n, 1.0), common)
    successor = demo._successors(rng, voc)
    readout = demo._readout(embd, successor, common, voc)
    return embd + demo.COMMON * np.sqrt(n) * common, readout, common


Block = Callable[[np.random.Generator, ArchSpec, int, np.ndarray], dict[str, np.ndarray]]


def _shape(spec: ArchSpec, layer: int) -> demo.DemoShape:
    return demo.DemoShape(
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        n_head_kv=spec.kv_heads(layer),
        n_ff=spec.n_ff,
        n_ctx_train=spec.n_ctx_train,
        head_dim=spec.head_dim,
    )


def _llama_like(
    rng: np.random.Generator, spec: ArchSpec, layer: int, common: np.ndarray
) -> dict[str, np.ndarray]:
    """The demo's llama block (attention, SwiGLU FFN, pre-norms), with .weight names."""
    return {f"{k}.weight": v for k, v in demo._block(rng, _shape(spec, layer), common).items()}


def _qwen2(
    rng: np.random.Generator, spec: ArchSpec, layer: int, common: np.ndarray
) -> dict[str, np.ndarray]:
    out = _llama_like(rng, spec, layer, common)
    n_kv = spec.kv_heads(layer) * spec.head_dim
    out["attn_q.bias"] = demo._normal(rng, 1, spec.n_head * spec.head_dim, 0.01)[0]
    out["attn_k.bias"] = demo._normal(rng, 1, n_kv, 0.01)[0]
    out["attn_v.bias"] = demo._normal(rng, 1, n_kv, 0.01)[0]
    return out


def _qk_norms(spec: ArchSpec) -> dict[str, np.ndarray]:
    return {
        "attn_q_norm.weight": np.ones(spec.head_dim),
        "attn_k_norm.weight": np.ones(spec.head_dim),
    }


def _qwen3(
    rng: np.random.Generator, spec: ArchSpec, layer: int, common: np.ndarray
) -> dict[str, np.ndarray]:
    return {**_llama_like(rng, spec, layer, common), **_qk_norms(spec)}


def _qwen3moe(
    rng: np.random.Generator, spec: ArchSpec, layer: int, common: np.ndarray
) -> dict[str, np.ndarray]:
    """Attention as qwen3; the FFN is a router and n_expert SwiGLU experts."""
    out = _qwen3(rng, spec, layer, common)
    for k in ("ffn_gate", "ffn_up", "ffn_down"):
        del out[f"{k}.weight"]
    n, e, f = spec.n_embd, spec.n_expert, spec.n_ff_exp
    gain = demo.RESIDUAL_GAIN / np.sqrt(2 * spec.n_layer)
    down = demo._normal(rng, e * n, f, 4.0 * gain**2 / f).reshape(e, n, f)
    down -= np.einsum("enf,n->ef", down, common)[:, None, :] * common[None, :, None]
    out["ffn_gate_inp.weight"] = demo._normal(rng, e, n, 1.0 / n)
    out["ffn_gate_exps.weight"] = demo._normal(rng, e * f, n, 1.0 / n).reshape(e, f, n)
    out["ffn_up_exps.weight"] = demo._normal(rng, e * f, n, 1.0 / n).reshape(e, f, n)
    out["ffn_down_exps.weight"] = down
    return out


def _gemma(
    rng: np.random.Generator, spec: ArchSpec, layer: int, common: np.ndarray
) -> dict[str, np.ndarray]:
    """Gemma 2/3: the input is scaled by sqrt(n_embd) and every sub-layer output is
    RMS-normalised again, so the post-norm weights set each layer's share of the
    residual stream (about RESIDUAL_GAIN of the embedding over all layers)."""
    out = _llama_like(rng, spec, layer, common)
    n = spec.n_embd
    embd_norm = np.sqrt(n) * np.sqrt(n * (1.0 + demo.COMMON**2))
    post = demo.RESIDUAL_GAIN / np.sqrt(2 * spec.n_layer) * embd_norm / np.sqrt(n)
    out["post_attention_norm.weight"] = np.full(n, post)
    out["post_ffw_norm.weight"] = np.full(n, post)
    if spec.arch == "gemma3":
        out.update(_qk_norms(spec))
    return out


def _phi3(
    rng: np.random.Generator, spec: ArchSpec, layer: int, common: np.ndarray
) -> dict[str, np.ndarray]:
    """phi3 fuses Q, K and V into attn_qkv and the gate and up projections into ffn_up."""
    b = _llama_like(rng, spec, layer, common)
    return {
        "attn_norm.weight": b["attn_norm.weight"],
        "attn_qkv.weight": np.concatenate(
            [b["attn_q.weight"], b["attn_k.weight"], b["attn_v.weight"]]
        ),
        "attn_output.weight": b["attn_output.weight"],
        "ffn_norm.weight": b["ffn_norm.weight"],
        "ffn_up.weight": np.concatenate([b["ffn_gate.weight"], b["ffn_up.weight"]]),
        "ffn_down.weight": b["ffn_down.weight"],
    }


def _deci(
    rng: np.random.Generator, spec: ArchSpec, layer: int, common: np.ndarray
) -> dict[str, np.ndarray]:
    """Per-layer KV heads; a layer with none is DeciLM's "linear attention" (wo only)."""
    if spec.kv_heads(layer) > 0:
        return _llama_like(rng, spec, layer, common)
    b = _llama_like(rng, _with_kv_heads(spec, 1), layer, common)
    n = spec.n_embd
    gain = demo.RESIDUAL_GAIN / np.sqrt(2 * spec.n_layer)
    wo = demo._perp(demo._normal(rng, n, n, gain**2 / n).T, common).T
    drop = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
    return {**{k: v for k, v in b.items() if k not in drop}, "attn_output.weight": wo}


def _with_kv_heads(spec: ArchSpec, n_head_kv: int) -> ArchSpec:
    return ArchSpec(**{**spec.__dict__, "n_head_kv": n_head_kv})


def _mamba(
    rng: np.random.Generator, spec: ArchSpec, layer: int, common: np.ndarray
) -> dict[str, np.ndarray]:
    """One Mamba block (llama_model_mamba::load_arch_tensors); A is negative, so
    the state decays and stays bounded."""
    n, d_inner = spec.n_embd, 2 * spec.n_embd
    gain = demo.RESIDUAL_GAIN / np.sqrt(spec.n_layer)

    def normal(rows: int, cols: int, var: float) -> np.ndarray:
        return demo._normal(rng, rows, cols, var)

    a = -np.tile(np.arange(1, MAMBA_D_STATE + 1, dtype=np.float32), (d_inner, 1))
    return {
        "attn_norm.weight": np.ones(n),
        "ssm_in.weight": normal(2 * d_inner, n, 1.0 / n),
        "ssm_conv1d.weight": normal(d_inner, MAMBA_D_CONV, 1.0 / MAMBA_D_CONV),
        "ssm_conv1d.bias": np.zeros(d_inner),
        "ssm_x.weight": normal(MAMBA_DT_RANK + 2 * MAMBA_D_STATE, d_inner, 1.0 / d_inner),
        "ssm_dt.weight": normal(d_inner, MAMBA_DT_RANK, 1.0 / MAMBA_DT_RANK),
        "ssm_dt.bias": np.full(d_inner, -2.0),
        "ssm_a": a,
        "ssm_d": np.ones(d_inner),
        "ssm_out.weight": demo._perp(normal(n, d_inner, gain**2 / d_inner).T, common).T,
    }


_BLOCKS: dict[str, Block] = {
    "qwen2": _qwen2,
    "qwen2vl": _qwen2,
    "qwen3": _qwen3,
    "qwen3moe": _qwen3moe,
    "gemma2": _gemma,
    "gemma3": _gemma,
    "phi3": _phi3,
    "deci": _deci,
    "mamba": _mamba,
}
