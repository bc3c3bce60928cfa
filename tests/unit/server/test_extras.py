"""/v1/embeddings, /tokenize, /detokenize and /v1/models/{id} over a stand-in engine:
request and response shapes, and each error with the field it names."""

from __future__ import annotations

import base64
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from orin.engine.client import EngineStatus
from orin.engine.embed import (
    Embeddings,
    EmbedJob,
    can_embed,
    normalize,
    plan_pass,
    pooling_name,
)
from orin.engine.errors import InvalidRequest
from orin.engine.scheduler import ContextPolicy, Remove, Scheduler
from orin.engine.types import StepStats
from orin.server.app import create_app
from orin.server.metrics import ServerMetrics
from orin.server.protocol_embed import EmbeddingRequest, encode_vector, piece_json
from orin.server.state import ServerState
from orin.telemetry.phases import Share, phase_shares

N_VOCAB = 100
WIDTH = 4
# token 1 is a control token (<s>), 50 and 51 the two bytes of "é"
PIECES = {1: b"<s>", 50: b"\xc3", 51: b"\xa9"}


class FakeEngine:
    """The EngineClient calls these routes make; a word is a token."""

    def __init__(self) -> None:
        self.cfg = SimpleNamespace(
            model_path="/models/demo.gguf", n_ctx=512, slots=2, type_k="f16", type_v="f16"
        )
        self.model_info = None
        self.state = "ready"
        self.embedded: list[list[int]] = []

    def status(self) -> EngineStatus:
        return EngineStatus("ready", None, 2, 0, 0, 0, 0, 1024, None, 0)

    def add_step_observer(self, fn: Any) -> None: ...  # the dashboard's history

    def remove_step_observer(self, fn: Any) -> None: ...

    def add_finish_observer(self, fn: Any) -> None: ...

    def remove_finish_observer(self, fn: Any) -> None: ...

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        ids = [1] if add_special else []
        for word in text.split():
            ids.append(1 if parse_special and word == "<s>" else 10 + len(word))
        return ids

    def piece(self, token: int, special: bool = False) -> bytes:
        if not 0 <= token < N_VOCAB:
            raise InvalidRequest("tokens", f"token id {token} is not in the vocabulary")
        if token == 1 and not special:
            return b""
        return PIECES.get(token, f" w{token}".encode())

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", "replace")

    async def embed_async(
        self,
        inputs: Sequence[str | Sequence[int]],
        dimensions: int | None = None,
        request_id: str | None = None,
    ) -> Embeddings:
        if dimensions is not None and dimensions != WIDTH:
            raise InvalidRequest("dimensions", f"the width is {WIDTH}")
        seqs = [self.tokenize(i) if isinstance(i, str) else list(i) for i in inputs]
        if any(not 0 <= t < N_VOCAB for s in seqs for t in s):
            raise InvalidRequest("input", "a token id is not in the vocabulary")
        self.embedded += seqs
        vectors = tuple(
            normalize(np.array([len(s), i + 1, 0, -1], dtype=np.float32))
            for i, s in enumerate(seqs)
        )
        return Embeddings(vectors, sum(len(s) for s in seqs))


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    name = "org/demo-7b"
    state = ServerState(engine=engine, model_name=name, metrics=ServerMetrics(2, 1024, name))  # type: ignore[arg-type]
    with TestClient(create_app(state)) as c:
        yield c


