"""A prompt's log-probabilities on real llama.cpp, against llama-cpp-python's own
computation of every position's logits: the engine's (SamplingParams.prompt_logprobs)
and an echoed prompt's on /v1/completions (OpenAI's legacy completions with echo and
logprobs, how lm-evaluation-harness's local-completions scores a text)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from orin.engine.engine import Engine
from orin.engine.errors import InvalidRequest
from orin.engine.types import SamplingParams, StepStats
from orin.model import demo
from orin.profile.loader import parse_profile
from orin.server.main import build_server

pytestmark = pytest.mark.llama

# four slots and 64-token batches: a prompt of a few hundred tokens takes several
# chunks, and other slots hold the same prompt's cells (prefix reuse, copies)
PROFILE = """
name: t
engine: {n_ctx: 512, slots: 4, n_batch: 64, n_ubatch: 64}
server: {model_name: demo, max_tokens_limit: 64}
"""
# the log-probabilities of one position computed in another batch layout than the
# reference's differ by about 1e-3 on the CPU; a prompt scored from the wrong
# position, or a context other than its own, is off by 0.1 and more
ATOL = 5e-3


@pytest.fixture(scope="module")
def model() -> Path:
    return demo.ensure("small", "f16")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[tuple[TestClient, Engine]]:
    """The served app in this process (no socket), on a started engine."""
    app_server, state = build_server(parse_profile(PROFILE), model)
    engine = state.engine
    assert isinstance(engine, Engine)
    engine.start()
    engine.wait_ready(120)
    try:
        with TestClient(app_server.config.app) as client:
            yield client, engine
    finally:
        engine.stop(drain=False, timeout=5)


@pytest.fixture(scope="module")
def engine(server: tuple[TestClient, Engine]) -> Engine:
    return server[1]


Reference = Callable[[list[int]], tuple[list[float], list[float]]]


@pytest.fixture(scope="module")
def reference(model: Path) -> Iterator[Reference]:
    """For each prompt token after the first: its log-probability given the tokens
    before it, and the most likely token's, from llama_cpp.Llama's logits of every
    position (one sequence alone, in one batch)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(model), n_ctx=1024, n_batch=512, logits_all=True, verbose=False)

    def logprobs(prompt: list[int]) -> tuple[list[float], list[float]]:
        llm.reset()
        llm.eval(prompt)
        logps, best = [], []
        for i in range(1, len(prompt)):
            row = np.asarray(llm.scores[i - 1], dtype=np.float64)
            row = row - row.max()
            row = row - np.log(np.exp(row).sum())
            logps.append(float(row[prompt[i]]))
            best.append(float(row.max()))
        return logps, best

    try:
        yield logprobs
    finally:
        llm.close()


def words(engine: Engine, n: int) -> list[int]:
    text = " ".join(f"board {i} runs the model at the edge." for i in range(n))
    return engine.tokenize(text, add_special=False)


# -- the engine ---------------------------------------------------------------------------


def test_prompt_logprobs_equal_llama_cpps_whatever_holds_the_prompt(
    engine: Engine, reference: Reference
) -> None:
    """The prompt is cached in one slot and decoding in another: a request that scores
    it still computes every position (nothing cached, nothing copied), in chunks,
    and its log-probabilities are llama.cpp's own for each position."""
    prompt = words(engine, 25)
    assert len(prompt) > 3 * 64  # several chunks
    engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0))  # cached after
    busy = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    scored = engine.generate(
        prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=True)
    )
    busy.result()
    want, best = reference(prompt)
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(prompt) - 1
    assert scored.timings is not None and scored.timings.cached_tokens == 0
    got = scored.prompt_logprobs
    assert [lp.token_id for lp in got] == prompt[1:]
    np.testing.assert_allclose([lp.logprob for lp in got], want, atol=ATOL)
    np.testing.assert_allclose([lp.top[0].logprob for lp in got], best, atol=ATOL)
    assert all(len(lp.top) == 2 for lp in got)
    # the answer's own logprobs are those of the generated tokens, as before
    assert len(scored.token_ids) == 3 == len(scored.logprobs)
    # the same prompt without the need takes its cached cells
    again = engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    assert again.timings is not None and again.timings.cached_tokens == len(prompt) - 1


def test_max_tokens_0_computes_the_prompt_and_generates_nothing(
    engine: Engine, reference: Reference
) -> None:
    prompt = words(engine, 6)
    c = engine.generate(
        prompt, SamplingParams(max_tokens=0, temperature=0, logprobs=0, prompt_logprobs=True)
    )
    assert (c.finish_reason, c.token_ids, c.text, c.logprobs) == ("length", (), "", ())
    assert c.timings is not None and c.timings.generated_tokens == 0
    assert c.prompt_logprobs is not None
    np.testing.assert_allclose(
        [lp.logprob for lp in c.prompt_logprobs], reference(prompt)[0], atol=ATOL
    )
    with engine.idle():
        assert engine.slots_busy == 0 and engine.kv_cells_used == 0


