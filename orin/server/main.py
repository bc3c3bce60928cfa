"""The composition root of the server: builds the engine, the HTTP app and the
telemetry from a resolved profile, chooses the HTTP stack and the API key, and runs
the lifecycle (load, serve until SIGTERM/SIGINT, drain). ``orin-llm serve`` parses
its options and calls ``run_server``; tests call ``build_server`` and start it
themselves."""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from orin import __version__
from orin.errors import OrinError
from orin.profile.loader import resolve_model_path
from orin.profile.schema import Profile
from orin.system.commands import SubprocessRunner

if TYPE_CHECKING:
    from orin.engine.config import EngineConfig
    from orin.model.gguf import ModelInfo
    from orin.server.lifecycle import OrinServer
    from orin.server.state import ServerState

log = logging.getLogger("orin.server")


def run_server(
    profile: Profile,
    model: Path | None,
    telemetry: str = "auto",
    record: Path | None = None,
    telemetry_hz: float | None = None,
) -> int:
    """Load, serve until SIGTERM/SIGINT, drain; the process exit code."""
    server, state = build_server(profile, model, telemetry, record, telemetry_hz)
    if profile.system.drop_caches:
        _drop_page_cache()
    state.engine.start()
    if state.telemetry is not None:
        state.telemetry.start()
    server.announce_when_ready()
    try:
        server.run()
    finally:
        state.engine.stop(drain=False, timeout=5)
        if state.telemetry is not None:
            state.telemetry.stop()
    return 1 if server.failed else 0


def build_server(
    profile: Profile,
    model: Path | None,
    telemetry: str = "off",
    record: Path | None = None,
    telemetry_hz: float | None = None,
) -> tuple[OrinServer, ServerState]:
    """Everything ``serve`` runs, wired but not started (tests start it themselves)."""
    import uvicorn

    from orin.engine.config import engine_config
    from orin.engine.engine import Engine
    from orin.llamacpp import build_info
    from orin.model.gguf import read_model_info
    from orin.server.app import create_app
    from orin.server.lifecycle import OrinServer
    from orin.server.metrics import ServerMetrics
    from orin.server.state import ServerState

    path = resolve_model_path(profile, model)
    info = read_model_info(path)
    build = build_info()
    cfg = engine_config(profile, path, info, build, _available())
    engine = Engine(cfg)
    name = profile.server.model_name or profile.name
    state = ServerState(
        engine=engine,
        model_name=name,
        model_match=profile.server.model_match,
        system_fingerprint=fingerprint(build.version, build.system_info, info, cfg),
        metrics=ServerMetrics(cfg.slots, engine.kv_cells_total, name),
        sampling_defaults=profile.sampling,
        api_key=_api_key(profile),
        max_body_bytes=profile.server.max_body_bytes,
        max_tokens_cap=profile.server.max_tokens_limit,
    )
    engine.add_step_observer(state.metrics.on_step)
    engine.add_finish_observer(state.metrics.on_finish)
    host, port = profile.server.host, profile.server.port
    log.info(
        "model %s (%s), %d slots x %d tokens, K=%s V=%s, flash_attn=%s, on http://%s:%d",
        path,
        info.quantization,
        cfg.slots,
        cfg.n_ctx,
        cfg.type_k,
        cfg.type_v,
        cfg.flash_attn,
        host,
        port,
    )
    if telemetry == "off" and record is not None:
        raise OrinError("--record needs telemetry; drop --telemetry off")
    if telemetry != "off":
        from orin.telemetry.service import Telemetry

        source = None if telemetry == "auto" else telemetry
        state.telemetry = Telemetry(
            engine, state.metrics.registry, source, hz=telemetry_hz, record=record
        )
    loop, http = http_stack()
    log.info("HTTP: %s on the %s event loop", http, loop)
    config = uvicorn.Config(
        create_app(state),
        host=host,
        port=port,
        loop=loop,
        http=http,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return OrinServer(config, state, grace_s=profile.server.grace_seconds), state


def http_stack() -> tuple[str, str]:
    """uvicorn's event loop and HTTP implementation: uvloop and httptools (both
    dependencies) where they are installed, else asyncio's loop and h11.

    Each streamed token is a wake-up of the event loop and a write through the
    HTTP layer, on the cores that decode: with uvloop and httptools the loop
    spends about a third less CPU per token (docs/performance.md).
    """
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return loop, http


def _drop_page_cache() -> None:
    """system.drop_caches: free the page cache before the load (needs root)."""
    from orin.system.root import SysRoot
    from orin.system.settings import drop_page_cache

    try:
        drop_page_cache(SysRoot(), SubprocessRunner())
        log.info("dropped the page cache before loading the model")
    except (OrinError, OSError) as exc:
        log.warning("could not drop the page cache (%s); loading anyway", exc)


def _available() -> int | None:
    from orin.system.memory import read_meminfo
    from orin.system.root import SysRoot

    try:
        return read_meminfo(SysRoot()).available
    except OrinError:
        return None


def fingerprint(llama_version: str, system_info: str, info: ModelInfo, cfg: EngineConfig) -> str:
    """OpenAI's ``system_fingerprint``: changes when anything that can change the
    output for the same request and seed does (the server and llama.cpp builds,
    the model file, the KV types and the context layout)."""
    parts = (
        __version__,
        llama_version,
        system_info,
        Path(cfg.model_path).name,
        str(info.file_size),
        info.quantization,
        cfg.type_k,
        cfg.type_v,
        str(cfg.n_ctx),
        str(cfg.slots),
        cfg.flash_attn,
    )
    return "fp_" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _api_key(profile: Profile) -> str | None:
    env = profile.server.api_key_env
    key = os.environ.get(env) if env else None
    host = profile.server.host
    if not key and not _is_loopback(host):
        log.warning(
            "binding %s WITHOUT an API key: anyone who can reach this address can use the "
            "model; set %s",
            host,
            env or "server.api_key_env",
        )
    return key or None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
