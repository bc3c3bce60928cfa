"""The engine on real llama.cpp and generated models."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from orin.engine.backend import Backend
from orin.engine.config import EngineConfig, engine_config
from orin.engine.engine import Engine
from orin.engine.errors import ContextLengthExceeded, InvalidRequest, QueueFull
from orin.engine.runner import Aborted, Runner
from orin.engine.scheduler import Batch, BatchItem
from orin.engine.timings import now_ns
from orin.engine.types import SamplingParams, StepStats
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile

pytestmark = pytest.mark.llama

GREEDY = dict(temperature=0.0)


def config(path: Path, yaml_engine: str, yaml_context: str = "{}") -> EngineConfig:
    profile = parse_profile(f"name: t\nengine: {yaml_engine}\ncontext: {yaml_context}\n")
    return engine_config(profile, path, read_model_info(path))


@pytest.fixture(scope="module")
def small() -> Path:
    return demo.ensure("small", "f16")


@pytest.fixture(scope="module")
def engine(small: Path) -> Iterator[Engine]:
    cfg = config(small, "{n_ctx: 512, slots: 8, n_batch: 64, n_ubatch: 64}", "{keep: 4}")
    with Engine(cfg) as e:
        yield e


def reference(path: Path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities, one sequence alone in plain llama_cpp.Llama."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=1024, n_batch=512, logits_all=True, verbose=False)
    llm.eval(prompt)
    tokens, logps = [], []
    for _ in range(n):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        t = int(np.argmax(logits))
        shifted = logits - logits.max()
        logps.append(float(shifted[t] - np.log(np.exp(shifted).sum())))
        tokens.append(t)
        llm.eval([t])
    return tokens, logps


def random_prompts(engine: Engine, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = engine.tokenize("Edge inference on the board:")
    vocab = engine.backend.n_vocab if engine.backend else 0
    return [
        base + [rng.randrange(263, vocab) for _ in range(rng.randrange(1, 120))] for _ in range(n)
    ]


def test_concurrent_greedy_equals_each_request_alone(engine: Engine, small: Path) -> None:
    prompts = random_prompts(engine, 8, seed=1)
    streams = []
    for p in prompts:  # staggered arrivals land in different batch compositions
        streams.append(engine.submit(p, SamplingParams(max_tokens=24, logprobs=0, **GREEDY)))
        time.sleep(0.01)
    results = [s.result() for s in streams]
    for prompt, got in zip(prompts, results, strict=True):
        want_tokens, want_logps = reference(small, prompt, 24)
        assert list(got.token_ids) == want_tokens
        assert got.finish_reason == "length"
        # log-probabilities move by ~0.1-0.7 when the context differs: a sequence that saw
        # another one's KV cells would show here even where the argmax survives
        np.testing.assert_allclose([lp.logprob for lp in got.logprobs], want_logps, atol=2e-3)


def test_timings_follow_the_definitions(engine: Engine) -> None:
    c = engine.generate("Timing a request", SamplingParams(max_tokens=10, **GREEDY))
    t = c.timings
    assert t is not None and t.generated_tokens == 10 == len(c.token_ids)
    assert t.ttft_ms == pytest.approx(t.queue_ms + t.prefill_ms)
    assert len(t.itl_ms) == 9
    assert t.tpot_ms == pytest.approx(sum(t.itl_ms) / 9)
    assert t.e2e_ms == pytest.approx(t.ttft_ms + sum(t.itl_ms))
    assert t.prompt_tokens == len(engine.tokenize("Timing a request"))


def test_prefix_reuse_reports_cached_tokens(engine: Engine) -> None:
    head = "A long shared system prompt about serving models on the Orin board. " * 3
    first = engine.generate(head + "First question?", SamplingParams(max_tokens=4, **GREEDY))
    second = engine.generate(head + "Second one?", SamplingParams(max_tokens=4, **GREEDY))
    assert first.timings is not None and second.timings is not None
    shared = len(engine.tokenize(head)) - 2
    assert second.timings.cached_tokens >= shared
    alone = engine.generate(head + "Second one?", SamplingParams(max_tokens=4, **GREEDY))
    assert alone.token_ids == second.token_ids


def test_identical_prompts_share_one_prefill(engine: Engine, small: Path) -> None:
    """n choices of one prompt: one prefill, the others copy its cells (one KV
    stream to another) and feed only the last prompt token. A wrong copy would
    move the log-probabilities away from a run alone."""
    prompt = random_prompts(engine, 1, seed=7)[0] + list(range(300, 340))
    params = SamplingParams(max_tokens=12, logprobs=0, **GREEDY)
    results = [s.result() for s in [engine.submit(prompt, params) for _ in range(4)]]
    want_tokens, want_logps = reference(small, prompt, 12)
    for got in results:
        assert list(got.token_ids) == want_tokens
        np.testing.assert_allclose([lp.logprob for lp in got.logprobs], want_logps, atol=2e-3)
    cached = sorted(r.timings.cached_tokens for r in results if r.timings)
    assert cached[1:] == [len(prompt) - 1] * 3


def test_a_busy_slots_prompt_cells_serve_a_new_prompt(engine: Engine, small: Path) -> None:
    system = random_prompts(engine, 1, seed=8)[0] + list(range(400, 450))
    first = engine.submit([*system, 500, 501], SamplingParams(max_tokens=200, **GREEDY))
    next(iter(first))  # decoding: its slot holds the system prompt
    second = engine.generate([*system, 600], SamplingParams(max_tokens=8, logprobs=0, **GREEDY))
    first.cancel()
    assert second.timings is not None and second.timings.cached_tokens >= len(system)
    want_tokens, want_logps = reference(small, [*system, 600], 8)
    assert list(second.token_ids) == want_tokens
    np.testing.assert_allclose([lp.logprob for lp in second.logprobs], want_logps, atol=2e-3)


def test_sliding_window_runs_far_past_the_context(small: Path) -> None:
    cfg = config(small, "{n_ctx: 256, slots: 2, n_batch: 64, n_ubatch: 64}", "{keep: 8}")
    positions: list[int] = []
    with Engine(cfg) as e:
        assert e.runner is not None
        runner = e.runner
        e.add_step_observer(lambda s: positions.append(runner.seq_pos_max(0)))
        c = e.generate("Go on and on", SamplingParams(max_tokens=4 * 256, **GREEDY))
    assert c.finish_reason == "length"
    assert len(c.token_ids) == 1024
    assert c.timings is not None and c.timings.context_shifts >= 6
    assert max(positions) < 256


def test_without_sliding_stops_at_the_window(small: Path) -> None:
    cfg = config(small, "{n_ctx: 256, slots: 1, n_batch: 64, n_ubatch: 64}", "{sliding: false}")
    with Engine(cfg) as e:
        prompt = e.tokenize("Stop at the edge")
        c = e.generate(prompt, SamplingParams(max_tokens=1000, **GREEDY))
    assert c.finish_reason == "length"
    assert len(prompt) + len(c.token_ids) == 256 + 1  # the last token never enters the cache


def test_cancellation_frees_every_slot_and_keeps_only_computed_cells(small: Path) -> None:
    """Cancelled in the queue, in prefill or decoding: every slot is free, and the
    cells llama.cpp holds are the ones the scheduler keeps as prefixes (those of the
    steps that finished, none of a step cut short)."""
    cfg = config(small, "{n_ctx: 512, slots: 4, n_batch: 64, n_ubatch: 64}")
    rng = random.Random(3)
    with Engine(cfg) as e:
        streams = []
        for i in range(50):
            prompt = "x " * rng.randrange(1, 200) + f"request {i}"
            s = e.submit(prompt, SamplingParams(max_tokens=400, **GREEDY))
            streams.append(s)
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.02)  # some in prefill, some decoding, some queued
            s.cancel()
        reasons = {s.result().finish_reason for s in streams}
        assert reasons <= {"cancelled", "length"}
        assert "cancelled" in reasons
        assert e.runner is not None
        deadline = time.time() + 5
        while (e.slots_busy or e.kv_cells_used) and time.time() < deadline:
            time.sleep(0.01)
        assert e.slots_busy == 0 and e.kv_cells_used == 0
        runner = e.runner
        with e.idle():  # llama.cpp's memory, once the cancellations' removals have run
            held = [runner.seq_pos_max(s.id) + 1 for s in e.scheduler.slots]
            assert held == [len(s.cache) for s in e.scheduler.slots]
            assert any(held)
        ok = e.generate("after the storm", SamplingParams(max_tokens=8, **GREEDY))
        assert ok.finish_reason == "length" and len(ok.token_ids) == 8


def test_a_stopped_answer_asked_again_reuses_its_prompt(small: Path) -> None:
    """A chat's stop, then regenerate: the client cancels a stream and sends the same
    prompt again. The cancelled request's cells stay in its slot as a finished one's
    do, so the second request computes only its last prompt token, and answers as a
    fresh engine does."""
    cfg = config(small, "{n_ctx: 512, slots: 2, n_batch: 64, n_ubatch: 64}")
    params = SamplingParams(max_tokens=12, **GREEDY)
    with Engine(cfg) as fresh:
        prompt = fresh.tokenize("x " * 150 + "the question")
        want = fresh.submit(prompt, params).result()
    with Engine(cfg) as e:
        stream = e.submit(prompt, SamplingParams(max_tokens=400, **GREEDY))
        seen, final = [], None
        for event in stream:
            final = event.finish_reason
            if event.token_id is not None:
                seen.append(event.token_id)
                if len(seen) == 3:
                    stream.cancel()
        assert final == "cancelled"
        assert seen[:3] == list(want.token_ids[:3])
        again = e.submit(prompt, params).result()
        assert e.slots_busy == 0 and e.kv_cells_used == 0
    assert again.token_ids == want.token_ids
    assert again.timings is not None and again.timings.cached_tokens == len(prompt) - 1


def test_abort_callback_interrupts_a_prompt_chunk(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """...and llama.cpp's lines about the stop it was asked for are not errors (an
    operator's `journalctl -p err` would show one for every cancelled prompt)."""
    assert engine.runner is not None
    runner = engine.runner
    with engine.idle():  # the engine thread waits while the block runs
        engine.scheduler.clear_idle_cache()
        runner.apply(engine.scheduler.take_ops())
        tokens = tuple(engine.tokenize("abort me " * 20)[:64])
        batch = Batch((), (BatchItem(7, tokens, 0, True, prefill=True),))
        with caplog.at_level(logging.DEBUG, "orin.llama"), pytest.raises(Aborted):
            runner.decode(batch, abort=lambda: True)
        assert runner.seq_pos_max(7) == -1  # the aborted micro-batch left nothing behind
    said = [r for r in caplog.records if r.name == "orin.llama"]
    assert any("failed to decode" in r.getMessage() for r in said)  # still there, for debugging
    assert [r.getMessage() for r in said if r.levelno >= logging.WARNING] == []


