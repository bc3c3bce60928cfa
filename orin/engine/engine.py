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
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from orin.engine import sharecost
from orin.engine.backend import Backend
from orin.engine.chat import ChatTemplate, RenderedChat, TemplateCaps
from orin.engine.client import (
    Arrival,
    EngineClient,
    EngineState,
    EngineStatus,
    FinishObserver,
    Observers,
    StepObserver,
)
from orin.engine.config import EngineConfig
from orin.engine.costmodel import ChunkPolicy, StepCost
from orin.engine.embed import (
    MAX_INPUTS,
    Embeddings,
    EmbedJob,
    PassItem,
    can_embed,
    normalize,
    plan_pass,
    pooling_name,
)
from orin.engine.errors import (
    BackendError,
    ContextLengthExceeded,
    EngineError,
    EngineStopped,
    InvalidRequest,
)
from orin.engine.request import ActiveRequest
from orin.engine.runner import Aborted, Runner
from orin.engine.scheduler import SHARE_MIN, Batch, KVOp, LoadFailed, Scheduler, Shift, Slot
from orin.engine.specrun import Speculation, WarmCache
from orin.engine.speculative import verify
from orin.engine.stream import Completion, RequestStream, batched_delivery, deliver_held
from orin.engine.timings import now_ns
from orin.engine.types import FinishReason, SamplingParams, StepStats, TokenEvent
from orin.engine.ubatch import micro_batches
from orin.engine.vision import MediaPrompt, RGBImage, Vision, is_image
from orin.model.gguf import ModelInfo

log = logging.getLogger("orin.engine")

