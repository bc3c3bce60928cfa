"""One table of sampling parameters: the profile, the requests and the engine agree.

A value one layer accepts must never be refused by another: a profile default
the engine refuses turns every request into a 400 that blames the client.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from orin import params
from orin.engine.errors import InvalidRequest
from orin.engine.types import SamplingParams
from orin.errors import ProfileError
from orin.profile.loader import parse_profile
from orin.profile.schema import SamplingSection
from orin.server.protocol import ChatCompletionRequest, CompletionRequest

N_VOCAB = 32_000
INTEGERS = {"max_tokens", "top_k", "seed", "logprobs", "penalty_last_n"}
PROFILE = set(SamplingSection.model_fields)
# a request's max_tokens has no fixed upper bound: server.max_tokens_limit refuses above it
REQUEST = set(CompletionRequest.model_fields) & set(params.BY_NAME) - {"max_tokens"}


def engine_accepts(name: str, value: float) -> bool:
    try:
        SamplingParams(**{name: value}).validate(N_VOCAB)
    except InvalidRequest as exc:
        assert exc.param == name
        return False
    return True


def profile_accepts(name: str, value: float) -> bool:
    try:
        SamplingSection(**{name: value})
    except ValidationError:
        return False
    return True


def request_accepts(name: str, value: float) -> bool:
    try:
        CompletionRequest(prompt="x", **{name: value})
    except ValidationError as exc:
        assert exc.errors()[0]["loc"] == (name,)
        return False
    return True


def edges(p: params.Param[Any]) -> tuple[list[float], list[float]]:
    """(values inside the bounds, values just outside them)."""
    step = 1 if p.name in INTEGERS else 0.001
    inside = [p.lo + step if p.lo_open else p.lo, p.hi]
    outside = [p.lo if p.lo_open else p.lo - step, p.hi + step]
    return [int(v) if step == 1 else v for v in inside], [
        int(v) if step == 1 else v for v in outside
    ]


@pytest.mark.parametrize("p", params.SAMPLING, ids=lambda p: p.name)
def test_every_layer_takes_the_same_bounds(p: params.Param[Any]) -> None:
    inside, outside = edges(p)
    for value in inside:
        assert engine_accepts(p.name, value), value
        assert p.problem(value) is None
        if p.name in PROFILE:
            assert profile_accepts(p.name, value), value
        if p.name in REQUEST:
            assert request_accepts(p.name, value), value
    for value in outside:
        if not (p is params.MAX_TOKENS and value == 0):  # the engine's prompt only (below)
            assert not engine_accepts(p.name, value), value
        assert p.problem(value) is not None
        if p.name in PROFILE:
            assert not profile_accepts(p.name, value), value
        if p.name in REQUEST and p is not params.SEED:  # a request's seed: below
            assert not request_accepts(p.name, value), value


def test_the_engine_takes_max_tokens_0_as_the_prompt_only() -> None:
    """Below the table's bound, which a profile's and a chat request's max_tokens keep:
    a completion with echo and max_tokens 0 (the prompt and its logprobs, nothing
    generated) asks the engine for 0 tokens. Nothing lower."""
    assert engine_accepts("max_tokens", 0)
    assert not engine_accepts("max_tokens", -1)
    assert not profile_accepts("max_tokens", 0)


def test_the_surfaces_cover_the_table() -> None:
    assert set(params.BY_NAME) >= PROFILE
    assert set(params.BY_NAME) - {"max_tokens"} == REQUEST


def test_the_defaults_are_the_tables() -> None:
    engine, profile = SamplingParams(), SamplingSection()
    for p in params.SAMPLING:
        assert getattr(engine, p.name) == p.default
        if p.name in PROFILE:
            assert getattr(profile, p.name) == p.default
    assert engine_accepts("temperature", profile.temperature)


def test_a_profile_repeat_penalty_of_zero_is_refused_where_it_is_written() -> None:
    # llama.cpp divides logits by the penalty, so 0 has no meaning: the profile is
    # refused when read, naming the field, and its lowest value the engine accepts
    with pytest.raises(ProfileError, match=r"sampling\.repeat_penalty"):
        parse_profile("name: t\nsampling: {repeat_penalty: 0.0}\n")
    lowest = parse_profile("name: t\nsampling: {repeat_penalty: 0.01}\n")
    assert engine_accepts("repeat_penalty", lowest.sampling.repeat_penalty)
    assert not request_accepts("repeat_penalty", 0.0)
    assert request_accepts("repeat_penalty", 0.01)


def test_one_temperature_cap() -> None:
    for accepts in (engine_accepts, profile_accepts, request_accepts):
        assert accepts("temperature", 2.0) and not accepts("temperature", 2.5)
    with pytest.raises(ProfileError, match=r"sampling\.temperature"):
        parse_profile("name: t\nsampling: {temperature: 3.0}\n")


def test_a_profile_seed_fits_the_engine() -> None:
    assert not profile_accepts("seed", 1 << 32)
    assert profile_accepts("seed", (1 << 32) - 2) and engine_accepts("seed", (1 << 32) - 2)


def test_no_seed_is_llamacpps_random_seed() -> None:
    """llama.cpp's dist sampler takes 0xFFFFFFFF (LLAMA_DEFAULT_SEED) as 'pick a random
    seed': a request with that seed, or the choice of an n > 1 request that reached
    it by seed + i, got a different answer on every call."""
    from orin.engine.sampling import DEFAULT_SEED

    for accepts in (engine_accepts, profile_accepts):
        assert not accepts("seed", DEFAULT_SEED)
    sampled = CompletionRequest(prompt="x", seed=DEFAULT_SEED).to_sampling(SamplingSection(), 9)
    assert sampled.seed == 0
    top = int(params.SEED.hi)
    body = CompletionRequest(prompt="x", seed=top - 1, n=4, temperature=1)
    seeds = [p.seed for p in body.choice_params(SamplingSection(), 100)]
    assert seeds == [top - 1, top, 0, 1]


@pytest.mark.parametrize(
    ("seed", "sampled"),
    [
        ((1 << 32) - 2, (1 << 32) - 2),  # llama.cpp's range is kept as it is
        (1 << 32, 1),
        ((1 << 63) - 1, ((1 << 63) - 1) % ((1 << 32) - 1)),  # a 63-bit seed
        ((1 << 64) - 1, 0),
    ],
)
def test_a_request_seed_up_to_64_bits_samples_as_a_seed_in_llamacpps_range(
    seed: int, sampled: int
) -> None:
    """Clients that draw 63- or 64-bit seeds got a 400 for any seed above 4294967294.
    Such a seed is taken, modulo 4294967295: the same seed gives the same answer
    again, and none becomes llama.cpp's 'pick a random seed'; n > 1 counts on from
    it. The profile and the engine keep llama.cpp's range."""
    assert request_accepts("seed", seed)
    body = CompletionRequest(prompt="x", seed=seed, n=2, temperature=1)
    seeds = [p.seed for p in body.choice_params(SamplingSection(), 100)]
    assert seeds == [sampled, (sampled + 1) % ((1 << 32) - 1)]
    assert all(engine_accepts("seed", s) for s in seeds if s is not None)


