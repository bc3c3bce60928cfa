"""A GGUF file's header, key/value metadata and tensor table, read without building
its token arrays.

gguf-py's ``GGUFReader`` (the ``gguf`` package) reads the same, but makes a numpy
view of every element of every array while it opens the file: 3.4 s for
SmolLM2-135M-Instruct's 49,152 tokens and 48,900 merges on a 2-core EPYC VM, and
several times that for a 128k-token vocabulary, on every ``doctor``, ``model
inspect``, ``install`` and ``serve`` start. This reader walks the same bytes with
``struct`` and keeps arrays as offsets into the memory-mapped file, decoded when
asked: 23 ms for the same file (docs/performance.md, "Reading a model's
metadata"). gguf-py still names the value and tensor types and gives the tensor
types' sizes, and tests hold this reader's output equal to ``GGUFReader``'s.

Any inconsistency (a length past the end of the file, an unknown type) raises
``GGUFFormatError``; the caller turns it into a one-line message. So does what
llama.cpp's own reader (gguf.cpp, gguf_init_from_file) refuses in a file whose bytes
all parse: a key or a tensor name given twice, an array of arrays, a
general.alignment that is not a u32, a tensor with more than four dimensions, a
name of 64 bytes or more, rows that are not whole blocks, tensor data that does
not follow the table in order at padded offsets. Such a file would pass
``model inspect`` and doctor and stop serve only once llama.cpp opens it.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

ALIGNMENT = 32  # general.alignment's default (gguf.GGUF_DEFAULT_ALIGNMENT)
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses a tensor with more
MAX_NAME = 64  # GGML_MAX_NAME: a tensor name takes at most 63 bytes

_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file."""


class StringArray(Sequence[str]):
    """An array of strings in the file, each decoded (UTF-8, errors replaced) when read."""

    def __init__(self, buf: mmap.mmap, offsets: list[int], lengths: list[int]) -> None:
        self._buf, self._offsets, self._lengths = buf, offsets, lengths

    def __len__(self) -> int:
        return len(self._offsets)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        start = self._offsets[i]
        return self._buf[start : start + self._lengths[i]].decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists the dimensions (fastest first)
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file


@dataclass(frozen=True)
class GGUFContents:
    version: int
    fields: dict[str, Any]  # scalars as Python values, arrays as sequences
    tensors: tuple[TensorEntry, ...]
    data_start: int


@contextmanager
def open_gguf(path: Path) -> Iterator[GGUFContents]:
    """The file's metadata and tensor table; its string arrays read from the file
    while the block runs."""
    if path.exists() and not path.is_file():  # a FIFO's open would wait for a writer
        raise GGUFFormatError("not a regular file (a folder, FIFO, socket or device)")
    with path.open("rb") as fh:
        if path.stat().st_size == 0:
            raise GGUFFormatError("the file is empty")
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield _Parser(buf).contents()
        finally:
            buf.close()


