"""GGUF metadata without loading weights.

Reads the header, key/value metadata and tensor table (``ggufread``: memory-mapped,
no tensor data touched, the tokenizer's arrays left undecoded) and turns them into
a ``ModelInfo`` that the planner, the profile rules and doctor share.

Any architecture is read. What llama.cpp will keep per context differs between
architectures (plain per-layer K/V, an extra sliding-window cache, a recurrent
state, a compressed MLA cache), so the info also says which layout the file
gets, taken from the same metadata llama.cpp's loader reads; the planner is
exact for the layouts it knows and labels the rest as estimates.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orin.errors import ModelFileError

if TYPE_CHECKING:
    from orin.model.ggufread import GGUFContents

GGUF_MAGIC = b"GGUF"
MAX_LAYERS = 512  # LLAMA_MAX_LAYERS: llama.cpp refuses per-layer metadata for more

# How llama.cpp keeps the context of an architecture (llama-model.cpp create_memory and
# llama-arch.cpp llm_arch_is_recurrent / llm_arch_is_hybrid). Every architecture is read;
# these sets decide whether the planner's KV figures are exact or an estimate.

# One K and one V tensor per layer of n_head_kv(layer) x head_dim values per cell, no
# sliding window: the planner matches llama.cpp's allocation byte for byte.
PLAIN_KV_ARCHITECTURES = frozenset(
    {
        "llama",
        "deci",
        "qwen2",
        "qwen2moe",
        "qwen3",
        "qwen3moe",
        "qwen2vl",
        "phi3",  # llama.cpp ignores phi3's attention.sliding_window (phi3.cpp)
        "gemma",
        "granite",
        "internlm2",
        "stablelm",
        "starcoder2",
        "exaone",
        "deepseek",
        "baichuan",
        "orion",
        "minicpm",
        "smollm3",
    }
)


@dataclass(frozen=True)
class SwaRule:
    """How an architecture's loader marks sliding-window layers (its load_arch_hparams).

    Without an ``attention.sliding_window_pattern`` array in the file, llama.cpp's
    ``set_swa_pattern(n_pattern, dense_first)`` makes every ``n_pattern``-th layer a
    full-attention layer (the last of each group, or the first with ``dense_first``);
    a scalar pattern key replaces ``n_pattern``.
    """

    n_pattern: int
    dense_first: bool = False
    default_window: int | None = None  # the window when the file names none
    needs_window: bool = False  # without a window (or with 0) no layer slides


# Architectures with an interleaved sliding window whose layout the planner knows.
SWA_RULES: dict[str, SwaRule] = {
    "gemma2": SwaRule(n_pattern=2, default_window=4096),  # alternating, local first
    "gemma3": SwaRule(n_pattern=6, needs_window=True),  # 5 local, then 1 global
    "cohere2": SwaRule(n_pattern=4),
    "olmo2": SwaRule(n_pattern=4, needs_window=True),
}

EXACT_KV_ARCHITECTURES = PLAIN_KV_ARCHITECTURES | frozenset(SWA_RULES)

# State-space / linear-attention models: a fixed recurrent state per sequence, no KV cells.
RECURRENT_ARCHITECTURES = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

# Attention layers and recurrent layers in one model.
HYBRID_ARCHITECTURES = frozenset(
    {
        "jamba",
        "falcon-h1",
        "plamo2",
        "granitehybrid",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "qwen3next",
        "kimi-linear",
        "bailingmoe3",
        "kimi-k3",
        "glm5-next",
        "qwen35",
        "qwen35moe",
        "qwen4exp",
        "deepseek4",
        "minimax-01",
    }
)

# Encoders, embedding and diffusion models: llama.cpp creates no KV memory for them.
NO_KV_ARCHITECTURES = frozenset(
    {
        "bert",
        "jina-bert-v2",
        "jina-bert-v3",
        "nomic-bert",
        "nomic-bert-moe",
        "neo-bert",
        "eurobert",
        "wavtokenizer-dec",
        "modern-bert",
        "gemma-embedding",
        "dream",
        "llada",
        "llada-moe",
        "rnd1",
    }
)

# KV layouts. "standard" and "iswa" are computed exactly; the others are estimates.
KV_LAYOUT_STANDARD = "standard"  # every layer caches every cell
KV_LAYOUT_ISWA = "iswa"  # full-attention layers plus a separate sliding-window cache
KV_LAYOUT_RECURRENT = "recurrent"
KV_LAYOUT_HYBRID = "hybrid"
KV_LAYOUT_MLA = "mla"  # compressed latent K, no V (multi-head latent attention)
KV_LAYOUT_NONE = "none"
KV_LAYOUT_UNKNOWN = "unknown"
EXACT_KV_LAYOUTS = frozenset({KV_LAYOUT_STANDARD, KV_LAYOUT_ISWA})

# Nominal bits per weight of each llama.cpp file type family, used to match
# the KV-cache precision to the weights.
_BITS_BY_PREFIX = (
    ("F32", 32),
    ("F16", 16),
    ("BF16", 16),
    ("Q8", 8),
    ("Q6", 6),
    ("Q5", 5),
    ("Q4", 4),
    ("IQ4", 4),
    ("MXFP4", 4),
    ("NVFP4", 4),
    ("Q3", 3),
    ("IQ3", 3),
    ("Q2", 2),
    ("IQ2", 2),
    ("TQ2", 2),
    ("TQ1", 2),
    ("IQ1", 1),
    ("Q1", 1),
)


def weight_bits(quantization: str) -> int | None:
    """Nominal bits per weight of a quantization name such as ``Q4_K_M``."""
    name = quantization.upper()
    for prefix, bits in _BITS_BY_PREFIX:
        if name == prefix or name.startswith(prefix + "_"):
            return bits
    return None


@dataclass(frozen=True)
class TensorTypeShare:
    """How many tensors, elements and bytes a tensor type accounts for."""

    type: str
    tensors: int
    elements: int
    bytes: int


@dataclass(frozen=True)
class RopeInfo:
    freq_base: float
    dimension_count: int | None = None
    scaling_type: str | None = None
    scaling_factor: float | None = None
    original_context_length: int | None = None


@dataclass(frozen=True)
class RecurrentState:
    """Sizes of the per-sequence state of recurrent layers (f32 rows in llama.cpp).

    ``r`` is the rolling convolution or token-shift state, ``s`` the SSM or WKV
    state, in values per layer (llama_hparams::n_embd_r and n_embd_s).
    """

    r: int
    s: int


@dataclass(frozen=True)
class ModelInfo:
    """Everything orin-llm needs to know about a GGUF file before loading it.

    The KV fields say what llama.cpp will allocate for the model: ``kv_layout`` is
    ``standard`` or ``iswa`` where the planner computes the cache exactly, and
    ``recurrent``, ``hybrid``, ``mla``, ``none`` or ``unknown`` where its figures are
    estimates (``kv_note`` says why). ``swa_layers`` flags, per layer, the layers that
    attend only to the last ``sliding_window`` positions, as llama.cpp decides it
    (empty, and ``sliding_window`` None, where no layer slides or the layers are not
    known; the file's own value is then ``extra["sliding_window_metadata"]``).
    """

    path: str
    file_size: int
    gguf_version: int
    architecture: str
    name: str | None
    file_type: int | None
    quantization: str
    tensor_types: tuple[TensorTypeShare, ...]
    parameter_count: int
    weights_bytes: int
    n_layer: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    head_dim_k: int
    head_dim_v: int
    n_embd: int
    n_ff: int | None
    n_ctx_train: int
    rope: RopeInfo
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    sliding_window: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    kv_layout: str = KV_LAYOUT_STANDARD
    kv_note: str | None = None
    swa_layers: tuple[bool, ...] = ()
    head_dim_k_swa: int | None = None  # None: the same as head_dim_k
    head_dim_v_swa: int | None = None
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int | None = None
    n_layer_nextn: int = 0  # trailing next-token-prediction layers the main context skips
    recurrent_state: RecurrentState | None = None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def weight_bits(self) -> int | None:
        return weight_bits(self.quantization)

    @property
    def kv_heads_uniform(self) -> bool:
        return len(set(self.n_head_kv)) <= 1

    @property
    def kv_exact(self) -> bool:
        """Whether the planner's KV figures match llama.cpp's allocation exactly."""
        return self.kv_layout in EXACT_KV_LAYOUTS

    @property
    def n_swa_layers(self) -> int:
        return sum(self.swa_layers)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    def head_dims(self, layer: int) -> tuple[int, int]:
        """(K, V) head dimension of a layer; sliding-window layers may have their own."""
        if self.is_swa(layer):
            k = self.head_dim_k_swa if self.head_dim_k_swa is not None else self.head_dim_k
            v = self.head_dim_v_swa if self.head_dim_v_swa is not None else self.head_dim_v
            return k, v
        return self.head_dim_k, self.head_dim_v

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (the chat template itself is summarised, not dumped)."""
        return {
            "path": self.path,
            "file_size": self.file_size,
            "gguf_version": self.gguf_version,
            "architecture": self.architecture,
            "name": self.name,
            "file_type": self.file_type,
            "quantization": self.quantization,
            "weight_bits": self.weight_bits,
            "tensor_types": [vars(t) for t in self.tensor_types],
            "parameter_count": self.parameter_count,
            "weights_bytes": self.weights_bytes,
            "n_layer": self.n_layer,
            "n_head": _compact(self.n_head),
            "n_head_kv": _compact(self.n_head_kv),
            "n_head_per_layer": list(self.n_head),
            "n_head_kv_per_layer": list(self.n_head_kv),
            "head_dim_k": self.head_dim_k,
            "head_dim_v": self.head_dim_v,
            "head_dim_k_swa": self.head_dim_k_swa,
            "head_dim_v_swa": self.head_dim_v_swa,
            "n_embd": self.n_embd,
            "n_ff": self.n_ff,
            "n_ctx_train": self.n_ctx_train,
            "rope": vars(self.rope),
            "kv_layout": self.kv_layout,
            "kv_exact": self.kv_exact,
            "kv_note": self.kv_note,
            "sliding_window": self.sliding_window,
            "sliding_window_metadata": self.extra.get("sliding_window_metadata"),
            "swa_layers": [i for i, swa in enumerate(self.swa_layers) if swa],
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "n_ff_exp": self.n_ff_exp,
            "n_layer_nextn": self.n_layer_nextn,
            "recurrent_state": vars(self.recurrent_state) if self.recurrent_state else None,
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "has_chat_template": self.has_chat_template,
        }


def _compact(values: Sequence[int]) -> int | list[int]:
    """One number when every layer agrees, the per-layer list otherwise."""
    return values[0] if len(set(values)) == 1 else list(values)


def quantization_name(file_type: int | None) -> str | None:
    """``15`` -> ``Q4_K_M``, using gguf's own LlamaFileType names."""
    if file_type is None:
        return None
    from gguf import LlamaFileType

    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return None
    return re.sub(r"^(MOSTLY|ALL)_", "", name)


def read_model_info(path: str | Path) -> ModelInfo:
    """Read a GGUF file's metadata; any problem is a one-line ModelFileError."""
    from orin.model.ggufread import GGUFFormatError, open_gguf  # imports gguf and numpy

    p = Path(path)
    _check_file(p)
    try:
        with open_gguf(p) as contents:
            return _build_info(p, contents)
    except GGUFFormatError as exc:
        raise ModelFileError(f"{p}: truncated or corrupt GGUF file: {exc}") from exc
    except OSError as exc:
        raise ModelFileError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    except ModelFileError as exc:
        if str(p) in str(exc):
            raise
        raise ModelFileError(f"{p}: {exc}") from exc  # which file, for every message
    except (KeyError, ValueError, TypeError, IndexError, OverflowError) as exc:
        raise ModelFileError(f"{p}: malformed GGUF metadata: {exc}") from exc


def _check_file(p: Path) -> None:
    if not p.exists():
        raise ModelFileError(f"{p}: no such file")
    if p.is_dir():
        raise ModelFileError(f"{p}: is a directory, not a GGUF file")
    if not p.is_file():  # opening a FIFO would wait for a writer; llama.cpp maps a file
        raise ModelFileError(f"{p}: not a regular file (a FIFO, socket or device), not a GGUF file")
    try:
        with p.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelFileError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{p}: not a GGUF file (magic {magic!r}, expected b'GGUF')")


class _Meta:
    """Typed access to the file's key/value fields."""

    def __init__(self, contents: GGUFContents) -> None:
        self.fields = contents.fields

    def get(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key, default)
        if hasattr(value, "tolist"):  # a large numeric array
            return value.tolist()
        if isinstance(value, Sequence) and not isinstance(value, str):
            return list(value)
        return value

    def strings(self, key: str) -> Sequence[str]:
        """A string array as it is in the file, each string decoded when read."""
        value = self.fields.get(key)
        return value if isinstance(value, Sequence) and not isinstance(value, str) else ()

    def require_int(self, key: str) -> int:
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"missing metadata key {key}")
        if isinstance(value, bool) or not isinstance(value, int):  # llama.cpp: "wrong type"
            raise ModelFileError(f"metadata key {key} must be an integer, not {value!r}")
        return value


