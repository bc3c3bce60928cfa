"""llama.cpp's own server tests against `orin-llm serve` and `llama-server`, side by side.

    .venv/bin/python -m benchmarks.peer_tests [--out FILE] [--json FILE]
        [--only orin|llama-server] [--threads N] [-k EXPR]

1. Takes the tests of the OpenAI-compatible surface (``TEST_FILES``) from
   tools/server/tests/unit of the llama.cpp sources vendored in the llama-cpp-python
   sdist the project pins (the one benchmarks/peers.py builds `llama-server` from), with
   llama.cpp's models/templates beside them, into a work folder in the user cache.
2. Puts benchmarks/peer_shim/utils.py and conftest.py next to them: the ``utils`` module
   the tests import, with llama.cpp's API (``ServerProcess``, ``ServerPreset``,
   ``make_request``, ...), whose ``start()`` turns the settings a test makes into an
   orin-llm profile (``orin_setup``) or llama-server's flags (``llama_server_argv``).
   Both serve SmolLM2-135M-Instruct (the packaged model, no hub download) whatever model
   a preset names. pytest runs once per server.
3. Reports per test id and server: passed, failed (with the first assertion line), error,
   skipped or not offered (an endpoint or server feature orin-llm does not have), the
   totals, which failures assert the story model's exact words or token counts, and per
   orin-llm failure the request that failed with both servers' answers: Markdown (the
   section of docs/conformance.md) and JSON.

llama.cpp's unprefixed aliases of OpenAI routes with the same handler (``/chat/completions``,
``GET /models``) are sent to orin-llm's ``/v1/...`` route; llama.cpp's native routes
(``/completion``, ``/completions``, ``/embeddings``, ``/props``, ``/slots``, ...) are not.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ORIN, LLAMA = "orin", "llama-server"
SERVERS = (ORIN, LLAMA)
TITLE = {ORIN: "orin-llm", LLAMA: "llama-server"}
STATUSES = ("passed", "failed", "error", "skipped", "not offered")

TEST_FILES = (
    "test_chat_completion.py",
    "test_completion.py",
    "test_tokenize.py",
    "test_embedding.py",
    "test_tool_call.py",
    "test_stream.py",
)

# (method, path) orin-llm answers; llama.cpp's aliases of the same handlers map onto them
OFFERED = frozenset(
    {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/embeddings"),
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/health"),
        ("GET", "/metrics"),
    }
)
ALIASES = {
    ("POST", "/chat/completions"): "/v1/chat/completions",
    ("GET", "/models"): "/v1/models",
    ("GET", "/v1/health"): "/health",
}

# ServerProcess's attributes and their defaults in llama.cpp's tests/utils.py
DEFAULTS: dict[str, Any] = {
    "debug": False,
    "server_port": 8080,
    "server_host": "127.0.0.1",
    "model_hf_repo": "ggml-org/models",
    "model_hf_file": "tinyllamas/stories260K.gguf",
    "model_alias": None,
    "temperature": 0.8,
    "seed": 42,
    "offline": False,
    "model_tags": None,
    "model_url": None,
    "model_file": None,
    "model_draft": None,
    "n_threads": None,
    "n_gpu_layer": None,
    "n_batch": None,
    "n_ubatch": None,
    "n_ctx": None,
    "n_ga": None,
    "n_ga_w": None,
    "n_predict": None,
    "n_prompts": 0,
    "slot_save_path": None,
    "id_slot": None,
    "cache_prompt": None,
    "n_slots": None,
    "ctk": None,
    "ctv": None,
    "fa": None,
    "server_continuous_batching": False,
    "server_embeddings": False,
    "server_reranking": False,
    "server_metrics": False,
    "kv_unified": False,
    "swa_full": False,
    "server_slots": False,
    "pooling": None,
    "api_key": None,
    "models_dir": None,
    "models_max": None,
    "models_preset": None,
    "no_models_autoload": None,
    "lora_files": None,
    "enable_ctx_shift": False,
    "spec_type": None,
    "spec_draft_n_min": None,
    "spec_draft_n_max": None,
    "spec_synth_len": None,
    "spec_synth_rates": None,
    "no_ui": None,
    "jinja": None,
    "reasoning_format": None,
    "reasoning": None,
    "chat_template": None,
    "chat_template_file": None,
    "server_path": None,
    "mmproj_url": None,
    "no_mmproj": None,
    "media_path": None,
    "sleep_idle_seconds": None,
    "cache_ram": None,
    "no_cache_idle_slots": False,
    "log_path": None,
    "ui_mcp_proxy": False,
    "backend_sampling": False,
    "gcp_compat": False,
    "server_tools": None,
    "server_tools_runtime": None,
    "mcp_servers_config": None,
    "mcp_servers_json": None,
    "cors_origins": None,
}

# where the model comes from: every run serves SmolLM2 instead
MODEL_SOURCE = ("model_hf_repo", "model_hf_file", "model_url", "model_file", "offline")
# no server setting, or what orin-llm always does
NO_OP = {
    "server_continuous_batching": "continuous batching is always on",
    "server_metrics": "/metrics is always on (behind the API key when one is set)",
    "server_embeddings": "/v1/embeddings needs no switch",
    "jinja": "orin-llm always renders the chat template with Jinja",
    "no_ui": "the tests never open the web page at / (server.dashboard)",
    "cache_prompt": "not a server flag",
    "id_slot": "not a server flag",
    "n_prompts": "not a server flag",
    "log_path": "server log destination",
    "server_path": "server binary",
}
# features orin-llm does not have; a test that fails with one set is "not offered" when its
# failure mentions the evidence (None: any failure)
FEATURES: dict[str, tuple[str, str | None]] = {
    "debug": ("--verbose: a __verbose object in every response", "__verbose"),
    "server_slots": ("the /slots endpoint", None),
    "kv_unified": ("one KV pool shared by all slots (--kv-unified)", None),
    "swa_full": ("--swa-full", None),
    "server_reranking": ("reranking (--reranking)", None),
    "model_draft": ("speculative decoding with a draft model", None),
    "spec_type": ("speculative decoding", None),
    "spec_draft_n_min": ("speculative decoding", None),
    "spec_draft_n_max": ("speculative decoding", None),
    "spec_synth_len": ("speculative decoding", None),
    "spec_synth_rates": ("speculative decoding", None),
    "lora_files": ("LoRA adapters", None),
    "slot_save_path": ("slot save/restore", None),
    "n_ga": ("group attention (self-extend)", None),
    "n_ga_w": ("group attention (self-extend)", None),
    "reasoning_format": ("reasoning_content extraction (--reasoning-format)", None),
    "reasoning": ("--reasoning", None),
    "mmproj_url": ("multimodal projectors", None),
    "no_mmproj": ("multimodal projectors", None),
    "media_path": ("local media files", None),
    "sleep_idle_seconds": ("sleeping when idle", None),
    "cache_ram": ("the host-memory prompt cache (--cache-ram)", None),
    "no_cache_idle_slots": ("--no-cache-idle-slots", None),
    "ui_mcp_proxy": ("the web UI's MCP proxy", None),
    "backend_sampling": ("backend sampling", None),
    "gcp_compat": ("Vertex AI (AIP_*) mode", None),
    "server_tools": ("built-in server tools (--tools)", None),
    "server_tools_runtime": ("built-in server tools (--tools-runtime)", None),
    "mcp_servers_config": ("MCP servers", None),
    "mcp_servers_json": ("MCP servers", None),
    "cors_origins": ("CORS origins", None),
    "models_dir": ("router mode (several models)", None),
    "models_max": ("router mode (several models)", None),
    "models_preset": ("router mode (several models)", None),
    "no_models_autoload": ("router mode (several models)", None),
    "model_tags": ("model tags", None),
}
TEMPLATE_NAME = re.compile(r"[\w.+-]+")  # llama.cpp's built-in templates go by name
MIN_CTX, MIN_BATCH = 256, 32  # orin-llm's engine.n_ctx (per slot) and engine.n_batch minima
AUTO_SLOTS = 4  # llama-server's -np auto

# an assertion on the story model's words or token counts
MODEL_MARKERS = (
    "match_regex",
    "re_content",
    "re.match(",
    "n_prompt",
    "n_predicted",
    "n_cache",
    "n_tokens",
    "bosId",
    "== 2 * 9",
    "batch_count",
    "text tokens",
    '"<s> ',
    "Expected 1 tool call",
)


def settings_of(values: Mapping[str, Any]) -> dict[str, Any]:
    """Every ServerProcess attribute: the defaults overlaid with ``values``."""
    return {**DEFAULTS, **values}


def changed(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k not in DEFAULTS or DEFAULTS[k] != v}


@dataclass
class OrinSetup:
    profile: dict[str, Any]  # the profile YAML's tree
    env: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)  # attribute -> feature
    approximated: dict[str, str] = field(default_factory=dict)  # attribute -> what runs


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    section, key = dotted.split(".")
    tree.setdefault(section, {})[key] = value


def _read_text(path: str) -> str:
    return Path(path).read_text()


def orin_setup(
    settings: Mapping[str, Any],
    model: Path,
    port: int,
    read_text: Callable[[str], str] = _read_text,
) -> OrinSetup:
    """The orin-llm profile for a ServerProcess's settings; what it cannot express is
    recorded: ``unsupported`` (a feature orin-llm lacks), ``approximated`` (a nearby value)."""
    s = settings_of(settings)
    p: dict[str, Any] = {"name": "peer-test", "model": {"path": str(model)}}
    out = OrinSetup(p)
    _put(p, "server.host", s["server_host"])
    _put(p, "server.port", port)
    _put(p, "server.grace_seconds", 0)
    _put(p, "server.api_key_env", None)
    _put(p, "server.model_match", "any")
    if s["model_alias"]:
        _put(p, "server.model_name", str(s["model_alias"]))
    if s["api_key"]:
        _put(p, "server.api_key_env", "ORIN_PEER_API_KEY")
        out.env["ORIN_PEER_API_KEY"] = str(s["api_key"])

    slots = s["n_slots"] or AUTO_SLOTS
    if not s["n_slots"]:
        out.approximated["n_slots"] = (
            f"llama-server's auto: {AUTO_SLOTS} slots sharing one KV pool; orin-llm gives "
            f"each of {AUTO_SLOTS} slots its own share"
        )
    _put(p, "engine.slots", slots)
    if s["n_ctx"]:
        per_slot = int(s["n_ctx"]) // slots
        if per_slot < MIN_CTX:
            out.approximated["n_ctx"] = f"{per_slot} per slot raised to orin-llm's {MIN_CTX}"
        _put(p, "engine.n_ctx", max(per_slot, MIN_CTX))
    n_batch = s["n_batch"]
    if n_batch:
        if n_batch < max(MIN_BATCH, slots):
            out.approximated["n_batch"] = f"{n_batch} raised to {max(MIN_BATCH, slots)}"
            n_batch = max(MIN_BATCH, slots)
        _put(p, "engine.n_batch", int(n_batch))
    n_ubatch = s["n_ubatch"] or (min(int(n_batch), 512) if n_batch else None)
    if n_ubatch:
        if n_ubatch < MIN_BATCH:
            out.approximated["n_ubatch"] = f"{n_ubatch} raised to {MIN_BATCH}"
        _put(p, "engine.n_ubatch", max(int(n_ubatch), MIN_BATCH))
    for attr, dotted in (
        ("n_threads", "engine.threads"),
        ("n_gpu_layer", "engine.gpu_layers"),
    ):
        if s[attr] is not None:
            _put(p, dotted, int(s[attr]))
    # llama-server's defaults: f16 cache, flash attention auto
    _put(p, "engine.type_k", s["ctk"] or "f16")
    _put(p, "engine.type_v", s["ctv"] or "f16")
    _put(p, "engine.flash_attn", s["fa"] or "auto")
    # llama-server shifts the context only with --context-shift
    _put(p, "context.sliding", bool(s["enable_ctx_shift"]))

    _put(p, "sampling.temperature", float(s["temperature"]))
    if s["seed"] is not None and int(s["seed"]) >= 0:
        _put(p, "sampling.seed", int(s["seed"]))
    if s["n_predict"]:
        if int(s["n_predict"]) > 0:
            _put(p, "sampling.max_tokens", int(s["n_predict"]))
        else:
            out.approximated["n_predict"] = (
                f"{s['n_predict']} (no limit): orin-llm's default max_tokens"
            )

    pooling = s["pooling"]
    if pooling in ("mean", "cls", "last"):
        _put(p, "model.pooling", pooling)
    elif pooling:
        out.unsupported["pooling"] = f"pooling {pooling!r}"

    if s["chat_template_file"]:
        _put(p, "model.chat_template", read_text(str(s["chat_template_file"])))
    elif s["chat_template"]:
        if TEMPLATE_NAME.fullmatch(str(s["chat_template"])):
            out.approximated["chat_template"] = (
                f"llama.cpp's built-in template {s['chat_template']!r}: the model's own"
            )
        else:
            _put(p, "model.chat_template", str(s["chat_template"]))

    for attr, (feature, _evidence) in FEATURES.items():
        if s.get(attr):
            out.unsupported[attr] = feature
    return out


FLAGS: dict[str, str] = {
    "n_batch": "--batch-size",
    "n_ubatch": "--ubatch-size",
    "n_threads": "--threads",
    "n_gpu_layer": "--n-gpu-layers",
    "pooling": "--pooling",
    "model_alias": "--alias",
    "model_tags": "--tags",
    "n_ctx": "--ctx-size",
    "n_slots": "--parallel",
    "ctk": "-ctk",
    "ctv": "-ctv",
    "n_predict": "--n-predict",
    "slot_save_path": "--slot-save-path",
    "n_ga": "--grp-attn-n",
    "n_ga_w": "--grp-attn-w",
    "spec_type": "--spec-type",
    "api_key": "--api-key",
    "spec_draft_n_max": "--spec-draft-n-max",
    "spec_draft_n_min": "--spec-draft-n-min",
    "chat_template": "--chat-template",
    "chat_template_file": "--chat-template-file",
    "media_path": "--media-path",
    "server_tools": "--tools",
    "server_tools_runtime": "--tools-runtime",
    "mcp_servers_config": "--mcp-servers-config",
    "mcp_servers_json": "--mcp-servers-json",
    "cors_origins": "--cors-origins",
    "models_dir": "--models-dir",
    "models_preset": "--models-preset",
}
SWITCHES: dict[str, str] = {
    "server_continuous_batching": "--cont-batching",
    "server_embeddings": "--embedding",
    "server_reranking": "--reranking",
    "server_metrics": "--metrics",
    "kv_unified": "--kv-unified",
    "swa_full": "--swa-full",
    "debug": "--verbose",
    "enable_ctx_shift": "--context-shift",
    "no_ui": "--no-ui",
    "no_models_autoload": "--no-models-autoload",
    "no_mmproj": "--no-mmproj",
    "no_cache_idle_slots": "--no-cache-idle-slots",
    "ui_mcp_proxy": "--ui-mcp-proxy",
    "backend_sampling": "--backend_sampling",
}


def llama_server_argv(
    settings: Mapping[str, Any], binary: Path, model: Path | None, port: int
) -> list[str]:
    """llama-server's command line for a ServerProcess's settings, as llama.cpp's tests
    start it, with ``model`` (None: router mode) in place of the preset's."""
    s = settings_of(settings)
    argv = [str(binary), "--port", str(port), "--host", str(s["server_host"])]
    argv += ["--temp", str(s["temperature"]), "--seed", str(s["seed"])]
    if model is not None:
        argv += ["--model", str(model)]
    for attr, flag in FLAGS.items():
        if s.get(attr):
            argv += [flag, str(s[attr])]
    if s["fa"] is not None:
        argv += ["-fa", str(s["fa"])]
    if s["models_max"] is not None:
        argv += ["--models-max", str(s["models_max"])]
    if s["spec_synth_len"] is not None:
        argv += ["--spec-synth-len", str(s["spec_synth_len"])]
    if s["spec_synth_rates"] is not None:
        argv += ["--spec-synth-rates", ",".join(str(r) for r in s["spec_synth_rates"])]
    if s["sleep_idle_seconds"] is not None:
        argv += ["--sleep-idle-seconds", str(s["sleep_idle_seconds"])]
    if s["cache_ram"] is not None:
        argv += ["--cache-ram", str(s["cache_ram"])]
    if s["reasoning_format"] is not None:
        argv += ["--reasoning-format", str(s["reasoning_format"])]
    if s["reasoning"] is not None:
        argv += ["--reasoning", str(s["reasoning"])]
    for attr, flag in SWITCHES.items():
        if s.get(attr):
            argv.append(flag)
    for lora in s["lora_files"] or ():
        argv += ["--lora", str(lora)]
    argv.append("--slots" if s["server_slots"] else "--no-slots")
    argv.append("--jinja" if s["jinja"] else "--no-jinja")
    return argv