def test_a_request_seed_above_64_bits_or_below_minus_one_is_refused() -> None:
    assert not request_accepts("seed", 1 << 64)
    assert not request_accepts("seed", -2)
    assert not profile_accepts("seed", 1 << 32)


def test_a_request_seed_of_minus_one_is_a_random_seed_as_in_llama_server() -> None:
    """llama-server documents seed -1 as 'a random seed'; it was a 400 here. It means
    a random seed for that request even where the profile fixes one (no seed in the
    request keeps the profile's), and every choice of n > 1 draws its own; the
    profile and the engine keep their bounds, and other negative seeds stay a 400."""
    assert request_accepts("seed", -1) and not request_accepts("seed", -2)
    assert not profile_accepts("seed", -1) and not engine_accepts("seed", -1)
    fixed = SamplingSection(seed=9)
    assert CompletionRequest(prompt="x").to_sampling(fixed, 100).seed == 9
    assert CompletionRequest(prompt="x", seed=5).to_sampling(fixed, 100).seed == 5
    body = CompletionRequest(prompt="x", seed=-1, n=3)
    assert [p.seed for p in body.choice_params(fixed, 100)] == [None, None, None]
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], seed=-1)
    assert chat.to_sampling(fixed, 100).seed is None


def test_top_k_minus_one_means_all_tokens_as_in_llama_server_and_vllm() -> None:
    """Clients written for vLLM send top_k -1 (its default) and llama-server takes any
    top_k <= 0 as off; both were a 400 here."""
    for accepts in (engine_accepts, profile_accepts, request_accepts):
        assert accepts("top_k", -1) and not accepts("top_k", -2)


