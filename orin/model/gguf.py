"""GGUF metadata without loading weights.

Reads the header, key/value metadata and tensor table through the ``gguf``
package (memory-mapped, no tensor data touched) and turns them into a
``ModelInfo`` that the planner, the profile rules and doctor share.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orin.errors import ModelFileError

GGUF_MAGIC = b"GGUF"

# Decoder-only architectures whose KV cache follows the plain formula (every
# layer caches K and V for n_head_kv heads of head_dim). Others (recurrent,
# MLA, hybrid) need their own accounting and are refused rather than misplanned.
SUPPORTED_ARCHITECTURES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "phi3",
        "gemma",
        "granite",
        "internlm2",
        "stablelm",
        "starcoder2",
        "olmo2",
        "exaone",
        "deepseek",
        "baichuan",
        "orion",
        "minicpm",
        "smollm3",
    }
)

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
class ModelInfo:
    """Everything orin-llm needs to know about a GGUF file before loading it."""

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

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def weight_bits(self) -> int | None:
        return weight_bits(self.quantization)

    @property
    def kv_heads_uniform(self) -> bool:
        return len(set(self.n_head_kv)) <= 1

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
            "n_embd": self.n_embd,
            "n_ff": self.n_ff,
            "n_ctx_train": self.n_ctx_train,
            "rope": vars(self.rope),
            "sliding_window": self.sliding_window,
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
    p = Path(path)
    _check_file(p)
    reader = _open_reader(p)
    try:
        return _build_info(p, reader)
    except ModelFileError:
        raise
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise ModelFileError(f"{p}: malformed GGUF metadata: {exc}") from exc


def _check_file(p: Path) -> None:
    if not p.exists():
        raise ModelFileError(f"{p}: no such file")
    if p.is_dir():
        raise ModelFileError(f"{p}: is a directory, not a GGUF file")
    try:
        with p.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelFileError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{p}: not a GGUF file (magic {magic!r}, expected b'GGUF')")


def _open_reader(p: Path) -> Any:
    import numpy as np
    from gguf import GGUFReader

    try:
        with np.errstate(all="ignore"):
            return GGUFReader(p, "r")
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, OSError) as exc:
        raise ModelFileError(f"{p}: truncated or corrupt GGUF file: {exc}") from exc


class _Meta:
    """Typed access to the reader's key/value fields."""

    def __init__(self, reader: Any) -> None:
        self.fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        if isinstance(value, list):
            return [_plain(v) for v in value]
        return _plain(value)

    def require_int(self, key: str) -> int:
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"missing metadata key {key}")
        if isinstance(value, list):
            raise ModelFileError(f"metadata key {key} must be a number")
        return int(value)


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if hasattr(value, "item"):
        return value.item()
    return value


def _per_layer(meta: _Meta, key: str, n_layer: int, default: int) -> tuple[int, ...]:
    """Scalar or per-layer array metadata, expanded to one value per layer."""
    value = meta.get(key, default)
    if isinstance(value, list):
        if len(value) != n_layer:
            raise ModelFileError(f"{key} has {len(value)} entries for {n_layer} layers")
        return tuple(int(v) for v in value)
    return (int(value),) * n_layer


def _tensor_stats(p: Path, reader: Any) -> tuple[tuple[TensorTypeShare, ...], int, int]:
    counts: Counter[str] = Counter()
    elements: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    size = p.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelFileError(
                f"{p}: truncated GGUF file: tensor {t.name} ends at byte {end}, file has {size}"
            )
        name = t.tensor_type.name
        counts[name] += 1
        elements[name] += int(t.n_elements)
        nbytes[name] += int(t.n_bytes)
    shares = tuple(
        TensorTypeShare(type=k, tensors=counts[k], elements=elements[k], bytes=nbytes[k])
        for k in sorted(counts, key=lambda k: -nbytes[k])
    )
    return shares, sum(elements.values()), sum(nbytes.values())


def _guess_quantization(shares: Sequence[TensorTypeShare]) -> str:
    """Without general.file_type, name the type holding most of the weight bytes."""
    return shares[0].type if shares else "unknown"


def _build_info(p: Path, reader: Any) -> ModelInfo:
    meta = _Meta(reader)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{p}: GGUF file has no general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ModelFileError(f"{p}: unsupported architecture '{arch}' (supported: {supported})")
    shares, n_params, n_bytes = _tensor_stats(p, reader)
    file_type = meta.get("general.file_type")
    file_type = int(file_type) if file_type is not None else None
    quant = quantization_name(file_type) or _guess_quantization(shares)

    n_layer = meta.require_int(f"{arch}.block_count")
    n_embd = meta.require_int(f"{arch}.embedding_length")
    n_head = _per_layer(meta, f"{arch}.attention.head_count", n_layer, 0)
    if not any(n_head):
        raise ModelFileError(f"{p}: missing metadata key {arch}.attention.head_count")
    n_head_kv = _per_layer(meta, f"{arch}.attention.head_count_kv", n_layer, max(n_head))
    head_ref = max(n_head)
    head_k = int(meta.get(f"{arch}.attention.key_length", n_embd // head_ref))
    head_v = int(meta.get(f"{arch}.attention.value_length", head_k))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    n_ff = meta.get(f"{arch}.feed_forward_length")
    return ModelInfo(
        path=str(p),
        file_size=p.stat().st_size,
        gguf_version=int(_plain(reader.fields["GGUF.version"].contents())),
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
        n_ff=max(n_ff) if isinstance(n_ff, list) else (int(n_ff) if n_ff is not None else None),
        n_ctx_train=meta.require_int(f"{arch}.context_length"),
        rope=_rope(meta, arch),
        vocab_size=int(meta.get(f"{arch}.vocab_size", len(tokens))),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_id=int(eos) if eos is not None else None,
        bos_token=_token_text(tokens, bos),
        eos_token=_token_text(tokens, eos),
        chat_template=meta.get("tokenizer.chat_template"),
        sliding_window=meta.get(f"{arch}.attention.sliding_window"),
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