def orin_path(method: str, path: str) -> str:
    """The path orin-llm gets for a request llama.cpp's tests send."""
    bare, sep, query = path.partition("?")
    return ALIASES.get((method.upper(), bare), bare) + sep + query


def offered(method: str, path: str) -> bool:
    return (method.upper(), orin_path(method, path).partition("?")[0]) in OFFERED


# ---- outcomes -------------------------------------------------------------------------


def not_offered_reason(rec: Mapping[str, Any]) -> str | None:
    """Why a failed orin-llm test needed something orin-llm does not offer, or None."""
    if rec.get("not_offered"):
        return str(rec["not_offered"])
    routes = sorted(
        {
            f"{e['method']} {e['path'].partition('?')[0]}"
            for e in rec.get("events", ())
            if not offered(e["method"], e["path"])
        }
    )
    if routes:
        return "endpoint " + ", ".join(routes)
    text = f"{rec.get('message', '')}\n{rec.get('line', '')}\n{rec.get('detail', '')}"
    for attr, feature in (rec.get("unsupported") or {}).items():
        evidence = FEATURES.get(attr, (feature, None))[1]
        if evidence is None or evidence in text:
            return f"{attr}: {feature}"
    return None


def model_dependent(rec: Mapping[str, Any]) -> bool:
    text = f"{rec.get('line', '')}\n{rec.get('message', '')}"
    return any(m in text for m in MODEL_MARKERS)