def _per_layer(meta: _Meta, key: str, n_layer: int, default: int) -> tuple[int, ...]:
    """Scalar or per-layer array metadata, expanded to one value per layer."""
    value = meta.get(key, default)
    if isinstance(value, list):
        if len(value) != n_layer:
            raise ModelFileError(f"{key} has {len(value)} entries for {n_layer} layers")
        return tuple(int(v) for v in value)
    return (int(value),) * n_layer


def _tensor_stats(p: Path, contents: GGUFContents) -> tuple[tuple[TensorTypeShare, ...], int, int]:
    counts: Counter[str] = Counter()
    elements: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    size = p.stat().st_size
    for t in contents.tensors:
        end = t.data_offset + t.n_bytes
        if end > size:
            raise ModelFileError(
                f"{p}: truncated GGUF file: tensor {t.name} ends at byte {end}, file has {size}"
            )
        name = t.tensor_type.name
        counts[name] += 1
        elements[name] += t.n_elements
        nbytes[name] += t.n_bytes
    shares = tuple(
        TensorTypeShare(type=k, tensors=counts[k], elements=elements[k], bytes=nbytes[k])
        for k in sorted(counts, key=lambda k: -nbytes[k])
    )
    return shares, sum(elements.values()), sum(nbytes.values())


SPLIT_PART = re.compile(r"-\d{5}-of-(\d{5})\.gguf$", re.IGNORECASE)
"""The end of a llama-gguf-split part's name (``-00002-of-00003.gguf``), the count in
its group."""


