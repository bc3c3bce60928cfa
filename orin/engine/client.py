"""What the server and telemetry may ask of an engine: ``EngineClient``.

The HTTP layer and the telemetry service depend on this protocol, never on the
concrete ``Engine`` and its scheduler, backend or runner: submit and cancel,
embed, tokenize and detokenize, render a chat, a health and load snapshot
(``status``), observers of steps and finished requests, and the lifecycle
(start, wait until loaded, stop). Another engine (speculative, several
boards) plugs in behind the same calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from orin.engine.chat import RenderedChat, TemplateCaps
from orin.engine.config import EngineConfig
from orin.engine.embed import Embeddings
from orin.engine.stream import RequestStream
from orin.engine.types import FinishReason, RequestTimings, SamplingParams, StepStats
from orin.engine.vision import MediaPrompt, RGBImage
from orin.model.gguf import ModelInfo

EngineState = Literal["new", "loading", "ready", "draining", "stopped", "failed"]
StepObserver = Callable[[StepStats], None]
FinishObserver = Callable[[str, FinishReason, RequestTimings], None]


@dataclass(frozen=True)
class EngineStatus:
    """A snapshot of the engine's health and load, read without its lock: each
    figure is current, together they may be a step apart."""

    state: EngineState
    error: str | None  # why the model failed to load (state "failed")
    slots_total: int
    slots_busy: int
    waiting: int  # requests queued for a slot
    kv_cells_used: int  # held by running requests
    kv_cells_cached: int  # kept by idle slots as a prefix for the next prompt
    kv_cells_total: int
    step_started_ns: int | None  # set while a step runs (perf_counter_ns)
    heartbeat_ns: int  # the engine loop's latest sign of life (perf_counter_ns)
    slot_moves: int = 0  # busy slots moved down to close a hole (one KV stream per slot)
    prompt_splits: int = 0  # steps of starting prompts run as two to lower their mean TTFT
    # the persistent prompt cache's running totals (hits, misses, saves, loads, rejected,
    # evicted); empty without one
    prompt_cache: dict[str, int] = field(default_factory=dict)
    # while the model loads: the RPC worker (HOST:PORT) that accepted the connection and
    # whose answer llama.cpp waits for, without a limit (a worker busy with another
    # server); nothing can interrupt that wait, so a stop does not wait for it
    rpc_wait: str | None = None
    # after a stop: the RPC worker whose connection the engine thread waited on with
    # nothing moving either way for rpc.STALL_S (a worker that hung mid-upload), which
    # the stop stopped waiting for
    rpc_stalled: str | None = None

    @property
    def busy(self) -> bool:
        """A step running, a slot working or a request waiting."""
        return self.step_started_ns is not None or self.waiting > 0 or self.slots_busy > 0


class Arrival(Protocol):
    """A request the server has read and is still preparing (``EngineClient.arrival``)."""

    def close(self) -> None:
        """It is queued, or failed before that; a second close does nothing."""
        ...


class EngineClient(Protocol):
    """The engine as the server and telemetry see it."""

    @property
    def cfg(self) -> EngineConfig:
        """What the engine runs with (a frozen value)."""
        ...

    @property
    def model_info(self) -> ModelInfo | None:
        """The loaded model's metadata; None until it is loaded."""
        ...

    @property
    def state(self) -> EngineState: ...

    def status(self) -> EngineStatus: ...

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> EngineClient:
        """Begin loading the model; returns at once."""
        ...

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until loaded; raises the load error."""
        ...

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None: ...

    # -- requests -------------------------------------------------------------

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        whole: bool = False,
        media: MediaPrompt | None = None,
    ) -> RequestStream:
        """Queue a request for a blocking consumer; raises the engine's typed errors
        (InvalidRequest, QueueFull, ContextLengthExceeded, EngineStopped). ``media``: a
        prompt with images from ``tokenize_media`` (``prompt`` is its tokens)."""
        ...

    async def submit_async(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        whole: bool = False,
        media: MediaPrompt | None = None,
        arrival: Arrival | None = None,
    ) -> RequestStream:
        """Queue a request for an asyncio consumer; the preparation (tokenizing,
        grammar parsing, sampler construction) runs off the event loop, and its
        errors are raised here, before any event. ``arrival``: the request's ticket,
        closed once it is queued."""
        ...

    def arrival(self) -> Arrival:
        """A ticket for a request being prepared: while one is open, an idle engine
        holds its first step back a few milliseconds so that requests arriving
        together start in one step."""
        ...

    def cancel(self, request_id: str) -> None: ...

    # -- images -------------------------------------------------------------------

    @property
    def supports_images(self) -> bool:
        """Whether the model was loaded with a vision projector (model.mmproj)."""
        ...

    def tokenize_media(
        self, text: str, images: Sequence[RGBImage], add_special: bool = True
    ) -> MediaPrompt:
        """A rendered prompt with one MEDIA_MARKER per image, tokenized with its images
        (any thread); InvalidRequest without a projector or when markers and images
        do not pair up."""
        ...

    # -- embeddings ---------------------------------------------------------------

    def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        dimensions: int | None = None,
        request_id: str | None = None,
    ) -> Embeddings:
        """One pooled, unit-norm vector per input (text, or token ids), blocking.
        InvalidRequest when the model cannot embed (no pooling), for an empty or
        over-long input, ids outside the vocabulary, too many inputs, or
        ``dimensions`` other than the model's width; QueueFull, EngineStopped."""
        ...

    async def embed_async(
        self,
        inputs: Sequence[str | Sequence[int]],
        dimensions: int | None = None,
        request_id: str | None = None,
    ) -> Embeddings:
        """``embed`` for an asyncio caller: tokenizing runs off the event loop, and a
        caller cancelled while the job waits or runs drops the job."""
        ...

    # -- text -------------------------------------------------------------------

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]: ...

    def control_tokens(self, texts: tuple[str, ...]) -> tuple[int, ...]:
        """The ids of those ``texts`` that the vocabulary has as one control token."""
        ...

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        """Empty once the model is unloaded. ``special``: control tokens render as their
        text; ids outside the vocabulary are an InvalidRequest naming ``tokens``."""
        ...

    def piece(self, token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (``special``: control tokens as their text);
        empty once the model is unloaded; an id outside the vocabulary is an
        InvalidRequest naming ``tokens``."""
        ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final: bool = False,
    ) -> RenderedChat:
        """(prompt, whether tokenizing should still add BOS) from the model's chat
        template, with the messages' tool calls and results, the request's ``tools``
        and extra template variables (``chat_template_kwargs``); without the
        template's generation prompt, or ending with the final message's text for the
        answer to continue (``continue_final``). InvalidRequest when there is no
        template, it rejects the messages, or it cannot take tools."""
        ...

    def chat_caps(self) -> TemplateCaps:
        """What the chat template supports (tools, their call format, a thinking
        block), decided when the model loaded."""
        ...

    # -- observers (called on the engine thread; keep them short) -------------

    def add_step_observer(self, fn: StepObserver) -> None: ...

    def remove_step_observer(self, fn: StepObserver) -> None: ...

    def add_finish_observer(self, fn: FinishObserver) -> None: ...

    def remove_finish_observer(self, fn: FinishObserver) -> None: ...


F = TypeVar("F", bound=Callable[..., None])


class Observers(Generic[F]):
    """Observers added and removed from any thread while the engine thread calls
    them: the engine iterates a tuple that add and remove replace, so a call in
    progress never sees the collection change under it."""

    def __init__(self) -> None:
        self._items: tuple[F, ...] = ()
        self._lock = threading.Lock()

    def add(self, fn: F) -> None:
        with self._lock:
            self._items = (*self._items, fn)

    def remove(self, fn: F) -> None:
        """Remove one registration of ``fn``; ValueError if there is none."""
        with self._lock:
            items = list(self._items)
            items.remove(fn)
            self._items = tuple(items)

    def __iter__(self) -> Iterator[F]:
        return iter(self._items)

    def __contains__(self, fn: object) -> bool:
        return fn in self._items

    def __len__(self) -> int:
        return len(self._items)