def outcome(server: str, rec: Mapping[str, Any]) -> dict[str, Any]:
    """A test's outcome on one server from the conftest's record."""
    status = str(rec["outcome"])
    detail = str(rec.get("message") or "")
    if server == ORIN and status != "skipped":
        # a test that reached an endpoint orin-llm lacks says nothing of it, pass or fail
        reason = not_offered_reason(rec)
        if reason is not None and (status != "passed" or reason.startswith("endpoint ")):
            status, detail = "not offered", reason
    out: dict[str, Any] = {"status": status, "detail": detail}
    if status in ("failed", "error"):
        out["line"] = rec.get("line", "")
        out["model_dependent"] = model_dependent(rec)
    return out


def _short(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def error_message(response: Any) -> str:
    """The message of an OpenAI- or llama.cpp-style error body (JSON text or parsed)."""
    body = response
    if isinstance(response, str):
        try:
            body = json.loads(response)
        except ValueError:
            return response
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(body)


def failing_event(rec: Mapping[str, Any]) -> dict[str, Any] | None:
    """The request a failure is about: the last one answered with an error status, else
    the last one."""
    events = list(rec.get("events", ()))
    for e in reversed(events):
        if isinstance(e.get("status"), int) and e["status"] >= 400:
            return dict(e)
    return dict(events[-1]) if events else None


def matching_event(
    rec: Mapping[str, Any] | None, event: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The same request in the other server's record of the test."""
    if not rec:
        return None
    for e in rec.get("events", ()):
        if (e["method"], e["path"], e.get("body")) == (
            event["method"],
            event["path"],
            event.get("body"),
        ):
            return dict(e)
    return None


def answer(event: Mapping[str, Any] | None) -> str:
    if event is None:
        return "-"
    status = event.get("status")
    if status is None:
        return f"no answer ({event.get('exception', 'no status')})"
    body = event.get("response", "")
    if isinstance(status, int) and status >= 400:
        return f"{status} {_short(error_message(body), 160)}"
    return f"{status} {_short(body, 160)}"


def failure_cause(
    rec: Mapping[str, Any],
    event: Mapping[str, Any] | None,
    peer_event: Mapping[str, Any] | None = None,
) -> str:
    """The request's error when llama-server answered it otherwise (or did not run), else
    the failed assertion."""
    status = None if event is None else event.get("status")
    if (
        event is not None
        and isinstance(status, int)
        and status >= 400
        and (peer_event is None or peer_event.get("status") != status)
    ):
        msg = _short(error_message(event.get("response", "")), 140)
        return f"{status} from {event['method']} {event['sent']}: {msg}"
    line = str(rec.get("line") or "")
    message = str(rec.get("message") or "").removeprefix("AssertionError: ")
    if not line.startswith("assert"):  # raised inside a call: its message says more
        return _short(message or line or "failed", 200)
    if message in ("", "assert False") or message == line:
        return _short(f"`{line}`", 200)
    return _short(f"`{line}`: {message}", 200)


def settings_noted(rec: Mapping[str, Any]) -> list[str]:
    """The settings of the test orin-llm could not take as they were."""
    names: list[str] = []
    for start in rec.get("starts", ()):
        for key in ("unsupported", "approximated"):
            names += [n for n in start.get(key, {}) if n not in names]
    return names


def build_report(
    records: Mapping[str, Iterable[Mapping[str, Any]]], meta: Mapping[str, Any]
) -> dict[str, Any]:
    """Per test id and server: the outcome; the totals; the orin-llm failures with the
    request each is about and both servers' answers to it."""
    by_server = {srv: {str(r["id"]): r for r in recs} for srv, recs in records.items()}
    ids: list[str] = []
    for recs in by_server.values():
        ids += [i for i in recs if i not in ids]
    tests: list[dict[str, Any]] = []
    totals = {srv: Counter({s: 0 for s in STATUSES}) for srv in by_server}
    failures: list[dict[str, Any]] = []
    for test_id in ids:
        row: dict[str, Any] = {"id": test_id}
        for srv, recs in by_server.items():
            if test_id in recs:
                row[srv] = outcome(srv, recs[test_id])
                totals[srv][row[srv]["status"]] += 1
        tests.append(row)
        mine = by_server.get(ORIN, {}).get(test_id)
        if mine is None or row[ORIN]["status"] not in ("failed", "error"):
            continue
        peer = by_server.get(LLAMA, {}).get(test_id)
        event = failing_event(mine)
        peer_event = matching_event(peer, event) if event else None
        failures.append(
            {
                "id": test_id,
                "status": row[ORIN]["status"],
                "cause": failure_cause(mine, event, peer_event),
                "settings": settings_noted(mine),
                "line": mine.get("line", ""),
                "message": mine.get("message", ""),
                "model_dependent": row[ORIN]["model_dependent"],
                "llama_server": row[LLAMA]["status"] if LLAMA in row else "not run",
                "llama_server_same_line": bool(
                    LLAMA in row
                    and row[LLAMA]["status"] in ("failed", "error")
                    and row[LLAMA].get("line") == mine.get("line")
                ),
                "request": None
                if event is None
                else {k: event.get(k) for k in ("method", "path", "sent", "body")},
                "orin_answer": answer(event),
                "llama_server_answer": answer(peer_event),
            }
        )
    return {
        "meta": dict(meta),
        "totals": {srv: dict(c) for srv, c in totals.items()},
        "tests": tests,
        "orin_failures": failures,
    }


BEGIN, END = "<!-- peer-tests:begin -->", "<!-- peer-tests:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Mapping[str, Any]) -> str:
    meta = report["meta"]
    servers = [s for s in SERVERS if s in report["totals"]]
    lines = [
        BEGIN,
        "## llama.cpp's server tests",
        "",
        f"llama.cpp's own pytest suite for its server (`tools/server/tests/unit` of "
        f"llama-cpp-python {meta.get('llama_cpp_python', '?')}'s vendored llama.cpp: "
        f"{', '.join(f'`{f}`' for f in meta.get('files', ()))}), run unchanged against "
        "`orin-llm serve` and `llama-server` built from the same sources, through "
        "`benchmarks/peer_shim/utils.py` in place of their `utils.py`. Both serve "
        f"{meta.get('model', 'SmolLM2-135M-Instruct')} whatever model a preset names "
        "(the tests were written for tiny story models, so assertions on exact words and "
        f"token counts fail on both). The {meta.get('slow_left_out', 0)} tests marked slow "
        "(each needs a model from Hugging Face) are left out, as llama.cpp's `tests.sh` "
        "does.",
        "",
        "```",
        str(meta.get("command", ".venv/bin/python -m benchmarks.peer_tests")),
        "```",
        "",
        f"- machine: {meta.get('cpu', '?')}, {meta.get('cores', '?')} cores; server threads: "
        f"{meta.get('threads', '?')}",
        f"- date: {meta.get('date', '?')}",
        f"- orin-llm: {meta.get('orin_commit', '?')}",
        f"- llama-server: {meta.get('llama_server', '?')}",
        "",
        "| outcome | " + " | ".join(TITLE[s] for s in servers) + " |",
        "|---|" + "---:|" * len(servers),
    ]
    for status in STATUSES:
        counts = [str(report["totals"][s].get(status, 0)) for s in servers]
        lines.append(f"| {status} | " + " | ".join(counts) + " |")
    lines.append(
        "| total | " + " | ".join(str(sum(report["totals"][s].values())) for s in servers) + " |"
    )
    failures = report["orin_failures"]
    if failures:
        own = [f for f in failures if not f["llama_server_same_line"]]
        shared = [f for f in failures if f["llama_server_same_line"]]
        lines += [
            "",
            "### orin-llm failures",
            "",
            "One line each: the test, the cause (the request's error where llama-server "
            "answered it otherwise, else the failed assertion), llama-server's outcome. *model* "
            "marks an assertion on the story model's words or token counts.",
        ]
        for title, group in (
            ("Where llama-server passes, or fails elsewhere in the test", own),
            ("Where llama-server fails at the same assertion", shared),
        ):
            if not group:
                continue
            lines += ["", f"#### {title} ({len(group)})", ""]
            causes = Counter(f["cause"] for f in group)
            if len(causes) < len(group):
                lines += ["| cause | tests |", "|---|---:|"]
                lines += [f"| {_cell(c)} | {n} |" for c, n in causes.most_common()]
                lines.append("")
            for f in sorted(group, key=lambda f: (f["model_dependent"], f["cause"], f["id"])):
                tag = " *model*" if f["model_dependent"] else ""
                noted = ", ".join(f.get("settings", ()))
                noted = f"; settings not taken as set: {noted}" if noted else ""
                lines.append(
                    f"- `{f['id']}`{tag}: {f['cause']} (llama-server: {f['llama_server']}{noted})"
                )
    lines += [
        "",
        "<details><summary>Every test</summary>",
        "",
        "| test | " + " | ".join(TITLE[s] for s in servers) + " |",
        "|---|" + "---|" * len(servers),
    ]
    for row in report["tests"]:
        cells = []
        for s in servers:
            o = row.get(s)
            if o is None:
                cells.append("not run")
                continue
            text = o["status"]
            if o["status"] != "passed" and o.get("detail"):
                text += ": " + _short(o["detail"], 90)
            cells.append(_cell(text))
        lines.append(f"| `{row['id']}` | " + " | ".join(cells) + " |")
    lines += ["", "</details>", END, ""]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """``section`` into ``path``: in place of the marked section when there is one, else
    appended (a new file is the section alone)."""
    if not path.exists():
        path.write_text(section)
        return
    text = path.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        path.write_text(head + section.rstrip("\n") + tail)
    else:
        path.write_text(text.rstrip("\n") + "\n\n" + section)


# ---- running --------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
SHIM = Path(__file__).resolve().parent / "peer_shim"
SDIST_TESTS = "vendor/llama.cpp/tools/server/tests"
SDIST_TEMPLATES = "vendor/llama.cpp/models/templates"


def sdist_path(cache: Path, version: str) -> Path:
    """The pinned llama-cpp-python sdist, fetched with pip once into ``cache``."""
    out = cache / f"llama_cpp_python-{version}.tar.gz"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "-d", str(cache), f"llama-cpp-python=={version}"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return out


def prepare(sdist: Path, work: Path, files: Iterable[str]) -> Path:
    """The work folder: llama.cpp's tests (``files``) and templates as the sdist lays them
    out, the shim and conftest beside the tests; returns the tests folder."""
    wanted = set(files)
    if work.exists():
        shutil.rmtree(work)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            rel = member.name.split("/", 1)[1] if "/" in member.name else ""
            if not member.isfile():
                continue
            if rel.startswith(SDIST_TESTS + "/unit/") and Path(rel).name in wanted:
                dest = work / "tools/server/tests/unit" / Path(rel).name
            elif rel.startswith(SDIST_TEMPLATES + "/"):
                dest = work / "models/templates" / rel[len(SDIST_TEMPLATES) + 1 :]
            else:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            if src is not None:
                dest.write_bytes(src.read())
    tests = work / "tools/server/tests"
    missing = sorted(wanted - {p.name for p in (tests / "unit").glob("*.py")})
    if missing:
        print(f"peer_tests: not in this llama.cpp: {', '.join(missing)}", file=sys.stderr)
    shutil.copy(SHIM / "utils.py", tests / "utils.py")
    shutil.copy(SHIM / "conftest.py", tests / "conftest.py")
    (tests / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    slow: needs models from Hugging Face\n    serial\n"
    )
    return tests


def run_server_tests(
    server: str,
    tests: Path,
    results: Path,
    model: Path,
    llama_server: Path | None,
    select: str | None,
    threads: int | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """pytest over the copied tests against one server: the conftest's records, and the
    ids of the slow tests it left out."""
    results.unlink(missing_ok=True)
    slow = results.with_suffix(".slow.json")
    slow.unlink(missing_ok=True)
    logs = results.parent / f"logs-{server}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
        "ORIN_PEER_SERVER": server,
        "ORIN_PEER_MODEL": str(model),
        "ORIN_PEER_LLAMA_SERVER": str(llama_server or ""),
        "ORIN_PEER_PYTHON": sys.executable,
        "ORIN_PEER_RESULTS": str(results),
        "ORIN_PEER_SLOW": str(slow),
        "ORIN_PEER_LOGS": str(logs),
        "ORIN_PEER_THREADS": str(threads or ""),
    }
    files = sorted(str(p.relative_to(tests)) for p in (tests / "unit").glob("test_*.py"))
    cmd = [sys.executable, "-m", "pytest", "-c", "pytest.ini", "--rootdir", ".",
           "-p", "no:cacheprovider", "-q", "--tb=long", *files]  # fmt: skip
    if select:
        cmd += ["-k", select]
    with open(results.parent / f"pytest-{server}.log", "w") as log:
        subprocess.run(cmd, cwd=tests, env=env, stdout=log)
    left_out = json.loads(slow.read_text()) if slow.exists() else []
    if not results.exists():
        return [], left_out
    lines = results.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()], left_out


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        said = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in said.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count()}