class RecordingLib:
    """llama.cpp's functions as the runner sees them, with the calls that bound a step
    recorded (name, time the call returned) in one list the step observer shares."""

    RECORDED = frozenset({"llama_decode", "llama_synchronize"})

    def __init__(self, lib: Any, events: list[tuple[str, Any]]) -> None:
        self._lib = lib
        self._events = events

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        if name not in self.RECORDED:
            return fn

        def recorded(*args: Any) -> Any:
            result = fn(*args)
            self._events.append((name, now_ns()))
            return result

        return recorded


def test_a_step_ends_after_llama_synchronize(small: Path) -> None:
    """llama_decode only queues the work on a GPU: every step's end, and so TTFT, TPOT
    and the telemetry's phase boundaries, must come after llama_synchronize. The runner
    synchronizes on every build, so the CPU build shows the same order as a GPU's."""
    events: list[tuple[str, Any]] = []

    def runner(backend: Backend, n_batch: int) -> Runner:
        r = Runner(backend, n_batch)
        r.lib = cast(Any, RecordingLib(r.lib, events))
        return r

    cfg = config(small, "{n_ctx: 256, slots: 2, n_batch: 64, n_ubatch: 64, prefill_chunk: 16}")
    with Engine(cfg, runner_factory=runner) as e:
        e.add_step_observer(lambda stats: events.append(("step", stats)))
        prompt = e.tokenize("a prompt long enough for several chunks " * 3)
        assert len(prompt) > 32
        c = e.generate(prompt, SamplingParams(max_tokens=6, **GREEDY))
    assert c.finish_reason == "length"
    names = [name for name, _ in events]
    assert names.count("step") >= 3 + 5  # prompt chunks, then one decode per token
    last_sync = None
    for i, (name, value) in enumerate(events):
        if name == "llama_decode":
            assert names[i + 1] == "llama_synchronize"  # before anything reads the result
        elif name == "llama_synchronize":
            last_sync = value
        elif name == "step":
            assert last_sync is not None and value.start_ns <= last_sync <= value.end_ns
            last_sync = None  # each step has its own decode and synchronize
    # the first token's timestamp is a step's end: after the GPU has finished too
    step_ends = {stats.end_ns for name, stats in events if name == "step"}
    assert c.timings is not None and c.timings.first_token_ns in step_ends


