"""The ``utils`` module llama.cpp's server tests import, for benchmarks/peer_tests.py.

The API the tests use (``ServerProcess`` with the attributes they set, ``start``,
``stop``, ``make_request``, ``make_stream_request``, ``make_any_request``,
``ServerPreset``, ``ServerError``, ``match_regex``, ``parallel_function_calls``, ...)
over either server, chosen by ORIN_PEER_SERVER:

- ``orin``: `orin-llm serve` with the profile ``orin_setup`` makes of the settings; the
  settings it cannot express are recorded (``STARTS``);
- ``llama-server``: the binary in ORIN_PEER_LLAMA_SERVER with the flags llama.cpp's tests
  give it (``llama_server_argv``).

Both load ORIN_PEER_MODEL, whatever model a preset names. Every request a test makes is
recorded (``EVENTS``) for the report; conftest.py writes the records out.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import (  # noqa: UP035 (names the tests take from `from utils import *`)
    Any,
    Callable,
    ContextManager,
    Iterable,
    Iterator,
    List,
    Literal,
    Optional,
    Set,
    Tuple,
)

import requests
import yaml

from benchmarks.peer_tests import (
    DEFAULTS,
    ORIN,
    changed,
    llama_server_argv,
    orin_path,
    orin_setup,
)

__all__ = [
    "DEFAULT_HTTP_TIMEOUT",
    "DEFAULT_REQUEST_TIMEOUT",
    "TMP_DIR",
    "Any",
    "Callable",
    "ContextManager",
    "Iterable",
    "Iterator",
    "List",
    "Literal",
    "NotOffered",
    "Optional",
    "ServerError",
    "ServerPreset",
    "ServerProcess",
    "ServerResponse",
    "Set",
    "ThreadPoolExecutor",
    "Tuple",
    "as_completed",
    "download_file",
    "is_slow_test_allowed",
    "json",
    "match_regex",
    "os",
    "parallel_function_calls",
    "re",
    "requests",
    "server_instances",
    "subprocess",
    "sys",
    "time",
]

TMP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tmp")
DEFAULT_HTTP_TIMEOUT = 60  # seconds for a server to come up, as the tests ask
START_TIMEOUT = 240  # ... at least: python's imports and the load on 2 busy cores
DEFAULT_REQUEST_TIMEOUT = 120.0  # per request: a hung server fails the test
CLIP = 2000  # characters of a request or response body kept in a record

EVENTS: list[dict[str, Any]] = []  # the requests of the running test
STARTS: list[dict[str, Any]] = []  # the servers it started and how
NOT_OFFERED: list[str] = []  # server modes orin-llm does not have that it asked for


def reset() -> None:
    EVENTS.clear()
    STARTS.clear()
    NOT_OFFERED.clear()


def clip(text: str, limit: int = CLIP) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} … {text[-half:]}"


def record(method: str, path: str, sent: str, body: Any, via: str = "utils") -> dict[str, Any]:
    """A request as a test sent it (``path``) and as the server got it (``sent``)."""
    shown = body if body is None else clip(json.dumps(body, ensure_ascii=False))
    event: dict[str, Any] = {
        "method": method.upper(),
        "path": path,
        "sent": sent,
        "body": shown,
        "via": via,
        "status": None,
    }
    EVENTS.append(event)
    return event


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_kind() -> str:
    return os.environ.get("ORIN_PEER_SERVER", ORIN)


class NotOffered(Exception):
    """The test needs a server mode orin-llm does not have."""


class ServerResponse:
    headers: dict[str, str]
    status_code: int
    body: Any


class ServerError(Exception):
    def __init__(self, code: int, body: Any) -> None:
        super().__init__(f"{code}: {body}")
        self.code = code
        self.body = body


_started = [0]  # servers started in this session: a unique prefix for their files


def _file_name() -> str:
    """A name for the files of a server start: a running number and the test's id."""
    _started[0] += 1
    current = os.environ.get("PYTEST_CURRENT_TEST", "test").rsplit(" ", 1)[0]
    test = re.sub(r"[^\w.-]+", "_", current.split("::", 1)[-1])[:120]
    return f"{_started[0]:04d}-{test}"


