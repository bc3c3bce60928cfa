"""The engine thread: the one owner of every llama.cpp call.

Requests enter through ``submit`` (any thread; ``submit_async`` prepares them on
a worker thread, off the event loop); the scheduler is guarded by a lock held
only around scheduling and bookkeeping, never during a decode. ``Engine``
implements ``EngineClient`` (client.py), all the server and telemetry see.
Cancellation is a flag the loop checks before each step, so a client that
goes away frees its slot and KV cells within one step. During a step with
prompt chunks the flag also reaches llama.cpp's abort callback, which the CPU
backend checks between graph nodes; a GPU decode ignores it and runs to its
end, which ``prefill_chunk`` keeps short.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from orin.engine.backend import Backend
from orin.engine.chat import ChatTemplate
from orin.engine.client import (
    EngineClient,
    EngineState,
    EngineStatus,
    FinishObserver,
    Observers,
    StepObserver,
)
from orin.engine.config import EngineConfig
from orin.engine.errors import BackendError, EngineError, EngineStopped, InvalidRequest
from orin.engine.request import ActiveRequest
from orin.engine.runner import Aborted, Runner
from orin.engine.scheduler import Batch, Scheduler, Shift, Slot
from orin.engine.stream import Completion, RequestStream, batched_delivery
from orin.engine.timings import now_ns
from orin.engine.types import FinishReason, SamplingParams, StepStats, TokenEvent
from orin.model.gguf import ModelInfo

log = logging.getLogger("orin.engine")

_ids = itertools.count(1)


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        runner_factory: Callable[[Backend, int], Runner] = Runner,
    ) -> None:
        self.cfg = cfg
        self._runner_factory = runner_factory
        self.backend: Backend | None = None
        self.runner: Runner | None = None
        self.scheduler = Scheduler(
            cfg.slots, cfg.n_batch, cfg.context, cfg.max_queue, cfg.prefill_chunk or None
        )
        self._lock = threading.Condition()
        self._requests: dict[str, ActiveRequest] = {}
        self._cancels: set[str] = set()
        self._abort_flag = False
        self._in_batch: set[str] = set()
        self._state: EngineState = "new"
        self._load_error: BaseException | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._chat: ChatTemplate | None = None
        self.step_observers: Observers[StepObserver] = Observers()
        self.finish_observers: Observers[FinishObserver] = Observers()
        self.heartbeat_ns = now_ns()
        self.step_started_ns: int | None = None  # set while a step runs (telemetry waits)
        self._stepping = False  # a batch was taken and its step has not ended

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> Engine:
        """Load the model on the engine thread and start serving; returns at once."""
        self._state = "loading"
        self._thread = threading.Thread(target=self._main, name="orin-engine", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not finish loading in time")
        if self._load_error is not None:
            raise self._load_error

    @property
    def state(self) -> EngineState:
        return self._state

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop admissions; let running requests finish (``drain``) up to ``timeout``
        seconds, cancel the rest, and join the thread."""
        with self._lock:
            if self._state in ("stopped", "failed", "new"):
                self._state = "stopped" if self._state == "new" else self._state
                return
            self._state = "draining"
            self._lock.notify_all()
        if drain:
            deadline = now_ns() + int(timeout * 1e9)
            with self._lock:
                while self.scheduler.has_work() and now_ns() < deadline:
                    self._lock.wait(0.05)
        with self._lock:
            for rid in list(self._requests):
                self._cancels.add(rid)
            self._abort_flag = bool(self._requests)
            self._state = "stopped"
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(timeout, 5.0))

    def __enter__(self) -> Engine:
        self.start().wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(drain=False)

    # -- requests -------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self._loaded().tokenize(text, add_special=add_special)

    def detokenize(self, tokens: list[int]) -> str:
        """Empty once the model is unloaded (a response still being written)."""
        backend = self.backend
        return backend.detokenize(tokens) if backend is not None else ""

    def piece(self, token: int) -> bytes:
        """The raw bytes of one token; empty once the model is unloaded."""
        backend = self.backend
        return backend.piece(token) if backend is not None else b""

    def render_chat(self, messages: list[dict[str, str]]) -> tuple[str, bool]:
        """(prompt, whether tokenizing should still add BOS), with the profile's chat
        template or else the model's (built when the model loads)."""
        chat = self._chat
        if chat is None:
            raise EngineStopped(f"the engine is {self._state}; the model is not loaded")
        return chat.render(messages)

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        whole: bool = False,
    ) -> RequestStream:
        """Queue a request; raises QueueFull, ContextLengthExceeded, InvalidRequest,
        EngineStopped synchronously, so a server can answer with the right status.
        ``whole``: deliver the events only once the request has finished."""
        return self._submit(prompt, params, request_id, None, whole)

    async def submit_async(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        whole: bool = False,
    ) -> RequestStream:
        """``submit`` for an asyncio consumer. The preparation (tokenizing, a grammar's
        parse, the sampler chain, penalties fed the whole prompt) runs on a worker
        thread, so a large grammar or prompt does not stall the event loop; its
        errors are raised here. A caller cancelled while it runs cancels the
        request as soon as it is queued."""
        loop = asyncio.get_running_loop()
        prepared = loop.run_in_executor(
            None, functools.partial(self._submit, prompt, params, request_id, loop, whole)
        )
        try:
            return await asyncio.shield(prepared)
        except asyncio.CancelledError:
            prepared.add_done_callback(_cancel_orphan)
            raise

    def _submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str | None,
        loop: asyncio.AbstractEventLoop | None,
        whole: bool,
    ) -> RequestStream:
        backend = self._loaded()
        params = params or SamplingParams()
        params.validate(backend.n_vocab)
        tokens = backend.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        bad = next((t for t in tokens if not 0 <= t < backend.n_vocab), None)
        if bad is not None:
            raise InvalidRequest("prompt", f"token id {bad} is not in the vocabulary")
        tokens = self.scheduler.check_prompt(tokens)
        rid = request_id or f"req-{next(_ids)}"
        stream = RequestStream(rid, self.cancel, loop, whole)
        request = ActiveRequest(rid, tokens, params, stream)
        request.start(backend)  # builds the sampler: a bad grammar is an InvalidRequest here
        with self._lock:
            try:
                if self._state != "ready":
                    raise EngineStopped(f"the engine is {self._state}; not taking requests")
                self.scheduler.add(request)
            except EngineError:
                request.close()
                raise
            self._requests[rid] = request
            self._lock.notify_all()
        return stream

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> Completion:
        """Blocking convenience for scripts and benchmarks."""
        return self.submit(prompt, params).result()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._requests:
                return
            self._cancels.add(request_id)
            if request_id in self._in_batch:
                self._abort_flag = True  # the CPU backend stops the chunk; a GPU finishes it
            self._lock.notify_all()

    @contextlib.contextmanager
    def idle(self, timeout: float = 5.0) -> Iterator[None]:
        """Hold the engine thread between steps, with no work left (KV operations of
        cancellations included), while the block runs: for reading llama.cpp's
        memory from another thread. The scheduler's counts reach zero as soon as a
        request is cancelled; llama.cpp's cells go with the next step's operations."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._stepping or self._has_work():
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the engine did not become idle within {timeout} s")
                self._lock.wait(0.01)
            yield

    # -- observers -------------------------------------------------------------

    def add_step_observer(self, fn: StepObserver) -> None:
        """``fn(stats)`` after every step, on the engine thread."""
        self.step_observers.add(fn)

    def remove_step_observer(self, fn: StepObserver) -> None:
        self.step_observers.remove(fn)

    def add_finish_observer(self, fn: FinishObserver) -> None:
        """``fn(request_id, reason, timings)`` once per request, on the engine thread."""
        self.finish_observers.add(fn)

    def remove_finish_observer(self, fn: FinishObserver) -> None:
        self.finish_observers.remove(fn)

    # -- views for health and metrics ------------------------------------------

    def status(self) -> EngineStatus:
        """Health and load, without the lock (cheap enough for every sampler tick)."""
        busy, cells = self.scheduler.usage()
        error = self._load_error
        return EngineStatus(
            state=self._state,
            error=None if error is None else str(error),
            slots_total=self.cfg.slots,
            slots_busy=busy,
            waiting=self.scheduler.waiting,
            kv_cells_used=cells,
            kv_cells_cached=self.scheduler.kv_cells_cached,
            kv_cells_total=self.kv_cells_total,
            step_started_ns=self.step_started_ns,
            heartbeat_ns=self.heartbeat_ns,
        )

    @property
    def slots_busy(self) -> int:
        return self.scheduler.busy_slots

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    @property
    def kv_cells_used(self) -> int:
        return self.scheduler.kv_cells_used

    @property
    def kv_cells_cached(self) -> int:
        return self.scheduler.kv_cells_cached

    @property
    def kv_cells_total(self) -> int:
        """Cells of all slots' KV streams (llama.cpp pads each to 256)."""
        from orin.model.memplan import kv_cells_per_seq

        return kv_cells_per_seq(self.cfg.n_ctx, self.cfg.slots) * self.cfg.slots

    @property
    def load_error(self) -> BaseException | None:
        return self._load_error

    @property
    def model_info(self) -> ModelInfo | None:
        return self.backend.info if self.backend is not None else None

    def _loaded(self) -> Backend:
        if self.backend is None:
            raise EngineStopped(f"the engine is {self._state}; the model is not loaded")
        return self.backend

    # -- the thread -------------------------------------------------------------

    def _main(self) -> None:
        try:
            backend = Backend(self.cfg)
            try:
                info = backend.info
                chat = ChatTemplate(  # a template that does not compile fails the load
                    self.cfg.chat_template or info.chat_template,
                    info.bos_token or "",
                    info.eos_token or "",
                )
                self.runner = self._runner_factory(backend, self.cfg.n_batch)
            except BaseException:
                backend.close()
                raise
            self.backend, self._chat = backend, chat
        except BaseException as exc:  # reported through wait_ready
            self._load_error = exc
            self._state = "failed"
            self._ready.set()
            return
        with self._lock:
            if self._state == "loading":
                self._state = "ready"
        self._ready.set()
        try:
            self._loop()
        finally:
            self._shutdown()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._has_work() and self._state in ("ready", "draining"):
                    self.heartbeat_ns = now_ns()
                    self._lock.wait(0.5)
                if self._state == "stopped" and not self._cancels:
                    return
                self._apply_cancels()
                batch = self.scheduler.schedule()
                for slot_id in batch.length_limited:
                    self._finish(self._request_in(slot_id), "length")
                self._in_batch = {r.id for r in self._batch_requests(batch)}
                self._abort_flag = False
                self._stepping = bool(batch)
            self.heartbeat_ns = now_ns()
            if batch:
                try:
                    self._step(batch)
                except Exception as exc:  # a bug in one step must not take the engine down
                    log.exception("engine step failed; failing its requests")
                    self._fail_batch(batch, f"internal error: {type(exc).__name__}")
                finally:
                    self.step_started_ns = None
                    self._stepping = False

    def _has_work(self) -> bool:
        return bool(self._cancels) or self.scheduler.has_work()

    def _batch_requests(self, batch: Batch) -> list[ActiveRequest]:
        return [self._request_in(i.slot) for i in batch.items]

    def _request_in(self, slot_id: int) -> ActiveRequest:
        request = self.scheduler.slots[slot_id].request
        assert isinstance(request, ActiveRequest)
        return request

    def _apply_cancels(self) -> None:
        for rid in self._cancels:
            request = self._requests.get(rid)
            if request is None:
                continue
            slot = self.scheduler.cancel(rid)  # frees the slot and removes its KV cells
            self._emit_final(request, "cancelled", slot=slot)
        self._cancels.clear()

    def _step(self, batch: Batch) -> None:
        assert self.runner is not None and self.backend is not None
        start = now_ns()
        self.step_started_ns = start
        self.runner.apply(batch.ops)
        if not batch.items:  # only cells to remove (a cancellation): nothing to decode
            return
        requests = self._batch_requests(batch)
        for item, request in zip(batch.items, requests, strict=True):
            request.start(self.backend)
            if item.prefill:
                request.timings.prefill_started(start)
        aborted = False
        rows: dict[int, int] = {}
        sampled: dict[int, int] = {}
        try:
            rows = self.runner.decode(batch, self._abort_check if batch.n_prefill else None)
            sampled = self._sample(rows)
        except Aborted:
            aborted = True
        except BackendError as exc:
            log.error("decode failed: %s", exc)
            self._fail_batch(batch, str(exc))
            return
        self._record(batch, rows, sampled, aborted, start)

    def _fail_batch(self, batch: Batch, message: str) -> None:
        """Finish every request of a batch that could not run with ``error``."""
        with self._lock:
            for item in batch.items:
                request = self.scheduler.slots[item.slot].request
                if isinstance(request, ActiveRequest):
                    self._finish(request, "error", message)

    def _abort_check(self) -> bool:
        return self._abort_flag

    def _sample(self, rows: dict[int, int]) -> dict[int, int]:
        """slot -> sampled token; every plain greedy slot in one argmax over the outputs."""
        assert self.runner is not None
        sampled: dict[int, int] = {}
        greedy_slots: list[int] = []
        greedy_rows: list[int] = []
        for slot_id, row in rows.items():
            sampler = self._request_in(slot_id).sampler
            assert sampler is not None
            if sampler.plain_greedy:
                greedy_slots.append(slot_id)
                greedy_rows.append(row)
            elif sampler.chain is not None:  # llama.cpp's chain reads the logits itself
                sampled[slot_id] = sampler.sample(row, None)
            else:
                sampled[slot_id] = sampler.sample(row, self.runner.logits(row))
        if greedy_rows:
            sampled.update(zip(greedy_slots, self.runner.argmax(greedy_rows), strict=True))
        return sampled

    def _record(
        self,
        batch: Batch,
        rows: dict[int, int],
        sampled: dict[int, int],
        aborted: bool,
        start: int,
    ) -> None:
        assert self.runner is not None and self.backend is not None
        t = now_ns()
        with self._lock, batched_delivery():
            if aborted:
                self.scheduler.discard(batch)
            else:
                self.scheduler.update(batch, sampled)
                for slot_id, token in sampled.items():
                    request = self._request_in(slot_id)
                    if request.id in self._cancels:
                        continue
                    logits = (
                        self.runner.logits(rows[slot_id])
                        if request.params.logprobs is not None
                        else None
                    )
                    reason = request.on_token(self.backend, token, logits, t)
                    if reason is not None:
                        self._finish(request, reason)
                    elif request.stream.backlog > self.cfg.max_backlog:
                        log.warning(
                            "request %s: the client has not read %d tokens; cutting it off",
                            request.id,
                            request.stream.backlog,
                        )
                        self._cancels.add(request.id)
            busy, cells = self.scheduler.usage()
            stats = StepStats(
                start_ns=start,
                end_ns=t,
                prefill_tokens=batch.n_prefill,
                decode_tokens=batch.n_decode,
                slots_busy=busy,
                kv_cells_used=cells,
                waiting=self.scheduler.waiting,
                context_shifts=sum(1 for op in batch.ops if isinstance(op, Shift)),
                aborted=aborted,
            )
            self._lock.notify_all()
        for observer in self.step_observers:
            _safe(observer, stats)

    def _finish(
        self, request: ActiveRequest, reason: FinishReason, error: str | None = None
    ) -> None:
        """Release the slot (caller holds the lock) and send the final event."""
        slot = self.scheduler.slot_of(request.id)
        if slot is not None:
            keep = self.cfg.prefix_cache and reason in ("stop", "length")
            self.scheduler.release(slot, keep_cache=keep)
        self._emit_final(request, reason, error, slot)

    def _emit_final(
        self,
        request: ActiveRequest,
        reason: FinishReason,
        error: str | None = None,
        slot: Slot | None = None,
    ) -> None:
        """The last event of a request; ``slot`` is the one it held, if any."""
        if self._requests.pop(request.id, None) is None:
            return
        timings = request.timings.result(
            now_ns(),
            len(request.prompt_tokens),
            slot.cached_prompt if slot else 0,
            slot.shifts if slot else 0,
        )
        text = request.tail_text() if reason != "cancelled" else ""
        request.stream.put(TokenEvent(request.id, None, text, None, reason, timings, error))
        request.close()
        for observer in self.finish_observers:
            _safe(observer, request.id, reason, timings)

    def _shutdown(self) -> None:
        with self._lock:
            for request in list(self._requests.values()):
                self._emit_final(request, "cancelled")
            self._state = "stopped"
            self._lock.notify_all()
        runner, self.runner = self.runner, None
        backend, self.backend = self.backend, None  # submit and tokenize now see "stopped"
        if runner is not None:
            runner.close()
        if backend is not None:
            backend.close()


def _cancel_orphan(prepared: asyncio.Future[RequestStream]) -> None:
    """The caller of submit_async went away while its request was being prepared."""
    if not prepared.cancelled() and prepared.exception() is None:
        prepared.result().cancel()


def _safe(fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("observer %r failed", fn)


def _implements_client(engine: Engine) -> EngineClient:
    return engine  # mypy checks that Engine satisfies EngineClient
