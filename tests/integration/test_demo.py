"""Generated demo models, checked with the real llama.cpp (loader, tokenizer, quantizer)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from orin.errors import DemoModelError
from orin.llamacpp import llama
from orin.model import demo
from orin.model import vocab as v

pytestmark = pytest.mark.llama

TEXTS = [
    "Running a large language model on an edge board is a different job.",
    "我们在边缘设备上运行大语言模型，需要先考虑内存和功耗。",
    "罕见字：饕餮、龘、𠀀 are not in the corpus",
    "emoji 🦙🚀🇯🇵 and ünïcödé, tabs\tand\nnew lines",
    " leading space and  double  spaces ",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The few models this module needs, generated once."""
    root = tmp_path_factory.mktemp("demo-models")
    wanted = [("tiny", "f32"), ("tiny", "f16"), ("tiny", "q8_0"), ("small", "q4_k_m")]
    return {f"{s}-{q}": demo.generate(s, q, root / f"{s}-{q}.gguf") for s, q in wanted}


@contextmanager
def load(path: Path, **kwargs: Any) -> Iterator[Any]:
    llm = llama().Llama(model_path=str(path), verbose=False, n_ctx=256, n_threads=2, **kwargs)
    try:
        yield llm
    finally:
        llm.close()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def field_value(reader: gguf.GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def test_tiny_models_are_under_one_megabyte(models: dict[str, Path]) -> None:
    f32, f16 = models["tiny-f32"].stat().st_size, models["tiny-f16"].stat().st_size
    assert f32 < 1_000_000
    assert f16 < f32


def test_generation_is_byte_identical(models: dict[str, Path], tmp_path: Path) -> None:
    for key in ("tiny-f32", "tiny-f16", "small-q4_k_m"):
        size, quant = key.split("-", 1)
        again = demo.generate(size, quant, tmp_path / f"{key}.gguf")
        assert sha256(again) == sha256(models[key]), key
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_other_seed_gives_other_weights(models: dict[str, Path], tmp_path: Path) -> None:
    other = demo.generate("tiny", "f32", tmp_path / "seed1.gguf", seed=1)
    assert sha256(other) != sha256(models["tiny-f32"])
    with pytest.raises(DemoModelError, match="seed"):
        demo.generate("tiny", "f32", tmp_path / "bad.gguf", seed=-1)


def test_q4_k_m_file_holds_k_quants(models: dict[str, Path]) -> None:
    reader = gguf.GGUFReader(models["small-q4_k_m"])
    assert field_value(reader, "general.file_type") == llama().LLAMA_FTYPE_MOSTLY_Q4_K_M
    kinds = {t.tensor_type for t in reader.tensors}
    assert gguf.GGMLQuantizationType.Q4_K in kinds


def test_metadata(models: dict[str, Path]) -> None:
    reader = gguf.GGUFReader(models["tiny-f16"])
    shape = demo.SIZES["tiny"]
    assert field_value(reader, "general.architecture") == "llama"
    assert field_value(reader, "general.name") == "orin-llm demo tiny"
    assert field_value(reader, "general.file_type") == demo.QUANTS["f16"]
    assert field_value(reader, "llama.embedding_length") == shape.n_embd
    assert field_value(reader, "llama.attention.head_count_kv") == shape.n_head_kv
    assert field_value(reader, "llama.vocab_size") == len(v.build_vocab())
    assert field_value(reader, "tokenizer.ggml.model") == "llama"
    assert field_value(reader, "tokenizer.ggml.eot_token_id") == v.IM_END_ID
    template = field_value(reader, "tokenizer.chat_template")
    assert isinstance(template, str)
    assert "<|im_start|>" in template and "add_generation_prompt" in template


def test_shapes_suit_quantized_kv_caches() -> None:
    for shape in demo.SIZES.values():
        assert shape.head_dim in (64, 128)  # block-aligned, and CUDA has FA kernels for it
        assert shape.n_head % shape.n_head_kv == 0
        assert shape.n_head_kv < shape.n_head  # grouped-query attention everywhere


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_quantized_kv_cache_works(models: dict[str, Path], kv: str) -> None:
    kind = int(gguf.GGMLQuantizationType[kv.upper()])
    with load(models["tiny-f16"], type_k=kind, type_v=kind, flash_attn=True) as llm:
        out = llm.create_completion("The board", max_tokens=8, temperature=0.0)
    assert out["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("text", TEXTS)
def test_llama_cpp_tokenizes_like_the_vocab_and_round_trips(
    models: dict[str, Path], text: str
) -> None:
    with load(models["tiny-f16"]) as llm:
        ids = llm.tokenize(text.encode(), add_bos=True)
        assert ids[0] == v.BOS_ID
        assert ids[1:] == v.build_vocab().encode(text)
        assert llm.detokenize(ids).decode() == text


def test_chat_template_renders_chatml(models: dict[str, Path]) -> None:
    with load(models["tiny-f16"]) as llm:
        out = llm.create_chat_completion(
            messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0
        )
    assert out["usage"]["prompt_tokens"] > 5
    assert out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("key", ["tiny-f16", "tiny-q8_0", "small-q4_k_m"])
def test_greedy_generation_is_stable_and_never_stops(models: dict[str, Path], key: str) -> None:
    runs = []
    for _ in range(2):
        with load(models[key]) as llm:
            out = llm.create_completion("The board", max_tokens=32, temperature=0.0)
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 32
        runs.append(out["choices"][0]["text"])
    assert runs[0] == runs[1]
    assert len(set(runs[0].split())) > 5


def test_greedy_output_does_not_depend_on_batch_size(models: dict[str, Path]) -> None:
    prompt = "Questions to ask before deploying: how much memory is free?"
    texts = []
    for n_batch in (512, 1):
        with load(models["small-q4_k_m"], n_batch=n_batch, n_ubatch=n_batch) as llm:
            out = llm.create_completion(prompt, max_tokens=24, temperature=0.0)
        texts.append(out["choices"][0]["text"])
    assert texts[0] == texts[1]


def test_greedy_logit_margin_is_large(models: dict[str, Path]) -> None:
    with load(models["small-q4_k_m"], logits_all=True) as llm:
        llm.eval(llm.tokenize(b"Power modes matter"))
        margins = []
        for _ in range(48):
            logits = np.asarray(llm.scores[llm.n_tokens - 1])
            top2 = np.sort(logits)[-2:]
            margins.append(float(top2[1] - top2[0]))
            assert int(np.argmax(logits)) >= v.FIRST_NORMAL_ID
            llm.eval([int(np.argmax(logits))])
    assert min(margins) > 3.0


def test_ensure_reuses_the_cached_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path))
    first = demo.ensure("tiny", "f32")
    assert first.parent == tmp_path / "models"
    assert f"v{demo.FORMAT_VERSION}" in first.name and "tiny" in first.name
    stamp = first.stat().st_mtime_ns
    assert demo.ensure("tiny", "f32") == first
    assert first.stat().st_mtime_ns == stamp
    explicit = demo.ensure("tiny", "f32", cache=tmp_path / "elsewhere")
    assert explicit.parent == tmp_path / "elsewhere"
    assert sha256(explicit) == sha256(first)