def test_top_k_above_the_vocabulary_is_no_error() -> None:
    # llama.cpp keeps every candidate then; a profile's top_k must not depend on the model
    SamplingParams(top_k=1000).validate(n_vocab=256)


@pytest.mark.parametrize(
    "request_",
    [
        CompletionRequest(prompt="x"),
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]),
    ],
    ids=["completions", "chat"],
)
def test_an_unset_max_tokens_takes_the_profile_default(request_: Any) -> None:
    assert request_.to_sampling(SamplingSection(max_tokens=7), cap=100).max_tokens == 7
    assert request_.to_sampling(SamplingSection(max_tokens=512), cap=50).max_tokens == 50


def test_a_request_max_tokens_wins_and_above_the_limit_is_refused() -> None:
    defaults = SamplingSection(max_tokens=7)
    assert CompletionRequest(prompt="x", max_tokens=3).to_sampling(defaults, 100).max_tokens == 3
    chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], max_completion_tokens=5000
    )
    with pytest.raises(InvalidRequest) as refused:
        chat.to_sampling(defaults, 100)
    assert refused.value.param == "max_completion_tokens"


def test_request_values_override_the_profile_and_unset_ones_do_not() -> None:
    defaults = SamplingSection(temperature=0.3, top_k=5, repeat_penalty=1.2, seed=9)
    got = CompletionRequest(prompt="x", temperature=0, top_k=0).to_sampling(defaults, 100)
    assert (got.temperature, got.top_k) == (0, 0)
    assert (got.repeat_penalty, got.seed, got.top_p) == (1.2, 9, defaults.top_p)
    assert (got.presence_penalty, got.frequency_penalty) == (0.0, 0.0)


def test_messages_name_the_bounds() -> None:
    assert params.TEMPERATURE.problem(2.5) == "must be between 0 and 2, got 2.5"
    assert params.TOP_P.problem(0) == "must be above 0 and at most 1, got 0"
    assert params.TEMPERATURE.problem(float("nan")) == "must be a finite number, got nan"


def doc_row(p: params.Param[Any]) -> str:
    """The row of docs/server.md's parameter table for ``p``."""

    def num(x: float | None) -> str:
        if x is None:
            return "none"
        return str(int(x)) if float(x).is_integer() else str(x)

    default = num(p.default)
    if p.name in PROFILE:
        default = f"profile's `sampling.{p.name}` ({default})"
    if p.name == "max_tokens":  # bounded by server.max_tokens_limit, not a constant
        bounds = f"≥ {num(p.lo)}"
    elif p is params.SEED:  # a request's -1 is a random seed, and it may be 64-bit
        bounds = f"-1, or ≥ {num(p.lo)}, ≤ {params.REQUEST_SEED_MAX} (a profile's: ≤ {num(p.hi)})"
    else:
        low = f"> {num(p.lo)}" if p.lo_open else f"≥ {num(p.lo)}"
        bounds = f"{low}, ≤ {num(p.hi)}"
    return f"| `{p.name}` | {default} | {bounds} | {p.description} |"


def test_the_server_docs_show_the_table() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[3] / "docs" / "server.md").read_text(encoding="utf-8")
    rows = [doc_row(p) for p in params.SAMPLING if p.name != "penalty_last_n"]
    missing = [r for r in rows if r not in doc.splitlines()]
    assert not missing, "docs/server.md's parameter table differs from orin.params:\n" + "\n".join(
        missing
    )
