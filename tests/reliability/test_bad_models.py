"""Broken model files never crash a process: inspect, doctor and serve say what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orin.model import demo
from tests.ggufutil import LLAMA2_7B, write_gguf
from tests.serverutil import free_port

pytestmark = pytest.mark.reliability


def bad_models(tmp: Path) -> dict[str, Path]:
    good = demo.ensure("tiny", "f16").read_bytes()
    files = {
        "truncated": good[: len(good) // 2],
        "zero-byte": b"",
        "wrong-magic": b"GGML" + good[4:],
        "header-only": good[:24],
    }
    out = {name: tmp / f"{name}.gguf" for name in files}
    for name, data in files.items():
        out[name].write_bytes(data)
    out["missing-metadata"] = write_gguf(
        tmp / "mamba.gguf", arch="mamba", params={"block_count": 2}
    )
    # a tensor table that declares far more data than the file holds
    huge = write_gguf(
        tmp / "huge.gguf",
        params=LLAMA2_7B,
        tensors={"token_embd.weight": np.ones((64, 64), np.float32)},
    )
    raw = bytearray(huge.read_bytes())
    dims = np.array([64, 64], dtype=np.uint64).tobytes()
    at = raw.find(dims)
    raw[at : at + 16] = np.array([1 << 20, 1 << 20], dtype=np.uint64).tobytes()
    huge.write_bytes(bytes(raw))
    out["huge-declared-tensor"] = huge
    return out


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orin", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return bad_models(tmp_path_factory.mktemp("bad"))


KINDS = [
    "truncated",
    "zero-byte",
    "wrong-magic",
    "header-only",
    "missing-metadata",
    "huge-declared-tensor",
]


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_says_what_is_wrong(models: dict[str, Path], kind: str) -> None:
    r = run("model", "inspect", str(models[kind]))
    assert r.returncode == 3, r.stderr
    assert r.stderr.count("\n") == 1 and str(models[kind]) in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_doctor_reports_the_model_file(models: dict[str, Path], kind: str) -> None:
    r = run("doctor", "--model", str(models[kind]), "--json")
    assert r.returncode == 1, r.stdout + r.stderr  # a failing check, not a crash
    assert "Traceback" not in r.stderr and '"model-file"' in r.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_serve_exits_with_a_clear_error(models: dict[str, Path], kind: str) -> None:
    r = run("serve", "--model", str(models[kind]), "--port", str(free_port()))
    assert r.returncode not in (0, -11, 139), r.stderr  # no success, no segfault
    assert "Traceback" not in r.stderr
    assert str(models[kind]) in r.stderr


def misplaced_and_fifo(tmp: Path) -> dict[str, Path]:
    """A real model whose second tensor's data offset is 32 bytes off (llama.cpp: 'has
    offset X, expected Y'), and a FIFO where the model belongs."""
    from orin.model.ggufread import open_gguf

    good = demo.ensure("tiny", "f16")
    with open_gguf(good) as contents:
        second = contents.tensors[1]
        relative = second.data_offset - contents.data_start
    raw = bytearray(good.read_bytes())
    at = raw.find(relative.to_bytes(8, "little"), 0, contents.data_start)
    raw[at : at + 8] = (relative + 32).to_bytes(8, "little")
    misplaced = tmp / "misplaced.gguf"
    misplaced.write_bytes(bytes(raw))
    fifo = tmp / "fifo.gguf"
    os.mkfifo(fifo)
    return {"misplaced-tensor": misplaced, "fifo": fifo}


@pytest.mark.parametrize("kind", ["misplaced-tensor", "fifo"])
def test_serve_refuses_what_llama_cpp_would_before_starting(tmp_path: Path, kind: str) -> None:
    path = misplaced_and_fifo(tmp_path)[kind]
    r = run("serve", "--model", str(path), "--port", str(free_port()), "--telemetry", "off")
    assert r.returncode == 3, r.stderr
    assert r.stderr.count("\n") == 1 and str(path) in r.stderr
    r = run("model", "inspect", str(path))
    assert r.returncode == 3 and r.stderr.count("\n") == 1, r.stderr
