"""Request streams: delivery to asyncio consumers, batched per engine step."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from orin.engine.stream import RequestStream, batched_delivery, deliver_held
from orin.engine.types import TokenEvent


def event(rid: str, i: int, final: bool = False) -> TokenEvent:
    return TokenEvent(rid, i, f"t{i}", None, "stop" if final else None)


class CountingLoop:
    """Wraps a running loop and counts the cross-thread wake-ups it is asked for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.wakeups = 0

    def call_soon_threadsafe(self, cb: Any, *args: Any) -> Any:
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(cb, *args)

    def create_future(self) -> asyncio.Future[Any]:
        return self.loop.create_future()


def run_engine_thread(fn: Any) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_a_step_wakes_each_loop_once_and_keeps_the_order() -> None:
    async def main() -> tuple[int, list[list[str]]]:
        loop = CountingLoop(asyncio.get_running_loop())
        streams = [RequestStream(f"r{k}", lambda _: None, loop) for k in range(3)]  # type: ignore[arg-type]

        def engine() -> None:
            for step in range(2):
                with batched_delivery():
                    for s in streams:
                        s.put(event(s.request_id, step, final=step == 1))

        run_engine_thread(engine)
        texts = []
        for s in streams:
            texts.append([e.text async for e in s])
        return loop.wakeups, texts

    wakeups, texts = asyncio.run(main())
    assert wakeups == 2  # one per step, not one per event
    assert texts == [["t0", "t1"]] * 3


def test_outside_a_step_every_event_is_delivered_at_once() -> None:
    async def main() -> int:
        loop = CountingLoop(asyncio.get_running_loop())
        stream = RequestStream("r", lambda _: None, loop)  # type: ignore[arg-type]
        run_engine_thread(lambda: [stream.put(event("r", i, final=i == 2)) for i in range(3)])
        assert [e.token_id async for e in stream] == [0, 1, 2]
        return loop.wakeups

    assert asyncio.run(main()) == 3


def test_nested_blocks_deliver_at_the_outer_end() -> None:
    async def main() -> list[int]:
        loop = CountingLoop(asyncio.get_running_loop())
        stream = RequestStream("r", lambda _: None, loop)  # type: ignore[arg-type]

        def engine() -> None:
            with batched_delivery():
                stream.put(event("r", 0))
                with batched_delivery():
                    stream.put(event("r", 1, final=True))
                assert loop.wakeups == 0

        run_engine_thread(engine)
        assert loop.wakeups == 1
        return [e.token_id async for e in stream]

    assert asyncio.run(main()) == [0, 1]


def test_held_events_go_when_asked_in_order_and_the_rest_at_the_end() -> None:
    async def main() -> tuple[list[int], list[int | None]]:
        loop = CountingLoop(asyncio.get_running_loop())
        stream = RequestStream("r", lambda _: None, loop)  # type: ignore[arg-type]
        wakeups: list[int] = []

        def engine() -> None:  # the engine thread: one block around its whole loop
            with batched_delivery():
                for step in range(3):
                    with batched_delivery():  # a step's bookkeeping
                        stream.put(event("r", step))
                    wakeups.append(loop.wakeups)  # nothing yet: held for the decode
                    deliver_held()  # just before the next decode
                    deliver_held()  # nothing held: no wake-up
                stream.put(event("r", 3, final=True))  # the final one, at the block's end
                wakeups.append(loop.wakeups)

        run_engine_thread(engine)
        wakeups.append(loop.wakeups)
        return wakeups, [e.token_id async for e in stream]

    wakeups, ids = asyncio.run(main())
    assert wakeups == [0, 1, 2, 3, 4]
    assert ids == [0, 1, 2, 3]


def test_delivering_outside_a_block_does_nothing() -> None:
    async def main() -> int:
        loop = CountingLoop(asyncio.get_running_loop())
        stream = RequestStream("r", lambda _: None, loop)  # type: ignore[arg-type]
        run_engine_thread(deliver_held)
        run_engine_thread(lambda: stream.put(event("r", 0, final=True)))
        assert [e.token_id async for e in stream] == [0]
        return loop.wakeups

    assert asyncio.run(main()) == 1


def test_batches_hand_over_everything_that_is_ready() -> None:
    async def main() -> list[list[int | None]]:
        stream = RequestStream("r", lambda _: None, asyncio.get_running_loop())
        run_engine_thread(lambda: [stream.put(event("r", i)) for i in range(4)])
        await asyncio.sleep(0.05)  # all four delivered before the consumer looks
        out = []
        while ready := await stream.next_batch():
            out.append([e.token_id for e in ready])
            if len(out) == 1:
                run_engine_thread(lambda: stream.put(event("r", 9, final=True)))
        assert stream.backlog == 0
        return out

    assert asyncio.run(main()) == [[0, 1, 2, 3], [9]]


def test_batches_stop_at_the_final_event() -> None:
    async def main() -> list[list[int | None]]:
        stream = RequestStream("r", lambda _: None, asyncio.get_running_loop())
        run_engine_thread(
            lambda: [stream.put(event("r", i, final=i == 1)) for i in range(3)]
        )  # an event after the final one is never handed out
        await asyncio.sleep(0.05)
        out = []
        while ready := await stream.next_batch():
            out.append([e.token_id for e in ready])
        return out

    assert asyncio.run(main()) == [[0, 1]]


def test_sync_streams_refuse_async_iteration() -> None:
    stream = RequestStream("r", lambda _: None)

    async def main() -> None:
        async for _ in stream:
            pass

    with pytest.raises(TypeError, match="without an event loop"):
        asyncio.run(main())


def test_a_whole_stream_hands_everything_over_at_the_end() -> None:
    async def main() -> tuple[int, list[int | None], list[int]]:
        loop = CountingLoop(asyncio.get_running_loop())
        stream = RequestStream("r", lambda _: None, loop, whole=True)  # type: ignore[arg-type]
        backlogs: list[int] = []

        def engine() -> None:
            for i in range(5):
                with batched_delivery():
                    stream.put(event("r", i, final=i == 4))
                backlogs.append(stream.backlog)

        run_engine_thread(engine)
        return loop.wakeups, [e.token_id async for e in stream], backlogs

    wakeups, ids, backlogs = asyncio.run(main())
    assert wakeups == 1 and ids == [0, 1, 2, 3, 4]
    assert backlogs[:4] == [0, 0, 0, 0]  # held tokens never look like a slow client


def test_a_whole_sync_stream_still_iterates() -> None:
    stream = RequestStream("r", lambda _: None, whole=True)
    for i in range(3):
        stream.put(event("r", i, final=i == 2))
    assert stream.result().text == "t0t1t2"


def test_a_consumer_cancelled_while_waiting_leaves_the_stream_usable() -> None:
    async def main() -> tuple[list[int | None], list[TokenEvent]]:
        stream = RequestStream("r", lambda _: None, asyncio.get_running_loop())
        waiting = asyncio.ensure_future(stream.next_batch())
        await asyncio.sleep(0)  # it waits for an event
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        run_engine_thread(lambda: [stream.put(event("r", i, final=i == 1)) for i in range(2)])
        await asyncio.sleep(0.05)  # delivered with nobody waiting
        first = await stream.next_batch()
        return [e.token_id for e in first], await stream.next_batch()

    assert asyncio.run(main()) == ([0, 1], [])  # then empty: the final event was taken
