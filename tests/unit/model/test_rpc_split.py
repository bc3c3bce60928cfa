"""The layer split across RPC workers and the local GPU, as llama.cpp makes it: the
offloaded layers in proportion to each device's free memory, devices in order."""

from __future__ import annotations

from pathlib import Path

from orin.model.gguf import read_model_info
from orin.model.memplan import layer_split, plan_memory, split_bytes
from orin.profile.fit import rpc_fit
from tests.ggufutil import LLAMA2_7B, write_gguf

GiB = 1 << 30


def test_layers_follow_free_memory_in_device_order() -> None:
    # 32 layers + the output (33 parts) over two equal workers: layer il goes to the
    # first device whose cumulative share exceeds il / 33, so the first takes 17 and
    # the second 15 and the output
    assert layer_split(32, [8 * GiB, 8 * GiB]) == (0, [17, 15])
    # a worker with three times the free memory takes about three times the layers
    assert layer_split(32, [24 * GiB, 8 * GiB]) == (0, [25, 7])
    assert layer_split(32, [GiB, GiB, GiB, GiB]) == (0, [9, 8, 8, 7])


def test_layers_not_offloaded_stay_on_the_cpu() -> None:
    # gpu_layers counts the output: 17 offloaded leaves 16 repeating layers on the CPU
    assert layer_split(32, [GiB, GiB], gpu_layers=17) == (16, [9, 7])
    assert layer_split(32, [GiB], gpu_layers=0) == (32, [0])
    assert layer_split(32, []) == (32, [])


def test_devices_that_report_no_memory_share_equally() -> None:
    assert layer_split(8, [0, 0]) == (0, [5, 3])


def test_a_worker_too_small_for_its_share_fails_the_fit(tmp_path: Path) -> None:
    info = read_model_info(write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15))
    plan = plan_memory(info, 4096, 1, "q8_0", "q8_0", None)
    shares = split_bytes(plan, info.n_layer, [17, 15])
    whole = plan.weights_bytes + plan.kv_bytes  # the header-only file has no weights
    assert shares[0] > shares[1] and abs(sum(shares) - whole) <= whole * 0.01
    ok = rpc_fit(plan, info.n_layer, [("RPC0", 8 * GiB), ("RPC1", 8 * GiB)])
    assert ok.severity == "ok" and "RPC0: 17 layers" in ok.found
    # the split follows free memory, so a small worker takes few layers; together the
    # devices must still hold everything
    small = rpc_fit(plan, info.n_layer, [("RPC0", 8 * GiB), ("RPC1", GiB // 8)])
    assert small.severity == "ok" and "RPC1: 0 layers" in small.found
    tight = rpc_fit(plan, info.n_layer, [("RPC0", GiB // 2), ("RPC1", GiB // 4)])
    assert tight.severity == "fail" and "over" in tight.fix


def test_a_model_too_large_for_this_board_alone_only_warns_with_workers(tmp_path: Path) -> None:
    from orin.profile.fit import memory_fit
    from orin.profile.schema import EngineSection

    info = read_model_info(write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15))
    alone = memory_fit(info, EngineSection(n_ctx=4096, slots=1), "q8_0", "q8_0", True, GiB // 2)
    assert alone.severity == "fail"
    split = EngineSection(n_ctx=4096, slots=1, rpc=["10.0.0.2:50052"])
    fit = memory_fit(info, split, "q8_0", "q8_0", True, GiB // 2)
    assert fit.severity == "warn" and "1 RPC worker(s)" in fit.found
