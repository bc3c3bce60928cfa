"""The composition root of the server: builds the engine, the HTTP app and the
telemetry from a resolved profile, chooses the HTTP stack and the API key, and runs
the lifecycle (load, serve until SIGTERM/SIGINT/SIGHUP, drain). ``orin-llm serve`` parses
its options and calls ``run_server``; tests call ``build_server`` and start it
themselves."""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import logging
import math
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from orin import __version__
from orin.errors import BindError, ModelFileError, OrinError
from orin.profile.loader import resolve_model_path
from orin.profile.schema import Profile, SamplingSection
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
    """Bind, load, serve until SIGTERM/SIGINT/SIGHUP, drain; the process exit code.

    The listening socket is bound first, before the model file is even read: a
    port in use or an address this host does not have is a ``BindError`` (exit 8)
    at once, not after minutes of loading. uvicorn serves that same socket, so
    nothing else can take the port in between."""
    sock = bind_socket(profile.server.host, profile.server.port)
    try:
        server, state = build_server(profile, model, telemetry, record, telemetry_hz)
    except BaseException:
        sock.close()
        raise
    if profile.system.drop_caches:
        _drop_page_cache()
    state.engine.start()
    if state.telemetry is not None:
        state.telemetry.start()
    server.announce_when_ready()
    try:
        server.run(sockets=[sock])
    finally:
        state.engine.stop(drain=False, timeout=5)
        if state.telemetry is not None:
            state.telemetry.stop()
    if server.exit_code is not None:
        return server.exit_code
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

    from orin.engine.config import draft_model_problem, engine_config, mmproj_problem
    from orin.engine.engine import Engine
    from orin.llamacpp import build_info
    from orin.model.gguf import read_model_info
    from orin.server import deadlines
    from orin.server.app import create_app
    from orin.server.images import ImageLimits
    from orin.server.lifecycle import FLUSH_S, OrinServer
    from orin.server.metrics import ServerMetrics
    from orin.server.routing import register_routing
    from orin.server.state import ServerState

    path = resolve_model_path(profile, model)
    info = read_model_info(path)
    draft = draft_model_problem(profile, path)
    if draft is not None and draft[1] is not None:  # before minutes of loading, exit 3
        raise ModelFileError(f"speculative.draft_model: {draft[1]}")
    projector = mmproj_problem(profile)
    if projector is not None:
        raise ModelFileError(f"model.mmproj: {projector[1]}")
    build = build_info()
    cfg = engine_config(profile, path, info, build, _available())
    engine = Engine(cfg)
    name = served_name(profile, model)
    state = ServerState(
        engine=engine,
        model_name=name,
        model_match=profile.server.model_match,
        system_fingerprint=fingerprint(
            build.version, build.system_info, info, cfg, profile.sampling
        ),
        metrics=ServerMetrics(cfg.slots, engine.kv_cells_total, name),
        sampling_defaults=profile.sampling,
        api_key=_api_key(profile),
        metrics_public=profile.server.metrics_public,
        cors_origins=tuple(profile.server.cors_origins),
        dashboard=profile.server.dashboard,
        image_limits=ImageLimits.from_server(profile.server),
        max_body_bytes=profile.server.max_body_bytes,
        max_tokens_cap=profile.server.max_tokens_limit,
    )
    engine.add_step_observer(state.metrics.on_step)
    engine.add_finish_observer(state.metrics.on_finish)
    register_routing(state.metrics.registry, profile.server, engine.status, name)
    host, port = profile.server.host, profile.server.port
    log.info(
        "model %s (%s), %d slot%s x %d tokens, K=%s V=%s, flash_attn=%s, on http://%s:%d",
        path,
        info.quantization,
        cfg.slots,
        "" if cfg.slots == 1 else "s",
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
        http=deadlines.protocol(http),  # a request's headers within deadlines.HEADERS_S
        log_config=None,
        access_log=False,
        # the drain sets it to what is left of the grace period (lifecycle.py)
        timeout_graceful_shutdown=math.ceil(profile.server.grace_seconds + FLUSH_S),
    )
    return OrinServer(config, state, grace_s=profile.server.grace_seconds), state


def served_name(profile: Profile, model: Path | None) -> str:
    """The name /v1/models and the responses give the model: server.model_name, else
    the profile's name, else (``--model`` replacing the model a profile names) the
    file's stem, as ``serve --model FILE`` without a profile names it. A profile
    name such as ``demo`` would otherwise be served for another model without a
    word; the replacement is logged."""
    m = profile.model
    own = m.path or m.hf or m.packaged or (f"demo {m.demo.size} {m.demo.quant}" if m.demo else None)
    if model is None or own is None:
        return profile.server.model_name or profile.name
    name = profile.server.model_name or Path(model).stem
    log.info(
        "--model %s replaces profile %s's model (%s): serving it as '%s'%s",
        model,
        profile.name,
        own,
        name,
        "" if profile.server.model_name else " (server.model_name sets another name)",
    )
    return name


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


BACKLOG = 2048  # uvicorn's default: connections the kernel queues before accept


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, as uvicorn binds one (IPv6
    for an address with a colon; SO_REUSEADDR, so that a restart need not wait for
    the last run's connections in TIME_WAIT, while a port another socket listens on
    stays refused), or a ``BindError`` that says why not."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:  # no IPv6 on this host
        raise BindError(_bind_message(where, port, exc)) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise BindError(_bind_message(where, port, exc)) from None
    return sock


def _bind_message(where: str, port: int, exc: OSError) -> str:
    if isinstance(exc, socket.gaierror):
        return f"cannot bind {where}: not an address or a known host name ({exc.strerror})"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{where} is already in use: another program listens there "
            f"(`ss -ltnp 'sport = :{port}'` names it); stop it or choose another --port"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"cannot bind {where}: not an address of this host "
            "(`ip -brief address` lists them; --host 0.0.0.0 listens on all of them)"
        )
    if exc.errno == errno.EACCES:
        return (
            f"cannot bind {where}: permission denied (a port below 1024 needs root or "
            "CAP_NET_BIND_SERVICE; choose a port above 1023)"
        )
    return f"cannot bind {where}: {exc.strerror or exc}"


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


def fingerprint(
    llama_version: str,
    system_info: str,
    info: ModelInfo,
    cfg: EngineConfig,
    sampling: SamplingSection | None = None,
) -> str:
    """OpenAI's ``system_fingerprint``: changes when anything that can change the
    output for the same request and seed does (the server and llama.cpp builds,
    the model file, the KV types, the context layout and sliding window, the RoPE
    base, the profile's chat template, and the sampling defaults a request that
    leaves a parameter out gets)."""
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
        repr(cfg.context),
        repr(cfg.rope_freq_base),
        cfg.chat_template or "",
        sampling.model_dump_json() if sampling is not None else "",
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