class AbortIgnoringRunner(Runner):
    """A runner as a GPU backend behaves: llama.cpp's abort callback is never honoured,
    so a prompt chunk, once in llama_decode, is always decoded to its end."""

    def __init__(self, backend: Backend, n_batch: int, during_prefill: Any) -> None:
        super().__init__(backend, n_batch)
        self.fed: list[tuple[int, int]] = []  # (slot, prompt tokens) of every decoded chunk
        self.during_prefill = during_prefill

    def decode(self, batch: Batch, abort: Any = None) -> dict[int, int]:
        self.fed += [(i.slot, len(i.tokens)) for i in batch.items if i.prefill]
        if batch.n_prefill:
            self.during_prefill(len(self.fed))  # e.g. a client leaves while this chunk runs
        return super().decode(batch, None)


def test_a_cancel_the_backend_ignores_stops_the_prompt_after_its_chunk(small: Path) -> None:
    """On a GPU a cancel cannot interrupt llama_decode: the chunk being decoded finishes,
    no further chunk of the prompt is fed, and the chunks' cells stay as the slot's
    prefix, as the scheduler records them."""
    # share_min set: no copy is timed at load, so the runner sees this prompt's chunks only
    engine = "{n_ctx: 512, slots: 2, n_batch: 128, n_ubatch: 128, prefill_chunk: 32, share_min: 16}"
    cfg = config(small, engine)
    assert cfg.prefill_chunk == 32
    runners: list[AbortIgnoringRunner] = []
    engines: list[Engine] = []

    def cancel_during_third_chunk(n_chunks: int) -> None:
        if n_chunks == 3:
            engines[0].cancel("long")

    def factory(backend: Backend, n_batch: int) -> Runner:
        runners.append(AbortIgnoringRunner(backend, n_batch, cancel_during_third_chunk))
        return runners[0]

    steps: list[StepStats] = []
    with Engine(cfg, runner_factory=factory) as e:
        engines.append(e)
        e.add_step_observer(steps.append)
        prompt = random_prompts(e, 1, seed=5)[0][:8] * 50  # 400 tokens: 13 chunks of 32
        stream = e.submit(prompt, SamplingParams(max_tokens=4, **GREEDY), request_id="long")
        assert stream.result().finish_reason == "cancelled"
        runner = runners[0]
        with e.idle():
            assert runner.seq_pos_max(0) + 1 == len(e.scheduler.slots[0].cache) == 96
            assert runner.fed == [(0, 32), (0, 32), (0, 32)]  # nothing after the cancel
        assert not any(s.aborted for s in steps)  # nothing was interrupted
        ok = e.generate("after the cancel", SamplingParams(max_tokens=3, **GREEDY))
    assert ok.finish_reason == "length" and len(ok.token_ids) == 3