class ServerProcess:
    server_host: str
    server_port: int
    api_key: str | None
    model_alias: str | None
    process: subprocess.Popen[bytes] | None

    def __init__(self) -> None:
        for name, value in DEFAULTS.items():
            setattr(self, name, value)
        self.server_port = free_port()
        self.stands_in_for: str | None = None  # the preset's model, which SmolLM2 replaces
        self.process = None
        self.ready = False
        self.external_server = False
        self._log: Any = None
        if os.environ.get("ORIN_PEER_THREADS"):
            self.n_threads = int(os.environ["ORIN_PEER_THREADS"])
        if "N_GPU_LAYERS" in os.environ:
            self.n_gpu_layer = int(os.environ["N_GPU_LAYERS"])
        if "DEBUG" in os.environ:
            self.debug = True

    def settings(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k in DEFAULTS}

    def _argv(self, logs: Path, name: str) -> tuple[list[str], dict[str, str]]:
        kind = server_kind()
        settings = self.settings()
        model = Path(os.environ["ORIN_PEER_MODEL"])
        router = all(
            settings[k] is None
            for k in ("model_file", "model_hf_repo", "model_hf_file", "model_url")
        )
        start: dict[str, Any] = {
            "server": kind,
            "changed": json.loads(json.dumps(changed(settings), default=str)),
            "stands_in_for": self.stands_in_for,
        }
        STARTS.append(start)
        env = {**os.environ}
        if kind == ORIN:
            if router:
                reason = "router mode: no model of its own, models loaded per request"
                NOT_OFFERED.append(reason)
                raise NotOffered(reason)
            setup = orin_setup(settings, model, self.server_port)
            start.update(
                unsupported=setup.unsupported,
                approximated=setup.approximated,
                profile={
                    **setup.profile,
                    "model": {
                        k: (clip(v, 200) if k == "chat_template" else v)
                        for k, v in setup.profile["model"].items()
                    },
                },
            )
            profile = logs / f"{name}.yaml"
            profile.write_text(yaml.safe_dump(setup.profile, sort_keys=False))
            env.update(setup.env)
            python = os.environ.get("ORIN_PEER_PYTHON", sys.executable)
            argv = [python, "-m", "orin", "serve", "--profile", str(profile)]
            return [*argv, "--telemetry", "off"], env
        if router:
            import pytest

            pytest.skip("router preset: its models come from Hugging Face, not here")
        binary = Path(os.environ["ORIN_PEER_LLAMA_SERVER"])
        argv = [*llama_server_argv(settings, binary, model, self.server_port), "--offline"]
        start["argv"] = argv[1:]
        env["LLAMA_SERVER_DEBUG_FAKE_TIMING"] = "1"
        return argv, env

    def start(self, timeout_seconds: int = DEFAULT_HTTP_TIMEOUT) -> None:
        logs = Path(os.environ.get("ORIN_PEER_LOGS", TMP_DIR))
        logs.mkdir(parents=True, exist_ok=True)
        name = _file_name()
        argv, env = self._argv(logs, name)
        log_path = logs / f"{name}.log"
        self._log = open(log_path, "wb")  # noqa: SIM115 (open while the server runs)
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        server_instances.add(self)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limit = max(timeout_seconds, START_TIMEOUT)
        deadline = time.time() + limit
        while time.time() < deadline:
            try:
                url = self.make_url("/health")
                if requests.get(url, headers=headers, timeout=2).status_code == 200:
                    self.ready = True
                    return
            except requests.RequestException:
                pass
            if self.process.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(
                    f"{server_kind()} exited with {self.process.returncode}: " + " / ".join(tail)
                )
            time.sleep(0.25)
        raise TimeoutError(f"{server_kind()} did not come up within {limit} s")

    def stop(self) -> None:
        server_instances.discard(self)
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def make_url(self, path: str, host: str | None = None) -> str:
        if host is None:
            host = self.server_host.split(",")[0].strip()
        return f"http://{host}:{self.server_port}{path}"

    def _sent(self, method: str, path: str) -> str:
        return orin_path(method, path) if server_kind() == ORIN else path

    def make_request(
        self,
        method: str,
        path: str,
        data: Any = None,
        headers: dict[str, Any] | None = None,
        timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        host: str | None = None,
    ) -> ServerResponse:
        if method not in ("GET", "POST", "DELETE", "OPTIONS"):
            raise ValueError(f"Unimplemented method: {method}")
        sent = self._sent(method, path)
        event = record(method, path, sent, data)
        try:
            response = requests.request(
                method,
                self.make_url(sent, host),
                headers=headers,
                json=data if method == "POST" else None,
                timeout=timeout,
            )
        except requests.RequestException as exc:
            event["exception"] = type(exc).__name__
            raise
        event["status"] = response.status_code
        event["response"] = clip(response.text)
        result = ServerResponse()
        result.headers = dict(response.headers)
        result.status_code = response.status_code
        result.body = None
        if method != "OPTIONS":
            try:
                result.body = response.json()
            except ValueError:
                result.body = response.text
        return result

    def make_stream_request(
        self,
        method: str,
        path: str,
        data: dict[str, Any] | None = None,
        headers: dict[str, Any] | None = None,
        host: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        if method != "POST":
            raise ValueError(f"Unimplemented method: {method}")
        sent = self._sent(method, path)
        event = record(method, path, sent, data)
        response = requests.post(
            self.make_url(sent, host),
            headers=headers,
            json=data,
            stream=True,
            timeout=(10, DEFAULT_REQUEST_TIMEOUT),
        )
        event["status"] = response.status_code
        if response.status_code != 200:
            event["response"] = clip(response.text)
            try:
                body = response.json()
            except ValueError:
                body = response.text
            raise ServerError(response.status_code, body)
        seen: list[str] = []
        event["response"] = ""
        try:
            for raw in response.iter_lines():
                line = raw.decode("utf-8")
                if line:
                    # kept as it comes: a test that fails mid-stream never closes the generator
                    seen.append(line)
                    event["response"] = clip("\n".join(seen))
                if "[DONE]" in line:
                    break
                if line.startswith("data: "):
                    yield json.loads(line[6:])
        finally:
            response.close()

    def make_any_request(
        self,
        method: str,
        path: str,
        data: dict[str, Any] | None = None,
        headers: dict[str, Any] | None = None,
        timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
    ) -> dict[str, Any]:
        """The response as one chat completion, streamed or not; a stream's chunks are
        checked against the shape llama.cpp's tests expect and merged."""
        data = data or {}
        if not data.get("stream", False):
            response = self.make_request(method, path, data, headers, timeout=timeout)
            assert response.status_code == 200, f"Server returned error: {response.status_code}"
            return dict(response.body)
        return _merge_stream(self.make_stream_request(method, path, data, headers))


def _merge_stream(chunks: Iterable[dict[str, Any]]) -> dict[str, Any]:
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    finish_reason = None
    for chunk in chunks:
        if not chunk["choices"]:
            assert "usage" in chunk, f"Expected usage in chunk: {chunk}"
            assert "timings" in chunk, f"Expected timings in chunk: {chunk}"
            continue
        assert len(chunk["choices"]) == 1, f"Expected 1 choice, got {len(chunk['choices'])}"
        choice = chunk["choices"][0]
        delta = choice["delta"]
        for key, parts in (("content", content), ("reasoning_content", reasoning)):
            if delta.get(key) is not None:
                assert len(delta[key]) > 0, f"Expected non empty {key} delta!"
                parts.append(delta[key])
        if choice.get("finish_reason") is not None:
            finish_reason = choice["finish_reason"]
        for tc in delta.get("tool_calls") or []:
            if "function" not in tc:
                raise ValueError(f"Expected function type, got {tc.get('type')}")
            if tc["index"] >= len(calls):
                assert "id" in tc
                assert tc.get("type") == "function"
                assert tc["function"].get("name"), (
                    f"Expected function call with name, got {tc.get('function')}"
                )
                calls.append(
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
            call = calls[tc["index"]]
            if tc.get("id") is not None:
                call["id"] = tc["id"]
            fn = tc["function"]
            assert "id" not in fn, f"Function call should not have id: {fn}"
            if fn.get("name") is not None:
                call["function"]["name"] += fn["name"]
            if fn.get("arguments") is not None:
                call["function"]["arguments"] += fn["arguments"]
    message = {
        "role": "assistant",
        "content": "".join(content) if content else None,
        "reasoning_content": "".join(reasoning) if reasoning else None,
        "tool_calls": calls or None,
    }
    return {"choices": [{"index": 0, "finish_reason": finish_reason, "message": message}]}


server_instances: set[ServerProcess] = set()


def _preset(
    stands_in_for: str, alias: str | None, n_ctx: int, n_batch: int, n_slots: int, **more: Any
) -> ServerProcess:
    server = ServerProcess()
    server.stands_in_for = stands_in_for
    settings = {
        "offline": True,
        "model_hf_repo": stands_in_for,
        "model_hf_file": None,
        "model_alias": alias,
        "n_ctx": n_ctx,
        "n_batch": n_batch,
        "n_slots": n_slots,
        "seed": 42,
        **more,
    }
    for name, value in settings.items():
        setattr(server, name, value)
    return server


class ServerPreset:
    """llama.cpp's presets with their settings; every one serves ORIN_PEER_MODEL."""

    @staticmethod
    def load_all() -> None:
        """Nothing to download: every preset serves the local model."""

    @staticmethod
    def tinyllama2() -> ServerProcess:
        return _preset("ggml-org/test-model-stories260K", "tinyllama-2", 512, 32, 2, n_predict=64)

    # BERT's GGUF brings its own pooling, SmolLM2's none: the stand-in pools by mean
    @staticmethod
    def bert_bge_small() -> ServerProcess:
        return _preset(
            "ggml-org/models bert-bge-small/ggml-model-f16.gguf", "bert-bge-small", 512, 128, 2,
            n_ubatch=128, server_embeddings=True, pooling="mean",
        )  # fmt: skip

    @staticmethod
    def bert_bge_small_with_fa() -> ServerProcess:
        return _preset(
            "ggml-org/models bert-bge-small/ggml-model-f16.gguf", "bert-bge-small", 1024, 300, 2,
            n_ubatch=300, fa="on", server_embeddings=True, pooling="mean",
        )  # fmt: skip

    @staticmethod
    def tinyllama_infill() -> ServerProcess:
        return _preset(
            "ggml-org/test-model-stories260K-infill", "tinyllama-infill", 2048, 1024, 1,
            n_predict=64, temperature=0.0,
        )  # fmt: skip

    @staticmethod
    def stories15m_moe() -> ServerProcess:
        return _preset(
            "ggml-org/stories15M_MOE", "stories15m-moe", 2048, 1024, 1,
            n_predict=64, temperature=0.0,
        )  # fmt: skip

    @staticmethod
    def jina_reranker_tiny() -> ServerProcess:
        return _preset(
            "ggml-org/models jina-reranker-v1-tiny-en", "jina-reranker", 512, 512, 1,
            server_reranking=True,
        )  # fmt: skip

    @staticmethod
    def tinygemma3() -> ServerProcess:
        return _preset("ggml-org/tinygemma3-GGUF:Q8_0", "tinygemma3", 1024, 512, 2, n_predict=4)

    @staticmethod
    def router() -> ServerProcess:
        return _preset("no model (router)", None, 1024, 16, 1, n_predict=16, model_hf_repo=None)


def parallel_function_calls(
    function_list: List[Tuple[Callable[..., Any], Tuple[Any, ...]]],  # noqa: UP006
) -> List[Any]:  # noqa: UP006
    """Runs the calls at once; results in order, None for a call that raised."""
    results: list[Any] = [None] * len(function_list)
    errors: list[tuple[int, str]] = []

    def run(index: int, fn: Callable[..., Any], args: Tuple[Any, ...]) -> None:  # noqa: UP006
        try:
            results[index] = fn(*args)
        except Exception as exc:
            errors.append((index, str(exc)))

    with ThreadPoolExecutor() as pool:
        for future in as_completed(
            [pool.submit(run, i, f, a) for i, (f, a) in enumerate(function_list)]
        ):
            future.result()
    for index, error in errors:
        print(f"Function at index {index}: {error}")
    return results


def match_regex(regex: str, text: str) -> bool:
    flags = re.IGNORECASE | re.MULTILINE | re.DOTALL
    return re.compile(regex, flags=flags).search(text) is not None


def download_file(url: str, output_file_path: str | None = None) -> str:
    raise NotOffered(f"the peer run downloads nothing ({url})")


def is_slow_test_allowed() -> bool:
    return os.environ.get("SLOW_TESTS") in ("1", "ON")