@contextlib.contextmanager
def prefilled(engine: Engine) -> Iterator[list[int]]:
    """The prompt tokens of every step while the block runs (StepStats)."""
    fed: list[int] = []

    def observe(stats: StepStats) -> None:
        fed.append(stats.prefill_tokens)

    engine.add_step_observer(observe)
    try:
        yield fed
    finally:
        engine.remove_step_observer(observe)


def test_choices_that_score_one_prompt_compute_it_once(
    engine: Engine, reference: Reference
) -> None:
    """Three requests scoring the same prompt (a completion's ``n`` choices): the first
    computes every position, the others wait for it, copy its cells, feed the last
    prompt token and share its log-probabilities; each answer is the one it gets
    alone."""
    prompt = words(engine, 10)
    assert len(prompt) > 64  # several chunks

    def params(seed: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=6, temperature=0.9, seed=seed, logprobs=1, prompt_logprobs=True
        )

    alone = [engine.generate(prompt, params(seed)) for seed in (7, 8, 9)]
    with prefilled(engine) as fed:
        with engine.idle():  # queued together, before the engine steps
            streams = [engine.submit(prompt, params(seed)) for seed in (7, 8, 9)]
        together = [s.result() for s in streams]
    assert sum(fed) == len(prompt) + 2
    assert [t.timings.cached_tokens for t in together if t.timings] == [0, *[len(prompt) - 1] * 2]
    assert [c.text for c in together] == [c.text for c in alone]
    assert together[0].prompt_logprobs is not None
    assert all(c.prompt_logprobs == together[0].prompt_logprobs for c in together)
    want, _ = reference(prompt)
    got = [lp.logprob for lp in together[0].prompt_logprobs]
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_when_the_scoring_choice_is_cancelled_the_next_one_scores(
    engine: Engine, reference: Reference
) -> None:
    """The first choice goes before its prompt is scored: the second computes it, and
    the third still waits for it and copies its cells."""
    prompt = words(engine, 9)
    p = SamplingParams(max_tokens=2, temperature=0, logprobs=0, prompt_logprobs=True)
    with prefilled(engine) as fed:
        with engine.idle():
            streams = [engine.submit(prompt, p) for _ in range(3)]
            streams[0].cancel()
        done = [s.result() for s in streams]
    assert [c.finish_reason for c in done] == ["cancelled", "length", "length"]
    assert sum(fed) == len(prompt) + 1
    assert done[1].prompt_logprobs == done[2].prompt_logprobs
    assert done[1].prompt_logprobs is not None
    np.testing.assert_allclose(
        [lp.logprob for lp in done[1].prompt_logprobs], reference(prompt)[0], atol=ATOL
    )


def post(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


# -- the API ----------------------------------------------------------------------------


def test_lm_eval_harness_loglikelihood_request(
    server: tuple[TestClient, Engine], reference: Reference
) -> None:
    """What lm-evaluation-harness's local-completions sends to score a continuation:
    token ids in a one-prompt batch, echo, logprobs 1, temperature 0, and max_tokens
    0 (older releases) or 1 (it drops the last entry then)."""
    client, engine = server
    prompt = words(engine, 12)
    want, best = reference(prompt)
    for max_tokens in (0, 1):
        out = post(
            client,
            {
                "model": "demo",
                "prompt": [prompt],
                "echo": True,
                "logprobs": 1,
                "max_tokens": max_tokens,
                "temperature": 0,
                "seed": 1234,
            },
        )
        choice = out["choices"][0]
        lp = choice["logprobs"]
        n = len(prompt) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1 : len(prompt)], want, atol=ATOL)
        tops = [max(t.values()) for t in lp["top_logprobs"][1 : len(prompt)]]
        np.testing.assert_allclose(tops, best, atol=ATOL)
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
        echoed = engine.detokenize(prompt)
        assert choice["text"].startswith(echoed)
        assert "".join(lp["tokens"][: len(prompt)]) == echoed
        assert lp["text_offset"][len(prompt) - 1] == len(echoed) - len(
            lp["tokens"][len(prompt) - 1]
        )
        assert out["usage"]["prompt_tokens"] == len(prompt)
        assert out["usage"]["completion_tokens"] == max_tokens
        if max_tokens == 0:
            assert choice["text"] == echoed and choice["finish_reason"] == "length"
        else:
            assert lp["text_offset"][-1] == len(echoed)


