"""Every generated architecture through inspect, plan, llama.cpp's allocation and the engine.

The models come from tests/archmodels.py (generated once per session); each is
read by the planner, run through ``orin-llm model inspect`` and ``model plan``,
loaded by llama.cpp to compare the planned KV bytes with what it allocates, and
served by the engine with two slots at once.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from orin.cli.app import app
from orin.cli.deps import Deps
from orin.engine.config import EngineConfig, engine_config
from orin.engine.engine import Engine
from orin.engine.errors import ContextShiftUnsupported
from orin.engine.stream import Completion
from orin.engine.types import SamplingParams
from orin.llamacpp import capture_log
from orin.model.gguf import read_model_info
from orin.model.memplan import kv_caches, plan_memory, recurrent_state_bytes
from orin.profile.loader import parse_profile
from tests import archmodels
from tests.fakes.board import FakeBoard, GiB
from tests.integration.test_plan_vs_llamacpp import (
    BUFFER_LINE,
    RS_LINE,
    MiB,
    llama_context,
    mib,
    reported_kv_caches,
)

pytestmark = pytest.mark.llama

ARCHS = tuple(archmodels.SPECS)
ATTENTION = archmodels.ATTENTION_ARCHS
SWA = ("gemma2", "gemma3")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return archmodels.ensure(tmp_path_factory.getbasetemp() / "archmodels")


def config(path: Path, engine: str, context: str = "{}") -> EngineConfig:
    profile = parse_profile(f"name: t\nengine: {engine}\ncontext: {context}\n")
    return engine_config(profile, path, read_model_info(path))


def context_yaml(arch: str) -> str:
    """qwen2vl's multi-section RoPE cannot shift positions: no sliding window for it."""
    return "{sliding: false}" if arch == "qwen2vl" else "{}"


