"""Phase attribution on synthetic timelines with known answers."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from orin.telemetry.phases import StepIndex, phase_shares, summarize, weighted_stats, window_stats

MS = 1_000_000


@dataclass(frozen=True)
class S:
    t_ns: int
    gpu_util: float | None = None
    emc_util: float | None = None
    cpu_util: float | None = None
    proc_cpu_util: float | None = None
    power_mw: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    start_ns: int
    end_ns: int
    prefill_tokens: int
    decode_tokens: int


def test_shares_by_step_kind() -> None:
    assert [(s.phase, s.weight) for s in phase_shares(None)] == [("idle", 1.0)]
    assert [(s.phase, s.weight) for s in phase_shares(Step(0, 1, 10, 0))] == [("prefill", 1.0)]
    assert [(s.phase, s.weight) for s in phase_shares(Step(0, 1, 0, 4))] == [("decode", 1.0)]
    mixed = phase_shares(Step(0, 1, 12, 4))
    assert [(s.phase, s.weight, s.mixed) for s in mixed] == [
        ("prefill", 0.75, True),
        ("decode", 0.25, True),
    ]


@dataclass(frozen=True)
class ImageStep(Step):
    encode_ns: int = 0
    encoded_images: int = 0


def test_the_image_encoding_at_a_steps_start_is_its_own_phase() -> None:
    step = ImageStep(0, 10 * MS, 16, 8, encode_ns=4 * MS, encoded_images=1)
    assert [(s.phase, s.weight) for s in phase_shares(step, 3 * MS)] == [("encode", 1.0)]
    after = phase_shares(step, 4 * MS)  # the encoding is over: the step's batch
    assert [s.phase for s in after] == ["prefill", "decode"]
    assert [s.weight for s in after] == pytest.approx([2 / 3, 1 / 3])
    samples = [S(t * MS, gpu_util=0.9 if t < 4 else 0.3) for t in range(0, 10)]
    out = summarize(samples, [step])
    assert out["encode"].seconds == pytest.approx(0.004)
    assert out["encode"].stats["gpu_util"].mean == pytest.approx(0.9)
    assert out["prefill"].stats["gpu_util"].mean == pytest.approx(0.3)


def test_boundaries_belong_to_what_comes_next() -> None:
    idx = StepIndex([Step(0, 10, 5, 0), Step(10, 20, 0, 1)])
    assert idx.at(0) is idx.steps[0]
    assert idx.at(10) is idx.steps[1]  # end of the first, start of the second
    assert idx.at(20) is None  # after the last step: idle
    assert idx.at(-1) is None


def test_prefill_then_decode_then_idle() -> None:
    # 100 ms of prefill at 90 %, 100 ms of decode at 40 %, 100 ms idle at 0 %; 10 ms samples
    steps = [Step(0, 100 * MS, 500, 0)] + [
        Step(t * MS, (t + 10) * MS, 0, 1) for t in range(100, 200, 10)
    ]
    samples = [
        S(
            t * MS,
            gpu_util=0.9 if t < 100 else 0.4 if t < 200 else 0.0,
            power_mw={"VDD_GPU_SOC": 10_000.0},
        )
        for t in range(5, 300, 10)
    ]
    out = summarize(samples, steps)
    assert out["prefill"].stats["gpu_util"].mean == pytest.approx(0.9)
    assert out["decode"].stats["gpu_util"].mean == pytest.approx(0.4)
    assert out["idle"].stats["gpu_util"].max == 0.0
    assert out["prefill"].seconds == pytest.approx(0.1)
    assert out["decode"].seconds == pytest.approx(0.1)
    assert out["prefill"].tokens == 500 and out["decode"].tokens == 10
    # 10 W for 0.1 s = 1 J over 500 prompt tokens; 1 J over 10 generated tokens
    assert out["prefill"].energy_j == pytest.approx(1.0)
    assert out["prefill"].energy_per_token_j == pytest.approx(0.002)
    assert out["decode"].energy_per_token_j == pytest.approx(0.1)
    assert out["prefill"].mixed_share == 0.0


@dataclass(frozen=True)
class SpecStep(Step):
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    aborted: bool = False


def test_decode_tokens_are_the_tokens_generated_not_the_drafts_rejected() -> None:
    """With speculation a decode row carries its drafts: 10 steps of 1 row + 3 drafts
    each, 1 draft accepted per step, generated 20 tokens in 40 batch tokens. Energy per
    generated token divides by 20; an aborted step (batch discarded) adds none."""
    steps = [
        SpecStep(t * MS, (t + 10) * MS, 0, 4, drafted_tokens=3, accepted_tokens=1)
        for t in range(0, 100, 10)
    ] + [SpecStep(100 * MS, 110 * MS, 50, 0, aborted=True)]
    samples = [S(t * MS, power_mw={"VDD_GPU_SOC": 10_000.0}) for t in range(5, 100, 10)]
    out = summarize(samples, steps)
    assert out["decode"].tokens == 20
    assert out["decode"].energy_per_token_j == pytest.approx(1.0 / 20)
    assert out["prefill"].tokens == 0
    # the samples of a mixed step are still split by the batch's tokens (the work done)
    shares = phase_shares(SpecStep(0, 1, 4, 4, drafted_tokens=3, accepted_tokens=0))
    assert [s.weight for s in shares] == [0.5, 0.5]


def test_mixed_steps_split_by_token_share_and_say_so() -> None:
    steps = [Step(0, 100 * MS, 30, 10)]
    samples = [S(t * MS, gpu_util=0.8) for t in range(0, 100, 10)]
    out = summarize(samples, steps)
    assert out["prefill"].seconds == pytest.approx(0.075)
    assert out["decode"].seconds == pytest.approx(0.025)
    assert out["prefill"].mixed_share == 1.0 and out["decode"].mixed_share == 1.0
    assert out["prefill"].stats["gpu_util"].samples == pytest.approx(7.5)
    assert out["idle"].seconds == 0.0


def test_gaps_between_steps_are_idle_and_missing_values_are_skipped() -> None:
    steps = [Step(0, 10 * MS, 0, 1), Step(50 * MS, 60 * MS, 0, 1)]
    samples = [
        S(5 * MS, gpu_util=0.5),
        S(30 * MS, gpu_util=None, cpu_util=0.2),
        S(55 * MS, gpu_util=0.7),
    ]
    out = summarize(samples, steps)
    assert out["decode"].stats["gpu_util"].mean == pytest.approx(0.6)
    assert "gpu_util" not in out["idle"].stats
    assert out["idle"].stats["cpu_util"].mean == pytest.approx(0.2)
    assert out["decode"].energy_j is None  # no power rails: no energy figures


def test_weighted_percentile() -> None:
    st = weighted_stats([0.1] * 95 + [1.0] * 5, [1.0] * 100)
    assert st is not None and st.p95 == 0.1 and st.max == 1.0
    st = weighted_stats([0.1] * 94 + [1.0] * 6, [1.0] * 100)
    assert st is not None and st.p95 == 1.0
    assert weighted_stats([], []) is None
    assert weighted_stats([0.5], [0.0]) is None


def test_window_stats_for_one_request() -> None:
    samples = [S(t * MS, gpu_util=t / 100) for t in range(0, 100, 10)]
    st = window_stats(samples, 20 * MS, 40 * MS)
    assert st is not None and st.mean == pytest.approx(0.3) and st.samples == 3
    assert window_stats(samples, 200 * MS, 300 * MS) is None
