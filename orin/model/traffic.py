"""Bytes one decode step reads from memory: the bound on single-stream decode speed.

A decode step of one token runs every weight matrix once and attends to every
cached K and V cell of its sequence, so, with nothing reused from the caches,
it reads all the weights plus the K and V rows of the cells it attends to.
Divided into a machine's memory bandwidth that is the fastest a step can be:
an AGX Orin's 204.8 GB/s over the ~3.8 GB of a 4-bit 7B model is about 50
tokens/s. ``decode_bytes_per_step`` counts those bytes for one stream and
``decode_bytes_per_batch`` for several streams decoding in one step, where the
weights are read once and the KV cells per stream.

What counts, tensor by tensor from the GGUF file's table:

- every weight tensor in full, except the token-embedding table: a step gathers
  one row of it (counted as that row), unless the model has no ``output.weight``
  and llama.cpp reads the embedding table as the output matrix too (tied
  embeddings), which is then counted in full;
- the expert tensors of a mixture of experts (``*_exps``) by the share of experts
  a step runs: ``n_expert_used`` of ``n_expert`` for one stream, at most
  ``n_expert_used`` per stream for a batch (every stream choosing other experts,
  an upper bound);
- not the trailing next-token-prediction layers, which the main context skips;
- the K and V bytes of the attended cells over every cached layer, with the row
  sizes of ``orin.model.memplan`` (per-layer KV heads, head sizes, cache types);
  a sliding-window layer attends to at most its window;
- a recurrent or hybrid model's per-sequence state, once per stream.

Activations, logits and the compute buffers stay in the caches and are left out,
so the figures are a lower bound of the traffic, and achieved bytes/s over them
a lower bound of the bandwidth used.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orin.errors import ModelFileError
from orin.model.gguf import KV_LAYOUT_ISWA, ModelInfo
from orin.model.memplan import KV_PAD, kv_caches, recurrent_state_bytes

TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_EXPERTS = re.compile(r"_exps(\.|$)")  # ffn_{gate,up,down,gate_up}_exps: one slice per expert


@dataclass(frozen=True)
class WeightTraffic:
    """The weight bytes of a model as one decode step sees them.

    ``dense`` is read in full by every step, ``experts`` holds all experts' bytes
    (a step reads its share), ``embedding_row`` is the one gathered row of the
    token-embedding table (0 when the table is read in full as the output matrix,
    and then inside ``dense``), ``skipped`` the next-token-prediction layers.
    """

    dense: int
    experts: int
    embedding_row: int
    embedding_table: int
    skipped: int = 0


@dataclass(frozen=True)
class DecodeTraffic:
    """Bytes one decode step reads: the weights (once per step) and, per stream,
    the attended K and V cells and the recurrent state."""

    weights: int
    kv: int
    state: int
    streams: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state


def weight_traffic(info: ModelInfo) -> WeightTraffic:
    """The model's weight bytes by how a decode step reads them (see WeightTraffic).

    ModelInfo keeps only per-type totals, so the tensor table is read again from
    the file (memory-mapped, no tensor data touched; cached per file version).
    """
    p = Path(info.path)
    try:
        st = p.stat()
    except OSError as exc:
        raise ModelFileError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    n_main = info.n_layer - info.n_layer_nextn
    return _weight_traffic(str(p), st.st_size, st.st_mtime_ns, n_main)


@functools.lru_cache(maxsize=16)
def _weight_traffic(path: str, size: int, mtime_ns: int, n_main: int) -> WeightTraffic:
    tensors = _tensor_table(Path(path))
    dense = experts = skipped = row = table = 0
    tied = OUTPUT not in tensors
    for name, (n_bytes, n_rows) in tensors.items():
        block = _BLOCK.match(name)
        if block is not None and int(block.group(1)) >= n_main:
            skipped += n_bytes
        elif name == TOKEN_EMBD:
            table = n_bytes
            if tied:
                dense += n_bytes  # the output matrix: every row is read
            else:
                row = n_bytes // max(n_rows, 1)
        elif _EXPERTS.search(name):
            experts += n_bytes
        else:
            dense += n_bytes
    return WeightTraffic(dense, experts, row, table, skipped)


def _tensor_table(p: Path) -> dict[str, tuple[int, int]]:
    """Tensor name -> (bytes, rows); a row is the first dimension's values."""
    from orin.model.ggufread import GGUFFormatError, open_gguf

    try:
        with open_gguf(p) as contents:
            tensors = contents.tensors
    except (GGUFFormatError, OSError) as exc:
        raise ModelFileError(f"{p}: truncated or corrupt GGUF file: {exc}") from exc
    out = {}
    for t in tensors:
        width = t.shape[0] if t.shape else 1
        out[t.name] = (t.n_bytes, t.n_elements // max(width, 1))
    return out


def expert_share(info: ModelInfo, streams: int) -> float:
    """The share of the expert tensors a step of ``streams`` streams reads, at most.

    Each stream's token runs ``n_expert_used`` experts; a batch reads the union,
    counted as if no two streams chose the same expert (capped at all of them).
    """
    if not info.n_expert:
        return 1.0
    used = info.n_expert_used or info.n_expert
    return min(info.n_expert, used * max(streams, 1)) / info.n_expert


def weight_bytes_per_step(info: ModelInfo, streams: int = 1) -> int:
    """Weight bytes one decode step of ``streams`` streams reads (weights read once)."""
    w = weight_traffic(info)
    rows = w.embedding_row * max(streams, 1)
    return w.dense + rows + round(w.experts * expert_share(info, streams))


def kv_bytes_per_cell(info: ModelInfo, type_k: str, type_v: str) -> tuple[int, int]:
    """(full-attention layers, sliding-window layers) K+V bytes of one cell.

    Taken from memplan's cache sizes for one padded block of cells, so the row
    sizes (per-layer heads, head dims, block types) are the planner's own.
    """
    caches = kv_caches(info, KV_PAD, 1, type_k.lower(), type_v.lower(), swa_full=True)
    full = sum(c.total // c.cells_per_seq for c in caches if c.kind == "full")
    swa = sum(c.total // c.cells_per_seq for c in caches if c.kind == "swa")
    return full, swa


def kv_bytes_read(info: ModelInfo, kv_cells: int, type_k: str, type_v: str) -> int:
    """K and V bytes one stream's step reads when it attends to ``kv_cells`` cells."""
    if kv_cells < 0:
        raise ValueError("kv_cells must not be negative")
    full, swa = kv_bytes_per_cell(info, type_k, type_v)
    window = kv_cells
    if info.kv_layout == KV_LAYOUT_ISWA and info.sliding_window is not None:
        window = min(kv_cells, info.sliding_window)
    return full * kv_cells + swa * window


def decode_traffic(
    info: ModelInfo, kv_cells_per_stream: Sequence[int], type_k: str, type_v: str
) -> DecodeTraffic:
    """The bytes of one decode step of ``len(kv_cells_per_stream)`` streams, by part."""
    streams = len(kv_cells_per_stream)
    if streams < 1:
        raise ValueError("a decode step has at least one stream")
    return DecodeTraffic(
        weights=weight_bytes_per_step(info, streams),
        kv=sum(kv_bytes_read(info, c, type_k, type_v) for c in kv_cells_per_stream),
        state=recurrent_state_bytes(info, 1) * streams,
        streams=streams,
    )


def decode_bytes_per_step(info: ModelInfo, kv_cells: int, type_k: str, type_v: str) -> int:
    """Bytes one decode step of one stream reads: its weights and ``kv_cells`` cells."""
    return decode_traffic(info, [kv_cells], type_k, type_v).total


def decode_bytes_per_batch(
    info: ModelInfo, kv_cells_per_stream: Sequence[int], type_k: str, type_v: str
) -> int:
    """Bytes one decode step of several streams reads: the weights once, each stream's
    attended cells (and state) once per stream."""
    return decode_traffic(info, kv_cells_per_stream, type_k, type_v).total