# -- orin-llm model inspect / plan --------------------------------------------------


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), obj=Deps(), env={"COLUMNS": "240"})
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_shows_the_layout(models: dict[str, Path], arch: str) -> None:
    info = read_model_info(models[arch])
    code, out, err = invoke("model", "inspect", str(models[arch]), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["architecture"] == arch
    assert data["kv_layout"] == info.kv_layout
    assert data["kv_exact"] is (arch != "mamba")
    code, out, err = invoke("model", "inspect", str(models[arch]))
    assert code == 0, err
    assert f"│ {info.kv_layout}" in out
    if arch in SWA:
        assert f"{info.sliding_window} tokens on {info.n_swa_layers} of {info.n_layer}" in out
    if arch == "qwen3moe":
        assert "2 of 4 per token, 64 FFN each" in out
    if arch == "phi3":
        assert "none (llama.cpp ignores the file's 2047)" in out
    if arch == "mamba":
        assert "recurrent (planner estimates)" in out


@pytest.mark.parametrize("arch", ARCHS)
def test_plan_through_the_cli(models: dict[str, Path], arch: str, board: FakeBoard) -> None:
    board.meminfo(total=64 * GiB, available=8 * GiB)
    info = read_model_info(models[arch])
    args = ("model", "plan", str(models[arch]), "--ctx", "1024", "--slots", "2")
    code, out, err = invoke(
        *args, "--ubatch", "32", "--swa-full", "--json", "--root", str(board.base)
    )
    assert code == 0, err
    data = json.loads(out)
    want = plan_memory(info, 1024, 2, available=8 * GiB, n_ubatch=32, swa_full=True)
    assert (data["kv_k_bytes"], data["kv_v_bytes"]) == (want.kv_k_bytes, want.kv_v_bytes)
    assert data["total_bytes"] == want.total_bytes and data["fits"] is True
    assert data["kv_estimated"] is (arch == "mamba")
    assert ("kv_k_bytes" in data["estimated"]) is (arch == "mamba")
    assert len(data["kv_caches"]) == {"mamba": 0, "gemma2": 2, "gemma3": 2}.get(arch, 1)
    code, out, err = invoke(*args, "--ubatch", "32", "--swa-full", "--root", str(board.base))
    assert code == 0, err
    assert ("KV cache K (estimate)" in out) is (arch == "mamba")
    assert ("KV figures are estimates for the 'recurrent' layout" in err) is (arch == "mamba")
    if arch in SWA:
        assert "without it (--no-swa-full, the default) they hold only the window" in err
        code, out, err = invoke(*args, "--no-swa-full", "--root", str(board.base), "--json")
        assert code == 0, err
        windowed = json.loads(out)
        assert windowed["kv_bytes"] < data["kv_bytes"]
        assert windowed["kv_caches"][1]["cells_per_seq"] == 768  # pad256(window 128 + ubatch 512)


# -- KV bytes against llama.cpp's own allocation -------------------------------------

KV_CASES = [
    # (arch, ctx, slots, type_k, type_v, flash_attn, swa_full, n_ubatch)
    *[(a, 1024, 1, "f16", "f16", True, True, 32) for a in ATTENTION],
    *[(a, 1000, 3, "q8_0", "q8_0", True, True, 32) for a in ATTENTION],
    *[(a, 4096, 2, "f16", "q4_0", True, True, 32) for a in ATTENTION],
    # the window cache: ctx far beyond the window, several slots, micro-batch padding
    *[(a, 1024, 1, "f16", "f16", True, False, 32) for a in SWA],
    *[(a, 4096, 3, "q8_0", "q8_0", True, False, 64) for a in SWA],
    *[(a, 2048, 2, "f16", "f16", True, False, 512) for a in SWA],
    *[(a, 200, 2, "f16", "f16", True, False, 512) for a in SWA],
    # V stored transposed and padded to the widest layer (per-layer heads) without FA
    *[(a, 1024, 2, "f16", "f16", False, True, 32) for a in ("deci", "qwen3", "gemma3")],
    ("gemma3", 2048, 2, "f16", "f16", False, False, 32),
]


@pytest.mark.parametrize(
    ("arch", "ctx", "slots", "type_k", "type_v", "flash_attn", "swa_full", "n_ubatch"), KV_CASES
)
def test_kv_bytes_equal_llama_cpp(
    models: dict[str, Path],
    arch: str,
    ctx: int,
    slots: int,
    type_k: str,
    type_v: str,
    flash_attn: bool,
    swa_full: bool,
    n_ubatch: int,
) -> None:
    info = read_model_info(models[arch])
    with (
        capture_log() as lines,
        llama_context(
            models[arch], ctx, slots, type_k, type_v, n_ubatch, flash_attn, swa_full, n_batch=512
        ),
    ):
        pass
    reported = reported_kv_caches("".join(lines))
    planned = kv_caches(info, ctx, slots, type_k, type_v, n_ubatch, 512, flash_attn, swa_full)
    assert len(reported) == len(planned)
    for got, want in zip(reported, planned, strict=True):
        assert (got.cells, got.layers, got.streams) == (want.cells_per_seq, want.layers, slots)
        assert (got.type_k, got.type_v) == (type_k, type_v)
        assert (got.k_mib, got.v_mib) == (mib(want.k_bytes), mib(want.v_bytes))
        assert got.total_mib == mib(want.total)
    plan = plan_memory(info, ctx, slots, type_k, type_v, None, n_ubatch, flash_attn, 512, swa_full)
    assert plan.kv_bytes == sum(c.total for c in planned)


@pytest.mark.parametrize("slots", [1, 3])
def test_recurrent_state_estimate_matches_mamba(models: dict[str, Path], slots: int) -> None:
    info = read_model_info(models["mamba"])
    with capture_log() as lines, llama_context(models["mamba"], 1024, slots):
        pass
    m = RS_LINE.search("".join(lines))
    assert m, "llama.cpp did not report its recurrent state"
    _, cells, layers, seqs, r_mib, s_mib = m.groups()
    assert (int(cells), int(layers), int(seqs)) == (slots, info.n_layer, slots)
    state = info.recurrent_state
    assert state is not None
    r = info.n_layer * state.r * 4 * slots
    s = info.n_layer * state.s * 4 * slots
    assert (r_mib, s_mib) == (mib(r), mib(s))
    assert recurrent_state_bytes(info, slots) == r + s
    assert kv_caches(info, 1024, slots, "f16", "f16") == ()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    ("ctx", "slots", "n_ubatch", "flash_attn"), [(2048, 4, 128, True), (4096, 1, 512, False)]
)
def test_compute_estimate_covers_llama_cpp_buffers(
    models: dict[str, Path], arch: str, ctx: int, slots: int, n_ubatch: int, flash_attn: bool
) -> None:
    info = read_model_info(models[arch])
    with (
        capture_log() as lines,
        llama_context(models[arch], ctx, slots, n_ubatch=n_ubatch, flash_attn=flash_attn),
    ):
        pass
    reported = sum(float(x) for x in BUFFER_LINE.findall("".join(lines))) * MiB
    assert reported > 0
    # llama_context keeps llama.cpp's own default, swa_full on
    estimate = plan_memory(
        info, ctx, slots, n_ubatch=n_ubatch, flash_attn=flash_attn, swa_full=True
    )
    # an estimate that errs high, but not wildly
    assert reported <= estimate.compute_bytes <= 2.5 * reported + 0.01 * MiB