def _refuse_split(p: Path, meta: _Meta) -> None:
    """A part of a model split by llama-gguf-split (``split.count`` > 1) holds only some of
    the tensors, and only the first part the metadata: read alone, its weights and memory
    plan would be a fraction of the model's. orin-llm serves single-file models."""
    count = meta.get("split.count")
    if not isinstance(count, int) or isinstance(count, bool) or count <= 1:
        return
    number = meta.get("split.no")
    part = f"part {number + 1} of {count}" if isinstance(number, int) else f"a part of {count}"
    first = SPLIT_PART.sub(r"-00001-of-\1.gguf", p.name)
    merged = SPLIT_PART.sub(".gguf", p.name)
    if merged == p.name:
        first, merged = "FIRST-PART.gguf", "MERGED.gguf"
    raise ModelFileError(
        f"{p}: {part} of a split model (split.count {count}); orin-llm reads single-file "
        f"models: merge the parts into one with `llama-gguf-split --merge {first} {merged}`"
    )


def _guess_quantization(shares: Sequence[TensorTypeShare]) -> str:
    """Without general.file_type, name the type holding most of the weight bytes."""
    return shares[0].type if shares else "unknown"


def _build_info(p: Path, contents: GGUFContents) -> ModelInfo:
    meta = _Meta(contents)
    _refuse_split(p, meta)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{p}: GGUF file has no general.architecture")
    if arch == "clip":
        raise ModelFileError(
            f"{p}: a vision projector (mmproj), not a language model; a profile names it as "
            "model.mmproj beside the model it serves"
        )
    shares, n_params, n_bytes = _tensor_stats(p, contents)
    file_type = meta.get("general.file_type")
    file_type = int(file_type) if file_type is not None else None
    quant = quantization_name(file_type) or _guess_quantization(shares)

    n_layer = meta.require_int(f"{arch}.block_count")
    if not 0 < n_layer <= MAX_LAYERS:
        raise ModelFileError(
            f"{p}: {arch}.block_count is {n_layer}; llama.cpp loads 1 to {MAX_LAYERS} layers"
        )
    n_embd = meta.require_int(f"{arch}.embedding_length")
    n_head = _per_layer(meta, f"{arch}.attention.head_count", n_layer, 0)
    if not any(n_head) and arch in EXACT_KV_ARCHITECTURES:
        raise ModelFileError(f"{p}: missing metadata key {arch}.attention.head_count")
    # llama.cpp: n_head_kv defaults to n_head layer by layer; head sizes to n_embd / n_head(0)
    n_head_kv = _per_layer_default(meta, f"{arch}.attention.head_count_kv", n_head)
    head_ref = n_head[0] or max(n_head)
    head_default = n_embd // head_ref if head_ref else 0
    head_k = int(meta.get(f"{arch}.attention.key_length", head_default))
    head_v = int(meta.get(f"{arch}.attention.value_length", head_default))
    head_k_swa = meta.get(f"{arch}.attention.key_length_swa")
    head_v_swa = meta.get(f"{arch}.attention.value_length_swa")
    nextn = int(meta.get(f"{arch}.nextn_predict_layers", 0))
    layout = _kv_layout(meta, arch, n_layer, nextn)
    tokens = meta.strings("tokenizer.ggml.tokens")
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    extra: dict[str, Any] = {}
    window_meta = meta.get(f"{arch}.attention.sliding_window")
    if window_meta is not None and not layout.swa_layers:
        extra["sliding_window_metadata"] = window_meta
    return ModelInfo(
        path=str(p),
        file_size=p.stat().st_size,
        gguf_version=contents.version,
        architecture=arch,
        name=meta.get("general.name"),
        file_type=file_type,
        quantization=quant,
        tensor_types=shares,
        parameter_count=n_params,
        weights_bytes=n_bytes,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_k,
        head_dim_v=head_v,
        n_embd=n_embd,
        n_ff=_max_or_none(meta.get(f"{arch}.feed_forward_length")),
        n_ctx_train=meta.require_int(f"{arch}.context_length"),
        rope=_rope(meta, arch),
        vocab_size=int(meta.get(f"{arch}.vocab_size", len(tokens))),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_id=int(eos) if eos is not None else None,
        bos_token=_token_text(tokens, bos),
        eos_token=_token_text(tokens, eos),
        chat_template=meta.get("tokenizer.chat_template"),
        sliding_window=layout.window,
        extra=extra,
        kv_layout=layout.layout,
        kv_note=layout.note,
        swa_layers=layout.swa_layers,
        head_dim_k_swa=int(head_k_swa) if head_k_swa is not None else None,
        head_dim_v_swa=int(head_v_swa) if head_v_swa is not None else None,
        n_expert=int(meta.get(f"{arch}.expert_count", 0)),
        n_expert_used=_max_or_none(meta.get(f"{arch}.expert_used_count")) or 0,
        n_ff_exp=_max_or_none(meta.get(f"{arch}.expert_feed_forward_length")),
        n_layer_nextn=nextn,
        recurrent_state=(
            _recurrent_state(meta, arch, n_embd)
            if layout.layout in (KV_LAYOUT_RECURRENT, KV_LAYOUT_HYBRID)
            else None
        ),
    )


