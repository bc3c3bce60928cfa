"""What the routes share: the engine, the served model's identity, limits and metrics.

One object built by ``orin-llm serve`` (or a test) and passed to create_app;
no module-level singletons. The engine is seen only through ``EngineClient``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from orin import __version__
from orin.engine.client import EngineClient, EngineStatus
from orin.engine.types import RequestTimings
from orin.profile.schema import SamplingSection
from orin.server import protocol
from orin.server.auth import LoginLimiter
from orin.server.images import ImageLimits
from orin.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from orin.telemetry.service import Telemetry


@dataclass
class ServerState:
    engine: EngineClient
    model_name: str
    metrics: ServerMetrics
    model_match: Literal["any", "strict"] = "any"
    system_fingerprint: str | None = None
    sampling_defaults: SamplingSection = field(default_factory=SamplingSection)
    api_key: str | None = None
    # /metrics without the key (server.metrics_public); every other route but
    # /health and the dashboard's login page needs it (orin/server/auth.py)
    metrics_public: bool = False
    # wrong keys posted to the dashboard's /login, per client address
    login_limiter: LoginLimiter = field(default_factory=LoginLimiter)
    cors_origins: tuple[str, ...] = ()  # server.cors_origins; empty: no CORS headers
    dashboard: bool = True  # server.dashboard: the web page at / (off: 404)
    # server.image_url_hosts / max_image_bytes / max_image_pixels
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    max_body_bytes: int = 2 * 1024 * 1024
    max_tokens_cap: int = 4096
    version: str = __version__
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    inflight: int = 0
    telemetry: Telemetry | None = None

    def health(self) -> tuple[dict[str, Any], int]:
        """(body, status): 503 while loading, draining or failed; 200 with slot figures."""
        s = self.engine.status()
        if s.state == "failed":
            return {"status": "failed", "error": s.error}, 503
        if s.state in ("new", "loading"):
            return {"status": "loading"}, 503
        if self.draining or s.state in ("draining", "stopped"):
            return {"status": "draining", **_slots(s)}, 503
        return {"status": "ok", "model": self.model_name, **_slots(s)}, 200

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
        return self.engine.piece(token)

    def detokenize(self, tokens: list[int]) -> str:
        return self.engine.detokenize(tokens)

    def timings(self, t: RequestTimings | None) -> dict[str, Any] | None:
        """The response's timings object, with the request's telemetry when sampled."""
        out = protocol.timings(t)
        if out is not None and self.telemetry is not None:
            out.update(self.telemetry.request_block(t))
        return out


def _slots(s: EngineStatus) -> dict[str, int]:
    return {
        "slots_total": s.slots_total,
        "slots_busy": s.slots_busy,
        "slots_idle": s.slots_total - s.slots_busy,
        "queue": s.waiting,
        "kv_cells_used": s.kv_cells_used,
        "kv_cells_cached": s.kv_cells_cached,
        "kv_cells_total": s.kv_cells_total,
    }
