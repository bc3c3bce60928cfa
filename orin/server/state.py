"""What the routes share: the engine, the served model's identity, limits and metrics.

One object built by ``orin-llm serve`` (or a test) and passed to create_app;
no module-level singletons.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orin import __version__
from orin.engine.engine import Engine
from orin.engine.types import RequestTimings
from orin.profile.schema import SamplingSection
from orin.server import protocol
from orin.server.chat import ChatTemplate
from orin.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from orin.telemetry.service import Telemetry


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    chat: ChatTemplate
    metrics: ServerMetrics
    sampling_defaults: SamplingSection = field(default_factory=SamplingSection)
    api_key: str | None = None
    max_body_bytes: int = 2 * 1024 * 1024
    max_tokens_cap: int = 4096
    version: str = __version__
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    inflight: int = 0
    telemetry: Telemetry | None = None

    def health(self) -> tuple[dict[str, Any], int]:
        """(body, status): 503 while loading, draining or failed; 200 with slot figures."""
        e = self.engine
        if e.state == "failed":
            return {"status": "failed", "error": str(e.load_error)}, 503
        if e.state in ("new", "loading"):
            return {"status": "loading"}, 503
        if self.draining or e.state in ("draining", "stopped"):
            return {"status": "draining", **self._slots()}, 503
        return {"status": "ok", "model": self.model_name, **self._slots()}, 200

    def _slots(self) -> dict[str, int]:
        e = self.engine
        total = e.cfg.slots
        return {
            "slots_total": total,
            "slots_busy": e.slots_busy,
            "slots_idle": total - e.slots_busy,
            "queue": e.waiting,
            "kv_cells_used": e.kv_cells_used,
            "kv_cells_cached": e.kv_cells_cached,
            "kv_cells_total": e.kv_cells_total,
        }

    def model_meta(self) -> dict[str, Any]:
        info = self.engine.model_info
        return {
            "file": str(self.engine.cfg.model_path),
            "quantization": info.quantization if info else None,
            "n_ctx_per_slot": self.engine.cfg.n_ctx,
            "slots": self.engine.cfg.slots,
            "type_k": self.engine.cfg.type_k,
            "type_v": self.engine.cfg.type_v,
        }

    def engine_piece(self, token: int) -> bytes:
        backend = self.engine.backend
        return backend.piece(token) if backend is not None else b""

    def detokenize(self, tokens: list[int]) -> str:
        backend = self.engine.backend
        return backend.detokenize(tokens) if backend is not None else ""

    def timings(self, t: RequestTimings | None) -> dict[str, Any] | None:
        """The response's timings object, with the request's telemetry when sampled."""
        out = protocol.timings(t)
        if out is not None and self.telemetry is not None:
            out.update(self.telemetry.request_block(t))
        return out
