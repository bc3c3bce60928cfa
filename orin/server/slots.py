"""``GET /slots``: what each slot is doing now, like llama-server's view of the same name.

Per slot: its id, idle / prefill / decode, the request it serves (id, prompt and
generated tokens, prompt tokens taken from the KV cache instead of prefilled), the
context it may hold (``n_ctx``) and the KV cells it holds; with the queue length and
the totals ``/health`` reports. An idle slot keeps its cells as a prefix for the next
prompt; they show as ``cells_used`` with no request.

``EngineClient`` has totals only (``status``); the per-slot figures are read from the
engine's scheduler when the engine has one, without its lock, like ``status``: each
figure is current, two slots may be a step apart, and a request that finishes or is
moved down to close a hole while the view is read can show in one slot, in two, or in
none for that instant. An engine without a scheduler (a fake, a remote engine) gets
the totals and an empty list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from orin.engine.client import EngineClient
from orin.engine.scheduler import SlotState
from orin.server import auth
from orin.server.errors import Unauthorized
from orin.server.state import ServerState


@dataclass(frozen=True)
class SlotView:
    id: int
    state: str  # "idle", "prefill" or "decode"
    is_processing: bool  # llama-server's name for "busy"
    request_id: str | None
    n_ctx: int  # cells this slot may hold (the per-slot context)
    cells_used: int  # KV cells the slot holds (an idle slot's are a reusable prefix)
    prompt_tokens: int  # of the running request; 0 when idle
    cached_prompt_tokens: int  # of those, taken from the cache instead of prefilled
    generated_tokens: int  # by the running request so far; 0 when idle


class _Request(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def prompt_tokens(self) -> list[int]: ...


class _Slot(Protocol):
    """What this module reads of ``orin.engine.scheduler.Slot``."""

    id: int
    state: SlotState
    request: _Request | None
    cache: list[int]
    cached_prompt: int
    generated: int


def slot_views(engine: EngineClient) -> list[SlotView]:
    """One view per slot, in slot order; empty when the engine has no scheduler."""
    scheduler = getattr(engine, "scheduler", None)
    slots: Sequence[_Slot] = tuple(getattr(scheduler, "slots", ()))
    n_ctx = engine.cfg.n_ctx
    return [_view(slot, n_ctx) for slot in slots]


def _view(slot: _Slot, n_ctx: int) -> SlotView:
    # each read once: the engine thread may change them meanwhile
    request, state = slot.request, slot.state
    if request is None or state is SlotState.IDLE:
        return SlotView(slot.id, "idle", False, None, n_ctx, len(slot.cache), 0, 0, 0)
    return SlotView(
        id=slot.id,
        state=state.value,
        is_processing=True,
        request_id=request.id,
        n_ctx=n_ctx,
        cells_used=len(slot.cache),
        prompt_tokens=len(request.prompt_tokens),
        cached_prompt_tokens=slot.cached_prompt,
        generated_tokens=slot.generated,
    )


def slots_body(engine: EngineClient) -> dict[str, Any]:
    """The ``/slots`` response: the slots, the queue length and the engine's totals."""
    s = engine.status()
    return {
        "slots": [asdict(v) for v in slot_views(engine)],
        "slots_total": s.slots_total,
        "slots_busy": s.slots_busy,
        "queue": s.waiting,
        "n_ctx": engine.cfg.n_ctx,
        "kv_cells_used": s.kv_cells_used,
        "kv_cells_cached": s.kv_cells_cached,
        "kv_cells_total": s.kv_cells_total,
    }


def register(app: FastAPI, state: ServerState) -> None:
    """``GET /slots``, behind the API key. A coroutine: the view is a few attribute reads,
    cheaper than the round trip through FastAPI's thread pool a plain function takes."""

    @app.get("/slots")
    async def slots_route(request: Request) -> JSONResponse:
        require_key(state, request)
        return JSONResponse(slots_body(state.engine), headers={"Cache-Control": "no-store"})


def require_key(state: ServerState, request: Request) -> None:
    """The route's own check, beside the app's blanket one (orin/server/auth.py): the
    server's live views stay behind the key even where a route escapes that check."""
    if not auth.authorized(state, request):
        raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)")
