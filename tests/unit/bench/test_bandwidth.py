"""Decode bandwidth utilization: the arithmetic on hand-made requests, and its place in
`orin-llm bench`'s table and JSON against the fake servers of test_loadgen."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from orin.bench.bandwidth import (
    BandwidthRequest,
    at_rate,
    bytes_per_step,
    decode_load,
    describe,
    is_local,
    machine_bandwidth,
    model_source,
    union_seconds,
    utilization,
)
from orin.bench.stats import RequestResult
from orin.cli import bench as bench_cli
from orin.model.gguf import ModelInfo, read_model_info
from orin.model.traffic import decode_bytes_per_batch, decode_bytes_per_step
from orin.system import membw
from orin.system.membw import GB, Bandwidth
from tests.fakes.boards_system import x86_machine
from tests.ggufutil import write_gguf
from tests.unit.bench.test_loadgen import Answer, FakeServer, Seen, bench, serving

N_EMBD = 64


def req(
    i: int, start_s: float, ttft: float, e2el: float, n_out: int, prompt: int = 16
) -> RequestResult:
    return RequestResult(
        i, prompt, True, prompt_tokens=prompt, output_tokens=n_out, count_source="usage",
        ttft_ms=ttft, e2el_ms=e2el, start_s=start_s,
    )  # fmt: skip


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    params = {
        "block_count": 2,
        "embedding_length": N_EMBD,
        "feed_forward_length": 128,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "context_length": 4096,
    }
    tensors = {
        "token_embd.weight": np.zeros((100, N_EMBD), np.float32),
        "output.weight": np.zeros((100, N_EMBD), np.float16),
        "blk.0.ffn_up.weight": np.zeros((128, N_EMBD), np.float16),
        "blk.1.ffn_up.weight": np.zeros((128, N_EMBD), np.float16),
    }
    return write_gguf(tmp_path / "m.gguf", params=params, tensors=tensors)


@pytest.fixture
def info(gguf: Path) -> ModelInfo:
    return read_model_info(gguf)


def test_one_stream_runs_at_its_tpot() -> None:
    # one after another: 10 steps in 1.0 s, then 10 steps in 0.5 s
    load = decode_load([req(0, 0.0, 100, 1100, 11), req(1, 2.0, 100, 600, 11)])
    assert load is not None
    assert load.steps == 20 and load.seconds == pytest.approx(1.5)
    assert load.streams == pytest.approx(1.0)
    assert load.steps_per_s == pytest.approx(20 / 1.5)  # 1000 / TPOT pooled over tokens
    # each step j = 1..10 attends the 16 prompt cells and j more: 16 + 5.5
    assert load.mean_kv_cells == pytest.approx(21.5)


def test_overlapping_streams_share_the_steps() -> None:
    # two streams decode side by side for 1 s, then one alone for 1 s
    load = decode_load([req(0, 0.0, 0, 1000, 11), req(1, 0.0, 0, 2000, 21, prompt=36)])
    assert load is not None
    assert load.streams == pytest.approx(3.0 / 2.0)
    assert load.steps_per_s == pytest.approx(30 / 3.0)
    assert load.mean_kv_cells == pytest.approx((10 * (16 + 5.5) + 20 * (36 + 10.5)) / 30)


def test_requests_without_decode_steps_are_left_out() -> None:
    failed = RequestResult(0, 16, False, "timeout")
    assert decode_load([failed, req(1, 0.0, 100, 100, 1)]) is None
    assert union_seconds([(0, 1), (0.5, 2), (3, 4), (3.5, 3.6)]) == pytest.approx(3.0)


def test_utilization_arithmetic(info: ModelInfo) -> None:
    results = [req(0, 0.0, 0, 1000, 11), req(1, 0.0, 0, 1000, 11)]  # 2 streams, 10 steps/s
    bw = Bandwidth(1 * GB, "given")
    u = utilization(results, info, "f16", "f16", bw)
    assert u is not None
    per_step = decode_bytes_per_batch(info, [22, 22], "f16", "f16")  # round(16 + 5.5)
    assert u.bytes_per_step == per_step and u.steps_per_s == pytest.approx(10)
    assert u.achieved_bytes_per_s == pytest.approx(10 * per_step)
    assert u.utilization == pytest.approx(10 * per_step / GB)
    j = u.to_json()
    assert j["decode_bytes_per_step"] == per_step
    assert j["achieved_gb_per_s"] == pytest.approx(10 * per_step / GB)
    assert j["utilization_pct"] == pytest.approx(100 * 10 * per_step / GB)
    assert (j["mem_bandwidth_gb_per_s"], j["mem_bandwidth_source"]) == (1.0, "given")
    assert "of 1.0 GB/s (given)" in describe(u)


def test_a_single_stream_uses_decode_bytes_per_step(info: ModelInfo) -> None:
    u = at_rate(info, 1, 100, 25.0, "q8_0", "q8_0", Bandwidth(0.0, "unknown"))
    assert u.bytes_per_step == decode_bytes_per_step(info, 100, "q8_0", "q8_0")
    assert u.utilization is None and u.to_json()["utilization_pct"] is None
    assert "memory bandwidth unknown" in describe(u)


def test_fractional_streams_interpolate(info: ModelInfo) -> None:
    one = decode_bytes_per_batch(info, [50], "f16", "f16")
    two = decode_bytes_per_batch(info, [50, 50], "f16", "f16")
    assert bytes_per_step(info, 1.25, 50, "f16", "f16") == pytest.approx(one + 0.25 * (two - one))
    assert bytes_per_step(info, 0.5, 50, "f16", "f16") == one  # never below one stream


def test_where_the_model_and_kv_types_come_from(gguf: Path, tmp_path: Path) -> None:
    src, why = model_source(gguf, {"type_k": "q8_0", "type_v": "q4_0"})
    assert src is not None and why is None
    assert (src.path, src.type_k, src.type_v, src.source) == (gguf, "q8_0", "q4_0", "--model-file")
    src, _ = model_source(None, {"file": str(gguf)}, type_v="Q8_0")
    assert src is not None and (src.type_k, src.type_v, src.source) == ("f16", "q8_0", "server")
    src, why = model_source(None, {"file": str(tmp_path / "elsewhere.gguf")})
    assert src is None and why is not None and "not on this machine" in why
    src, why = model_source(None, {})
    assert src is None and why is not None and "--model-file" in why
    assert is_local("http://127.0.0.1:8080") and is_local("http://localhost:1/v1")
    assert not is_local("http://orin.local:8080")


def test_bench_reports_utilization_in_the_table_and_json(gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    with serving(FakeServer(usage=True)) as url:
        args = [
            "--url", url, "--num-requests", "4", "--input-len", "8", "--output-len", "6",
            "--concurrency", "1", "--model-file", str(gguf), "--mem-bandwidth", "0.5",
            "--cache-type-k", "q8_0", "--output", str(out),
        ]  # fmt: skip
        result = CliRunner().invoke(bench_cli.app, args)
    assert result.exit_code == 0, result.output
    for label in ("decode memory traffic", "decode bytes per step", "achieved GB/s"):
        assert label in result.output
    assert "bandwidth utilization" in result.output and "(given)" in result.output
    b = json.loads(out.read_text())["bandwidth"]
    assert (b["type_k"], b["type_v"], b["model_file"]) == ("q8_0", "f16", str(gguf))
    assert b["decode_streams"] == pytest.approx(1.0)
    assert b["mean_kv_cells"] == pytest.approx(8 + 3)  # prompt of 8 plus half of 6
    info = read_model_info(gguf)
    assert b["decode_bytes_per_step"] == decode_bytes_per_step(info, 11, "q8_0", "f16")
    achieved = b["decode_bytes_per_step"] * b["decode_steps_per_s"] / GB
    assert b["achieved_gb_per_s"] == pytest.approx(achieved)
    assert b["utilization_pct"] == pytest.approx(100 * achieved / 0.5)
    assert b["mem_bandwidth_gb_per_s"] == 0.5 and b["note"] is None


def test_without_a_model_file_the_json_says_why() -> None:
    r = bench(FakeServer(usage=True))
    assert r.bandwidth is None
    assert r.to_json()["bandwidth"] == {
        "note": "no model file: give --model-file PATH for the bandwidth figures"
    }


def test_an_orin_llm_server_names_its_model_and_kv_types(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file and KV types come from /v1/models; a server on this machine is compared
    with this machine's bandwidth (the copy probe, cached under the user cache dir)."""
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[int] = []

    def fake_copy(nbytes: int, reps: int = 5, threads: int | None = None) -> float:
        calls.append(nbytes)
        return 8 * GB

    monkeypatch.setattr(membw, "copy_bandwidth", fake_copy)
    board, _ = x86_machine(tmp_path / "root")  # this machine, as far as the bench can tell
    monkeypatch.setattr(membw, "SysRoot", lambda: board.root)
    fake = FakeServer(usage=True)
    meta: dict[str, Any] = {"file": str(gguf), "type_k": "q8_0", "type_v": "q8_0"}

    def orin_llm(seen: Seen) -> Answer:
        if seen.path == "/v1/models":
            return Answer(body={"data": [{"id": "m", "owned_by": "orin-llm", "meta": meta}]})
        if seen.path == "/metrics":
            return Answer(404, {})
        return fake(seen)

    r = bench(orin_llm)
    assert r.server.kind == "orin-llm" and r.bandwidth is not None
    j = r.to_json()["bandwidth"]
    assert (j["type_k"], j["type_v"], j["model_file"]) == ("q8_0", "q8_0", str(gguf))
    assert (j["mem_bandwidth_source"], j["mem_bandwidth_gb_per_s"]) == ("probe", 8.0)
    assert j["utilization_pct"] == pytest.approx(100 * j["achieved_gb_per_s"] / 8)
    assert len(calls) == 1 and (tmp_path / "cache" / "membw.json").exists()


def test_a_remote_server_needs_its_bandwidth_given(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(nbytes: int, reps: int = 5, threads: int | None = None) -> float:
        raise AssertionError("this machine is not the server's")

    monkeypatch.setattr(membw, "copy_bandwidth", never)
    remote = machine_bandwidth(BandwidthRequest(), "http://orin.local:8080")
    assert (remote.known, remote.source) == (False, "unknown")
    assert "--mem-bandwidth" in remote.detail
    given = machine_bandwidth(BandwidthRequest(mem_bandwidth_gbps=204.8), "http://orin.local:80")
    assert (given.bytes_per_s, given.source) == (pytest.approx(204.8 * GB), "given")


def test_an_unknown_cache_type_is_a_usage_error() -> None:
    args = ["--url", "http://127.0.0.1:9", "--concurrency", "1", "--cache-type-k", "q7"]
    result = CliRunner().invoke(bench_cli.app, args)
    assert result.exit_code == 2 and "q8_0" in result.output