def test_chinese_byte_fallback_streams_whole_characters(engine: Engine) -> None:
    target = "龘靐齉 边缘推理 🚀"  # rare characters exist only as byte-fallback tokens
    grammar = 'root ::= "' + target + '"'
    stream = engine.submit(
        "请用中文回答：", SamplingParams(max_tokens=64, grammar=grammar, **GREEDY)
    )
    events = list(stream)
    deltas = [e.text for e in events]
    assert all("\ufffd" not in d for d in deltas)
    assert any(e.token_id is not None and e.text == "" for e in events)  # bytes held back
    assert "".join(deltas) == target
    ids = [e.token_id for e in events if e.token_id is not None]
    assert engine.detokenize(ids) == target


def test_stop_string_across_tokens_is_honoured_and_not_leaked(engine: Engine) -> None:
    params = SamplingParams(max_tokens=40, **GREEDY)
    full = engine.generate("Stop strings", params)
    pieces = [engine.piece(t).decode("utf-8", "replace") for t in full.token_ids]
    i = next(k for k in range(5, 35) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
    before = "".join(pieces[:i])
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    straddle = len(before) + len(pieces[i]) - 2  # the stop string starts in token i, ends in i+1
    stream = engine.submit("Stop strings", SamplingParams(max_tokens=40, stop=(stop,), **GREEDY))
    events = list(stream)
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop"
    assert text == full.text[: full.text.find(stop)]
    assert full.text.find(stop) <= straddle
    assert stop not in text and len(text) <= straddle
    assert len(events) <= i + 3  # generation ended at the token completing the stop string


def test_typed_errors(engine: Engine, small: Path) -> None:
    with pytest.raises(InvalidRequest) as exc:
        engine.submit("x", SamplingParams(temperature=-1))
    assert exc.value.param == "temperature"
    with pytest.raises(InvalidRequest) as exc:
        engine.submit("x", SamplingParams(logit_bias={10**7: 1.0}))
    assert exc.value.param == "logit_bias"
    with pytest.raises(InvalidRequest) as exc:
        engine.submit("x", SamplingParams(grammar="root ::= ["))
    assert exc.value.param == "grammar"
    assert engine.generate("still serving", SamplingParams(max_tokens=2)).finish_reason == "length"
    with pytest.raises(InvalidRequest) as exc:
        engine.submit([1, -5, 300])
    assert exc.value.param == "prompt"
    with pytest.raises(InvalidRequest):
        engine.submit([1, 10**6])
    with pytest.raises(ContextLengthExceeded) as too_long:
        engine.submit([5] * 600)
    assert too_long.value.prompt_tokens == 600 and too_long.value.limit == 512
    cfg = config(small, "{n_ctx: 256, slots: 1, n_batch: 64, n_ubatch: 64}")
    with Engine(cfg.with_(max_queue=1)) as e:
        first = e.submit("busy", SamplingParams(max_tokens=200, **GREEDY))
        second = e.submit("waits", SamplingParams(max_tokens=2, **GREEDY))
        time.sleep(0.05)
        with pytest.raises(QueueFull):
            e.submit("no room", SamplingParams(max_tokens=2))
        first.cancel()
        assert second.result().finish_reason == "length"


def test_sampling_with_seed_is_reproducible(engine: Engine) -> None:
    p = SamplingParams(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a = engine.generate("Sample me", p)
    b = engine.generate("Sample me", p)
    c = engine.generate("Sample me", SamplingParams(**{**p.__dict__, "seed": 7}))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_logit_bias_and_stop_token_ids(engine: Engine) -> None:
    forced = engine.generate(
        "bias", SamplingParams(max_tokens=3, logit_bias={300: 100.0}, **GREEDY)
    )
    assert forced.token_ids == (300, 300, 300)
    stopped = engine.generate(
        "bias",
        SamplingParams(max_tokens=10, logit_bias={300: 100.0}, stop_token_ids=(300,), **GREEDY),
    )
    assert stopped.finish_reason == "stop" and stopped.token_ids == (300,)
    eos = engine.generate("eos", SamplingParams(max_tokens=10, logit_bias={2: 100.0}, **GREEDY))
    assert eos.finish_reason == "stop" and eos.text == "" and eos.token_ids == (2,)
    ignored = engine.generate(
        "eos", SamplingParams(max_tokens=5, logit_bias={2: 100.0}, ignore_eos=True, **GREEDY)
    )
    assert ignored.finish_reason == "length" and 2 not in ignored.token_ids


def _pieces_text(engine: Engine, logprobs: Any) -> str:
    backend = engine.backend
    assert backend is not None
    return b"".join(backend.piece(lp.token_id) for lp in logprobs).decode("utf-8", "replace")


def test_logprobs_cover_the_text_the_client_gets_and_nothing_after_a_stop(
    engine: Engine,
) -> None:
    """The tokens of a stop string are not in the logprobs (their text is not sent), nor
    is a stop token's; the logprobs of tokens whose text was held back while it could
    still become a stop string come before the text they made, streamed or not."""
    plain = engine.generate("stop here", SamplingParams(max_tokens=16, logprobs=0, **GREEDY))
    assert _pieces_text(engine, plain.logprobs) == plain.text  # nothing held: all tokens
    backend = engine.backend
    assert backend is not None
    pieces = [backend.piece(t).decode("utf-8", "replace") for t in plain.token_ids]
    k = next(i for i in range(4, 16) if pieces[i].strip() and pieces[i + 1].strip())
    # a stop string of two tokens' text, starting where token k starts
    stop = pieces[k] + pieces[k + 1]
    assert stop not in "".join(pieces[:k]) + pieces[k]  # it first completes at k + 1
    cut = engine.generate(
        "stop here", SamplingParams(max_tokens=16, logprobs=0, stop=[stop], **GREEDY)
    )
    assert cut.finish_reason == "stop" and cut.text == "".join(pieces[:k])
    assert [lp.token_id for lp in cut.logprobs] == list(plain.token_ids[:k])

    events = list(
        engine.submit("stop here", SamplingParams(max_tokens=16, logprobs=0, stop=[stop], **GREEDY))
    )
    sent, with_logprobs = "", []
    for e in events:  # each logprob arrives no later than its token's text
        if e.logprob is not None:
            with_logprobs.append(e.logprob)
            assert _pieces_text(engine, with_logprobs).startswith(sent)
        sent += e.text
    assert sent == cut.text and _pieces_text(engine, with_logprobs) == sent

    ended = engine.generate(
        "stop here",
        SamplingParams(max_tokens=16, logprobs=0, stop_token_ids=[plain.token_ids[k]], **GREEDY),
    )
    assert ended.finish_reason == "stop" and list(ended.token_ids) == list(plain.token_ids[: k + 1])
    assert [lp.token_id for lp in ended.logprobs] == list(plain.token_ids[:k])  # no stop token


def test_top_logprobs(engine: Engine) -> None:
    c = engine.generate("probabilities", SamplingParams(max_tokens=3, logprobs=5, **GREEDY))
    for lp in c.logprobs:
        assert len(lp.top) == 5
        assert lp.top[0].token_id == lp.token_id  # greedy picks the most likely
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)


def test_step_stats_and_async_stream(engine: Engine) -> None:
    import asyncio

    stats: list[StepStats] = []
    engine.add_step_observer(stats.append)
    try:

        async def run() -> str:
            stream = await engine.submit_async(
                "async please", SamplingParams(max_tokens=5, **GREEDY)
            )
            return "".join([e.text async for e in stream])

        text = asyncio.run(run())
    finally:
        engine.remove_step_observer(stats.append)
    assert text
    assert stats[0].prefill_tokens > 0 and stats[0].phase in ("prefill", "mixed")
    assert any(s.phase == "decode" for s in stats)
    assert all(s.end_ns >= s.start_ns for s in stats)


@pytest.mark.parametrize("hold", [True, False])
def test_a_steps_events_reach_the_loop_just_before_the_next_decode(small: Path, hold: bool) -> None:
    """The engine thread holds a step's events and hands them to the event loop just
    before its next llama_decode (the loop's SSE work then runs beside the decode,
    not against the engine for the GIL); the last ones go when it is idle. Without
    ``hold_events`` they go at the end of each step."""
    import asyncio

    from orin.engine import stream as stream_module

    def held() -> int:
        pending = stream_module._outbox.pending  # this (the engine's) thread's
        return sum(len(items) for items in (pending or {}).values())

    seen: list[tuple[int, int]] = []  # at each decode: events held, then left after

    class Recording(Runner):
        def _run(self, b: Any, n: int) -> None:
            before = held()
            self.before_wait()
            seen.append((before, held()))
            super()._run(b, n)

    engine = Engine(config(small, "{n_ctx: 256, slots: 2, share_min: 4}"), Recording)
    engine.hold_events = hold
    with engine:

        async def run() -> list[str]:
            stream = await engine.submit_async("hand over", SamplingParams(max_tokens=6, **GREEDY))
            return [e.text async for e in stream]

        texts = asyncio.run(asyncio.wait_for(run(), 120))
    assert len(texts) == 6 + 1  # six tokens, then the final event, which went when idle
    assert len(seen) == 6  # the prompt's decode, then one for each token but the last
    if hold:
        assert seen == [(0, 0)] + [(1, 0)] * 5  # the step before's token, handed over here
    else:
        assert seen == [(0, 0)] * 6


def test_clean_shutdown_leaves_no_thread(small: Path) -> None:
    cfg = config(small, "{n_ctx: 256, slots: 2, n_batch: 64, n_ubatch: 64}")
    e = Engine(cfg).start()
    e.wait_ready(60)
    s = e.submit("long", SamplingParams(max_tokens=100000, **GREEDY))
    e.stop(drain=False)
    assert s.result().finish_reason == "cancelled"
    assert e._thread is not None and not e._thread.is_alive()
    assert e.state == "stopped"


def test_backend_failures_are_typed(small: Path, tmp_path: Path) -> None:
    from orin.engine.backend import Backend
    from orin.engine.errors import BackendError
    from orin.errors import KVConfigError, ModelFileError

    cfg = config(small, "{n_ctx: 256, slots: 1, n_batch: 64, n_ubatch: 64}")
    with pytest.raises(ModelFileError, match="no such file"):
        Backend(cfg.with_(model_path=tmp_path / "missing.gguf"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small.read_bytes()[:50_000])
    with pytest.raises(ModelFileError, match="truncated"):
        Backend(cfg.with_(model_path=cut))
    # the profile rules catch a quantized V cache without flash attention first...
    with pytest.raises(KVConfigError, match="kv-quant-v-needs-fa"):
        config(small, "{n_ctx: 256, slots: 1, type_k: q8_0, type_v: q8_0, flash_attn: off}")
    # ...and llama.cpp's own refusal still comes back as a typed error with its reason
    with pytest.raises(BackendError, match="could not create the context"):
        Backend(cfg.with_(type_v="q8_0", flash_attn="off"))
    huge = cfg.with_(n_ctx=1 << 20, slots=64, n_batch=64)
    with pytest.raises(BackendError, match="could not create the context"):
        Backend(huge)


def test_engine_reports_load_failure(small: Path, tmp_path: Path) -> None:
    from orin.errors import ModelFileError

    cfg = config(small, "{n_ctx: 256, slots: 1, n_batch: 64, n_ubatch: 64}")
    e = Engine(cfg.with_(model_path=tmp_path / "nope.gguf")).start()
    with pytest.raises(ModelFileError):
        e.wait_ready(30)
    assert e.state == "failed"


def test_drain_lets_running_requests_finish(small: Path) -> None:
    from orin.engine.errors import EngineStopped

    cfg = config(small, "{n_ctx: 256, slots: 2, n_batch: 64, n_ubatch: 64}")
    e = Engine(cfg).start()
    e.wait_ready(60)
    s = e.submit("finish me", SamplingParams(max_tokens=50, **GREEDY))
    stopper = threading.Thread(target=e.stop, kwargs={"drain": True, "timeout": 30})
    stopper.start()
    time.sleep(0.01)
    with pytest.raises(EngineStopped):
        e.submit("too late", SamplingParams(max_tokens=5))
    stopper.join()
    c = s.result()
    assert c.finish_reason == "length" and len(c.token_ids) == 50
    assert e.state == "stopped" and e._thread is not None and not e._thread.is_alive()


def test_cancel_on_an_otherwise_idle_engine_decodes_nothing(
    small: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(small, "{n_ctx: 256, slots: 1, n_batch: 64, n_ubatch: 64}")
    steps: list[StepStats] = []
    with Engine(cfg) as e:
        e.add_step_observer(steps.append)
        s = e.submit("cancel me", SamplingParams(max_tokens=100_000, **GREEDY))
        while not steps:
            time.sleep(0.001)
        s.cancel()
        assert s.result().finish_reason == "cancelled"
        ok = e.generate("next", SamplingParams(max_tokens=3, **GREEDY))
    assert ok.finish_reason == "length"
    assert "failed to decode" not in caplog.text and "decode failed" not in caplog.text
    assert all(st.prefill_tokens + st.decode_tokens > 0 for st in steps)


def test_a_client_that_does_not_read_is_cut_off_and_others_go_on(
    small: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(small, "{n_ctx: 256, slots: 2, n_batch: 64, n_ubatch: 64}").with_(max_backlog=32)
    with Engine(cfg) as e:
        stalled = e.submit("nobody reads me", SamplingParams(max_tokens=100_000, **GREEDY))
        other = e.submit("read me", SamplingParams(max_tokens=20, **GREEDY))
        for event in other:  # read as it comes: never over the bound
            assert event.finish_reason in (None, "length")
        deadline = time.time() + 30
        while e.slots_busy and time.time() < deadline:
            time.sleep(0.01)
        events = list(stalled)
    assert events[-1].finish_reason == "cancelled"
    assert 32 < len(events) - 1 < 200  # buffered up to the bound, then cut off
    assert "has not read" in caplog.text


def test_async_submit_parses_the_grammar_off_the_event_loop(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grammar parsing and sampler construction run on a worker thread, and a grammar
    that does not parse is still raised by submit_async, before any event."""
    import asyncio

    import llama_cpp

    parsed_on: list[int] = []
    real = llama_cpp.llama_sampler_init_grammar

    def recording(*args: Any) -> Any:
        parsed_on.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(llama_cpp, "llama_sampler_init_grammar", recording)

    async def run() -> tuple[int, str, str]:
        stream = await engine.submit_async(
            "answer", SamplingParams(max_tokens=8, grammar='root ::= "ok"', **GREEDY)
        )
        text = "".join([e.text async for e in stream])
        with pytest.raises(InvalidRequest) as bad:
            await engine.submit_async("x", SamplingParams(grammar="root ::= ["))
        return threading.get_ident(), text, bad.value.param

    loop_thread, text, param = asyncio.run(run())
    assert text == "ok" and param == "grammar"
    assert len(parsed_on) == 2 and loop_thread not in parsed_on


def test_a_grammar_that_does_not_parse_is_no_server_error(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The client gets the 400; llama.cpp's own line about it is logged at info level,
    not as an error of the server's (`journalctl -p err`)."""
    with caplog.at_level(logging.DEBUG, "orin.llama"), pytest.raises(InvalidRequest):
        engine.submit("x", SamplingParams(grammar='root ::= ("a" '))
    said = [r for r in caplog.records if r.name == "orin.llama"]
    assert any("failed to parse grammar" in r.getMessage() for r in said)
    assert [r.getMessage() for r in said if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("root ::= " + "(" * 30_000 + '"a"' + ")" * 30_000, "nests groups 30000 deep"),
        (
            "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(100_000))])
            + '\nr100000 ::= "a"',
            "chains of rule references through up to 100002 rules",
        ),
    ],
)
def test_a_grammar_that_would_overflow_llama_cpps_stack_is_refused(
    engine: Engine, source: str, why: str
) -> None:
    """llama.cpp's parser recurses once per nested group and follows chains of rule
    references recursively: grammars like these (a few hundred kilobytes, well within
    a request body) overflowed the thread's stack and killed the process. They are
    refused before llama.cpp sees them, and the engine serves on."""
    with pytest.raises(InvalidRequest) as bad:
        engine.submit("x", SamplingParams(grammar=source))
    assert bad.value.param == "grammar" and why in str(bad.value)
    out = engine.generate("x", SamplingParams(max_tokens=4, grammar='root ::= "ok"', **GREEDY))
    assert out.text == "ok"


@pytest.mark.parametrize(
    ("grammar", "why"),
    [
        ("root ::= x", "Undefined rule identifier 'x'"),  # the parser's message (stderr)
        ('top ::= "a"', "grammar does not contain a 'root' symbol"),  # llama.cpp's log
    ],
)
def test_the_400_for_a_grammar_says_why_and_nothing_reaches_stderr(
    engine: Engine, capfd: pytest.CaptureFixture[str], grammar: str, why: str
) -> None:
    """llama.cpp's parser prints its message and the whole grammar to stderr itself,
    outside the log callback: the message goes into the client's error instead, and
    the service's log (`--log-format json`) gets no raw lines."""
    capfd.readouterr()
    with pytest.raises(InvalidRequest) as bad:
        engine.submit("x", SamplingParams(grammar=grammar))
    assert bad.value.param == "grammar"
    assert str(bad.value).endswith(f"the grammar does not parse: {why}")
    assert capfd.readouterr().err == ""


def test_async_submit_prepares_a_plain_request_on_the_loop(engine: Engine) -> None:
    """Token ids without grammar or penalties skip the worker-thread round trip; a
    text prompt, a penalized request and a long prompt still go to the pool."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    class Counting(ThreadPoolExecutor):
        calls = 0

        def submit(self, *args: Any, **kwargs: Any) -> Any:
            Counting.calls += 1
            return super().submit(*args, **kwargs)

    ids = engine.tokenize("hello there")

    async def run() -> list[int]:
        asyncio.get_running_loop().set_default_executor(Counting(1))
        used = []
        for prompt, params in (
            (ids, SamplingParams(max_tokens=2, **GREEDY)),
            ("hello there", SamplingParams(max_tokens=2, **GREEDY)),
            (ids, SamplingParams(max_tokens=2, repeat_penalty=1.3, **GREEDY)),
            (ids[1:3] * 1100, SamplingParams(max_tokens=1, **GREEDY)),  # 2,200 ids
        ):
            before = Counting.calls
            try:
                stream = await engine.submit_async(prompt, params)
                [e async for e in stream]
            except ContextLengthExceeded:  # the long prompt: longer than a slot's context
                pass
            used.append(Counting.calls - before)
        return used

    assert asyncio.run(run()) == [0, 1, 1, 1]


def test_end_of_generation_tokens_are_listed_once_per_model(
    small: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llama_cpp

    calls: list[int] = []
    real = llama_cpp.llama_vocab_is_eog

    def counting(vocab: Any, token: int) -> Any:
        calls.append(token)
        return real(vocab, token)

    monkeypatch.setattr(llama_cpp, "llama_vocab_is_eog", counting)
    cfg = config(small, "{n_ctx: 256, slots: 1, n_batch: 64, n_ubatch: 64}")
    params = SamplingParams(max_tokens=3, logit_bias={2: 100.0}, ignore_eos=True, **GREEDY)
    with Engine(cfg) as e:
        assert e.backend is not None
        n_vocab = e.backend.n_vocab
        first = e.generate("eos", params)
        after_first = len(calls)
        second = e.generate("eos again", params)
    assert after_first == n_vocab  # the whole vocabulary, once
    assert len(calls) == after_first  # the second request reuses the list
    for c in (first, second):
        assert c.finish_reason == "length" and 2 not in c.token_ids


def test_the_client_interface_status_chat_text_and_observers(small: Path) -> None:
    from orin.engine.errors import EngineStopped

    cfg = config(small, "{n_ctx: 256, slots: 2, n_batch: 64, n_ubatch: 64}")
    e = Engine(cfg)
    assert e.status().state == "new" and e.status().error is None
    with pytest.raises(EngineStopped):
        e.render_chat([{"role": "user", "content": "hi"}])
    assert e.piece(5) == b"" and e.detokenize([5]) == ""  # nothing loaded: nothing to show
    steps: list[StepStats] = []
    finished: list[tuple[str, str]] = []

    def on_finish(rid: str, reason: str, timings: Any) -> None:
        finished.append((rid, reason))

    with e:
        s = e.status()
        assert (s.state, s.slots_total, s.slots_busy, s.waiting) == ("ready", 2, 0, 0)
        assert (s.kv_cells_used, s.kv_cells_total) == (0, e.kv_cells_total)
        assert s.step_started_ns is None and not s.busy and s.heartbeat_ns > 0
        prompt, add_bos = e.render_chat([{"role": "user", "content": "hi"}])
        assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" and add_bos
        ids = e.tokenize("round trip")
        text = e.detokenize(ids)
        assert "round trip" in text and b"".join(e.piece(t) for t in ids).decode() == text
        e.add_step_observer(steps.append)
        e.add_finish_observer(on_finish)
        e.submit("observed", SamplingParams(max_tokens=2, **GREEDY), "one").result()
        with e.idle():  # the request's last step has ended: its observers have run
            e.remove_step_observer(steps.append)
            e.remove_finish_observer(on_finish)
        n_steps = len(steps)
        e.generate("not observed", SamplingParams(max_tokens=2, **GREEDY))
        with e.idle():
            assert e.status().kv_cells_cached > 0  # the finished prompts stay as prefixes
    assert n_steps >= 2 and len(steps) == n_steps
    assert finished == [("one", "length")]
    assert e.status().state == "stopped"
    override = cfg.with_(chat_template="{{ messages[0]['content'] }}!")
    with Engine(override) as e:
        assert e.render_chat([{"role": "user", "content": "hi"}]) == ("hi!", True)


def test_a_caller_gone_while_its_request_is_prepared_cancels_it(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    import llama_cpp

    parsing, release, finished = threading.Event(), threading.Event(), threading.Event()
    reasons: list[str] = []
    real = llama_cpp.llama_sampler_init_grammar

    def slow_parse(*args: Any) -> Any:
        parsing.set()
        release.wait(30)
        return real(*args)

    def on_finish(rid: str, reason: str, timings: Any) -> None:
        if rid == "orphan":
            reasons.append(reason)
            finished.set()

    monkeypatch.setattr(llama_cpp, "llama_sampler_init_grammar", slow_parse)
    params = SamplingParams(  # runs until cancelled
        max_tokens=100_000, grammar='root ::= "a"+', ignore_eos=True, **GREEDY
    )

    async def run() -> None:
        task = asyncio.ensure_future(engine.submit_async("x", params, request_id="orphan"))
        await asyncio.to_thread(parsing.wait, 30)  # the worker is inside the parse
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.to_thread(finished.wait, 30)  # the loop runs while the engine works

    engine.add_finish_observer(on_finish)
    try:
        asyncio.run(run())
    finally:
        engine.remove_finish_observer(on_finish)
    assert reasons == ["cancelled"]
