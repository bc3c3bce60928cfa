"""On a CUDA build with an NVIDIA GPU only (`make test-gpu`; deselected elsewhere).

The CUDA build as scripts/install-llama-cpp.sh makes it, every layer offloaded,
flash attention with quantized KV caches on the GPU giving the f16 cache's
greedy tokens, and `serve` with the NVML telemetry source.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from orin.engine.config import engine_config
from orin.engine.engine import Engine
from orin.engine.types import SamplingParams
from orin.llamacpp import build_info, capture_log
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile
from tests.serverutil import live_server

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def small() -> Path:
    return demo.ensure("small", "q8_0")


def test_the_build_is_cuda_with_every_flash_attention_pair() -> None:
    b = build_info()
    assert b.gpu_offload and b.cuda, b.system_info
    assert b.fa_quants is None, "GGML_CUDA_FA_QUANTS=all: every K/V pair has its kernel"
    assert b.backends.get("CPU", {}).get("AMX_INT8") != "1"


@contextmanager
def running(path: Path, kv: str, fa: str = "on") -> Iterator[tuple[Engine, str]]:
    """An engine with every layer offloaded, and llama.cpp's log of its loading."""
    k, v = kv.split("/")
    profile = parse_profile(
        "name: g\nengine: {n_ctx: 512, slots: 4, gpu_layers: -1, "
        f"flash_attn: {fa}, type_k: {k}, type_v: {v}}}\n"
    )
    engine = Engine(engine_config(profile, path, read_model_info(path), build_info()))
    with capture_log() as lines:  # the model loads on the engine thread
        engine.start().wait_ready()
    try:
        yield engine, "".join(lines)
    finally:
        engine.stop(drain=False)


def test_every_layer_is_offloaded_and_the_kv_cache_is_on_the_gpu(small: Path) -> None:
    with running(small, "f16/f16") as (engine, log):
        m = re.search(r"offloaded (\d+)/(\d+) layers to GPU", log)
        assert m and m.group(1) == m.group(2), log[-2000:]
        assert "CUDA0 KV buffer size" in log, log[-2000:]
        assert len(engine.generate("offload", SamplingParams(max_tokens=8)).token_ids) == 8


@pytest.mark.parametrize("kv", ["q8_0/q8_0", "q4_0/q4_0", "q8_0/q4_0", "q5_1/q8_0"])
def test_flash_attention_with_quantized_kv_keeps_greedy_output(small: Path, kv: str) -> None:
    prompt = "Flash attention on the GPU with a quantized cache"
    params = SamplingParams(max_tokens=24, temperature=0.0)
    with running(small, "f16/f16") as (ref, _):
        want = ref.generate(prompt, params).token_ids
    with running(small, kv) as (engine, log):
        got = engine.generate(prompt, params).token_ids
    assert "CUDA0 KV buffer size" in log
    assert list(got) == list(want)


@pytest.fixture(scope="module")
def nvml_server(small: Path) -> Iterator[str]:
    with live_server(small, "engine: {n_ctx: 512, slots: 2}\n", "nvml") as (base, state):
        assert state.telemetry is not None
        yield base


def test_serve_with_the_nvml_source(nvml_server: str) -> None:
    body = {"prompt": "nvml " * 100, "max_tokens": 200, "temperature": 0}
    r = httpx.post(f"{nvml_server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200
    metrics = httpx.get(f"{nvml_server}/metrics").text
    assert 'orin_llm_telemetry_source_info{source="nvml"} 1.0' in metrics
    snap = httpx.get(f"{nvml_server}/telemetry").json()
    assert snap["source"] == "nvml"
    assert snap["latest"]["gpu_util"] is not None
    assert 0.0 <= snap["latest"]["gpu_util"] <= 1.0