def test_a_text_prompt_with_n_choices(
    server: tuple[TestClient, Engine], reference: Reference
) -> None:
    """Every choice carries the prompt's logprobs (the first choice computes them, the
    others copy its cells and share them); the BOS tokenizing added is a token with no text, and the
    tokens' text adds up to the prompt as written."""
    client, engine = server
    text = "Jetson boards run <|im_start|> models at the edge, all day long."
    prompt = engine.tokenize(text)
    want, _ = reference(prompt)
    out = post(
        client,
        {"prompt": text, "echo": True, "logprobs": 0, "max_tokens": 2, "n": 2, "temperature": 0},
    )
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice in out["choices"]:
        lp = choice["logprobs"]
        head = lp["tokens"][: len(prompt)]
        assert "".join(head) == text and head[0] == ""  # BOS
        assert lp["token_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1 : len(prompt)], want, atol=ATOL)
        assert lp["top_logprobs"][1] == {}  # logprobs 0: no alternatives
        assert choice["text"].startswith(text)
        offsets = lp["text_offset"]
        assert offsets[: len(prompt)] == [len("".join(head[:i])) for i in range(len(prompt))]
        assert offsets[len(prompt)] == len(text)


def test_a_streamed_echo_carries_the_prompts_logprobs(server: tuple[TestClient, Engine]) -> None:
    """The first chunk is the echo with the prompt's logprobs; all chunks' logprobs
    together are the whole answer's."""
    client, engine = server
    prompt = words(engine, 8)
    body: dict[str, Any] = {
        "prompt": prompt,
        "echo": True,
        "logprobs": 2,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = post(client, body)["choices"][0]
    chunks = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :])["choices"][0])
    first = chunks[0]
    assert first["text"] == engine.detokenize(prompt)
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(prompt)
    joined: dict[str, list[Any]] = {k: [] for k in whole["logprobs"]}
    for c in chunks:
        for k, v in (c["logprobs"] or {}).items():
            joined[k] += v
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]
    np.testing.assert_allclose(
        joined["token_logprobs"][1:], whole["logprobs"]["token_logprobs"][1:], atol=ATOL
    )


def test_streamed_offsets_equal_the_whole_answers_where_a_stop_string_holds_text(
    server: tuple[TestClient, Engine],
) -> None:
    """A stop string that the text could still become holds its first characters back:
    the next token's event carries them, and a token whose whole text is held has its
    logprob sent in an event of its own. Each token's text_offset is still where its
    own text starts, as in the answer sent whole."""
    client, engine = server
    body: dict[str, Any] = {
        "prompt": words(engine, 3),
        "logprobs": 1,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    free = post(client, body)["choices"][0]["logprobs"]
    # a stop string that starts with the end of the third token's text (and then never
    # matches): the end of that text is held until the fourth token's event
    body["stop"] = [free["tokens"][2][-1:] + "\u0001", "".join(free["tokens"][3:5]) + "\u0002"]
    whole = post(client, body)["choices"][0]
    assert whole["logprobs"]["text_offset"] == free["text_offset"]
    joined: dict[str, list[Any]] = {k: [] for k in whole["logprobs"]}
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for k, v in (
                    json.loads(line[len("data: ") :])["choices"][0]["logprobs"] or {}
                ).items():
                    joined[k] += v
    assert joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]


def test_a_token_outside_the_vocabulary_is_a_400_not_an_abort(
    server: tuple[TestClient, Engine],
) -> None:
    """llama.cpp aborts the process on a token id it has no piece for: the echo's
    pieces are read before the request reaches the engine's own check."""
    client, engine = server
    n_vocab = engine.backend.n_vocab  # type: ignore[union-attr]
    for bad in (n_vocab, -1):
        for stream in (False, True):
            body = {"prompt": [1, bad], "echo": True, "logprobs": 1, "max_tokens": 0}
            r = client.post("/v1/completions", json={**body, "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            assert str(bad) in r.json()["error"]["message"]
    with pytest.raises(InvalidRequest):
        engine.piece(n_vocab)
    assert post(client, {"prompt": [1, 2], "echo": True, "logprobs": 1, "max_tokens": 0})


def test_echo_without_logprobs_and_max_tokens_0(server: tuple[TestClient, Engine]) -> None:
    client, engine = server
    prompt = words(engine, 3)
    out = post(client, {"prompt": prompt, "echo": True, "max_tokens": 0})
    choice = out["choices"][0]
    assert (choice["text"], choice["logprobs"], choice["finish_reason"]) == (
        engine.detokenize(prompt),
        None,
        "length",
    )
    assert out["usage"]["completion_tokens"] == 0
    assert out["timings"]["ttft_ms"] is None  # no token: no time to the first
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_batch_of_prompts_each_scored_as_its_own(
    server: tuple[TestClient, Engine], reference: Reference
) -> None:
    """lm-evaluation-harness with a batch size above 1 sends several token-id prompts
    in one request: choice i is prompt i's, with its own echo and logprobs."""
    client, engine = server
    prompts = [words(engine, 2), words(engine, 5)[3:], engine.tokenize("Orin", add_special=False)]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    out = post(client, body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert out["usage"]["completion_tokens"] == 0
    for prompt, choice in zip(prompts, out["choices"], strict=True):
        lp = choice["logprobs"]
        assert choice["text"] == engine.detokenize(prompt) == "".join(lp["tokens"])
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(prompt)
        np.testing.assert_allclose(lp["token_logprobs"][1:], reference(prompt)[0], atol=ATOL)
    # streamed: each choice's echo chunk carries its own prompt's logprobs
    firsts: dict[int, dict[str, Any]] = {}
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: ") :])["choices"][0]
                firsts.setdefault(choice["index"], choice)
    for i, prompt in enumerate(prompts):
        assert firsts[i]["text"] == engine.detokenize(prompt)
        assert len(firsts[i]["logprobs"]["tokens"]) == len(prompt)
