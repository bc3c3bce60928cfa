from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from orin.errors import ModelFileError
from orin.model.gguf import read_model_info, weight_bits
from tests import archmodels
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


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelFileError, match="not a regular file"):
        read_model_info(fifo)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"block_count": 2**31}, "block_count is 2147483648; llama.cpp loads 1 to 512"),
        ({"block_count": 0}, "block_count is 0"),
        ({"context_length": float("inf")}, "context_length must be an integer, not inf"),
        ({"embedding_length": 4096.0}, "embedding_length must be an integer, not 4096.0"),
    ],
)
def test_absurd_or_mistyped_sizes_are_refused_by_name(
    tmp_path: Path, params: dict[str, float], message: str
) -> None:
    p = write_gguf(tmp_path / "m.gguf", params={**LLAMA2_7B, **params})
    with pytest.raises(ModelFileError, match=message):
        read_model_info(p)


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


SMALL = {
    "block_count": 4,
    "embedding_length": 256,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "context_length": 4096,
}


@pytest.mark.parametrize(
    ("arch", "params", "layout"),
    [
        ("mamba", {"attention.head_count": 0, "ssm.conv_kernel": 4}, "recurrent"),
        ("qwen3next", {}, "hybrid"),
        ("jamba", {"attention.head_count_kv": [0, 0, 0, 2]}, "hybrid"),
        ("deepseek2", {"attention.key_length_mla": 192, "attention.key_length": 576}, "mla"),
        ("bert", {}, "none"),
        ("some-future-arch", {}, "unknown"),
        ("some-future-arch", {"attention.head_count": 0}, "unknown"),
    ],
)
def test_every_architecture_is_read(
    tmp_path: Path, arch: str, params: dict[str, object], layout: str
) -> None:
    info = read_model_info(write_gguf(tmp_path / "m.gguf", arch=arch, params={**SMALL, **params}))
    assert info.architecture == arch
    assert info.kv_layout == layout
    assert info.kv_exact is False and info.kv_note
    assert info.to_dict()["kv_exact"] is False


def test_exact_layouts(tmp_path: Path) -> None:
    for arch in ("llama", "qwen2", "qwen3moe", "phi3", "deci", "gemma"):
        info = read_model_info(write_gguf(tmp_path / f"{arch}.gguf", arch=arch, params=SMALL))
        assert (info.kv_layout, info.kv_exact, info.kv_note) == ("standard", True, None)


def test_mamba_state_sizes(tmp_path: Path) -> None:
    params = {
        **SMALL,
        "attention.head_count": 0,
        "ssm.conv_kernel": 4,
        "ssm.inner_size": 512,
        "ssm.state_size": 16,
        "ssm.group_count": 2,
    }
    info = read_model_info(write_gguf(tmp_path / "m.gguf", arch="mamba2", params=params))
    assert info.recurrent_state is not None
    # llama_hparams: n_embd_r = (d_conv - 1) x (d_inner + 2 n_group d_state),
    # n_embd_s = d_state x d_inner
    assert (info.recurrent_state.r, info.recurrent_state.s) == (3 * (512 + 64), 16 * 512)
    assert info.head_dim_k == info.head_dim_v == 0


def test_rwkv_state_sizes(tmp_path: Path) -> None:
    params = {**SMALL, "wkv.head_size": 64}
    info = read_model_info(write_gguf(tmp_path / "r.gguf", arch="rwkv6", params=params))
    assert info.recurrent_state is not None
    # token_shift_count defaults to 2 rows of n_embd; the WKV state is n_embd x head_size
    assert (info.recurrent_state.r, info.recurrent_state.s) == (2 * 256, 256 * 64)


@pytest.mark.parametrize(
    ("arch", "n_layer", "params", "window", "swa"),
    [
        # gemma2: every other layer, local first; 4096 when the file names no window
        ("gemma2", 4, {}, 4096, "TFTF"),
        ("gemma2", 4, {"attention.sliding_window": 512}, 512, "TFTF"),
        # gemma3: five local layers, then one global, only with a window
        ("gemma3", 12, {"attention.sliding_window": 1024}, 1024, "TTTTTF" * 2),
        ("gemma3", 6, {}, None, ""),
        ("gemma3", 6, {"attention.sliding_window": 0}, None, ""),
        # a scalar pattern key replaces the architecture's n_pattern
        (
            "gemma3",
            6,
            {"attention.sliding_window": 64, "attention.sliding_window_pattern": 3},
            64,
            "TTFTTF",
        ),
        (
            "gemma3",
            4,
            {
                "attention.sliding_window": 64,
                "attention.sliding_window_pattern": [False, True, True],
            },
            64,
            "FTTF",
        ),
        ("cohere2", 8, {"attention.sliding_window": 4096}, 4096, "TTTF" * 2),
        ("olmo2", 4, {"attention.sliding_window": 4096}, 4096, "TTTF"),
        ("olmo2", 4, {}, None, ""),
        # llama.cpp turns phi3's window off (phi3.cpp)
        ("phi3", 4, {"attention.sliding_window": 2047}, None, ""),
        # next-token-prediction layers never slide
        ("gemma3", 8, {"attention.sliding_window": 64, "nextn_predict_layers": 2}, 64, "TTTTTFFF"),
    ],
)
def test_sliding_window_layers_as_llama_cpp_decides(
    tmp_path: Path, arch: str, n_layer: int, params: dict[str, object], window: int | None, swa: str
) -> None:
    path = write_gguf(
        tmp_path / "m.gguf", arch=arch, params={**SMALL, "block_count": n_layer, **params}
    )
    info = read_model_info(path)
    assert info.sliding_window == window
    assert info.swa_layers == tuple(c == "T" for c in swa)
    assert info.kv_layout == ("iswa" if swa else "standard")
    assert info.kv_exact
    assert info.to_dict()["swa_layers"] == [i for i, c in enumerate(swa) if c == "T"]