_ids = itertools.count(1)
# A plain request of at most this many prompt tokens is prepared on the event loop
# (submit_async): checking the ids is ~0.1 ms at this length, less than a worker
# thread's wake-up on a loaded machine; longer prompts go to the thread pool.
INLINE_PROMPT_TOKENS = 2048
INLINE_BIASES = 64  # logit biases copied into the sampler at most, inline
_NO_BATCH = Batch((), ())  # a loop turn that runs an embedding pass instead
GATHER_S = 0.010
"""How long an idle engine's first step may wait for requests the server is still
preparing (``Engine.arrival``): a burst's requests reach the event loop within a few
milliseconds of each other and each takes about a millisecond to prepare, while a
step started on the first one alone makes all the others wait for it."""
UNMET_WARN_S = 600.0
"""Seconds between two warnings that the TPOT target cannot be met beside prompts."""
JOIN_POLL_S = 0.05  # stop: how often a join looks whether the load waits for an RPC worker


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
            cfg.slots,
            cfg.n_batch,
            cfg.context,
            cfg.max_queue,
            cfg.prefill_chunk or None,
            prefix_reuse=cfg.prefix_reuse,
            swa_window=cfg.swa_window,
            unified=cfg.kv_unified,
            n_ubatch=cfg.n_ubatch,
        )
        self.chunks = ChunkPolicy(
            cfg.tpot_target_ms, self.scheduler.prefill_chunk, self.scheduler.passes_for
        )
        self.scheduler.chunk_budget = self.chunks.budget
        self.scheduler.prompts_first = cfg.tpot_target_ms is None
        self.scheduler.drafts = self._drafts
        if cfg.even_tails and not cfg.kv_unified:  # evening tails up reads the cost model
            self.scheduler.pass_tokens = self._pass_tokens
            self.chunks.learn = True
        if cfg.split_bursts:  # splitting a burst's prompts reads the cost model
            self.scheduler.step_ms = self._step_ms
            self.chunks.learn = True
        self.speculation: Speculation | None = None
        self.prompt_cache: WarmCache | None = None
        self.vision: Vision | None = None  # the profile's projector, loaded with the model
        self._lock = threading.Condition()
        self._requests: dict[str, ActiveRequest] = {}
        self._cancels: set[str] = set()
        self._abort_flag = False
        self._in_batch: set[str] = set()
        self._state: EngineState = "new"
        self._load_error: BaseException | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._rpc_stalled: str | None = None  # the worker a stop found stalling the thread
        self._chat: ChatTemplate | None = None
        self.step_observers: Observers[StepObserver] = Observers()
        self.finish_observers: Observers[FinishObserver] = Observers()
        self.heartbeat_ns = now_ns()
        self.step_started_ns: int | None = None  # set while a step runs (telemetry waits)
        self._stepping = False  # a batch was taken and its step has not ended
        self._embeds: deque[EmbedJob] = deque()  # jobs with inputs no pass has taken yet
        self._embeds_waiting = 0  # of those, the jobs no pass has started (in ``waiting``)
        self._embedded_last = False  # the last step was an embedding pass: generation next
        self._arriving = 0  # requests the server is preparing (Arrival tickets open)
        self._idle_since_step = False  # the loop found no work since the last step
        self._unmet_warned: float | None = None  # time.monotonic() of the last such warning
        self.gather_s = GATHER_S
        # hand a step's events to the event loops just before the next decode (or
        # anything else long, or going idle) rather than at the step's end: the loop
        # turns them into SSE writes while the decode runs without the GIL, instead of
        # holding the GIL the engine needs to build the next batch (stream.deliver_held).
        # Where the decode leaves the loop a core (config.loop_has_a_core); set it
        # before start to compare
        self.hold_events = cfg.events_before_decode
        self._server_loop: asyncio.AbstractEventLoop | None = None  # the last submitter's

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
                while (
                    self.scheduler.has_work() or self._embeds or self._stepping
                ) and now_ns() < deadline:
                    self._lock.wait(0.05)
        with self._lock:
            for rid in list(self._requests):
                self._cancels.add(rid)
            self._abort_flag = bool(self._requests)
            self._state = "stopped"
            self._lock.notify_all()
        if self._thread is not None:
            self._join(max(timeout, 5.0))

    def _join(self, timeout: float) -> None:
        """Join the engine thread within ``timeout``, but give up on one whose load waits
        for an RPC worker's first answer (``rpc_wait``), or that waits on a worker's
        connection over which nothing has moved for ``rpc.STALL_S`` (``rpc_stalled``;
        the timeout is at least that long then): llama.cpp waits for either without a
        limit and nothing interrupts the wait; the thread (a daemon) ends with the
        process."""
        assert self._thread is not None
        watch = None
        if self.cfg.rpc:
            from orin.engine.rpc import STALL_S, StallWatch

            watch, timeout = StallWatch(self.cfg.rpc), max(timeout, STALL_S + 1.0)
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and self._rpc_wait() is None:
            if watch is not None:
                self._rpc_stalled = watch.check()
                if self._rpc_stalled is not None:
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._thread.join(min(left, JOIN_POLL_S))

    def __enter__(self) -> Engine:
        self.start().wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(drain=False)

    # -- requests -------------------------------------------------------------

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        return self._loaded().tokenize(text, add_special=add_special, parse_special=parse_special)

    def control_tokens(self, texts: tuple[str, ...]) -> tuple[int, ...]:
        """The ids of those ``texts`` that the vocabulary has as one control token
        (rendered as nothing unless a request preserves them)."""
        backend = self._loaded()
        out = []
        for text in texts:
            ids = backend.tokenize(text, add_special=False, parse_special=True)
            if len(ids) == 1 and not backend.piece(ids[0]):
                out.append(ids[0])
        return tuple(out)

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        """Empty once the model is unloaded (a response still being written).
        ``special``: control tokens render as their text (llama-server's /detokenize).
        An id outside the vocabulary is an InvalidRequest naming ``tokens``."""
        backend = self.backend
        if backend is None:
            return ""
        bad = next((t for t in tokens if not 0 <= t < backend.n_vocab), None)
        if bad is not None:
            raise InvalidRequest("tokens", f"token id {bad} is not in the vocabulary")
        if not special:
            return backend.detokenize(tokens)
        text = b"".join(backend.special_piece(t) for t in tokens)
        return text.decode("utf-8", errors="replace")

    def piece(self, token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (``special``: a control token as its text); empty
        once the model is unloaded. An id outside the vocabulary is an InvalidRequest
        naming ``tokens``: llama.cpp aborts the process on one."""
        backend = self.backend
        if backend is None:
            return b""
        if not 0 <= token < backend.n_vocab:
            raise InvalidRequest("tokens", f"token id {token} is not in the vocabulary")
        return backend.special_piece(token) if special else backend.piece(token)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final: bool = False,
    ) -> RenderedChat:
        """(prompt, whether tokenizing should still add BOS), with the profile's chat
        template or else the model's (built when the model loads)."""
        return self._chat_template().render(
            messages, tools, template_kwargs, add_generation_prompt, continue_final
        )

    def chat_caps(self) -> TemplateCaps:
        return self._chat_template().caps

    def _chat_template(self) -> ChatTemplate:
        chat = self._chat
        if chat is None:
            raise EngineStopped(f"the engine is {self._state}; the model is not loaded")
        return chat

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        whole: bool = False,
        media: MediaPrompt | None = None,
        arrival: Arrival | None = None,
    ) -> RequestStream:
        """Queue a request; raises QueueFull, ContextLengthExceeded, InvalidRequest,
        EngineStopped synchronously, so a server can answer with the right status.
        ``whole``: deliver the events only once the request has finished. ``media``:
        a prompt with images (``tokenize_media``); ``prompt`` is then its tokens.
        ``arrival``: the request's ticket from ``arrival()``, closed once it is queued."""
        return self._submit(prompt, params, request_id, None, whole, media, arrival)

    def arrival(self) -> Arrival:
        """A ticket for a request the server has read and is preparing (parsing,
        templating, tokenizing): while any ticket is open, an idle engine holds its
        first step back, at most ``GATHER_S``, so that requests arriving together
        start together instead of all but the first waiting for a step of its own.
        The submission closes the ticket; the server closes it when the request fails
        before that. A lone request never waits: its ticket is closed when it is
        queued, before the engine looks."""
        with self._lock:
            self._arriving += 1
        return _Ticket(self)

    def _arrived(self) -> None:
        """One ticket closed (the caller holds the lock)."""
        self._arriving -= 1
        if not self._arriving:
            self._lock.notify_all()

    @property
    def supports_images(self) -> bool:
        """Whether the loaded model has a vision projector (model.mmproj)."""
        return self.vision is not None

    def tokenize_media(
        self, text: str, images: Sequence[RGBImage], add_special: bool = True
    ) -> MediaPrompt:
        """A prompt text with one ``MEDIA_MARKER`` per image, tokenized with its images
        (any thread; the images are encoded later, on the engine thread).
        InvalidRequest when the model has no projector or the markers do not match."""
        vision = self.vision
        if vision is None or self.backend is None:
            raise InvalidRequest(
                "messages", "this model takes no images: the profile sets no model.mmproj"
            )
        return vision.tokenize(text, images, add_special)

    async def submit_async(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        whole: bool = False,
        media: MediaPrompt | None = None,
        arrival: Arrival | None = None,
    ) -> RequestStream:
        """``submit`` for an asyncio consumer. The preparation (tokenizing, a grammar's
        parse, the sampler chain, penalties fed the whole prompt) runs on a worker
        thread, so a large grammar or prompt does not stall the event loop; its
        errors are raised here. A caller cancelled while it runs cancels the
        request as soon as it is queued.

        A plain request (token ids, no grammar, no penalties, no speculation) is
        prepared on the loop itself: building its sampler is a few microseconds,
        while the round trip through a worker thread waits for a core that
        llama.cpp's threads hold, which added milliseconds to every TTFT under
        load (docs/performance.md, "Burst TTFT")."""
        loop = asyncio.get_running_loop()
        if media is None and self._cheap_to_prepare(prompt, params):
            return self._submit(prompt, params, request_id, loop, whole, None, arrival)
        prepared = loop.run_in_executor(
            None,
            functools.partial(
                self._submit, prompt, params, request_id, loop, whole, media, arrival
            ),
        )
        try:
            return await asyncio.shield(prepared)
        except asyncio.CancelledError:
            prepared.add_done_callback(_cancel_orphan)
            raise

    def _cheap_to_prepare(self, prompt: str | list[int], params: SamplingParams | None) -> bool:
        """Whether preparing this request costs next to nothing: already token ids and
        not too many of them to check, no grammar to parse, no penalties to feed the
        prompt, no n-gram index to build, few logit biases."""
        if not isinstance(prompt, list) or len(prompt) > INLINE_PROMPT_TOKENS:
            return False
        if self.speculation is not None:
            return False
        p = params or SamplingParams()
        return not p.grammar and not p.penalized and len(p.logit_bias) <= INLINE_BIASES

    def _submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str | None,
        loop: asyncio.AbstractEventLoop | None,
        whole: bool,
        media: MediaPrompt | None = None,
        arrival: Arrival | None = None,
    ) -> RequestStream:
        backend = self._loaded()
        params = params or SamplingParams()
        params.validate(backend.n_vocab)
        if media is not None:
            tokens = list(media.tokens)
        else:
            tokens = backend.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        bad = next(
            (t for t in tokens if not 0 <= t < backend.n_vocab and not (media and is_image(t))),
            None,
        )
        if bad is not None:
            raise InvalidRequest("prompt", f"token id {bad} is not in the vocabulary")
        if params.prompt_logprobs and media is not None:
            raise InvalidRequest("logprobs", "the log-probabilities of image rows do not exist")
        checked = self.scheduler.check_prompt(tokens)
        if checked != tokens and (media is not None or params.prompt_logprobs):
            # never cut an image in two, nor score a prompt other than the one given
            raise ContextLengthExceeded(len(tokens), self.cfg.context.window)
        tokens = checked
        rid = request_id or f"req-{next(_ids)}"
        stream = RequestStream(rid, self.cancel, loop, whole)
        self._server_loop = loop  # None: a blocking caller, no loop to let turn
        request = ActiveRequest(rid, tokens, params, stream, media=media)
        if media is not None:
            request.timings.images = len(media.spans)
        request.start(backend)  # builds the sampler: a bad grammar is an InvalidRequest here
        if self.speculation is not None and media is None:  # drafts are vocabulary tokens
            request.spec = self.speculation.for_request(rid, tokens)
        with self._lock:
            try:
                if self._state != "ready":
                    raise EngineStopped(f"the engine is {self._state}; not taking requests")
                if params.prompt_logprobs:
                    request.leader = self._scoring(request)
                self.scheduler.add(request, self._embeds_waiting)
            except EngineError:
                request.close()
                raise
            finally:
                if arrival is not None:
                    arrival.close()  # the lock is reentrant
            self._requests[rid] = request
            self._lock.notify_all()
        return stream

    def _scoring(self, request: ActiveRequest) -> ActiveRequest | None:
        """The request in flight that computes the log-probabilities of ``request``'s
        prompt, if any (the caller holds the lock): the other ``n`` choices of a
        scored prompt wait for the first one and copy its cells, so the prompt is
        computed once."""
        for other in self._requests.values():
            if other.id not in self._cancels and request.shares_scores_of(other):
                return other.leader or other
        return None

    def _pass_on_scoring(self, leader: ActiveRequest) -> None:
        """``leader`` ends before its prompt is scored (cancelled, failed): the first
        request that waited for its scores computes them instead, for the others."""
        followers = [r for r in self._requests.values() if r.leader is leader]
        if followers:
            first = followers[0]
            first.leader = None
            for r in followers[1:]:
                r.leader = first

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

    # -- embeddings -------------------------------------------------------------

    def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        dimensions: int | None = None,
        request_id: str | None = None,
    ) -> Embeddings:
        """One pooled, unit-norm vector per input (text, or token ids), blocking; the
        typed errors are raised before the job is queued (see ``_submit_embed``)."""
        return self._submit_embed(inputs, dimensions, request_id).future.result()

    async def embed_async(
        self,
        inputs: Sequence[str | Sequence[int]],
        dimensions: int | None = None,
        request_id: str | None = None,
    ) -> Embeddings:
        """``embed`` for an asyncio consumer: tokenizing runs on a worker thread and
        the result is awaited without blocking the loop. A caller cancelled while the
        job waits or runs drops it (a pass already running finishes without it)."""
        loop = asyncio.get_running_loop()
        prepared = loop.run_in_executor(
            None, functools.partial(self._submit_embed, inputs, dimensions, request_id)
        )
        try:
            job = await asyncio.shield(prepared)
        except asyncio.CancelledError:
            prepared.add_done_callback(self._drop_orphan_job)
            raise
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            self._cancel_embed(job)
            raise

    def _submit_embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        dimensions: int | None,
        request_id: str | None,
    ) -> EmbedJob:
        """Check and tokenize the inputs and queue the job. InvalidRequest when the
        model has no pooling that embeds, ``dimensions`` is not its width, there are
        no inputs or too many, an input is empty, has ids outside the vocabulary or
        is longer than one embedding pass takes (a pooled sequence must fit one
        micro-batch, n_ubatch, and a slot's context); QueueFull, EngineStopped."""
        backend = self._loaded()
        pooling = backend.pooling
        if not can_embed(pooling):
            raise InvalidRequest(
                "model",
                f"this model cannot embed: its pooling is {pooling_name(pooling)} (from the "
                "GGUF metadata); set model.pooling (mean, cls or last) in the profile to "
                "serve /v1/embeddings",
            )
        width = backend.n_embd_out
        if dimensions is not None and dimensions != width:
            raise InvalidRequest(
                "dimensions",
                f"this model's embeddings have {width} dimensions, not {dimensions} (this "
                f"server does not {'shorten' if dimensions < width else 'pad'} them); leave "
                f"dimensions out or set it to {width}",
            )
        if not inputs:
            raise InvalidRequest("input", "no input given")
        if len(inputs) > MAX_INPUTS:
            raise InvalidRequest("input", f"{len(inputs)} inputs; at most {MAX_INPUTS}")
        limit = min(self.cfg.n_ubatch, backend.n_ctx_seq)
        seqs: list[list[int]] = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                if not item:
                    raise InvalidRequest("input", f"input {i} is an empty string")
                tokens = backend.tokenize(item, add_special=True, parse_special=True)
            else:
                tokens = [int(t) for t in item]
                bad = next((t for t in tokens if not 0 <= t < backend.n_vocab), None)
                if bad is not None:
                    raise InvalidRequest(
                        "input", f"input {i}: token id {bad} is not in the vocabulary"
                    )
            if not tokens:
                raise InvalidRequest("input", f"input {i} has no tokens")
            if len(tokens) > limit:
                raise InvalidRequest(
                    "input",
                    f"input {i} has {len(tokens)} tokens; one embedding pass takes at most "
                    f"{limit} (engine.n_ubatch, within a slot's context)",
                )
            seqs.append(tokens)
        job = EmbedJob(request_id or f"emb-{next(_ids)}", seqs)
        with self._lock:
            if self._state != "ready":
                raise EngineStopped(f"the engine is {self._state}; not taking requests")
            # one bound for what waits: queued generation requests and embedding jobs
            self.scheduler.check_room(self._embeds_waiting)
            self._embeds.append(job)
            self._embeds_waiting += 1
            self._lock.notify_all()
        return job

    def _cancel_embed(self, job: EmbedJob) -> None:
        """Drop a job whose caller went away: out of the queue at once; the vectors of
        a pass already running for it are thrown away."""
        with self._lock:
            job.cancelled = True
            if job in self._embeds:
                self._embeds.remove(job)
                self._embeds_waiting = sum(1 for j in self._embeds if not j.started)
            self._lock.notify_all()
        job.future.cancel()

    def _drop_orphan_job(self, prepared: asyncio.Future[EmbedJob]) -> None:
        """The caller of embed_async went away while its job was being prepared."""
        if not prepared.cancelled() and prepared.exception() is None:
            self._cancel_embed(prepared.result())

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
            waiting=self.waiting,
            kv_cells_used=cells,
            kv_cells_cached=self.scheduler.kv_cells_cached,
            kv_cells_total=self.kv_cells_total,
            step_started_ns=self.step_started_ns,
            heartbeat_ns=self.heartbeat_ns,
            slot_moves=self.scheduler.moves,
            prompt_splits=self.scheduler.prompt_splits,
            prompt_cache=self.prompt_cache.counters() if self.prompt_cache is not None else {},
            rpc_wait=self._rpc_wait(),
            rpc_stalled=self._rpc_stalled,
        )

    def _rpc_wait(self) -> str | None:
        """The RPC worker the load waits for (``EngineStatus.rpc_wait``)."""
        if not self.cfg.rpc or self.backend is not None:
            return None
        from orin.engine.rpc import waiting_for

        return waiting_for()

    @property
    def slots_busy(self) -> int:
        return self.scheduler.busy_slots

    @property
    def waiting(self) -> int:
        """Requests queued for a slot, embedding jobs no pass has started included."""
        return self.scheduler.waiting + self._embeds_waiting

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
                self.scheduler.pos_min = self.runner.seq_pos_min
                self.scheduler.share_min = self._share_min(backend, self.runner)
                self._chat = chat
                if self.cfg.speculative.mode != "off":
                    self.speculation = Speculation(self.cfg, backend)
                    self.chunks.learn = True  # draft lengths read the step-cost model
                if self.cfg.prompt_cache is not None and self.cfg.prefix_reuse:
                    self.prompt_cache = WarmCache(self.cfg, backend, self.runner, chat)
                    self.prompt_cache.warm(self.scheduler)
                    self.runner.load = self.prompt_cache.load
                    self.scheduler.stored = self.prompt_cache.stored
                if self.cfg.mmproj is not None:
                    self.vision = _load_vision(self.cfg, backend)
                if self.cfg.rpc:
                    from orin.engine import rpc

                    rpc.on_lost(self._fail_all)
            except BaseException:
                self._chat = None
                if self.speculation is not None:
                    self.speculation.close()
                backend.close()
                raise
            self.backend = backend
        except BaseException as exc:  # reported through wait_ready
            self._load_error = exc
            self._state = "failed"
            self._ready.set()
            return
        with self._lock:
            if self._state == "loading":
                self._state = "ready"
        self._ready.set()
        held: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.hold_events:  # a step's events go just before the next decode
            self.runner.before_wait = deliver_held
            held = batched_delivery()
        try:
            with held:
                self._loop()
        finally:
            self._shutdown()

    def _share_min(self, backend: Backend, runner: Runner) -> int:
        """Prompt tokens a copy of another slot's cells must save: the profile's, or
        measured now (orin.engine.sharecost) when prompts can share cells at all."""
        cfg = self.cfg
        if cfg.share_min:
            return cfg.share_min
        if cfg.slots < 2 or not cfg.prefix_reuse:
            return SHARE_MIN
        word = backend.tokenize(" the", add_special=False, parse_special=False)
        return sharecost.share_min(runner, word[0] if word else 0)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._has_work() and self._state in ("ready", "draining"):
                    self.heartbeat_ns = now_ns()
                    self._idle_since_step = True
                    deliver_held()
                    self._lock.wait(0.5)
                if self._state == "stopped" and not self._cancels:
                    return
                if self._idle_since_step:
                    self._idle_since_step = False
                    self._gather()
                self._apply_cancels()
                # a draft model drafts here; not for a step of split-off prompt chunks,
                # which no decoding slot joins
                if self.speculation is not None and not self.scheduler.split_pending:
                    if self.speculation.model is not None:
                        deliver_held()  # the draft model decodes first
                    self.speculation.prepare(self.scheduler)
                embed = self._embed_pass()  # an embedding pass is a step of its own
                batch = self.scheduler.schedule() if embed is None else _NO_BATCH
                for slot_id in batch.length_limited:
                    self._finish(self._request_in(slot_id), "length")
                requests = self._batch_requests(batch)
                self._in_batch = {r.id for r in requests}
                self._abort_flag = False
                self._stepping = bool(batch) or embed is not None
            self.heartbeat_ns = now_ns()
            if batch.n_decode and batch.n_prefill and self.chunks.unmet_ms is not None:
                streams = batch.n_decode - batch.n_drafted
                self._warn_unmet(self.chunks.unmet_ms, streams, batch.budget)
            if embed is not None:
                deliver_held()
                self._run_embed_pass(*embed)
                continue
            if batch:
                try:
                    self._step(batch, requests)
                except Exception as exc:  # a bug in one step must not take the engine down
                    log.exception("engine step failed; failing its requests")
                    self._fail_batch(batch, f"internal error: {type(exc).__name__}")
                finally:
                    self.step_started_ns = None
                    self._stepping = False
            else:
                deliver_held()  # no decode follows at once: the events go now

    def _gather(self) -> None:
        """Before an idle engine's first step (the lock held, released while waiting):
        take in the requests that reached the server together with the one that woke
        the engine, at most ``gather_s`` (``GATHER_S``) in all, so that they start in one step
        instead of all but the first waiting for a step of its own.

        Two things make a request late for that step: the server's event loop has not
        looked at it yet (its bytes wait in the socket while the loop prepares the
        first request), or the loop is preparing it (its ``arrival`` ticket is open).
        So the engine lets the loop run what it has ready (two callbacks) and waits
        for the open tickets, and does it again while that brought a new request.
        A lone request pays two loop callbacks. The engine was idle, so no stream
        decodes meanwhile; once one does, new requests join its next step and nothing
        waits for them."""
        loop = self._server_loop
        deadline = time.monotonic() + self.gather_s
        while self._state == "ready":
            seen = self.scheduler.waiting  # nothing is admitted before the step
            if loop is not None and not self._let_loop_turn(loop, deadline):
                loop = None
            while self._arriving and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
            if self.scheduler.waiting == seen or time.monotonic() >= deadline:
                return

    def _let_loop_turn(self, loop: asyncio.AbstractEventLoop, deadline: float) -> bool:
        """Wait until ``loop`` has run every callback it had ready (the lock released
        meanwhile); False when the loop is closed."""
        turned = threading.Event()

        def second() -> None:  # queued behind whatever was ready when the first ran
            with self._lock:
                turned.set()
                self._lock.notify_all()

        try:
            loop.call_soon_threadsafe(loop.call_soon, second)
        except RuntimeError:  # closed
            return False
        while not turned.is_set() and (left := deadline - time.monotonic()) > 0:
            self._lock.wait(left)
        return True

    def _warn_unmet(self, step_ms: float, streams: int, chunk: int) -> None:
        """Say, at most every ``UNMET_WARN_S``, that the profile's TPOT target is below
        what a step with prompt tokens beside running streams costs here."""
        t = time.monotonic()
        if self._unmet_warned is not None and t - self._unmet_warned < UNMET_WARN_S:
            return
        self._unmet_warned = t
        log.warning(
            "slo.tpot_p90_ms is %g ms, but a step that feeds the smallest prompt chunk "
            "(%d tokens) beside %d decoding stream%s takes about %.0f ms here: while "
            "prompts arrive, the running streams' gaps exceed the target. Raise the "
            "target, or run fewer streams at once (docs/engine.md, 'SLO-aware prompt chunks')",
            self.cfg.tpot_target_ms,
            chunk,
            streams,
            "" if streams == 1 else "s",
            step_ms,
        )

    def _step_ms(self, passes: int, rows: int, prompt: int) -> float | None:
        """A step's time by the step-cost model; None until the model has settled."""
        model = self.chunks.model
        return model.predict(passes, rows, prompt) if model.settled else None

    def _pass_tokens(self) -> float:
        """Prompt tokens one llama.cpp pass costs as much as, by the step-cost model."""
        a, _, c = self.chunks.model.coefficients()
        return a / c

    def _drafts(self, slot: Slot, room: int) -> Sequence[int]:
        """Speculative tokens for a decoding slot (the scheduler's hook): none when
        speculation is off or has switched itself off for the request, and never
        past the request's max_tokens."""
        request = slot.request
        if not isinstance(request, ActiveRequest) or request.spec is None:
            return ()
        room = min(room, request.params.max_tokens - request.generated - 1)
        if room <= 0:
            return ()
        if not self.cfg.speculative.cost_aware:
            return request.spec.draft(room)
        return request.spec.draft(room, self._draft_cost)

    def _draft_cost(self) -> StepCost:
        """The step-cost model's figures for a draft's length (asked only when there
        is a draft to weigh)."""
        a, b, _ = self.chunks.model.coefficients()
        return a, b, self.scheduler.decoding

    def _has_work(self) -> bool:
        return bool(self._cancels) or self.scheduler.has_work() or bool(self._embeds)

    def _embed_pass(self) -> tuple[list[PassItem], list[KVOp]] | None:
        """The embedding pass to run in this turn of the loop, if any (the caller holds
        the lock): the queued jobs' next inputs on the sequence ids of idle slots, and
        the KV operations to run first (pending ones, and removing the borrowed slots'
        cells). Generation and embedding steps alternate while both have work, so a
        stream waits at most one pass; with no idle slot the jobs wait."""
        last, self._embedded_last = self._embedded_last, False
        if not self._embeds or (last and self.scheduler.has_work()):
            return None
        idle = self.scheduler.idle_slot_ids()
        # a pass is as long as a prompt chunk at most: what running streams wait for
        budget = self.cfg.prefill_chunk or self.cfg.n_batch
        if self.cfg.kv_unified:  # one buffer: llama.cpp cuts the batch every n_ubatch
            budget = min(budget, self.cfg.n_ubatch)  # tokens, and a sequence pools whole
        items = plan_pass(self._embeds, idle, budget) if idle else []
        if not items:
            return None
        while self._embeds and self._embeds[0].scheduled:
            self._embeds.popleft()
        self._embeds_waiting = sum(1 for j in self._embeds if not j.started)
        self._embedded_last = True
        return items, self.scheduler.lend_idle([i.seq for i in items])

    def _run_embed_pass(self, items: list[PassItem], ops: list[KVOp]) -> None:
        """Run one embedding pass (engine thread, lock not held): store each input's
        normalized vector, finish the jobs that are complete, fail them all if
        llama.cpp fails, and report the step."""
        assert self.runner is not None and self.backend is not None
        start = now_ns()
        self.step_started_ns = start
        vectors: list[Any] = []
        error: str | None = None
        try:
            self.runner.apply(ops)
            raw = self.backend.embed([(i.seq, i.tokens) for i in items])
            vectors = [normalize(v) for v in raw]
        except BackendError as exc:
            log.error("embedding pass failed: %s", exc)
            error = str(exc)
        except Exception as exc:  # a bug in one pass must not take the engine down
            log.exception("embedding pass failed; failing its requests")
            error = f"internal error: {type(exc).__name__}"
        t = now_ns()
        try:
            with self._lock:
                for item, vector in zip(items, vectors, strict=False):
                    if not item.job.cancelled and item.job.store(item.index, vector):
                        item.job.finish()
                if error is not None:
                    for job in {i.job for i in items}:
                        if job in self._embeds:
                            self._embeds.remove(job)
                        job.finish(BackendError(error))
                    self._embeds_waiting = sum(1 for j in self._embeds if not j.started)
                busy, cells = self.scheduler.usage()
                stats = StepStats(
                    start_ns=start,
                    end_ns=t,
                    prefill_tokens=0,
                    decode_tokens=0,
                    slots_busy=busy,
                    kv_cells_used=cells,
                    waiting=self.waiting,
                    embedded_tokens=sum(len(i.tokens) for i in items),
                    # the backend feeds the sequences in decreasing id order: with one
                    # KV stream per slot, a pass per sequence (each pooled whole)
                    micro_batches=micro_batches(
                        [(i.seq, len(i.tokens)) for i in sorted(items, key=lambda i: -i.seq)],
                        self.scheduler.n_ubatch,
                        self.scheduler.unified,
                    ),
                )
                self._lock.notify_all()
        finally:
            self.step_started_ns = None
            self._stepping = False
        for observer in self.step_observers:
            _safe(observer, stats)

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
            # frees the slot; the cells its finished steps computed stay as a prefix
            slot = self.scheduler.cancel(rid, keep_cache=self.cfg.prefix_cache)
            self._emit_final(request, "cancelled", slot=slot)
        self._cancels.clear()

    def _step(self, batch: Batch, requests: list[ActiveRequest]) -> None:
        """Run one scheduled batch; ``requests`` are its items' requests, in item order
        (looked up once, under the lock, when the batch was made)."""
        assert self.runner is not None and self.backend is not None
        start = now_ns()
        self.step_started_ns = start
        try:
            self.runner.apply(batch.ops)
        except LoadFailed as exc:  # the cache file went bad: prefill those prompts instead
            log.warning("%s; prefilling them", exc)
            with self._lock:
                self.scheduler.load_failed(exc.seqs)
            return  # the batch assumed the cells: schedule again
        if not batch.items:  # only cells to remove (a cancellation): nothing to decode
            return
        # the step-cost model learns the decode, not the KV operations before it: a
        # saved prompt read from disk, a stream copy or a shift costs what it costs
        # whatever the step's tokens (a 2-5 ms restore before an 11-token prompt tail
        # of the tiny demo model put a prompt token at 0.45 ms, 40 times its cost)
        ops_ns = now_ns() - start if batch.ops else 0
        by_slot: dict[int, ActiveRequest] = {}
        for item, request in zip(batch.items, requests, strict=True):
            by_slot[item.slot] = request
            request.start(self.backend)
            if item.prefill:
                request.timings.prefill_started(start)
        encoded = self._encode(batch, requests)
        if encoded is None:
            return
        embeds, encode_ns, images = encoded
        aborted = False
        emitted: dict[int, list[tuple[int, int]]] = {}
        accepted: dict[int, int] = {}
        try:
            abort = self._abort_check if batch.n_prefill else None
            if embeds:  # image rows: a batch of embeddings beside the tokens
                rows = self.runner.decode(batch, abort, embeds=embeds)
            else:
                rows = self.runner.decode(batch, abort)
            emitted, accepted = self._sample(batch, rows, by_slot)
            if self.runner.all_rows:
                self._score_prompts(batch, by_slot)
        except Aborted:
            aborted = True
        except BackendError as exc:
            log.error("decode failed: %s", exc)
            self._fail_batch(batch, str(exc))
            return
        self._record(batch, by_slot, emitted, accepted, aborted, start, (encode_ns, images), ops_ns)

    def _encode(
        self, batch: Batch, requests: list[ActiveRequest]
    ) -> tuple[dict[int, Any], int, int] | None:
        """The embedding rows of the batch's image items (item index -> rows), the time
        spent encoding images for them and how many: an image is encoded in the first
        step that feeds one of its rows, its own phase before the step's decode. An
        image that cannot be encoded fails its request only; the step is then dropped
        (None) and scheduled again without it."""
        embeds: dict[int, Any] = {}
        spent = images = 0
        for index, (item, request) in enumerate(zip(batch.items, requests, strict=True)):
            if not item.prefill or not item.tokens or not is_image(item.tokens[0]):
                continue
            assert self.vision is not None and request.media is not None
            deliver_held()  # nothing waits for an image's encoding
            parts = []
            try:
                for span, row, n in request.media.locate(item.tokens):
                    t0 = now_ns()
                    fresh = span.embeddings is None
                    rows = self.vision.encode(span)
                    if fresh:
                        took = now_ns() - t0
                        spent += took
                        images += 1
                        request.timings.encode_ns += took
                    parts.append(rows[row : row + n])
            except BackendError as exc:
                log.error("request %s: %s", request.id, exc)
                with self._lock:
                    self._finish(request, "error", str(exc))
                    self.scheduler.discard(batch)
                return None
            embeds[index] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return embeds, spent, images

    def _fail_batch(self, batch: Batch, message: str) -> None:
        """Finish every request of a batch that could not run with ``error``."""
        with self._lock:
            for item in batch.items:
                request = self.scheduler.slots[item.slot].request
                if isinstance(request, ActiveRequest):
                    self._finish(request, "error", message)

    def _fail_all(self, message: str) -> None:
        """End every request in flight with ``message`` (a lost RPC worker, just before
        the process exits). Called from inside llama.cpp on whichever thread aborted:
        the lock is taken only if it is free soon, never waited on for long."""
        if not self._lock.acquire(timeout=0.5):
            return
        try:
            for request in list(self._requests.values()):
                self._finish(request, "error", message)
            deliver_held()  # on the engine thread, its events held so far: now
            self._lock.notify_all()
        finally:
            self._lock.release()

    def _abort_check(self) -> bool:
        return self._abort_flag

    def _score_prompts(self, batch: Batch, by_slot: dict[int, ActiveRequest]) -> None:
        """The log-probabilities of the prompt tokens the logits of this step's chunks
        with every position's logits predict (before the next decode overwrites them;
        the lock is not held)."""
        assert self.runner is not None and self.backend is not None
        for item in batch.items:
            if item.logits_all:
                n = len(item.tokens)
                logits = self.runner.chunk_logits(item.slot, n)
                by_slot[item.slot].score_prompt(self.backend, logits, item.pos, n)

    def _sample(
        self, batch: Batch, rows: dict[int, int], by_slot: dict[int, ActiveRequest]
    ) -> tuple[dict[int, list[tuple[int, int]]], dict[int, int]]:
        """slot -> the tokens it emits this step, each with its batch position, and
        slot -> drafted tokens accepted (speculating slots).

        Every plain greedy row goes through one argmax over the outputs. A speculating
        slot samples its positions in order with its own sampler and stops at the
        first token that differs from the draft (llama-server's rule): each emitted
        token is sampled once, from the context it follows, so the output is the one
        decoding without speculation gives, greedy or seeded."""
        assert self.runner is not None
        samplers = [by_slot[s].sampler for s in rows]
        if not batch.n_drafted and all(x is not None and x.plain_greedy for x in samplers):
            # the usual step: every row greedy, nothing drafted: one argmax, a token each
            tokens = self.runner.argmax(list(rows.values()))
            return {s: [(t, row)] for (s, row), t in zip(rows.items(), tokens, strict=True)}, {}
        drafts = {i.slot: i.tokens[len(i.tokens) - i.draft :] for i in batch.items if i.draft}
        emitted: dict[int, list[tuple[int, int]]] = {}
        greedy_slots: list[int] = []
        greedy_rows: list[int] = []
        for slot_id, row in rows.items():
            sampler = by_slot[slot_id].sampler
            assert sampler is not None
            n = len(drafts.get(slot_id, ())) + 1
            if sampler.plain_greedy:
                greedy_slots.append(slot_id)
                greedy_rows.extend(range(row, row + n))
                continue
            draft = drafts.get(slot_id, ())
            out: list[tuple[int, int]] = []
            for j in range(n):
                r = row + j
                # llama.cpp's chain reads the logits itself
                logits = None if sampler.chain is not None else self.runner.logits(r)
                token = sampler.sample(r, logits)
                out.append((token, r))
                if j < len(draft) and token != draft[j]:
                    break
            emitted[slot_id] = out
        if greedy_rows:
            tokens = self.runner.argmax(greedy_rows)
            k = 0
            for slot_id in greedy_slots:
                row, draft = rows[slot_id], drafts.get(slot_id, ())
                sampled = tokens[k : k + len(draft) + 1]
                kept = verify(draft, sampled) + 1 if draft else 1
                emitted[slot_id] = [(t, row + j) for j, t in enumerate(sampled[:kept])]
                k += len(draft) + 1
        accepted = {slot_id: len(emitted[slot_id]) - 1 for slot_id in drafts}
        return emitted, accepted

    def _record(
        self,
        batch: Batch,
        by_slot: dict[int, ActiveRequest],
        emitted: dict[int, list[tuple[int, int]]],
        accepted: dict[int, int],
        aborted: bool,
        start: int,
        encoded: tuple[int, int] = (0, 0),
        ops_ns: int = 0,
    ) -> None:
        """``ops_ns``: of the step, the time its KV operations took."""
        assert self.runner is not None and self.backend is not None
        t = now_ns()
        encode_ns, images = encoded
        if not aborted and batch.items:  # the cost model learns decodes, not image encoding
            ms = (t - start - encode_ns - ops_ns) * 1e-6
            self.chunks.observe(batch.passes, batch.n_decode, batch.n_prefill, ms)
        with self._lock, batched_delivery():
            if aborted:
                self.scheduler.discard(batch)
            else:
                drafted = {i.slot: i.draft for i in batch.items if i.draft} if accepted else {}
                last = {slot_id: out[-1][0] for slot_id, out in emitted.items()}
                self.scheduler.update(batch, last, accepted)
                for slot_id, out in emitted.items():
                    request = by_slot[slot_id]
                    if request.id in self._cancels:
                        continue
                    if slot_id in drafted:
                        request.verified(drafted[slot_id], accepted[slot_id])
                    if request.generated == 0:  # its prompt is done
                        request.prompt_done()
                        if request.params.max_tokens == 0:  # and nothing more is asked
                            self._finish(request, "length")
                            continue
                    reason = None
                    for token, row in out:
                        logits = (
                            self.runner.logits(row) if request.params.logprobs is not None else None
                        )
                        reason = request.on_token(self.backend, token, logits, t)
                        if reason is not None:
                            break
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
                waiting=self.waiting,
                context_shifts=sum(1 for op in batch.ops if isinstance(op, Shift))
                if batch.ops
                else 0,
                aborted=aborted,
                prefill_budget=batch.budget,
                micro_batches=batch.passes,
                drafted_tokens=0 if aborted else batch.n_drafted,
                accepted_tokens=sum(accepted.values()),
                encode_ns=encode_ns,
                encoded_images=images,
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
        if request.params.prompt_logprobs and request.scores is None:
            self._pass_on_scoring(request)
        timings = request.timings.result(
            now_ns(),
            len(request.prompt_tokens),
            slot.cached_prompt if slot else 0,
            slot.shifts if slot else 0,
            request.drafted,
            request.accepted,
            request.spec is not None and request.spec.stopped,
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
            for job in self._embeds:
                job.finish(EngineStopped("the engine stopped before the embeddings were done"))
            self._embeds.clear()
            self._embeds_waiting = 0
            self._state = "stopped"
            self._lock.notify_all()
        runner, self.runner = self.runner, None
        backend, self.backend = self.backend, None  # submit and tokenize now see "stopped"
        vision, self.vision = self.vision, None
        if vision is not None:
            vision.close()
        if runner is not None:
            runner.close()
        if backend is not None:
            backend.close()


def _load_vision(cfg: EngineConfig, backend: Backend) -> Vision:
    """The projector's mtmd context, on the GPU when the model's layers are."""
    assert cfg.mmproj is not None
    lib = backend.lib
    return Vision(
        cfg.mmproj,
        backend.model,
        cfg.threads_batch,
        use_gpu=cfg.gpu_layers != 0,
        n_embd=int(lib.llama_model_n_embd_inp(backend.model)),
    )


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


class _Ticket:
    """``Engine.arrival``'s ticket; closing it twice is harmless, so the server
    closes it whatever happened to the request."""

    __slots__ = ("_engine", "_open")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._open = True

    def close(self) -> None:
        with self._engine._lock:
            if self._open:
                self._open = False
                self._engine._arrived()
