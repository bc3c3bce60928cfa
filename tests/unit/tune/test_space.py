"""The search space: which axes exist, what the KV rules and memory leave in it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from orin.model.gguf import ModelInfo, read_model_info
from orin.profile.loader import parse_profile
from orin.profile.schema import Profile
from orin.tune.space import Candidate, baseline_of, build_space

PROFILE = """
name: t
engine: {n_ctx: 512, slots: 8, n_batch: 256, n_ubatch: 256}
slo: {prompt_tokens: [16, 64], concurrency: [1, 4]}
"""


@pytest.fixture(scope="module")
def info(tiny_f16: Path) -> ModelInfo:
    return read_model_info(tiny_f16)


def profile(text: str = PROFILE) -> Profile:
    return parse_profile(text)


def test_f16_weights_keep_an_f16_cache(info: ModelInfo) -> None:
    space = build_space(profile(), info, cores=4, allow_fewer_slots=True)
    assert space.axes["kv"] == (("f16", "f16"),)  # q8_0 would lower precision below f16
    assert space.axes["threads"] == (2, 4) and space.axes["slots"] == (4, 8)
    assert len(space) == 3 * 2 * 2 * 2  # batch sizes x flash x threads x slots
    assert all(c.n_batch >= c.slots and c.n_ubatch <= c.n_batch for c in space.candidates)
    assert all(c.slots >= 4 for c in space.candidates)  # the largest SLO concurrency


def test_slots_never_go_below_the_profiles_unless_allowed(info: ModelInfo) -> None:
    # the profile serves 8 slots; its SLO lists concurrency up to 4 only
    space = build_space(profile(), info, cores=4)
    assert space.axes["slots"] == (8,)
    assert {c.slots for c in space.candidates} == {8}
    assert any("slots kept at the profile's 8" in n and "--allow-fewer-slots" in n
               for n in space.notes)  # fmt: skip
    assert all(c.n_batch >= 8 for c in space.candidates)
    fewer = build_space(profile(), info, cores=4, allow_fewer_slots=True)
    assert {c.slots for c in fewer.candidates} == {4, 8}
    assert not any("slots kept" in n for n in fewer.notes)


def test_slots_rise_to_the_slo_concurrency(info: ModelInfo) -> None:
    p = profile(PROFILE.replace("slots: 8", "slots: 2"))
    for allow in (False, True):
        space = build_space(p, info, cores=4, allow_fewer_slots=allow)
        assert space.axes["slots"] == (4,) and not any("slots kept" in n for n in space.notes)
    # --allow-fewer-slots with nothing fewer to try says so instead of nothing
    assert build_space(p, info, cores=4, allow_fewer_slots=True).notes == (
        "--allow-fewer-slots: nothing fewer to try, the SLO's largest concurrency (4) is not "
        "below the profile's 2 slots",
    )
    assert build_space(p, info, cores=4).notes == ()


def test_the_demo_profile_keeps_its_four_slots(info: ModelInfo) -> None:
    from orin.profile.loader import load_profile

    demo = load_profile("demo")
    assert demo.engine.slots > max(demo.slo.concurrency)  # the case the rule is for
    space = build_space(demo, info, cores=2)
    assert {c.slots for c in space.candidates} == {demo.engine.slots}


def test_quantized_weights_allow_quantized_caches_only_with_flash_attention(
    info: ModelInfo,
) -> None:
    q4 = dataclasses.replace(info, quantization="Q4_K_M")
    space = build_space(profile(), q4, cores=2)
    pairs = {(c.flash_attn, c.type_k) for c in space.candidates}
    assert pairs == {("on", "f16"), ("on", "q8_0"), ("on", "q4_0"), ("off", "f16")}
    assert len(space) >= 24


def test_memory_drops_what_does_not_fit(info: ModelInfo) -> None:
    space = build_space(profile(), info, available=1024, cores=2)
    assert len(space) == 0 and any("would not fit" in n for n in space.notes)


def test_baseline_is_the_profile_resolved(info: ModelInfo) -> None:
    p = profile(PROFILE.replace("n_ubatch: 256}", "n_ubatch: 128, threads: 3}"))
    b = baseline_of(p, info, None)
    assert (b.n_batch, b.n_ubatch, b.threads, b.slots) == (256, 128, 3, 8)
    assert (b.type_k, b.type_v) == ("f16", "f16")
    assert 3 in build_space(p, info, cores=2).axes["threads"]


def test_a_candidate_applies_to_a_copy_of_the_profile(info: ModelInfo) -> None:
    p = profile()
    c = Candidate(128, 128, "on", "f16", "f16", 1, 4)
    q = c.apply(p)
    assert (q.engine.n_batch, q.engine.slots, q.engine.threads, q.engine.flash_attn) == (
        128, 4, 1, "on",
    )  # fmt: skip
    assert p.engine.n_batch == 256 and q.slo == p.slo
    assert c.label == "b128/u128 fa=on kv=f16/f16 t1 s4"
