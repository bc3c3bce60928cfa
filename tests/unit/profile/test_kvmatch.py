from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orin.llamacpp import BuildInfo, parse_fa_quants, parse_system_info
from orin.model.gguf import read_model_info
from orin.model.memplan import total_bytes
from orin.profile.fit import HEADROOM, memory_fit
from orin.profile.kvmatch import auto_kv_type, resolve_kv
from orin.profile.schema import EngineSection
from tests.ggufutil import LLAMA2_7B, write_gguf

CUDA_DEFAULT = (
    "CUDA : ARCHS = 870 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | "
    "CPU : NEON = 1 | ARM_FMA = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
CUDA_ALL = CUDA_DEFAULT.replace("USE_GRAPHS = 1 |", "USE_GRAPHS = 1 | FA_QUANTS = all |")


def build(system_info: str, gpu: bool = True) -> BuildInfo:
    return BuildInfo("0.3.36", gpu, system_info, parse_system_info(system_info))


@pytest.mark.parametrize(
    ("quant", "expected"),
    [
        ("F32", "f16"),
        ("F16", "f16"),
        ("BF16", "f16"),
        ("Q8_0", "q8_0"),
        ("Q6_K", "q8_0"),
        ("Q5_K_M", "q8_0"),
        ("Q4_K_M", "q8_0"),
        ("Q4_0", "q8_0"),
        (None, "f16"),
    ],
)
def test_auto_from_quantization(quant: str | None, expected: str) -> None:
    assert auto_kv_type(quant)[0] == expected


def test_auto_falls_back_to_q4_0_when_q8_0_does_not_fit() -> None:
    assert auto_kv_type("Q4_K_M", lambda: False)[0] == "q4_0"
    assert auto_kv_type("Q4_K_M", lambda: True)[0] == "q8_0"
    # 8-bit weights never drop to a 4-bit cache
    assert auto_kv_type("Q8_0", lambda: False)[0] == "q8_0"


def test_auto_fit_uses_the_planner(tmp_path: Path) -> None:
    info = read_model_info(write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15))
    engine = EngineSection(n_ctx=32768, slots=4)
    # q8_0 for 4 x 32768 tokens is 34 GiB; q4_0 is 18 GiB
    roomy = resolve_kv(engine, "Q4_K_M", info, None, available=64 << 30)
    tight = resolve_kv(engine, "Q4_K_M", info, None, available=24 << 30)
    assert (roomy.type_k, roomy.type_v) == ("q8_0", "q8_0")
    assert (tight.type_k, tight.type_v) == ("q4_0", "q4_0")
    assert tight.flash_attn == "on"


def test_auto_takes_q8_0_only_where_memory_fit_passes_it(tmp_path: Path) -> None:
    """Where q8_0 fits with under 10% left over (memory-fit warns) and q4_0 leaves more,
    auto takes q4_0: a q8_0 there made doctor's memory-fit warn on a context its own fix
    had named, and serve run with less than the headroom the check asks for."""
    info = read_model_info(write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15))
    engine = EngineSection(n_ctx=4096, slots=4)
    need = total_bytes(info, 4096, 4, "q8_0", "q8_0", engine.n_ubatch, True, engine.n_batch)
    available = int(need / (1 - HEADROOM / 2))  # q8_0 fits, 5% left
    d = resolve_kv(engine, "Q4_K_M", info, None, available=available)
    assert (d.type_k, d.type_v) == ("q4_0", "q4_0")
    fit = memory_fit(info, engine, d.type_k, d.type_v, True, available)
    assert fit.severity == "ok"
    roomy = resolve_kv(engine, "Q4_K_M", info, None, available=int(need / (1 - 2 * HEADROOM)))
    assert (roomy.type_k, roomy.type_v) == ("q8_0", "q8_0")


def test_auto_with_flash_attention_off_stays_f16() -> None:
    d = resolve_kv(EngineSection(flash_attn="off"), "Q4_K_M")
    assert (d.type_k, d.type_v, d.flash_attn) == ("f16", "f16", "off")
    assert not d.errors


def test_quantized_v_without_flash_attention_is_an_error() -> None:
    d = resolve_kv(EngineSection(type_k="q8_0", type_v="q8_0", flash_attn="off"), "Q4_K_M")
    assert [f.rule for f in d.errors] == ["kv-quant-v-needs-fa"]
    # quantized K alone is fine without flash attention
    ok = resolve_kv(EngineSection(type_k="q8_0", type_v="f16", flash_attn="off"), "Q4_K_M")
    assert not ok.errors


def cuda_findings(
    type_k: str, type_v: str, system_info: str = CUDA_DEFAULT, flash: str = "on", **engine: Any
) -> list[tuple[str, str]]:
    """(rule, severity) of the CUDA flash-attention rule for one explicit K/V pair."""
    section = EngineSection(type_k=type_k, type_v=type_v, flash_attn=flash, **engine)
    d = resolve_kv(section, "F16", build=build(system_info))
    return [(f.rule, f.severity) for f in d.findings if f.rule == "kv-cuda-fa-kernels"]


# The default FA_QUANTS of the vendored CMake (ggml/CMakeLists.txt), as the CUDA
# backend reports it (";" turned into ","); f16-f16 is compiled whatever the list.
CUDA_LISTED = CUDA_DEFAULT.replace(
    "USE_GRAPHS = 1 |", "USE_GRAPHS = 1 | FA_QUANTS = q4_0-q4_0,q8_0-q8_0,f16-f16,bf16-bf16 |"
)
CUDA_ONE_PAIR = CUDA_DEFAULT.replace("USE_GRAPHS = 1 |", "USE_GRAPHS = 1 | FA_QUANTS = q8_0-q4_0 |")