def test_the_engine_allocates_what_the_plan_says(models: dict[str, Path]) -> None:
    """The planner's defaults (swa_full off) are the engine's own context settings."""
    path = models["gemma3"]
    cfg = config(path, "{n_ctx: 1024, slots: 2, n_batch: 64, n_ubatch: 32}")
    with capture_log() as lines, Engine(cfg):
        pass
    info = read_model_info(path)
    planned = kv_caches(
        info, 1024, 2, cfg.type_k, cfg.type_v, cfg.n_ubatch, cfg.n_batch, cfg.flash_attn != "off"
    )
    reported = reported_kv_caches("".join(lines))
    assert [(r.cells, r.layers, r.k_mib, r.v_mib) for r in reported] == [
        (c.cells_per_seq, c.layers, mib(c.k_bytes), mib(c.v_bytes)) for c in planned
    ]
    assert planned[1].cells_per_seq < planned[0].cells_per_seq  # a window-sized cache


# -- the engine -----------------------------------------------------------------------


def prompts(engine: Engine, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = engine.tokenize("Edge inference on the board:")
    vocab = engine.backend.n_vocab if engine.backend else 0
    return [base + [rng.randrange(263, vocab) for _ in range(length)] for _ in range(n)]


def run_alone(cfg: EngineConfig, prompt: list[int]) -> Completion:
    with Engine(cfg.with_(slots=1)) as e:
        return e.generate(prompt, GREEDY)


def assert_same(got: Completion, want: Completion) -> None:
    assert got.finish_reason == want.finish_reason == "length"
    assert list(got.token_ids) == list(want.token_ids)
    np.testing.assert_allclose(
        [lp.logprob for lp in got.logprobs], [lp.logprob for lp in want.logprobs], atol=2e-3
    )


@pytest.fixture(params=ARCHS)
def two_slot_engine(request: pytest.FixtureRequest, models: dict[str, Path]) -> Iterator[Engine]:
    arch = request.param
    cfg = config(
        models[arch], "{n_ctx: 512, slots: 2, n_batch: 64, n_ubatch: 32}", context_yaml(arch)
    )
    with Engine(cfg) as e:
        yield e


def test_two_slots_concurrently_equal_each_request_alone(two_slot_engine: Engine) -> None:
    e = two_slot_engine
    asked = prompts(e, 2, 40, seed=1)
    streams = [e.submit(p, GREEDY) for p in asked]  # both in flight, batched together
    results = [s.result() for s in streams]
    for prompt, got in zip(asked, results, strict=True):
        assert len(got.token_ids) == 8
        assert_same(got, run_alone(e.cfg, prompt))


def test_a_model_whose_cache_cannot_shift_needs_the_window_off(models: dict[str, Path]) -> None:
    cfg = config(models["qwen2vl"], "{n_ctx: 256, slots: 1}")
    with pytest.raises(ContextShiftUnsupported, match=r"context\.sliding: false"), Engine(cfg):
        pass


FULL = "{n_ctx: 1024, slots: %d, n_batch: 64, n_ubatch: 64, swa_full: true}"
WINDOW = "{n_ctx: 1024, slots: %d, n_batch: 64, n_ubatch: 64}"


@pytest.mark.parametrize("arch", SWA)
def test_prefix_reuse_beyond_the_window_equals_a_fresh_engine(
    models: dict[str, Path], arch: str
) -> None:
    """With swa_full the window layers hold every cell of a 300-token prefix
    (window 128), so a second prompt sharing it reuses the first one's cells and
    its output must equal a fresh engine's."""
    cfg = config(models[arch], FULL % 1)
    with Engine(cfg) as e:
        shared = prompts(e, 1, 300, seed=2)[0]
        first, second = (shared + tail for tail in prompts(e, 2, 20, seed=3))
        e.generate(first, SamplingParams(max_tokens=200, temperature=0.0))
        reused = e.generate(second, GREEDY)
    assert reused.timings is not None and reused.timings.cached_tokens >= len(shared)
    assert_same(reused, run_alone(cfg, second))


@pytest.mark.parametrize("arch", SWA)
def test_a_window_cache_reuses_a_prefix_only_while_it_holds_its_cells(
    models: dict[str, Path], arch: str
) -> None:
    """Without swa_full the window cache (window + one micro-batch, padded to 256
    cells) drops old cells once a sequence runs past it: a prefix is reused while
    its last window is still held, and prefilled again after that (llama-server's
    rule), with the same output as a fresh engine either way."""
    cfg = config(models[arch], WINDOW % 1)
    assert cfg.swa_window == read_model_info(models[arch]).sliding_window
    with Engine(cfg) as e:
        shared = prompts(e, 1, 100, seed=2)[0]
        first, second, third = (shared + tail for tail in prompts(e, 3, 20, seed=3))
        e.generate(first, SamplingParams(max_tokens=4, temperature=0.0))
        held = e.generate(second, GREEDY)  # ~130 positions: nothing dropped yet
        e.generate(first, SamplingParams(max_tokens=400, temperature=0.0))
        dropped = e.generate(third, GREEDY)
    assert held.timings is not None and held.timings.cached_tokens >= len(shared)
    assert dropped.timings is not None and dropped.timings.cached_tokens == 0
    assert_same(held, run_alone(cfg, second))
    assert_same(dropped, run_alone(cfg, third))


@pytest.mark.parametrize("arch", SWA)
def test_a_busy_slots_cells_beyond_the_window_serve_a_new_prompt(
    models: dict[str, Path], arch: str
) -> None:
    """The second prompt takes a copy of the first slot's cells (llama_memory_seq_cp)
    while that slot still decodes; its window layers must see the shared prefix."""
    cfg = config(models[arch], FULL % 2)
    with Engine(cfg) as e:
        system = prompts(e, 1, 300, seed=5)[0]
        first = e.submit([*system, 500, 501], SamplingParams(max_tokens=300, temperature=0.0))
        next(iter(first))  # decoding: its slot holds the shared prefix
        second = e.generate([*system, 600], GREEDY)
        first.cancel()
    assert second.timings is not None and second.timings.cached_tokens >= len(system)
    assert_same(second, run_alone(cfg, [*system, 600]))


def test_recurrent_model_serves_a_second_request_on_the_same_slot(
    models: dict[str, Path],
) -> None:
    cfg = config(models["mamba"], "{n_ctx: 512, slots: 1, n_batch: 64, n_ubatch: 32}")
    with Engine(cfg) as e:
        prompt = prompts(e, 1, 40, seed=4)[0]
        e.generate(prompt, GREEDY)
        again = e.generate(prompt, GREEDY)
    assert_same(again, run_alone(cfg, prompt))


def test_recurrent_model_prefills_identical_prompts_each_alone(
    models: dict[str, Path],
) -> None:
    """A recurrent state cannot be cut back to a prefix, so nothing is shared:
    each copy of the prompt is prefilled from its start."""
    cfg = config(models["mamba"], "{n_ctx: 512, slots: 2, n_batch: 64, n_ubatch: 32}")
    assert not cfg.prefix_reuse and not cfg.prefix_cache
    with Engine(cfg) as e:
        prompt = prompts(e, 1, 40, seed=5)[0]
        results = [s.result() for s in [e.submit(prompt, GREEDY) for _ in range(3)]]
    want = run_alone(cfg, prompt)
    for got in results:
        assert got.timings is not None and got.timings.cached_tokens == 0
        assert_same(got, want)


def test_window_model_slides_far_past_the_context_with_swa_full(
    models: dict[str, Path],
) -> None:
    engine = "{n_ctx: 256, slots: 2, n_batch: 64, n_ubatch: 32, swa_full: true}"
    cfg = config(models["gemma3"], engine)
    assert cfg.context.sliding
    with Engine(cfg) as e:
        done = e.generate("Go on and on", SamplingParams(max_tokens=400, temperature=0.0))
    assert done.finish_reason == "length" and len(done.token_ids) == 400


def test_a_window_cache_stops_at_the_window_unless_sliding_is_asked(
    models: dict[str, Path],
) -> None:
    """A window-sized cache cannot shift: by default the context stops at its end;
    asking for the sliding window explicitly is refused with both ways out."""
    engine = "{n_ctx: 512, slots: 2, n_batch: 64, n_ubatch: 32}"  # window cache: 256 cells
    cfg = config(models["gemma3"], engine)
    assert not cfg.context.sliding and not cfg.swa_full
    with Engine(cfg) as e:
        done = e.generate("Go on and on", SamplingParams(max_tokens=800, temperature=0.0))
    assert done.finish_reason == "length" and len(done.token_ids) < 512
    explicit = config(models["gemma3"], engine, "{sliding: true}")
    with pytest.raises(ContextShiftUnsupported, match=r"engine\.swa_full: true"), Engine(explicit):
        pass
