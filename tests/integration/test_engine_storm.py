"""Every step-shaping feature at once, against the plain engine.

Requests with shared prefixes (cells copied between slots), drafted tokens (n-gram
lookup or a draft model), SLO-sized prompt chunks, the persistent prompt cache, stop
strings, cancellations and embedding jobs (passes on borrowed idle slots) arrive from
several threads at moments of their own. Each answer must be the one the plain engine
gives to that request alone, a cancelled one up to where it stopped; afterwards every
slot's llama.cpp cells must be the tokens the scheduler thinks it holds, and a new
request must answer as on a fresh engine.

The moments at which requests arrive and are cancelled vary from run to run, and so
do the steps' shapes; what is asserted holds for any of them."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orin.engine.engine import Engine
from orin.engine.stream import Completion
from orin.engine.types import SamplingParams, TokenEvent
from orin.model import demo
from tests.integration.test_engine_steps import config

pytestmark = pytest.mark.llama

# flash attention: a row's logits do not depend on the rows beside it (docs/engine.md)
ENGINE = "{n_ctx: 1024, slots: 4, n_batch: 128, n_ubatch: 128, share_min: 4, flash_attn: on%s}"
SYSTEMS = (
    "You are the voice assistant of a delivery robot. Name the shelf and the box.",
    "System: answer in one short sentence and never guess a location.",
    "Log of the night shift, line 17:",
)
MODEL = "model: {pooling: mean}\n"  # embeddings beside generation
REQUESTS = 40
THREADS = 6
EMBED_JOBS = 10


@dataclass
class Plan:
    requests: list[Planned]
    embeds: list[list[str]]  # the inputs of each embedding job
    want_vectors: list[list[Any]]
    last: list[int]  # asked after the storm
    want_last: Completion


@dataclass
class Planned:
    prompt: list[int]
    params: SamplingParams
    cancel_after: int | None  # events read before cancelling
    delay: float  # seconds the thread waits before submitting
    want: Completion | None = None


@dataclass
class Seen:
    events: list[TokenEvent] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if e.token_id is not None]


@pytest.fixture(scope="module")
def small() -> Path:
    return demo.ensure("small", "f16")


@pytest.fixture(scope="module")
def plan(small: Path) -> Iterator[Plan]:
    """The requests and embedding jobs, each answered by the plain engine alone, and a
    last request to ask after the storm, with its plain answer."""
    rng = random.Random(16)
    with Engine(config(small, ENGINE % "", MODEL)) as plain:
        vocab = plain.backend.n_vocab if plain.backend else 0
        systems = [plain.tokenize(s) for s in SYSTEMS]
        planned: list[Planned] = []
        for _ in range(REQUESTS):
            tail = [rng.randrange(263, vocab) for _ in range(rng.randrange(2, 40))]
            if rng.random() < 0.4:  # a passage repeated: something for the n-gram drafter
                tail = tail + tail[: rng.randrange(4, 20)] + tail
            params = SamplingParams(
                temperature=0.0, max_tokens=rng.randrange(4, 70), ignore_eos=rng.random() < 0.5
            )
            prompt = rng.choice(systems) + tail
            if rng.random() < 0.2:  # a stop string the answer is known to contain
                free = plain.submit(prompt, params).result()
                piece = plain.detokenize(list(free.token_ids[5:7]))
                if piece.strip():
                    params = replace(params, stop=(piece,))
            cancel = rng.randrange(1, 20) if rng.random() < 0.25 else None
            planned.append(Planned(prompt, params, cancel, rng.random() * 0.05))
        for p in planned:
            p.want = plain.submit(p.prompt, p.params).result()
        embeds = [
            [plain.detokenize(p.prompt)[:200] for p in planned[k : k + 2]]
            for k in range(0, 2 * EMBED_JOBS, 2)
        ]
        vectors = [list(plain.embed(texts).vectors) for texts in embeds]
        last = systems[0] + [rng.randrange(263, vocab) for _ in range(30)]
        want_last = plain.submit(last, LAST).result()
    yield Plan(planned, embeds, vectors, last, want_last)


LAST = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def storm(engine: Engine, plan: Plan) -> tuple[list[Completion | Seen], list[list[Any]]]:
    """Submit every request from ``THREADS`` threads, each after its delay, and the
    embedding jobs from one more; cancel the requests planned to be cancelled after
    reading their events so far."""
    planned = plan.requests
    out: list[Completion | Seen | None] = [None] * len(planned)
    vectors: list[list[Any]] = []
    order = list(range(len(planned)))
    random.Random(7).shuffle(order)

    def embedder() -> None:
        rng = random.Random(5)
        for texts in plan.embeds:
            threading.Event().wait(rng.random() * 0.05)
            vectors.append(list(engine.embed(texts).vectors))

    def worker(indices: list[int]) -> None:
        for i in indices:
            p = planned[i]
            threading.Event().wait(p.delay)
            stream = engine.submit(p.prompt, p.params)
            if p.cancel_after is None:
                out[i] = stream.result()
                continue
            seen = Seen()
            for event in stream:  # to the final event, which may come after the cancel
                seen.events.append(event)
                if len(seen.events) == p.cancel_after:
                    stream.cancel()
            out[i] = seen

    threads = [threading.Thread(target=worker, args=(order[k::THREADS],)) for k in range(THREADS)]
    threads.append(threading.Thread(target=embedder))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert all(o is not None for o in out) and len(vectors) == len(plan.embeds)
    return [o for o in out if o is not None], vectors


# (engine settings, speculative settings, the draft model's demo size): the model drafting
# for itself has every draft accepted; the tiny demo model (same vocabulary) next to none
SPECULATION = {
    "ngram": ("", "mode: ngram, n_draft: 6", None),
    "draft-accepted": ("", "mode: draft, n_draft: 4", "small"),
    "draft-rejected": ("", "mode: draft, n_draft: 4", "tiny"),
    "unified-accepted": (", kv_unified: true", "mode: draft, n_draft: 4", "small"),
    "unified-rejected": (", kv_unified: true", "mode: draft, n_draft: 4", "tiny"),
}


@pytest.mark.parametrize("case", list(SPECULATION))
def test_every_feature_at_once_answers_as_the_plain_engine(
    small: Path, plan: Plan, tmp_path: Path, case: str
) -> None:
    engine_extra, spec, draft = SPECULATION[case]
    if draft is not None:
        spec += f", draft_model: '{demo.ensure(draft, 'f16')}'"
    extra = (
        MODEL + f"speculative: {{{spec}, cost_aware: false}}\n"
        "slo: {tpot_p90_ms: 3}\n"  # below a step's cost: prompt chunks at their floor
        f"prompt_cache: {{prompts: [{SYSTEMS[0]!r}, {SYSTEMS[1]!r}], "
        f"directory: '{tmp_path / 'cache'}'}}\n"
    )
    with Engine(config(small, ENGINE % engine_extra, extra)) as e:
        got, vectors = storm(e, plan)
        with e.idle():
            runner = e.runner
            assert runner is not None
            held = [(s.id, runner.seq_pos_max(s.id) + 1) for s in e.scheduler.slots]
            assert held == [(s.id, len(s.cache)) for s in e.scheduler.slots]
            assert e.scheduler.usage()[0] == 0
        assert e.submit(plan.last, LAST).result().token_ids == plan.want_last.token_ids
    for job, want in zip(vectors, plan.want_vectors, strict=True):
        for v, w in zip(job, want, strict=True):
            assert np.allclose(v, w, atol=1e-4)
    for i, (p, answer) in enumerate(zip(plan.requests, got, strict=True)):
        assert p.want is not None
        if isinstance(answer, Seen):
            final = answer.events[-1]
            assert final.finish_reason in ("cancelled", p.want.finish_reason), (i, final)
            assert answer.tokens == list(p.want.token_ids[: len(answer.tokens)]), i
        else:
            assert answer.finish_reason == p.want.finish_reason, (i, answer.error)
            assert answer.token_ids == p.want.token_ids, i
            assert answer.text == p.want.text, i
    done = [a for a in got if isinstance(a, Completion)]
    assert any(a.timings and a.timings.cached_tokens for a in done)  # prefixes were reused
    timings = [a.timings for a in done if a.timings]
    if draft is not None:
        assert sum(t.drafted_tokens for t in timings) > 0
    if draft == "small":
        assert sum(t.accepted_tokens for t in timings) > 0
    if draft == "tiny":
        assert sum(t.accepted_tokens for t in timings) < sum(t.drafted_tokens for t in timings)