class _Parser:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos, self.size = buf, 0, len(buf)
        if buf[:4] != b"GGUF":
            raise GGUFFormatError(f"magic {bytes(buf[:4])!r}, expected b'GGUF'")
        self.pos = 4
        version = self._unpack("<I")
        self.order = "<"
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order, version = ">", struct.unpack(">I", buf[4:8])[0]
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (2 and 3 are read)")
        self.version = version

    def _unpack(self, fmt: str) -> Any:
        s = struct.calcsize(fmt)
        if self.pos + s > self.size:
            raise GGUFFormatError(f"the file ends at byte {self.size}, inside the metadata")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += s
        return value

    def _count(self, what: str, item_bytes: int = 1) -> int:
        n = int(self._unpack(self.order + "Q"))
        if n * item_bytes > self.size - self.pos:
            raise GGUFFormatError(f"{what}: {n} items cannot fit in the rest of the file")
        return n

    def _string(self) -> str:
        n = self._count("a string")
        text = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def contents(self) -> GGUFContents:
        n_tensors = self._count("the tensor count", 8)
        n_kv = self._count("the key/value count", 12)
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            if key in fields:
                raise GGUFFormatError(f"key {key} is given twice")
            vtype = self._type()
            if key == "general.alignment" and vtype != GGUFValueType.UINT32:
                raise GGUFFormatError(
                    f"general.alignment is a {GGUFValueType(vtype).name}; it must be a UINT32"
                )
            fields[key] = self._value(vtype, key)
        tensors = [self._tensor_info() for _ in range(n_tensors)]
        alignment = fields.get("general.alignment", ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self.pos // alignment) * alignment
        entries = tuple(self._entry(start, *t) for t in tensors)
        _check_layout(entries, start, alignment)
        return GGUFContents(self.version, fields, entries, start)

    def _type(self) -> int:
        raw = self._unpack(self.order + "I")
        if raw not in _SCALARS and raw not in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            raise GGUFFormatError(f"unknown value type {raw}")
        return int(raw)

    def _value(self, vtype: int, key: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            return self._array(key)
        return self._unpack(self.order + _SCALARS[vtype])

    def _array(self, key: str) -> Any:
        itype = self._type()
        if itype == GGUFValueType.ARRAY:  # gguf.cpp: "has invalid GGUF type 9"
            raise GGUFFormatError(f"key {key} is an array of arrays, which llama.cpp cannot read")
        if itype == GGUFValueType.STRING:
            n = self._count("a string array", 8)
            offsets, lengths = [0] * n, [0] * n
            buf, pos, end = self.buf, self.pos, self.size
            unpack = struct.Struct(self.order + "Q").unpack_from
            for i in range(n):  # the hot loop: a vocabulary's tokens and merges
                if pos + 8 > end:
                    raise GGUFFormatError(f"the file ends at byte {end}, inside a string array")
                (length,) = unpack(buf, pos)
                pos += 8
                offsets[i], lengths[i] = pos, length
                pos += length
            if pos > end:
                raise GGUFFormatError(f"the file ends at byte {end}, inside a string array")
            self.pos = pos
            return StringArray(buf, offsets, lengths)
        fmt = self.order + _SCALARS[itype]
        width = struct.calcsize(fmt)
        n = self._count("an array", width)
        values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=n, offset=self.pos)
        self.pos += n * width
        return values.tolist() if n <= 4096 else values.copy()  # big ones (scores): arrays

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        at = self.pos
        name = self._string()
        if self.pos - at - 8 >= MAX_NAME:
            raise GGUFFormatError(f"tensor {name[:40]}...: a name of {MAX_NAME} bytes or more")
        n_dims = self._unpack(self.order + "I")
        if n_dims > MAX_DIMS:
            raise GGUFFormatError(f"tensor {name}: {n_dims} dimensions (at most {MAX_DIMS})")
        shape = tuple(int(self._unpack(self.order + "Q")) for _ in range(n_dims))
        raw_type = self._unpack(self.order + "I")
        offset = self._unpack(self.order + "Q")
        return name, shape, raw_type, offset

    def _entry(
        self, start: int, name: str, shape: tuple[int, ...], raw_type: int, offset: int
    ) -> TensorEntry:
        try:
            ttype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name}: unknown tensor type {raw_type}") from None
        n = 1
        for d in shape:
            n *= d
        if n >= 1 << 63 or any(d >= 1 << 63 for d in shape):  # int64_t in llama.cpp
            raise GGUFFormatError(f"tensor {name}: {list(shape)} is too many elements")
        row = shape[0] if shape else 1
        if row % block:  # gguf.cpp: a row is whole blocks
            raise GGUFFormatError(
                f"tensor {name}: rows of {row} values are not whole blocks of {block}"
            )
        return TensorEntry(name, ttype, shape, n, n // block * type_size, start + offset)


def _check_layout(entries: Sequence[TensorEntry], start: int, alignment: int) -> None:
    """Each tensor's data where llama.cpp expects it: right after the one before,
    padded to the alignment, in the order of the table; no name twice."""
    names: set[str] = set()
    expected = 0
    for t in entries:
        if t.name in names:
            raise GGUFFormatError(f"tensor {t.name} is given twice")
        names.add(t.name)
        if t.data_offset - start != expected:
            raise GGUFFormatError(
                f"tensor {t.name}: data at offset {t.data_offset - start}, expected {expected}"
            )
        expected += -(-t.n_bytes // alignment) * alignment