@pytest.mark.parametrize("info", [CUDA_DEFAULT, CUDA_LISTED])
@pytest.mark.parametrize(
    "pair", [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("bf16", "bf16")]
)
def test_a_compiled_pair_is_fine(info: str, pair: tuple[str, str]) -> None:
    assert cuda_findings(*pair, info) == []


@pytest.mark.parametrize(
    "pair",
    [("q8_0", "q4_0"), ("q8_0", "f16"), ("f16", "q8_0"), ("q4_1", "q4_1"), ("q5_0", "q5_1"),
     ("bf16", "f16"), ("f32", "q8_0")],
)  # fmt: skip
def test_a_supported_pair_without_its_kernel_runs_converted_to_f16(pair: tuple[str, str]) -> None:
    assert cuda_findings(*pair) == [("kv-cuda-fa-kernels", "warn")]
    d = resolve_kv(EngineSection(type_k=pair[0], type_v=pair[1], flash_attn="on"), "F16",
                   build=build(CUDA_DEFAULT))  # fmt: skip
    message = next(f.message for f in d.findings if f.rule == "kv-cuda-fa-kernels")
    assert "convert K and V to f16" in message and "stays on the GPU" in message
    assert "q8_0/q8_0" in message  # what the build has
    assert "GGML_CUDA_FA_QUANTS=all" in message and "FA_ALL_QUANTS" not in message
    assert not d.errors
    # every pair has its kernel in a build with FA_QUANTS=all
    assert cuda_findings(*pair, CUDA_ALL) == []


def test_f32_looks_for_the_f16_kernel_and_f16_f16_is_always_compiled() -> None:
    assert cuda_findings("f32", "f32") == []
    assert cuda_findings("f32", "f16", CUDA_ONE_PAIR) == []  # f16-f16 is added to any list
    assert cuda_findings("q8_0", "q4_0", CUDA_ONE_PAIR) == []
    assert cuda_findings("q8_0", "q8_0", CUDA_ONE_PAIR) == [("kv-cuda-fa-kernels", "warn")]


@pytest.mark.parametrize("info", [CUDA_DEFAULT, CUDA_ALL])
@pytest.mark.parametrize("pair", [("iq4_nl", "iq4_nl"), ("q8_0", "iq4_nl"), ("iq4_nl", "q8_0")])
def test_a_type_outside_the_cuda_set_runs_attention_on_the_cpu(
    info: str, pair: tuple[str, str]
) -> None:
    assert cuda_findings(*pair, info) == [("kv-cuda-fa-kernels", "fail")]
    d = resolve_kv(EngineSection(type_k=pair[0], type_v=pair[1], flash_attn="on"), "F16",
                   build=build(info))  # fmt: skip
    assert "iq4_nl" in d.errors[0].message and "on the CPU" in d.errors[0].message


def test_a_type_outside_the_set_with_flash_attention_auto() -> None:
    # K alone: llama.cpp's auto probe sees the op leave the GPU and turns flash attention off
    assert cuda_findings("iq4_nl", "f16", flash="auto") == [("kv-cuda-fa-kernels", "warn")]
    # a quantized V forces flash attention on (llama.cpp does the same): the CPU again
    d = resolve_kv(EngineSection(type_k="q8_0", type_v="iq4_nl"), "F16", build=build(CUDA_ALL))
    assert d.flash_attn == "on" and [f.rule for f in d.errors] == ["kv-cuda-fa-kernels"]


def test_the_cuda_rule_needs_a_cuda_build_offload_and_flash_attention() -> None:
    cpu = "CPU : AVX2 = 1 | OPENMP = 1 |"
    assert cuda_findings("q8_0", "q4_0", cpu) == []
    assert cuda_findings("iq4_nl", "iq4_nl", cpu) == []
    assert cuda_findings("iq4_nl", "iq4_nl", gpu_layers=0) == []  # the model stays on the CPU
    assert cuda_findings("iq4_nl", "f16", flash="off") == []


def test_lower_precision_than_weights_warns_with_savings(tmp_path: Path) -> None:
    info = read_model_info(write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=7))
    engine = EngineSection(n_ctx=512, slots=1, type_k="q4_0", type_v="q4_0", flash_attn="on")
    d = resolve_kv(engine, "Q8_0", info)
    warnings = [f for f in d.findings if f.severity == "warn"]
    assert [f.rule for f in warnings] == ["kv-below-weights"]
    # f16 256 MiB against q4_0 72 MiB at 512 tokens of Llama-2-7B
    assert "saves 184.0 MiB" in warnings[0].message
    same = EngineSection(type_k="q8_0", type_v="q8_0", flash_attn="on")
    assert not [f for f in resolve_kv(same, "Q8_0").findings if f.severity == "warn"]


def test_parse_system_info_and_fa_quants() -> None:
    parsed = parse_system_info(CUDA_ALL)
    assert parsed["CUDA"]["ARCHS"] == "870"
    assert parsed["CPU"]["NEON"] == "1"
    assert build(CUDA_ALL).fa_quants is None
    assert build(CUDA_DEFAULT).fa_quants == parse_fa_quants(None)
    assert parse_fa_quants("q8_0-q4_0;f16-f16") == {("q8_0", "q4_0"), ("f16", "f16")}
    assert parse_fa_quants("q8_0-q4_0") == {("q8_0", "q4_0"), ("f16", "f16")}  # always built
    assert build("CPU : AVX2 = 1 |", gpu=False).cuda is False
