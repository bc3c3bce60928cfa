"""The length rule of a request's max_tokens, and the field an over-long prompt blames."""

from __future__ import annotations

import json

import pytest

from orin.engine.errors import ContextLengthExceeded, InvalidRequest
from orin.engine.scheduler import ContextPolicy
from orin.profile.schema import SamplingSection
from orin.server import protocol
from orin.server.errors import to_response
from orin.server.protocol import answer_length

SLIDING = ContextPolicy(window=512)
FIXED = ContextPolicy(window=512, sliding=False)


def test_a_length_over_the_servers_limit_is_refused_never_capped() -> None:
    with pytest.raises(InvalidRequest) as caught:
        answer_length(30_000, "max_tokens", 512, 4096, 10, SLIDING)
    assert caught.value.param == "max_tokens"
    assert "30000" in str(caught.value) and "4096 tokens (server.max_tokens_limit)" in str(
        caught.value
    )
    assert answer_length(4096, "max_tokens", 512, 4096, 10, SLIDING) == 4096


def test_with_sliding_on_an_answer_may_run_past_the_window() -> None:
    assert answer_length(3000, "max_tokens", 512, 4096, 500, SLIDING) == 3000


def test_with_sliding_off_prompt_and_answer_must_fit_the_window() -> None:
    assert answer_length(412, "max_tokens", 512, 4096, 100, FIXED) == 412
    with pytest.raises(InvalidRequest) as caught:
        answer_length(413, "max_completion_tokens", 512, 4096, 100, FIXED)
    assert caught.value.param == "max_completion_tokens"
    assert "ask for 412 at most" in str(caught.value) and "512 tokens per slot" in str(caught.value)
    # an over-long prompt the engine cuts leaves the answer half the window after keep
    truncating = ContextPolicy(window=512, keep=12, sliding=False, truncate_prompt=True)
    assert truncating.cut_length == 262
    assert answer_length(250, "max_tokens", 512, 4096, 600, truncating) == 250
    assert answer_length(None, "max_tokens", 512, 4096, 600, truncating) == 250
    with pytest.raises(InvalidRequest, match="ask for 250 at most") as caught:
        answer_length(251, "max_tokens", 512, 4096, 600, truncating)
    assert "600 tokens, cut to 262 (context.overflow)," in str(caught.value)
    with pytest.raises(InvalidRequest, match="ask for 12 at most"):  # fits: not cut
        answer_length(13, "max_tokens", 512, 4096, 500, truncating)


@pytest.mark.parametrize("requested", [None, 1, 300])
def test_a_prompt_over_the_window_is_the_prompts_fault_whatever_the_length(
    requested: int | None,
) -> None:
    """Where over-long prompts are refused, the error names the prompt (its route's
    field, context_length_exceeded), as it does when no length is asked for."""
    with pytest.raises(ContextLengthExceeded) as caught:
        answer_length(requested, "max_tokens", 512, 4096, 1202, FIXED)
    assert (caught.value.prompt_tokens, caught.value.limit) == (1202, 512)


def test_an_unset_length_is_the_profiles_within_the_limit_and_the_room() -> None:
    assert answer_length(None, "max_tokens", 512, 4096, 10, SLIDING) == 512
    assert answer_length(None, "max_tokens", 8192, 4096, 10, SLIDING) == 4096
    assert answer_length(None, "max_tokens", 512, 4096, 300, FIXED) == 212
    assert answer_length(None, "max_tokens", 512, 4096, 512, FIXED) == 1
    assert answer_length(None, "max_tokens", 512, 4096) == 512  # no prompt: no room check


def test_requests_name_the_length_field_they_set() -> None:
    defaults = SamplingSection()
    chat = [{"role": "user", "content": "x"}]
    cases = [
        (protocol.CompletionRequest(prompt="x", max_tokens=9000), "max_tokens"),
        (protocol.CompletionRequest(prompt="x", n_predict=9000), "n_predict"),
        (protocol.ChatCompletionRequest(messages=chat, max_tokens=9000), "max_tokens"),
        (
            protocol.ChatCompletionRequest(messages=chat, max_completion_tokens=9000),
            "max_completion_tokens",
        ),
    ]
    for body, field in cases:
        with pytest.raises(InvalidRequest) as caught:
            body.choice_params(defaults, 4096)
        assert caught.value.param == field
    body = protocol.CompletionRequest(prompt="x", max_tokens=300)
    with pytest.raises(InvalidRequest):
        body.choice_params(defaults, 4096, prompt_tokens=300, context=FIXED)
    params = body.choice_params(defaults, 4096, prompt_tokens=300, context=SLIDING)
    assert params[0].max_tokens == 300


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/v1/completions", "prompt"),
        ("/v1/chat/completions", "messages"),
        ("/v1/embeddings", "input"),
        (None, "messages"),
    ],
)
def test_an_over_long_prompt_blames_the_field_of_its_route(path: str | None, param: str) -> None:
    r = to_response(ContextLengthExceeded(600, 512), "req-1", path)
    err = json.loads(bytes(r.body))["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["param"] == param


def test_n_predict_0_asks_for_the_prompt_only_on_both_endpoints() -> None:
    """llama-server's n_predict 0: the prompt is computed into the cache and nothing is
    generated (the engine's max_tokens 0), not one token; -1 is the profile's length."""
    defaults = SamplingSection()
    chat = [{"role": "user", "content": "x"}]
    for body in (
        protocol.CompletionRequest(prompt="x", n_predict=0),
        protocol.ChatCompletionRequest(messages=chat, n_predict=0),
    ):
        assert [p.max_tokens for p in body.choice_params(defaults, 4096)] == [0]
    unset = protocol.CompletionRequest(prompt="x", n_predict=-1).choice_params(defaults, 4096)
    assert unset[0].max_tokens == defaults.max_tokens
