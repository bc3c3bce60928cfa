"""Embedding jobs: what ``Engine.embed`` queues and how the engine loop runs them.

A job holds the token ids of its inputs and fills one pooled, L2-normalized
vector per input. The engine thread runs embedding passes as steps of their
own between generation steps (llama.cpp's embeddings flag is per context, so an
embedding decode is never mixed with a generation decode). A pass borrows idle
slots: each slot's sequence id (one KV stream per slot) carries one input, the
inputs of one pass fill at most a prompt chunk (``engine.prefill_chunk``, the
whole ``n_batch`` on the CPU by default), and their cells are removed right
after. ``plan_pass`` picks the inputs; it is pure, like the scheduler.

llama.cpp pools a sequence inside one micro-batch: an input longer than
``n_ubatch`` cannot be embedded in one pass and is refused at submission. With
one KV stream per sequence llama.cpp splits a batch into micro-batches of
consecutive, increasing sequence ids of equal length, so the backend lays a
pass's sequences out in decreasing id order (``Backend.embed``): each one then
lands whole in a micro-batch of its own, whatever the lengths.

Pooling types are llama.cpp's ``enum llama_pooling_type``; ``POOLING`` names
them by value.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

# llama.h's enum llama_pooling_type, by value (UNSPECIFIED = -1 never reaches a context)
POOLING = ("none", "mean", "cls", "last", "rank")
# what a profile's model.pooling may ask for (llama-server's --pooling, minus none/rank)
PROFILE_POOLING = ("mean", "cls", "last")
# OpenAI's limit on the inputs of one embeddings request
MAX_INPUTS = 2048

Vector = npt.NDArray[np.float32]


def pooling_name(value: int) -> str:
    return POOLING[value] if 0 <= value < len(POOLING) else f"unknown ({value})"


def can_embed(pooling: int) -> bool:
    """Pooling that yields one embedding per sequence: mean, cls or last. ``none``
    gives per-token vectors and ``rank`` a reranker's scores."""
    return pooling_name(pooling) in PROFILE_POOLING


def normalize(vector: npt.NDArray[np.float32]) -> Vector:
    """Scale to unit Euclidean norm, as llama-server does for /v1/embeddings
    (``common_embd_normalize`` with its default ``embd_normalize`` 2): the sum of
    squares in double precision, and a zero vector stays zero."""
    norm = float(np.sqrt(np.dot(vector.astype(np.float64), vector.astype(np.float64))))
    scale = 1.0 / norm if norm > 0.0 else 0.0
    return (vector * np.float32(scale)).astype(np.float32)


@dataclass(frozen=True)
class Embeddings:
    """A finished job: one unit-norm vector per input, in input order."""

    vectors: tuple[Vector, ...]
    prompt_tokens: int


@dataclass(eq=False)
class EmbedJob:
    """One embeddings request inside the engine.

    ``next`` is the first input not yet given to a pass; ``started`` turns true
    with the first pass (until then the job counts as waiting). The future is
    completed once, from the engine thread, or cancelled by the caller.
    """

    id: str
    inputs: list[list[int]]
    future: concurrent.futures.Future[Embeddings] = field(default_factory=concurrent.futures.Future)
    vectors: list[Vector | None] = field(default_factory=list)
    next: int = 0
    done_inputs: int = 0
    started: bool = False
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.vectors = [None] * len(self.inputs)

    @property
    def n_tokens(self) -> int:
        return sum(len(i) for i in self.inputs)

    @property
    def scheduled(self) -> bool:
        """Every input has been given to a pass."""
        return self.next >= len(self.inputs)

    def store(self, index: int, vector: Vector) -> bool:
        """Record one input's vector; True when it was the job's last one."""
        if self.vectors[index] is None:
            self.done_inputs += 1
        self.vectors[index] = vector
        return self.done_inputs == len(self.inputs)

    def result(self) -> Embeddings:
        vectors = tuple(v for v in self.vectors if v is not None)
        return Embeddings(vectors, self.n_tokens)

    def finish(self, exc: BaseException | None = None) -> None:
        """Complete the future with the vectors, or with ``exc``; a future the caller
        cancelled in the meantime stays cancelled."""
        try:
            if exc is None:
                self.future.set_result(self.result())
            else:
                self.future.set_exception(exc)
        except concurrent.futures.InvalidStateError:
            pass


@dataclass(frozen=True)
class PassItem:
    """One input of a pass, on the sequence id of the slot it borrows."""

    job: EmbedJob
    index: int
    seq: int
    tokens: tuple[int, ...]


def plan_pass(jobs: Iterable[EmbedJob], seqs: Sequence[int], budget: int) -> list[PassItem]:
    """The next inputs, in queue order, one per free sequence id and together at most
    ``budget`` tokens, though the first one always goes (the engine admits no input
    longer than a pass can take); the jobs' ``next`` and ``started`` advance. Stops at
    the first input that does not fit, so inputs run in the order they arrived."""
    items: list[PassItem] = []
    free = list(seqs)
    for job in jobs:
        while free and not job.scheduled:
            tokens = job.inputs[job.next]
            if len(tokens) > budget and items:
                return items
            items.append(PassItem(job, job.next, free.pop(0), tuple(tokens)))
            job.next += 1
            job.started = True
            budget -= len(tokens)
        if not free:
            break
    return items
