"""An idle engine's first step takes in the requests that arrived together."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from orin.engine.config import EngineConfig, engine_config
from orin.engine.engine import Engine
from orin.engine.types import SamplingParams, StepStats
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile

pytestmark = pytest.mark.llama

A = [5, 6, 7, 8, 9, 10]
# no common prefix with A: nothing is shared or held back; as long as A: the step is one
# llama.cpp pass, which the scheduler does not split (Scheduler._first_pass_alone)
B = [40, 41, 42, 43, 44, 45]


def config(path: Path) -> EngineConfig:
    profile = parse_profile("name: t\nengine: {n_ctx: 256, slots: 4, n_batch: 64, n_ubatch: 64}\n")
    return engine_config(profile, path, read_model_info(path))


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine(config(demo.ensure("small", "f16"))) as e:
        yield e


def params() -> SamplingParams:
    return SamplingParams(max_tokens=3, temperature=0.0)


def first_steps(engine: Engine, run: Callable[[], object]) -> list[StepStats]:
    stats: list[StepStats] = []
    engine.add_step_observer(stats.append)
    try:
        run()
    finally:
        engine.remove_step_observer(stats.append)
    return stats


def test_a_request_still_being_prepared_joins_the_first_step(engine: Engine) -> None:
    engine.gather_s = 60.0  # far longer than any machine takes to queue B
    ticket = engine.arrival()  # B has reached the server and is being prepared

    def run() -> None:
        a = engine.submit(A, params())  # wakes the idle engine, which waits for B
        time.sleep(0.2)  # B's preparation takes a while: an engine that did not wait starts A
        b = engine.submit(B, params(), arrival=ticket)  # queued: the ticket closes
        assert a.result().finish_reason == "length" and b.result().finish_reason == "length"

    stats = first_steps(engine, run)
    assert stats[0].prefill_tokens == len(A) + len(B)
    assert engine._arriving == 0


def test_an_unclosed_ticket_holds_the_first_step_back_only_so_long(engine: Engine) -> None:
    engine.gather_s = 0.05
    ticket = engine.arrival()  # a request whose preparation never ends
    done = engine.submit(A, params()).result()
    assert done.finish_reason == "length" and len(done.token_ids) == 3
    ticket.close()
    ticket.close()  # twice is harmless
    assert engine._arriving == 0


def test_requests_the_event_loop_has_ready_start_in_one_step(engine: Engine) -> None:
    """Two requests whose tasks are ready on the loop together: the engine, woken by
    the first, lets the loop run the second's task before it builds the step."""
    engine.gather_s = 60.0

    async def both() -> None:
        async def one(prompt: list[int], busy: float) -> int:
            stream = await engine.submit_async(prompt, params())
            time.sleep(busy)  # the loop busy after A: an engine that did not wait starts A
            return sum([e.token_id is not None async for e in stream])

        assert await asyncio.gather(one(A, 0.2), one(B, 0)) == [3, 3]

    stats = first_steps(engine, lambda: asyncio.run(both()))
    assert stats[0].prefill_tokens == len(A) + len(B)


def test_nothing_waits_while_streams_decode(engine: Engine) -> None:
    """A ticket left open while a request decodes: the next requests still run, and
    the open ticket is not waited for (it would stall the running stream)."""
    engine.gather_s = 60.0
    running = engine.submit(A, SamplingParams(max_tokens=40, temperature=0.0))
    next(iter(running))  # A decodes now
    ticket = engine.arrival()
    later = engine.submit(B, params()).result()  # would wait 60 s if the engine waited
    assert later.finish_reason == "length"
    assert running.result().finish_reason == "length"
    ticket.close()


def test_a_returning_user_has_the_first_pass_to_itself(engine: Engine) -> None:
    """A returning user (its whole prompt cached: one token to feed) and a new prompt
    start together. llama.cpp would run one token of each and then the rest of the new
    prompt, two passes: the returning user's pass runs as a step of its own and the new
    prompt as the next, in as many passes, with the tokens a plain run gives."""
    want_a = list(engine.submit(A, params()).result().token_ids)
    with Engine(config(demo.ensure("small", "f16"))) as plain:
        want_b = list(plain.submit(B + B, params()).result().token_ids)
    engine.gather_s = 60.0
    ticket = engine.arrival()
    got: list[list[int]] = []

    def run() -> None:
        a = engine.submit(A, params())
        time.sleep(0.2)
        b = engine.submit(B + B, params(), arrival=ticket)
        got.extend([list(a.result().token_ids), list(b.result().token_ids)])

    stats = first_steps(engine, run)
    assert got == [want_a, want_b]
    assert (stats[0].prefill_tokens, stats[0].decode_tokens, stats[0].micro_batches) == (1, 0, 1)
    assert (stats[1].prefill_tokens, stats[1].decode_tokens, stats[1].micro_batches) == (12, 0, 1)
    assert stats[2].decode_tokens == 2


def test_a_burst_split_for_its_mean_ttft_answers_as_one_step_does(engine: Engine) -> None:
    """Four prompts that start together, where the step-cost model says two steps
    give them a lower mean TTFT (two and two at 14 and 28 ms, a mean of 21, against
    26 ms each in one step; the last ones lose 2 ms, the mean gains 5): two run first,
    the other two next, alone, and every answer is the one a plain engine gives."""
    prompts = [A, B, [60, 61, 62, 63, 64, 65], [70, 71, 72, 73, 74, 75]]  # one pass whole
    profile = (
        "name: t\nengine: {n_ctx: 256, slots: 4, n_batch: 64, n_ubatch: 64, split_bursts: false}\n"
    )
    path = demo.ensure("small", "f16")
    with Engine(engine_config(parse_profile(profile), path, read_model_info(path))) as plain:
        assert plain.scheduler.step_ms(1, 0, 8) is None  # splits off: never a prediction
        want = [list(plain.submit(p, params()).result().token_ids) for p in prompts]
    # a settled model of a machine where a prompt token costs half a pass
    engine.scheduler.step_ms = lambda passes, rows, prompt: 2.0 * passes + 0.3 * rows + prompt
    engine.gather_s = 60.0
    tickets = [engine.arrival() for _ in prompts[1:]]
    got: list[list[int]] = []

    def run() -> None:
        first = engine.submit(prompts[0], params())
        time.sleep(0.2)
        later = zip(prompts[1:], tickets, strict=True)
        rest = [engine.submit(p, params(), arrival=t) for p, t in later]
        got.extend(list(h.result().token_ids) for h in [first, *rest])

    stats = first_steps(engine, run)
    assert got == want
    assert [(s.prefill_tokens, s.decode_tokens) for s in stats[:2]] == [(12, 0), (12, 0)]
    assert stats[2].decode_tokens == 4
    assert engine.status().prompt_splits == 1


def test_the_engine_predicts_steps_once_its_cost_model_settles(engine: Engine) -> None:
    assert engine.scheduler.step_ms(1, 0, 8) is None  # a fresh model: no split yet
    model = engine.chunks.model
    for rows in (1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3):
        model.observe(1, rows, 0, 3.0 + 0.5 * rows)
    model.observe(1, 0, 40, 3.0 + 40 * 0.25)
    assert engine.scheduler.step_ms(2, 0, 8) == pytest.approx(model.predict(2, 0, 8))
