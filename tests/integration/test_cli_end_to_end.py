"""The CLI as a user runs it: a real process on a generated model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.llama


def orin_llm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orin", *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=300,
    )


def test_demo_then_inspect_says_q4_k_m(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    made = orin_llm("model", "demo", "--size", "small", "--quant", "q4_k_m", "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(out)
    assert made.stderr == ""  # llama.cpp's quantizer log stays out of the user's way
    shown = orin_llm("model", "inspect", str(out), "--json")
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["quantization"] == "Q4_K_M"
    assert info["architecture"] == "llama"
    assert info["has_chat_template"] is True
    assert {t["type"] for t in info["tensor_types"]} >= {"Q4_K", "F32"}


def test_plan_on_a_generated_model(small_q4km: Path) -> None:
    r = orin_llm(
        "model",
        "plan",
        str(small_q4km),
        "--ctx",
        "4096",
        "--slots",
        "4",
        "--kv-type-k",
        "q8_0",
        "--kv-type-v",
        "q8_0",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["cells"] == 4 * 4096
    assert plan["kv_bytes"] > 0 and plan["fits"] is True


def test_inspect_passwd_is_one_line_error() -> None:
    r = orin_llm("model", "inspect", "/etc/passwd")
    assert r.returncode == 3
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and "not a GGUF file" in r.stderr


def test_truncated_model_is_one_line_error(small_q4km: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small_q4km.read_bytes()[:100_000])
    r = orin_llm("model", "inspect", str(cut))
    assert r.returncode == 3
    assert r.stderr.count("\n") == 1 and "truncated" in r.stderr


def test_validate_demo_profile_against_its_model(small_q4km: Path) -> None:
    r = orin_llm("profile", "validate", "demo", "--model", str(small_q4km), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["valid"] is True
    assert (report["type_k"], report["type_v"]) == ("q8_0", "q8_0")