def _per_layer_default(meta: _Meta, key: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """Like _per_layer, but an absent key takes the per-layer default as it is."""
    if meta.get(key) is None:
        return default
    return _per_layer(meta, key, len(default), 0)


def _max_or_none(value: Any) -> int | None:
    """A scalar, or the largest entry of a per-layer array."""
    if value is None:
        return None
    if isinstance(value, list):
        return max((int(v) for v in value), default=None)
    return int(value)


@dataclass(frozen=True)
class _Layout:
    layout: str
    note: str | None = None
    swa_layers: tuple[bool, ...] = ()
    window: int | None = None


def _kv_layout(meta: _Meta, arch: str, n_layer: int, n_layer_nextn: int) -> _Layout:
    """The KV layout llama.cpp builds for this file (llama-model.cpp create_memory)."""
    if arch in RECURRENT_ARCHITECTURES:
        return _Layout(
            KV_LAYOUT_RECURRENT,
            "a recurrent model: llama.cpp keeps a fixed state per sequence instead of KV "
            "cells; the state is estimated from the ssm/wkv metadata",
        )
    if arch in HYBRID_ARCHITECTURES:
        return _Layout(
            KV_LAYOUT_HYBRID,
            "a hybrid model: attention layers cache K and V (counted where the metadata "
            "gives them KV heads), recurrent layers keep a state per sequence",
        )
    if arch in NO_KV_ARCHITECTURES:
        return _Layout(KV_LAYOUT_NONE, "llama.cpp keeps no KV cache for this architecture")
    if meta.get(f"{arch}.attention.key_length_mla") is not None:
        return _Layout(
            KV_LAYOUT_MLA,
            "multi-head latent attention: llama.cpp caches one compressed K row per layer "
            "and no V; estimated from attention.key_length x head_count_kv",
        )
    window = meta.get(f"{arch}.attention.sliding_window")
    rule = SWA_RULES.get(arch)
    if rule is not None:
        if window is None:
            window = rule.default_window
        if rule.needs_window and not window:
            return _Layout(KV_LAYOUT_STANDARD)  # llama.cpp runs it without a window
        if window is None:
            return _Layout(
                KV_LAYOUT_UNKNOWN,
                f"{arch} needs attention.sliding_window, which this file lacks",
            )
        flags = _swa_flags(meta, arch, n_layer, n_layer_nextn, rule)
        if not any(flags):
            return _Layout(KV_LAYOUT_UNKNOWN, "the sliding-window pattern marks no layer")
        return _Layout(KV_LAYOUT_ISWA, swa_layers=flags, window=int(window))
    if arch in PLAIN_KV_ARCHITECTURES:
        return _Layout(KV_LAYOUT_STANDARD)
    note = (
        f"llama.cpp's KV layout for '{arch}' is not known to the planner: the figures "
        "assume every layer caches K and V for every cell"
    )
    if window:
        note += " (the file names a sliding window; with swa_full llama.cpp sizes it the same)"
    return _Layout(KV_LAYOUT_UNKNOWN, note)


def _swa_flags(
    meta: _Meta, arch: str, n_layer: int, n_layer_nextn: int, rule: SwaRule
) -> tuple[bool, ...]:
    """Per-layer sliding-window flags (llama_model_base::load_swa_pattern).

    An array ``attention.sliding_window_pattern`` is taken as it is, layer by layer;
    otherwise llama_hparams::set_swa_pattern applies ``n_pattern`` (the scalar key,
    or the architecture's own) to the layers before the next-token-prediction ones.
    """
    raw = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(raw, list):
        return tuple(bool(raw[i]) if i < len(raw) else False for i in range(n_layer))
    n_pattern = int(raw) if raw is not None else rule.n_pattern
    n_main = n_layer - n_layer_nextn
    flags = []
    for il in range(n_layer):
        if il >= n_main:
            flags.append(False)
        elif n_pattern == 0:
            flags.append(True)
        elif rule.dense_first:
            flags.append(il % n_pattern != 0)
        else:
            flags.append(il % n_pattern < n_pattern - 1)
    return tuple(flags)


def _recurrent_state(meta: _Meta, arch: str, n_embd: int) -> RecurrentState | None:
    """State sizes per layer and sequence (llama_hparams::n_embd_r / n_embd_s)."""
    wkv = meta.get(f"{arch}.wkv.head_size")
    if wkv:
        shift = int(meta.get(f"{arch}.token_shift_count", 2))
        return RecurrentState(r=shift * n_embd, s=n_embd * int(wkv))
    d_conv = meta.get(f"{arch}.ssm.conv_kernel")
    d_inner = meta.get(f"{arch}.ssm.inner_size")
    d_state = meta.get(f"{arch}.ssm.state_size")
    if d_conv is None or d_inner is None or d_state is None:
        return None
    n_group = int(meta.get(f"{arch}.ssm.group_count", 0))
    d_conv, d_inner, d_state = int(d_conv), int(d_inner), int(d_state)
    return RecurrentState(
        r=max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state), s=d_state * d_inner
    )


def _token_text(tokens: Sequence[str], token_id: Any) -> str | None:
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return str(tokens[int(token_id)])


def _rope(meta: _Meta, arch: str) -> RopeInfo:
    factor = meta.get(f"{arch}.rope.scaling.factor")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    dims = meta.get(f"{arch}.rope.dimension_count")
    return RopeInfo(
        freq_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        dimension_count=int(dims) if dims is not None else None,
        scaling_type=meta.get(f"{arch}.rope.scaling.type"),
        scaling_factor=float(factor) if factor is not None else None,
        original_context_length=int(orig) if orig is not None else None,
    )
