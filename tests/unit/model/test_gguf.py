from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orin.errors import ModelFileError
from orin.model.gguf import read_model_info, weight_bits
from tests.ggufutil import LLAMA2_7B, write_gguf


def test_llama2_7b_metadata_only(tmp_path: Path) -> None:
    info = read_model_info(write_gguf(tmp_path / "l2.gguf", params=LLAMA2_7B, file_type=15))
    assert info.architecture == "llama"
    assert info.quantization == "Q4_K_M"
    assert info.weight_bits == 4
    assert info.n_layer == 32
    assert info.n_head == (32,) * 32
    assert info.n_head_kv == (32,) * 32
    assert info.head_dim_k == info.head_dim_v == 128
    assert info.n_ctx_train == 4096
    assert info.rope.freq_base == 10000.0
    assert info.parameter_count == 0 and info.weights_bytes == 0
    assert info.has_chat_template is False


def test_per_layer_kv_heads_array(tmp_path: Path) -> None:
    params = dict(LLAMA2_7B, block_count=4, **{"attention.head_count_kv": [8, 8, 4, 0]})
    info = read_model_info(write_gguf(tmp_path / "a.gguf", params=params))
    assert info.n_head_kv == (8, 8, 4, 0)
    assert info.kv_heads_uniform is False
    assert info.to_dict()["n_head_kv"] == [8, 8, 4, 0]


def test_per_layer_array_of_wrong_length(tmp_path: Path) -> None:
    params = dict(LLAMA2_7B, block_count=4, **{"attention.head_count_kv": [8, 8]})
    with pytest.raises(ModelFileError, match="2 entries for 4 layers"):
        read_model_info(write_gguf(tmp_path / "a.gguf", params=params))


def test_tensor_mix_and_parameter_count(tmp_path: Path) -> None:
    tensors = {
        "token_embd.weight": np.zeros((16, 8), dtype=np.float32),
        "output_norm.weight": np.zeros(8, dtype=np.float16),
    }
    info = read_model_info(write_gguf(tmp_path / "t.gguf", params=LLAMA2_7B, tensors=tensors))
    mix = {t.type: (t.tensors, t.elements, t.bytes) for t in info.tensor_types}
    assert mix == {"F32": (1, 128, 512), "F16": (1, 8, 16)}
    assert info.parameter_count == 136
    assert info.weights_bytes == 528
    # no general.file_type: named after the type holding most bytes
    assert info.quantization == "F32"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such file"):
        read_model_info(tmp_path / "nope.gguf")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="is a directory"):
        read_model_info(tmp_path)


def test_not_gguf(tmp_path: Path) -> None:
    p = tmp_path / "passwd"
    p.write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        read_model_info(p)


def test_truncated_in_header(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "t.gguf", params=LLAMA2_7B)
    p.write_bytes(p.read_bytes()[:40])
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        read_model_info(p)


def test_truncated_in_tensor_data(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": np.ones((256, 64), dtype=np.float32)}
    p = write_gguf(tmp_path / "t.gguf", params=LLAMA2_7B, tensors=tensors)
    p.write_bytes(p.read_bytes()[:-1000])
    with pytest.raises(ModelFileError, match="truncated"):
        read_model_info(p)


def test_unsupported_architecture(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "m.gguf", arch="mamba", params={"block_count": 2})
    with pytest.raises(ModelFileError, match="unsupported architecture 'mamba'"):
        read_model_info(p)


@pytest.mark.parametrize(
    ("quant", "bits"),
    [
        ("F32", 32),
        ("F16", 16),
        ("BF16", 16),
        ("Q8_0", 8),
        ("Q6_K", 6),
        ("Q5_K_M", 5),
        ("Q4_K_M", 4),
        ("IQ4_NL", 4),
        ("Q3_K_S", 3),
        ("IQ2_XS", 2),
        ("nonsense", None),
    ],
)
def test_weight_bits(quant: str, bits: int | None) -> None:
    assert weight_bits(quant) == bits
