"""`make serve` listens where it is told: HOST and PORT, or ORIN_LLM_HOST and
ORIN_LLM_PORT in the environment, as `orin-llm serve` reads them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def serve_line(*args: str, **env: str) -> str:
    """The command `make serve` would run (make -n: nothing runs, nothing is built)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ORIN_LLM_", "MAKE"))}
    done = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "serve", *args],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (line,) = [x for x in done.stdout.splitlines() if " serve " in x]
    return line


def test_make_serve_defaults_to_the_profiles_address() -> None:
    assert serve_line(HOST="a-machine-name").endswith("serve --host 127.0.0.1 --port 8080")


def test_make_serve_takes_host_and_port() -> None:
    assert serve_line("HOST=0.0.0.0", "PORT=8081").endswith("serve --host 0.0.0.0 --port 8081")


def test_make_serve_takes_the_environment_of_orin_llm_serve() -> None:
    line = serve_line(ORIN_LLM_HOST="0.0.0.0", ORIN_LLM_PORT="8082")
    assert line.endswith("serve --host 0.0.0.0 --port 8082")