def error(r: Any, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["param"] == param
    assert body["type"] == "invalid_request_error"
    return str(body["message"])


# -- /v1/embeddings ---------------------------------------------------------------------


def test_an_embeddings_response_has_openais_shape(client: TestClient) -> None:
    r = client.post("/v1/embeddings", json={"input": ["one two", "three"], "model": "x"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "org/demo-7b"
    assert [d["object"] for d in body["data"]] == ["embedding", "embedding"]
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}  # BOS + words
    first = np.array(body["data"][0]["embedding"])
    assert first.shape == (WIDTH,) and np.linalg.norm(first) == pytest.approx(1.0)
    assert first[0] > 0 and first[1] > 0  # [3, 1, 0, -1] normalized


def test_base64_is_little_endian_float32_of_the_same_vector(client: TestClient) -> None:
    floats = client.post("/v1/embeddings", json={"input": "a b c"}).json()
    b64 = client.post("/v1/embeddings", json={"input": "a b c", "encoding_format": "base64"})
    encoded = b64.json()["data"][0]["embedding"]
    assert isinstance(encoded, str)
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert decoded.tolist() == floats["data"][0]["embedding"]


def test_each_input_shape_is_one_embedding_per_input(
    client: TestClient, engine: FakeEngine
) -> None:
    shapes: list[tuple[Any, list[list[int]]]] = [
        ("a bb", [[1, 11, 12]]),
        (["a", "bb"], [[1, 11], [1, 12]]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5], [6, 7]], [[5], [6, 7]]),
        # llama-server's forms: ids with text pieces (BOS only before a leading text),
        # {prompt_string}, {content: [text parts]}, and lists mixing them
        ([5, "bb", 6], [[5, 12, 6]]),
        (["a", 5], [[1, 11, 5]]),
        ([[5], "a", [6, "bb"]], [[5], [1, 11], [6, 12]]),
        ({"prompt_string": "a bb"}, [[1, 11, 12]]),
        (
            {"content": [{"type": "text", "text": "a "}, {"type": "text", "text": "bb"}]},
            [[1, 11, 12]],
        ),
    ]
    for given, seqs in shapes:
        engine.embedded.clear()
        r = client.post("/v1/embeddings", json={"input": given})
        assert r.status_code == 200, r.text
        assert engine.embedded == seqs
        assert len(r.json()["data"]) == len(seqs)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": {"content": "a"}}, "input"),
        ({"input": {"content": [{"type": "unknown"}]}}, "input"),
        ({"input": {"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({}, "input"),
        ({"input": "a", "encoding_format": "binary"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": 3}, "dimensions"),  # the engine's: not the width
        ({"input": [[1, 200]]}, "input"),  # the engine's: outside the vocabulary
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    error(client.post("/v1/embeddings", json=body), 400, param)


@pytest.mark.parametrize(("given", "says"), [([[]], "input 0 "), ([[5, 6], []], "input 1 ")])
def test_an_empty_token_list_is_named_by_its_index(
    client: TestClient, given: list[list[int]], says: str
) -> None:
    """As an empty string is: which input is empty, not every form an input may take."""
    r = client.post("/v1/embeddings", json={"input": given})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert r.json()["error"]["message"] == f"input: {says}is an empty list of token ids"


@pytest.mark.parametrize(
    ("field", "on", "off"),
    [
        ("embd_normalize", -1, 2),  # llama-server's: -1 is no normalization
        ("embd_normalize", 1, 2),
        ("normalize", False, True),  # vLLM's
        ("truncate_prompt_tokens", 3, None),  # vLLM's
    ],
)
def test_other_servers_fields_that_change_the_vectors_are_refused(
    client: TestClient, field: str, on: object, off: object
) -> None:
    """`embd_normalize: -1` (llama-server's raw vectors) or vLLM's `normalize: false`
    were answered with unit vectors, `truncate_prompt_tokens: 3` with the whole
    input's: vectors other than the ones asked for, in silence."""
    error(client.post("/v1/embeddings", json={"input": "a", field: on}), 400, field)
    assert client.post("/v1/embeddings", json={"input": "a", field: off}).status_code == 200


def test_dimensions_equal_to_the_width_is_accepted(client: TestClient) -> None:
    r = client.post("/v1/embeddings", json={"input": "a", "dimensions": WIDTH})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == WIDTH


def test_a_lone_token_list_and_a_list_of_strings_parse_apart() -> None:
    assert EmbeddingRequest(input=[3, 4]).inputs() == [[3, 4]]
    assert EmbeddingRequest(input=[3, "x"]).inputs() == [[3, "x"]]  # one mixed prompt
    assert EmbeddingRequest(input=["3", "4"]).inputs() == ["3", "4"]
    assert EmbeddingRequest(input=[[3], [4]]).inputs() == [[3], [4]]
    assert EmbeddingRequest(input="x").inputs() == ["x"]


def test_vectors_encode_as_json_numbers_or_base64() -> None:
    v = np.array([0.5, -0.25, 1.0], dtype=np.float32)
    assert encode_vector(v, "float") == [0.5, -0.25, 1.0]
    assert base64.b64decode(str(encode_vector(v, "base64"))) == v.astype("<f4").tobytes()


def test_embedding_requests_are_counted(client: TestClient) -> None:
    client.post("/v1/embeddings", json={"input": ["a", "b"]})
    client.post("/v1/embeddings", json={"input": []})  # refused: not counted
    text = client.get("/metrics").text
    assert "orin_llm_embedding_requests_total 1.0" in text


# -- /tokenize, /detokenize ----------------------------------------------------------------


def test_tokenize_follows_llama_servers_defaults(client: TestClient) -> None:
    assert client.post("/tokenize", json={"content": "a bb"}).json() == {"tokens": [11, 12]}
    with_bos = client.post("/tokenize", json={"content": "a", "add_special": True}).json()
    assert with_bos == {"tokens": [1, 11]}
    special = client.post("/tokenize", json={"content": "<s> a"}).json()["tokens"]
    literal = client.post("/tokenize", json={"content": "<s> a", "parse_special": False})
    assert special == [1, 11] and literal.json()["tokens"] == [13, 11]
    assert client.post("/tokenize", json={}).json() == {"tokens": []}


def test_pieces_are_text_when_valid_utf8_else_byte_values(client: TestClient) -> None:
    r = client.post("/tokenize", json={"content": ["<s>", 50, 51, "a"], "with_pieces": True})
    assert r.json() == {
        "tokens": [
            {"id": 1, "piece": "<s>"},
            {"id": 50, "piece": [0xC3]},
            {"id": 51, "piece": [0xA9]},
            {"id": 11, "piece": " w11"},
        ]
    }
    assert piece_json("é".encode()) == "é" and piece_json(b"\xff") == [255]


def test_mixed_content_adds_special_only_before_a_leading_text(client: TestClient) -> None:
    mixed = {"content": ["a", 7, "bb"], "add_special": True}
    assert client.post("/tokenize", json=mixed).json()["tokens"] == [1, 11, 7, 12]
    leading_id = {"content": [7, "bb"], "add_special": True}
    assert client.post("/tokenize", json=leading_id).json()["tokens"] == [7, 12]
    error(client.post("/tokenize", json={"content": ["a", 500]}), 400, "content")


def test_detokenize_renders_control_tokens_and_refuses_unknown_ids(client: TestClient) -> None:
    r = client.post("/detokenize", json={"tokens": [1, 50, 51]})
    assert r.json() == {"content": "<s>é"}
    assert client.post("/detokenize", json={}).json() == {"content": ""}
    message = error(client.post("/detokenize", json={"tokens": [1, N_VOCAB]}), 400, "tokens")
    assert str(N_VOCAB) in message


# -- /v1/models/{id} ------------------------------------------------------------------------


def test_the_served_model_is_its_entry_in_the_list_and_ids_may_hold_slashes(
    client: TestClient,
) -> None:
    listed = client.get("/v1/models").json()["data"][0]
    one = client.get("/v1/models/org/demo-7b")
    assert one.status_code == 200 and one.json() == listed


def test_any_other_model_id_is_a_404_in_openais_shape(client: TestClient) -> None:
    r = client.get("/v1/models/org/other")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert "org/other" in r.json()["error"]["message"]


def test_an_unknown_path_or_method_is_an_error_in_openais_shape_with_a_code(
    client: TestClient,
) -> None:
    missing = client.get("/v1/nothing", headers={"X-Request-Id": "r-1"})
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": "Not Found: GET /v1/nothing",
            "type": "invalid_request_error",
            "param": None,
            "code": "not_found",
            "request_id": "r-1",
        }
    }
    wrong = client.post("/v1/models", json={})
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert wrong.json()["error"]["message"] == "Method Not Allowed: POST /v1/models"


def test_a_get_route_answers_head_and_a_post_route_does_not(client: TestClient) -> None:
    """RFC 9110: a server that answers GET answers HEAD (wget --spider, uptime checks)."""
    for path in ("/health", "/v1/models", "/metrics"):
        head = client.head(path)
        assert head.status_code == client.get(path).status_code == 200, path
        assert head.content == b""
    post_only = client.head("/v1/chat/completions")
    assert post_only.status_code == 405 and post_only.headers["allow"] == "POST"
    assert "head" not in client.get("/openapi.json").json()["paths"]["/health"]


def test_the_new_routes_need_the_api_key(engine: FakeEngine) -> None:
    state = ServerState(
        engine=engine,  # type: ignore[arg-type]
        model_name="demo",
        metrics=ServerMetrics(2, 1024, "demo"),
        api_key="sesame",
    )
    with TestClient(create_app(state)) as c:
        calls = [
            ("post", "/v1/embeddings", {"input": "a"}),
            ("post", "/tokenize", {"content": "a"}),
            ("post", "/detokenize", {"tokens": [11]}),
            ("get", "/v1/models/demo", None),
        ]
        for method, path, body in calls:
            assert c.request(method, path, json=body).status_code == 401
            ok = c.request(method, path, json=body, headers={"Authorization": "Bearer sesame"})
            assert ok.status_code == 200, (path, ok.text)


# -- the engine's pure parts: passes, pooling, phases ---------------------------------------


def test_a_pass_takes_inputs_in_order_one_per_sequence_within_the_token_budget() -> None:
    a = EmbedJob("a", [[1] * 3, [2] * 5])
    b = EmbedJob("b", [[3] * 4, [4] * 2])
    first = plan_pass([a, b], [2, 0, 3], budget=10)
    assert [(i.job.id, i.index, i.seq, len(i.tokens)) for i in first] == [
        ("a", 0, 2, 3),
        ("a", 1, 0, 5),
    ]  # b's first input (4 tokens) would pass the budget of 10: it waits
    assert a.scheduled and a.started and not b.started
    second = plan_pass([b], [1], budget=10)
    assert [(i.index, i.seq) for i in second] == [(0, 1)] and not b.scheduled
    long = EmbedJob("long", [[5] * 8, [6]])
    assert [len(i.tokens) for i in plan_pass([long], [0, 1], budget=4)] == [8]  # alone


def test_a_job_finishes_when_its_last_vector_is_stored() -> None:
    job = EmbedJob("j", [[1], [2, 3]])
    v = normalize(np.array([3.0, 4.0], dtype=np.float32))
    assert v.tolist() == pytest.approx([0.6, 0.8])
    assert not job.store(1, v)
    assert job.store(0, v)
    job.finish()
    result = job.future.result(timeout=0)
    assert result.prompt_tokens == 3 and len(result.vectors) == 2
    zero = normalize(np.zeros(3, dtype=np.float32))
    assert zero.tolist() == [0.0, 0.0, 0.0]  # as llama.cpp: a zero vector stays zero


def test_only_pooled_types_embed() -> None:
    assert [can_embed(p) for p in range(5)] == [False, True, True, True, False]
    assert pooling_name(0) == "none" and pooling_name(4) == "rank"


def test_lending_idle_slots_drops_their_cells_and_prefix_cache() -> None:
    s = Scheduler(3, 64, ContextPolicy(window=128))
    s.slots[0].cache = [1, 2, 3, 4]
    s.slots[0].reusable = 4
    s.slots[2].cache = [5]
    s.slots[2].reusable = 1
    assert s.idle_slot_ids() == [1, 2, 0]  # fewest cached cells first
    ops = s.lend_idle([2, 0])
    assert ops == [Remove(2, 0, -1), Remove(0, 0, -1)]
    assert s.slots[0].cache == [] and s.slots[0].reusable == 0
    assert s.kv_cells_cached == 0 and not s.has_work()


def test_an_embedding_step_counts_as_prefill() -> None:
    step = StepStats(0, 10, 0, 0, 0, 0, 0, embedded_tokens=12)
    assert step.phase == "prefill"
    assert phase_shares(step) == (Share("prefill", 1.0),)
    assert StepStats(0, 10, 0, 0, 0, 0, 0).phase == "idle"
