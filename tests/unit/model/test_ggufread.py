"""orin.model.ggufread against gguf-py's own GGUFReader: the same fields, the same
tensor table, for every value type, both byte orders and a custom alignment; a file
cut anywhere in its metadata is a GGUFFormatError, never another exception."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from orin.model.ggufread import GGUFFormatError, StringArray, open_gguf

TOKENS = [f"tok{i}" if i % 7 else f"é{i}\u2581" for i in range(20_000)]


def write(path: Path, endian: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = None) -> Path:
    w = GGUFWriter(path, "llama", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -32000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "naïve 日本 🚀")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.bools", [True, False])
    w.add_array("tokenizer.ggml.tokens", TOKENS)
    w.add_key_value(
        "t.scores",
        np.arange(10_000, dtype=np.float32).tolist(),
        GGUFValueType.ARRAY,
        GGUFValueType.FLOAT32,
    )
    w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b", np.ones((2, 64), dtype=np.float16))
    q8 = np.zeros((2, 34), dtype=np.uint8)  # two rows of one Q8_0 block (32 values) each
    w.add_tensor("c", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def plain(value: Any) -> Any:
    if isinstance(value, (StringArray, list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return value


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG])
@pytest.mark.parametrize("alignment", [None, 64])
def test_the_same_as_gguf_pys_reader(
    tmp_path: Path, endian: GGUFEndian, alignment: int | None
) -> None:
    path = write(tmp_path / "m.gguf", endian, alignment)
    want = GGUFReader(path)
    with open_gguf(path) as got:
        assert got.version == int(want.fields["GGUF.version"].contents())
        theirs = {
            k: plain(f.contents()) for k, f in want.fields.items() if not k.startswith("GGUF.")
        }
        ours = {k: plain(v) for k, v in got.fields.items()}
        assert ours == theirs
        assert isinstance(got.fields["tokenizer.ggml.tokens"], StringArray)
        assert [
            (t.name, t.tensor_type, t.shape, t.n_elements, t.n_bytes, t.data_offset)
            for t in got.tensors
        ] == [
            (
                t.name,
                t.tensor_type,
                tuple(int(d) for d in t.shape),
                int(t.n_elements),
                int(t.n_bytes),
                int(t.data_offset),
            )
            for t in want.tensors
        ]
        assert got.data_start % (alignment or 32) == 0


def test_a_string_array_is_read_string_by_string(tmp_path: Path) -> None:
    with open_gguf(write(tmp_path / "m.gguf")) as got:
        tokens = got.fields["tokenizer.ggml.tokens"]
        assert len(tokens) == len(TOKENS)
        assert (tokens[0], tokens[7], tokens[-1]) == (TOKENS[0], TOKENS[7], TOKENS[-1])
        assert tokens[5:9] == TOKENS[5:9]


def test_a_file_cut_in_its_metadata_is_a_format_error(tmp_path: Path) -> None:
    whole = write(tmp_path / "m.gguf").read_bytes()
    with open_gguf(tmp_path / "m.gguf") as got:
        end = got.data_start
    cut = tmp_path / "cut.gguf"
    last = end - 32  # at most the padding before the tensor data follows the table
    for size in [*range(0, 64), *range(64, last, last // 150), last]:
        cut.write_bytes(whole[:size])
        with pytest.raises(GGUFFormatError), open_gguf(cut):
            pass


@pytest.mark.parametrize(
    ("offset", "value"),
    [
        (4, (1).to_bytes(4, "little")),  # version 1
        (8, (2**60).to_bytes(8, "little")),  # tensors past the end of the file
        (16, (2**60).to_bytes(8, "little")),  # keys past the end of the file
    ],
)
def test_impossible_counts_are_format_errors(tmp_path: Path, offset: int, value: bytes) -> None:
    data = bytearray(write(tmp_path / "m.gguf").read_bytes())
    data[offset : offset + len(value)] = value
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError), open_gguf(bad):
        pass


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: GGUFValueType, value: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + value


def _tensor(name: str, dims: list[int], ttype: int = 0, offset: int = 0) -> bytes:
    shape = b"".join(struct.pack("<Q", d) for d in dims)
    return _s(name) + struct.pack("<I", len(dims)) + shape + struct.pack("<IQ", ttype, offset)


ARCH = _kv("general.architecture", GGUFValueType.STRING, _s("llama"))
ROW = _tensor("a", [32, 4])  # f32: 512 bytes at offset 0
NESTED = struct.pack("<IQ", GGUFValueType.ARRAY, 1)


def raw_gguf(path: Path, kvs: list[bytes], tensors: list[bytes], alignment: int = 32) -> Path:
    """A GGUF file byte by byte, for the layouts GGUFWriter will not write."""
    body = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs) + 1)
    body += ARCH + b"".join(kvs) + b"".join(tensors)
    path.write_bytes(body + bytes(-len(body) % alignment) + bytes(4096))
    return path


# What llama.cpp's gguf_init_from_file refuses, each in a file whose bytes all parse.
REFUSED = {
    "a key twice": ([_kv("x", GGUFValueType.UINT32, b"\0" * 4)] * 2, [ROW], "key x is given twice"),
    "an array of arrays": (
        [_kv("x", GGUFValueType.ARRAY, NESTED + struct.pack("<IQ", GGUFValueType.UINT8, 0))],
        [],
        "array of arrays",
    ),
    "arrays nested 100,000 deep": (
        [_kv("x", GGUFValueType.ARRAY, NESTED * 100_000 + struct.pack("<IQ", 4, 0))],
        [],
        "array of arrays",
    ),
    "a u8 alignment": (
        [_kv("general.alignment", GGUFValueType.UINT8, b"\x20")],
        [ROW],
        "general.alignment is a UINT8",
    ),
    "a bool alignment": (
        [_kv("general.alignment", GGUFValueType.BOOL, b"\x01")],
        [ROW],
        "general.alignment is a BOOL",
    ),
    "a tensor twice": ([], [ROW, _tensor("a", [32, 4], offset=512)], "tensor a is given twice"),
    "five dimensions": ([], [_tensor("a", [32, 1, 1, 1, 4])], "5 dimensions"),
    "a 64-byte name": ([], [_tensor("n" * 64, [32, 4])], "64 bytes or more"),
    "rows not whole blocks": (
        [],
        [_tensor("a", [16, 4], GGMLQuantizationType.Q8_0)],  # 64 values: two blocks
        "rows of 16 values are not whole blocks of 32",
    ),
    "a misaligned offset": ([], [_tensor("a", [32, 4], offset=3)], "offset 3, expected 0"),
    "overlapping data": (
        [],
        [ROW, _tensor("b", [32, 4], offset=0)],
        "tensor b: data at offset 0, expected 512",
    ),
    "a gap before a tensor": (
        [],
        [ROW, _tensor("b", [32, 4], offset=544)],
        "tensor b: data at offset 544, expected 512",
    ),
    "too many elements": ([], [_tensor("a", [2**32, 2**32])], "too many elements"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_llama_cpp_refuses_is_a_format_error(tmp_path: Path, case: str) -> None:
    kvs, tensors, message = REFUSED[case]
    bad = raw_gguf(tmp_path / "bad.gguf", kvs, tensors)
    with pytest.raises(GGUFFormatError, match=message), open_gguf(bad):
        pass


def test_what_llama_cpp_accepts_at_the_limits_is_read(tmp_path: Path) -> None:
    good = raw_gguf(
        tmp_path / "m.gguf",
        [_kv("general.alignment", GGUFValueType.UINT32, struct.pack("<I", 64))],
        [_tensor("n" * 63, [32, 1, 1, 4]), _tensor("b", [32], offset=512)],
        alignment=64,
    )
    with open_gguf(good) as got:
        assert [(t.name[:2], t.shape, t.data_offset - got.data_start) for t in got.tensors] == [
            ("nn", (32, 1, 1, 4), 0),
            ("b", (32,), 512),
        ]


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GGUFFormatError, match="not a regular file"), open_gguf(fifo):
        pass