def test_quantizer_failure_is_a_demo_model_error(tmp_path: Path) -> None:
    with pytest.raises(DemoModelError, match="failed"):
        demo._quantize(tmp_path / "missing.gguf", tmp_path / "out.gguf", demo.QUANTS["q8_0"])


def weights(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file, dequantized to float32."""
    reader = gguf.GGUFReader(path)
    return {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).ravel()
        for t in reader.tensors
    }


def test_convert_keeps_a_quantized_models_weights(models: dict[str, Path], tmp_path: Path) -> None:
    src = models["tiny-q8_0"]
    out = demo.convert(src, tmp_path / "conv" / "tiny.f16.gguf", "f16")
    reader = gguf.GGUFReader(out)
    assert field_value(reader, "general.file_type") == demo.QUANTS["f16"]
    assert gguf.GGMLQuantizationType.Q8_0 not in {t.tensor_type for t in reader.tensors}
    before, after = weights(src), weights(out)
    assert before.keys() == after.keys()
    for name, w in before.items():  # q8_0 values are f16 scales times small integers
        np.testing.assert_allclose(after[name], w, rtol=1e-3, atol=1e-6, err_msg=name)
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary left


def test_convert_rejects_an_unknown_type_and_a_broken_source(tmp_path: Path) -> None:
    with pytest.raises(DemoModelError, match="valid"):
        demo.convert(tmp_path / "x.gguf", tmp_path / "y.gguf", "q9_9")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(DemoModelError, match=r"bad\.gguf"):
        demo.convert(bad, tmp_path / "out.gguf", "f16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


@pytest.mark.parametrize(("size", "quant"), [("huge", "f16"), ("tiny", "q9_9"), ("", "")])
def test_bad_names_raise(tmp_path: Path, size: str, quant: str) -> None:
    with pytest.raises(DemoModelError, match="valid"):
        demo.generate(size, quant, tmp_path / "x.gguf")
    with pytest.raises(DemoModelError):
        demo.ensure(size, quant, cache=tmp_path)
    assert list(tmp_path.iterdir()) == []