def test_a_window_architecture_without_its_window_is_estimated(tmp_path: Path) -> None:
    info = read_model_info(write_gguf(tmp_path / "c.gguf", arch="cohere2", params=SMALL))
    assert info.kv_layout == "unknown"
    assert "attention.sliding_window" in (info.kv_note or "")


def test_window_layers_with_their_own_head_size(tmp_path: Path) -> None:
    params = {
        **SMALL,
        "attention.sliding_window": 128,
        "attention.key_length": 128,
        "attention.value_length": 128,
        "attention.key_length_swa": 64,
    }
    info = read_model_info(write_gguf(tmp_path / "g.gguf", arch="gemma2", params=params))
    assert info.head_dims(0) == (64, 128)  # a window layer: only K has its own size
    assert info.head_dims(1) == (128, 128)


def test_head_defaults_follow_llama_cpp(tmp_path: Path) -> None:
    """n_head_kv defaults to n_head layer by layer; V's head size to n_embd / n_head,
    whatever K's is."""
    params = {
        "block_count": 3,
        "embedding_length": 256,
        "attention.head_count": [4, 8, 4],
        "attention.key_length": 128,
        "context_length": 4096,
    }
    info = read_model_info(write_gguf(tmp_path / "d.gguf", arch="deci", params=params))
    assert info.n_head_kv == (4, 8, 4)
    assert (info.head_dim_k, info.head_dim_v) == (128, 64)


def test_experts(tmp_path: Path) -> None:
    params = {
        **SMALL,
        "expert_count": 128,
        "expert_used_count": 8,
        "expert_feed_forward_length": 768,
    }
    info = read_model_info(write_gguf(tmp_path / "q.gguf", arch="qwen3moe", params=params))
    assert (info.n_expert, info.n_expert_used, info.n_ff_exp) == (128, 8, 768)
    assert info.is_moe and info.kv_exact
    per_layer = {**params, "expert_used_count": [0, 8, 8, 4]}
    info = read_model_info(write_gguf(tmp_path / "p.gguf", arch="qwen3moe", params=per_layer))
    assert info.n_expert_used == 8
    dense = read_model_info(write_gguf(tmp_path / "l.gguf", params=LLAMA2_7B))
    assert (dense.n_expert, dense.n_expert_used, dense.is_moe) == (0, 0, False)


# What the generated test models (tests/archmodels.py) read as: layout, window layers,
# experts, KV heads per layer.
GENERATED = {
    "qwen2": ("standard", (), 0, (1, 1)),
    "qwen3": ("standard", (), 0, (1, 1)),
    "qwen3moe": ("standard", (), 4, (1, 1)),
    "gemma2": ("iswa", (0, 2), 0, (1,) * 4),
    "gemma3": ("iswa", (0, 1, 2, 3, 4), 0, (1,) * 6),
    "phi3": ("standard", (), 0, (1, 1)),
    "deci": ("standard", (), 0, (1, 2, 0)),
    "qwen2vl": ("standard", (), 0, (1, 1)),
    "mamba": ("recurrent", (), 0, (0, 0)),
}


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return archmodels.ensure(tmp_path_factory.getbasetemp() / "archmodels")


@pytest.mark.parametrize("arch", sorted(GENERATED))
def test_generated_architectures(arch_models: dict[str, Path], arch: str) -> None:
    layout, swa, n_expert, n_head_kv = GENERATED[arch]
    info = read_model_info(arch_models[arch])
    assert (info.architecture, info.kv_layout) == (arch, layout)
    assert tuple(i for i, s in enumerate(info.swa_layers) if s) == swa
    assert info.sliding_window == (128 if swa else None)
    assert (info.n_expert, info.n_head_kv) == (n_expert, n_head_kv)
    assert info.vocab_size == info.to_dict()["vocab_size"] > 0
    assert info.weights_bytes == sum(t.bytes for t in info.tensor_types) > 0


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


def test_a_part_of_a_split_model_is_refused_with_the_merge_to_run(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "m.gguf"), "llama", split_max_tensors=1)
    for key, value in LLAMA2_7B.items():
        if isinstance(value, float):
            w.add_float32(f"llama.{key}", value)
        else:
            w.add_uint32(f"llama.{key}", value)
    for i in range(3):
        w.add_tensor(f"t{i}", np.zeros(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for n in (1, 2, 3):
        part = tmp_path / f"m-0000{n}-of-00003.gguf"
        with pytest.raises(ModelFileError) as exc:
            read_model_info(part)  # part 1 alone read as a model a third of its size
        assert f"part {n} of 3 of a split model" in str(exc.value)
        assert "llama-gguf-split --merge m-00001-of-00003.gguf m.gguf" in str(exc.value)
