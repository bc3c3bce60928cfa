"""A request's event stream: filled by the engine thread, read blocking or with asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from orin.engine.types import FinishReason, RequestTimings, TokenEvent, TokenLogprob


@dataclass(frozen=True)
class Completion:
    """A finished request, collected from its stream."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: FinishReason
    timings: RequestTimings | None
    error: str | None = None
    # SamplingParams.prompt_logprobs: those of the prompt's tokens after the first
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


_Delivery = list[tuple["RequestStream", TokenEvent]]


class _Outbox(threading.local):
    pending: dict[asyncio.AbstractEventLoop, _Delivery] | None = None


_outbox = _Outbox()


class batched_delivery:  # used like a function: ``with batched_delivery():``
    """Hold the events put on this thread for asyncio consumers until the block ends,
    then hand each event loop its share with one wake-up.

    With eight streams that is one ``call_soon_threadsafe`` (one write to the
    loop's wake-up pipe) per step instead of eight, and the loop thread, which
    shares the cores with llama.cpp's threads, wakes once. Where the decode leaves
    the loop a core, the engine thread runs its whole loop inside one block and
    hands a step's events over with ``deliver_held`` just before its next
    ``llama_decode`` (and before anything else long, and when it goes idle). (A
    class rather than a generator-based context manager: inner blocks run on every
    step.)
    """

    __slots__ = ("_outer",)

    def __enter__(self) -> None:
        self._outer = _outbox.pending is None  # nested: the outer block delivers
        if self._outer:
            _outbox.pending = {}

    def __exit__(self, *exc: object) -> None:
        if self._outer:
            deliver_held()
            _outbox.pending = None


def deliver_held() -> None:
    """Hand over what this thread's ``batched_delivery`` block holds so far (one
    wake-up per event loop) and go on holding; nothing when it holds nothing.

    Where the decode leaves the event loop a core (``config.loop_has_a_core``), the
    engine delivers a step's events here, just before its next decode, rather than
    at the step's end: the loop turns them into SSE writes (about 0.1 ms of CPU per
    event on the development VM) holding the GIL, which the engine thread needs to
    schedule and fill the next batch; the decode holds none. At 4 streams the
    engine's gap between two steps was 0.26 ms against 0.7 ms with the events
    handed over at the step's end (docs/performance.md, "Events handed over before
    the next decode"). The tokens leave the engine later by its own gap."""
    pending = _outbox.pending
    if not pending:
        return
    _outbox.pending = {}
    for loop, items in pending.items():
        with contextlib.suppress(RuntimeError):  # that loop is gone: nobody listens
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: _Delivery) -> None:
    for stream, event in items:
        stream._arrive(event)


class RequestStream:
    """Iterate (``for`` or ``async for``) over TokenEvents until the final one."""

    def __init__(
        self,
        request_id: str,
        cancel: Callable[[str], None],
        loop: asyncio.AbstractEventLoop | None = None,
        whole: bool = False,
    ) -> None:
        """``whole``: the consumer wants the answer only when it is complete (a
        non-streaming request), so the events are held on the engine's side and
        handed over together with the final one: no wake-up per token."""
        self.request_id = request_id
        self._cancel = cancel
        self._loop = loop
        self._whole = whole
        self._held: list[TokenEvent] = []
        self._sync: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        # asyncio side, touched on the loop's thread only: the events delivered and
        # not taken, and the future the consumer waits on while there are none
        self._ready: deque[TokenEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        # events put (engine thread only) and taken (consumer only): no lock needed
        self._put = 0
        self._taken = 0

    @property
    def backlog(self) -> int:
        """Events the consumer has not taken yet (a slow client's unread tokens);
        events held for a ``whole`` stream are not a backlog."""
        return self._put - self._taken

    def put(self, event: TokenEvent) -> None:
        """Called from the engine thread."""
        if self._whole:
            self._held.append(event)
            if event.finish_reason is None:
                return
            events, self._held = self._held, []
            self._put += len(events)
            with batched_delivery():
                for e in events:
                    self._hand_over(e)
            return
        self._put += 1
        self._hand_over(event)

    def _hand_over(self, event: TokenEvent) -> None:
        if self._loop is None:
            self._sync.put(event)
            return
        pending = _outbox.pending
        if pending is not None:
            pending.setdefault(self._loop, []).append((self, event))
            return
        with contextlib.suppress(RuntimeError):  # the consumer's loop is gone: nobody listens
            self._loop.call_soon_threadsafe(self._arrive, event)

    def _arrive(self, event: TokenEvent) -> None:
        """On the consumer's loop: keep the event and wake the consumer if it waits."""
        self._ready.append(event)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # not cancelled with its consumer
                waiter.set_result(None)

    def cancel(self) -> None:
        if not self._done:
            self._cancel(self.request_id)

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._loop is not None:
            raise TypeError("this stream was opened for asyncio; use `async for`")
        while not self._done:
            event = self._sync.get()
            self._taken += 1
            self._done = event.finish_reason is not None
            yield event

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while not self._done:
            for event in await self.next_batch():
                yield event

    async def next_batch(self) -> list[TokenEvent]:
        """Every event ready now (waiting for at least one), up to the final one;
        an empty list once the final event was taken.

        The per-token path of a streamed response: one future per wait, no queue.
        """
        if self._loop is None:
            raise TypeError("this stream was opened without an event loop; use `for`")
        if self._done:
            return []
        ready = self._ready
        if not ready:
            self._waiter = waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        out = list(ready)
        ready.clear()
        for i, event in enumerate(out):
            if event.finish_reason is not None:  # nothing after the final event counts
                del out[i + 1 :]
                self._done = True
                break
        self._taken += len(out)
        return out

    def result(self) -> Completion:
        return collect(self.request_id, list(self))


def collect(request_id: str, events: list[TokenEvent]) -> Completion:
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    prompt: tuple[TokenLogprob, ...] | None = None
    last: TokenEvent | None = None
    for e in events:
        text.append(e.text)
        if e.token_id is not None:
            ids.append(e.token_id)
        if e.logprob is not None:
            logprobs.append(e.logprob)
        if e.prompt_logprobs is not None:
            prompt = e.prompt_logprobs
        last = e
    assert last is not None and last.finish_reason is not None
    return Completion(
        request_id,
        "".join(text),
        tuple(ids),
        tuple(logprobs),
        last.finish_reason,
        last.timings,
        last.error,
        prompt,
    )