def orin_commit() -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return f"{rev} (with uncommitted changes)" if dirty else rev


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, help="Markdown section into this file (replaced there)")
    ap.add_argument("--json", type=Path, help="the report as JSON (default: in the work folder)")
    ap.add_argument("--only", choices=SERVERS, help="run against one server")
    ap.add_argument("-k", dest="select", help="pytest -k expression (a subset of the tests)")
    ap.add_argument(
        "--threads", type=int, help="CPU threads of both servers (default: their own choice)"
    )
    args = ap.parse_args(argv)

    from benchmarks import peers
    from orin.model.packaged import SMOLLM2, fetch
    from orin.paths import cache_dir

    servers = [args.only] if args.only else list(SERVERS)
    cache = cache_dir() / "peers"
    work = cache / "peer-tests"
    model = fetch(SMOLLM2)
    llama_server = peers.build_llama_server() if LLAMA in servers else None
    sdist = sdist_path(cache, peers.LLAMA_CPP_PYTHON)
    tests = prepare(sdist, work / "llama.cpp", TEST_FILES)
    records: dict[str, list[dict[str, Any]]] = {}
    slow: list[str] = []
    for server in servers:
        print(f"peer_tests: {TITLE[server]} ...", file=sys.stderr)
        records[server], slow = run_server_tests(
            server, tests, work / f"results-{server}.jsonl", model, llama_server, args.select,
            args.threads,
        )  # fmt: skip
        print(
            f"peer_tests: {TITLE[server]}: {len(records[server])} tests "
            f"(pytest log: {work / f'pytest-{server}.log'})",
            file=sys.stderr,
        )
    command = ".venv/bin/python -m benchmarks.peer_tests" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:])
    )
    meta = {
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        **machine(),
        "llama_cpp_python": peers.LLAMA_CPP_PYTHON,
        "llama_server": llama_server.name if llama_server else "not run",
        "orin_commit": orin_commit(),
        "model": f"{SMOLLM2.title} ({model.name})",
        "files": [f for f in TEST_FILES if (tests / "unit" / f).exists()],
        "slow_left_out": len(slow),
        "threads": args.threads or "each server's default",
    }
    report = build_report(records, meta)
    out_json = args.json or work / "report.json"
    out_json.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    section = render_markdown(report)
    if args.out:
        write_section(args.out, section)
    else:
        print(section)
    for srv, counts in report["totals"].items():
        print(f"peer_tests: {TITLE[srv]}: {json.dumps(counts)}", file=sys.stderr)
    print(f"peer_tests: JSON report: {out_json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
