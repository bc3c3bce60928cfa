"""`orin-llm model pull` end to end against a hub stand-in on loopback: an interrupted
download resumed by the next pull with a Range request, a corrupted one refused, and a
pulled model served through a profile's ``hf:`` reference."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from orin.cli.app import app
from orin.cli.deps import Deps
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile, resolve_model_path
from tests.fakes.runner import FakeRunner
from tests.ggufutil import LLAMA2_7B, write_gguf
from tests.serverutil import live_server
from tests.unit.model.fakehub import FakeHub, point_at, serve

REPO = "acme/Big-GGUF"
FILE = "Big-Q8_0.gguf"
MiB = 1 << 20
MOSTLY_Q8_0 = 7


@pytest.fixture
def hub_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with serve(FakeHub()) as h:
        point_at(h, monkeypatch, tmp_path / "hf-home")
        monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path / "cache"))
        yield h


def pull(*args: str) -> tuple[int, str, str]:
    deps = Deps(runner=FakeRunner(), effective_uid=lambda: 1000)
    r = CliRunner().invoke(app, ["model", "pull", *args], env={"COLUMNS": "200"}, obj=deps)
    return r.exit_code, r.stdout, r.stderr


def test_an_interrupted_pull_resumes_where_it_stopped(hub_env: FakeHub, tmp_path: Path) -> None:
    # 12 MiB: huggingface_hub writes in 10 MiB blocks, so a cut at 11 MiB leaves 10 on disk
    weights = {"w": np.arange(3 * MiB, dtype=np.float32)}
    data = write_gguf(tmp_path / "src.gguf", params=LLAMA2_7B, file_type=MOSTLY_Q8_0,
                      tensors=weights).read_bytes()  # fmt: skip
    hub_env.repos[REPO] = {FILE: data}
    hub_env.cut_after = 11 * MiB  # the first GET stops there; the hub is down afterwards
    models = tmp_path / "models"

    code, out, err = pull(f"{REPO}:Q8_0", "--dir", str(models))
    assert code == 9 and "run the same pull again to resume" in err
    assert not (models / FILE).exists()
    (part,) = (models / ".partial").iterdir()
    kept = part.stat().st_size
    assert 0 < kept < len(data) and part.read_bytes() == data[:kept]

    hub_env.down = False
    code, out, err = pull(f"{REPO}:Q8_0", "--dir", str(models))
    assert code == 0, err
    assert hub_env.gets()[-1].range == f"bytes={kept}-"
    assert f"resumed at {kept / MiB:.2f} MiB" in out
    pulled = models / FILE
    assert hashlib.sha256(pulled.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
    assert read_model_info(pulled).quantization == "Q8_0"
    assert not (models / ".partial").exists()


def test_a_server_that_ignores_range_restarts_the_file_and_says_so(
    hub_env: FakeHub, tmp_path: Path
) -> None:
    """A mirror that answers a Range request with the whole file: the part is started
    over (huggingface_hub truncates it), and the pull does not claim to have resumed."""
    data = write_gguf(tmp_path / "src.gguf", params=LLAMA2_7B, file_type=MOSTLY_Q8_0,
                      tensors={"w": np.arange(3 * MiB, dtype=np.float32)}).read_bytes()  # fmt: skip
    hub_env.repos[REPO] = {FILE: data}
    hub_env.cut_after = 11 * MiB
    models = tmp_path / "models"
    assert pull(f"{REPO}:Q8_0", "--dir", str(models))[0] == 9
    hub_env.down, hub_env.no_range = False, True
    code, out, err = pull(f"{REPO}:Q8_0", "--dir", str(models), "--json")
    assert code == 0, err
    assert json.loads(out)["resumed_from"] == 0
    assert (
        hashlib.sha256((models / FILE).read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
    )


def test_a_dropped_download_is_reported_once_per_retry(hub_env: FakeHub, tmp_path: Path) -> None:
    """`orin-llm model pull` as a person runs it (its own process, the CLI's logging): the
    warning huggingface_hub gives when it resumes a dropped download is one line in the
    CLI's format, not that line and a plain copy of it from the library's own handler."""
    data = write_gguf(tmp_path / "src.gguf", params=LLAMA2_7B, file_type=MOSTLY_Q8_0,
                      tensors={"w": np.arange(MiB, dtype=np.float32)}).read_bytes()  # fmt: skip
    hub_env.repos[REPO] = {FILE: data}
    hub_env.cut_after = MiB  # then 503 until the end: one resume is tried, and fails
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "COLUMNS": "400"}
    done = subprocess.run(
        [sys.executable, "-m", "orin", "model", "pull", f"{REPO}:{FILE}",
         "--dir", str(tmp_path / "models")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 9, done.stderr
    lines = done.stderr.splitlines()
    dropped = [line for line in lines if "Error while downloading from" in line]
    assert dropped and all(line.startswith("WARNING huggingface_hub") for line in dropped), lines
    assert lines[-1].startswith("orin-llm: ") and "run the same pull again to resume" in lines[-1]


def test_a_corrupted_download_is_refused(hub_env: FakeHub, tmp_path: Path) -> None:
    data = write_gguf(tmp_path / "src.gguf", params=LLAMA2_7B, file_type=MOSTLY_Q8_0).read_bytes()
    hub_env.repos[REPO] = {FILE: data}
    hub_env.sha_override[f"{REPO}/{FILE}"] = hashlib.sha256(b"other bytes").hexdigest()
    models = tmp_path / "models"
    code, out, err = pull(f"{REPO}:{FILE}", "--dir", str(models))
    assert code == 9 and out == ""
    assert "refused and deleted" in err
    assert [p for p in models.rglob("*") if p.is_file()] == []


@pytest.mark.llama
def test_a_pulled_model_is_served_through_its_profile(
    hub_env: FakeHub, tmp_path: Path, tiny_f16: Path
) -> None:
    hub_env.repos["acme/Tiny-GGUF"] = {"tiny-F16.gguf": tiny_f16.read_bytes()}
    profile = parse_profile("name: t\nmodel: {hf: 'acme/Tiny-GGUF:F16'}\n")
    with pytest.raises(Exception, match="orin-llm model pull acme/Tiny-GGUF:F16"):
        resolve_model_path(profile)
    code, _, err = pull("acme/Tiny-GGUF:F16")  # into the user cache, where profiles look
    assert code == 0, err
    path = resolve_model_path(profile)
    assert path == tmp_path / "cache" / "models" / "tiny-F16.gguf"
    gets = len(hub_env.gets())
    with live_server(path, "engine: {n_ctx: 256, slots: 1}\n") as (base, _):
        r = httpx.post(
            f"{base}/v1/completions",
            json={"prompt": "hello", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert len(hub_env.gets()) == gets  # serving never asked the hub
