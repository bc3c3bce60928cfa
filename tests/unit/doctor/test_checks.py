"""One check at a time: the cases that make each one warn or fail, and its fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orin.doctor import board as board_checks
from orin.doctor import checks
from orin.doctor.context import DoctorContext, model_path_for, probe_port
from orin.doctor.findings import Finding
from orin.doctor.report import run_checks
from orin.errors import LlamaCppError
from orin.profile.loader import builtin_profiles, load_profile
from orin.profile.schema import Profile
from orin.profile.validate import validate_profile
from tests.fakes.board import GiB
from tests.fakes.boards_system import (
    CUDA_BUILD,
    CUDA_BUILD_DEFAULT_FA,
    agx_orin_64gb_jp6,
    thermal_zone,
    x86_machine,
)
from tests.ggufutil import LLAMA2_7B, write_gguf
from tests.unit.doctor.conftest import MakeCtx


@pytest.fixture
def jetson_ctx(tmp_path: Path, make_ctx: MakeCtx, llama2_q4: Path) -> MakeCtx:
    fake = agx_orin_64gb_jp6(tmp_path / "board")

    def make(**kw: object) -> DoctorContext:
        kw.setdefault("model", llama2_q4)
        return make_ctx(fake.board.root, fake.runner, **kw)

    return make


def test_llama_cpp_not_importable(jetson_ctx: MakeCtx) -> None:
    ctx = jetson_ctx(build=LlamaCppError("llama-cpp-python is not usable: No module"))
    f = checks.check_llama_build(ctx)
    assert f.severity == "fail" and "not usable" in f.found
    assert "scripts/install-llama-cpp.sh --mode jetson" in f.fix
    kv = checks.check_kv_type(ctx)
    assert kv.severity == "info" and "CUDA kernel rules were not checked" in kv.found


def test_quantized_v_without_flash_attention_fails(jetson_ctx: MakeCtx) -> None:
    f = checks.check_kv_type(jetson_ctx(type_k="q8_0", type_v="q8_0", flash_attn="off"))
    assert f.severity == "fail"
    assert "needs flash attention" in f.found
    assert f.fix == "engine.flash_attn: on (or auto), or engine.type_v: f16"


def test_kv_pair_without_its_cuda_fa_kernel_warns(jetson_ctx: MakeCtx) -> None:
    ctx = jetson_ctx(type_k="q8_0", type_v="f16", flash_attn="on", build=CUDA_BUILD_DEFAULT_FA)
    f = checks.check_kv_type(ctx)
    assert f.severity == "warn" and "convert K and V to f16" in f.found
    assert "GGML_CUDA_FA_QUANTS=all" in f.fix and "FA_ALL_QUANTS" not in f.fix


def test_kv_type_cuda_flash_attention_lacks_fails(jetson_ctx: MakeCtx) -> None:
    ctx = jetson_ctx(type_k="iq4_nl", type_v="iq4_nl", flash_attn="on", build=CUDA_BUILD_DEFAULT_FA)
    f = checks.check_kv_type(ctx)
    assert f.severity == "fail" and "attention on the CPU" in f.found


def test_kv_below_the_weights_precision_warns(tmp_path: Path, make_ctx: MakeCtx) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    q8 = write_gguf(tmp_path / "q8.gguf", params=LLAMA2_7B, file_type=7)
    f = checks.check_kv_type(make_ctx(fake.board.root, fake.runner, model=q8, type_k="q4_0"))
    assert f.severity == "warn" and "lower precision" in f.found


def test_memory_fit_fails_with_the_largest_context_that_fits(
    jetson_ctx: MakeCtx,
) -> None:
    ctx = jetson_ctx(n_ctx=65536, slots=16, n_batch=512, type_k="f16", type_v="f16")
    f = checks.check_memory_fit(ctx)
    assert f.severity == "fail"
    assert "available 54.00 GiB" in f.found
    best = int(f.found.rsplit(": ", 1)[1])
    assert 0 < best < 65536 and best % 256 == 0
    fixed = int(f.fix.removeprefix("engine.n_ctx: ").split(",")[0])
    assert 0 < fixed < best and fixed % 256 == 0  # the fix leaves the headroom too
    assert f.fix.endswith("the largest that leaves 10% free (or fewer slots, or a smaller KV type)")


def test_memory_fit_of_a_builtin_profile_says_where_the_fix_goes(
    tmp_path: Path, make_ctx: MakeCtx
) -> None:
    """A built-in profile is inside the package: the fields the fix names go into a
    copy (or --ctx), as the board checks' fixes say; the user's own file is edited."""
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    model = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    fake.board.meminfo(total=8 * GiB, available=GiB // 2)
    builtin = load_profile("llama2-7b-q4_k_m")
    f = checks.check_memory_fit(make_ctx(fake.board.root, fake.runner, builtin, model))
    source = builtin_profiles()["llama2-7b-q4_k_m"]
    assert f.severity == "fail"
    assert f.fix.endswith(
        f"; set it in a copy of the built-in profile (cp {source} my-llama2-7b-q4_k_m.yaml), "
        "or give serve and doctor --ctx for the context"
    )
    own = tmp_path / "mine.yaml"
    own.write_text(source.read_text())
    f = checks.check_memory_fit(make_ctx(fake.board.root, fake.runner, load_profile(own), model))
    assert f.severity == "fail" and "cp " not in f.fix


@pytest.mark.parametrize("available_gib", [4.3, 4.5])  # under the plan: fail; 4.5: warn
def test_following_the_memory_fit_fix_passes(
    tmp_path: Path, make_ctx: MakeCtx, available_gib: float
) -> None:
    """The context the fix names passes the check: not the largest that only fits, which
    warns again (and is larger than the context of a fit that warns)."""
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    model = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    fake.board.meminfo(total=8 * GiB, available=int(available_gib * GiB))

    def fit(n_ctx: int) -> Finding:
        ctx = make_ctx(
            fake.board.root,
            fake.runner,
            model=model,
            n_ctx=n_ctx,
            slots=4,
            type_k="q8_0",
            type_v="q8_0",
        )
        return checks.check_memory_fit(ctx)

    before = fit(4096)
    assert before.severity == ("fail" if available_gib < 4.33 else "warn")
    fixed = int(before.fix.removeprefix("engine.n_ctx: ").split(",")[0])
    assert fixed < 4096
    after = fit(fixed)
    assert after.severity == "ok", after.found


def test_memory_fit_warns_without_headroom(tmp_path: Path, make_ctx: MakeCtx) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    model = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    fake.board.meminfo(total=8 * GiB, available=int(4.5 * GiB))
    ctx = make_ctx(fake.board.root, fake.runner, model=model, type_k="q8_0", type_v="q8_0")
    f = checks.check_memory_fit(ctx)
    assert f.severity == "warn" and "= 4.33 GiB at n_ctx=4096 x 4 slots" in f.found
    assert "CUDA runtime" in f.why


@pytest.mark.parametrize("meminfo", [None, "", "MemFree: lots\n"])
def test_unreadable_meminfo_says_why_the_fit_is_unchecked(
    tmp_path: Path, make_ctx: MakeCtx, meminfo: str | None
) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    model = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    path = fake.board.root.path("/proc/meminfo")
    if meminfo is None:
        path.unlink()
    else:
        path.write_text(meminfo)
    f = checks.check_memory_fit(make_ctx(fake.board.root, fake.runner, model=model))
    reason = f"cannot read {path}" if meminfo is None else "meminfo has no MemTotal line"
    assert (f.severity, f.found) == ("warn", f"unchecked: {reason}")
    assert "MemAvailable" in f.why and f.fix.startswith("run doctor where the board's")


def test_profile_validate_reports_doctors_memory_fit(tmp_path: Path, make_ctx: MakeCtx) -> None:
    """One check: validate shows doctor's figures, as a warning at most (this machine's memory
    is not necessarily the board's)."""
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    model = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    for available, doctor_severity in ((int(4.5 * GiB), "warn"), (3 * GiB, "fail")):
        fake.board.meminfo(total=8 * GiB, available=available)
        ctx = make_ctx(fake.board.root, fake.runner, model=model, type_k="q8_0", type_v="q8_0")
        doctor = checks.check_memory_fit(ctx)
        report = validate_profile(ctx.profile, model, CUDA_BUILD, fake.board.base)
        [finding] = [f for f in report.findings if f.rule == "memory-fit"]
        assert doctor.severity == doctor_severity
        assert finding.severity == "warn" and finding.message.startswith(doctor.found)
        assert doctor.fix in finding.message and report.ok
    fake.board.meminfo(total=64 * GiB, available=48 * GiB)
    ctx = make_ctx(fake.board.root, fake.runner, model=model)
    assert checks.check_memory_fit(ctx).severity == "ok"
    report = validate_profile(ctx.profile, model, CUDA_BUILD, fake.board.base)
    assert "memory-fit" not in [f.rule for f in report.findings]


def test_window_beyond_training_context_fails(jetson_ctx: MakeCtx) -> None:
    f = checks.check_context(jetson_ctx(n_ctx=8192))
    assert f.severity == "fail"
    assert f.found == "the window (8192 tokens per slot) exceeds the training context (4096)"
    assert f.fix == "context.window: 4096 (or engine.n_ctx: 4096)"


def test_n_ctx_beyond_training_with_a_window_inside_warns(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    model = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    p = Profile(name="t", engine={"n_ctx": 8192}, context={"window": 4096})
    ctx = DoctorContext(fake.board.root, fake.runner, p, model)
    f = checks.check_context(ctx)
    assert f.severity == "warn" and f.fix == "engine.n_ctx: 4096"
    assert "RoPE freq base 10000 from the model's metadata" in f.found


def test_rope_base_override_against_the_metadata(tmp_path: Path) -> None:
    """engine.rope_freq_base overrides the metadata; a different base is a failure."""
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    model = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    p = Profile(name="t")
    p.engine.rope_freq_base = 500000.0
    f = checks.check_context(DoctorContext(fake.board.root, fake.runner, p, model))
    assert f.severity == "fail"
    assert "RoPE freq base 500000; the model was trained with 10000" in f.found


def test_mmap_on_while_fully_offloaded_warns(jetson_ctx: MakeCtx) -> None:
    f = checks.check_mmap(jetson_ctx(load_mode="mmap"))
    assert f.severity == "warn"
    assert f.fix == "system.mmap: auto (or off) with engine.load_mode: auto"


def test_model_file_problems(tmp_path: Path, jetson_ctx: MakeCtx) -> None:
    truncated = tmp_path / "cut.gguf"
    full = write_gguf(tmp_path / "full.gguf", params=LLAMA2_7B, tensors={"w": np.ones(4096)})
    truncated.write_bytes(full.read_bytes()[:-1024])
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_text("hello")
    for path, words in (
        (truncated, "truncated"),
        (not_gguf, "not a GGUF file"),
        (tmp_path / "none.gguf", "no such file"),
    ):
        f = checks.check_model_file(jetson_ctx(model=path))
        assert f.severity == "fail" and words in f.found, f.found
        assert checks.check_memory_fit(jetson_ctx(model=path)).severity == "info"


def test_no_model_at_all_is_information(tmp_path: Path, make_ctx: MakeCtx) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    report = run_checks(make_ctx(fake.board.root, fake.runner, model=None))
    found = report.by_id()
    assert found["model-file"].severity == "info"
    assert found["context"].found.startswith("skipped: no readable model")
    assert found["kv-type"].severity == "ok"  # the profile's quantization is enough


def test_demo_model_path_is_not_generated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path / "cache"))
    p = Profile(name="d", model={"demo": {"size": "tiny", "quant": "f16"}})
    path, source = model_path_for(p, None)
    assert source == "demo" and path is not None and not path.exists()
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    f = checks.check_model_file(DoctorContext(fake.board.root, fake.runner, p, path, source))
    assert f.severity == "info" and f.fix == "orin-llm model demo --size tiny --quant f16"
    assert not path.exists()
    assert model_path_for(Profile(name="n"), None) == (
        None,
        "profile 'n' names no model; give one with --model PATH",
    )


def test_numa_option_on_one_node_is_reported(jetson_ctx: MakeCtx) -> None:
    f = board_checks.check_numa(jetson_ctx(numa="distribute"))
    assert f.severity == "info" and f.fix == "engine.numa: disabled"
    assert "change nothing" in f.why


def test_thermal_near_and_past_trip_points(tmp_path: Path, jetson_ctx: MakeCtx) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    thermal_zone(fake.board, 1, "gpu-thermal", 92.0, [("passive", 99.0), ("critical", 103.0)])
    f = board_checks.check_thermal(jetson_ctx())
    assert f.severity == "warn"
    assert f.found == "gpu-thermal at 92.0 C, passive trip at 99.0 C"
    thermal_zone(fake.board, 1, "gpu-thermal", 104.0, [("passive", 99.0), ("critical", 103.0)])
    assert board_checks.check_thermal(jetson_ctx()).severity == "fail"


def test_jtop_states(tmp_path: Path, make_ctx: MakeCtx) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    ctx = make_ctx(fake.board.root, fake.runner)
    assert board_checks.check_jtop(ctx).severity == "warn"
    fake.jtop = "active"
    assert board_checks.check_jtop(make_ctx(fake.board.root, fake.runner)).severity == "ok"
    fake.board.root.path("/lib/systemd/system/jtop.service").unlink()
    f = board_checks.check_jtop(make_ctx(fake.board.root, fake.runner))
    assert f.severity == "info" and "not installed" in f.found


def test_low_disk(jetson_ctx: MakeCtx) -> None:
    assert board_checks.check_disk(jetson_ctx(free=1 * GiB)).severity == "warn"
    f = board_checks.check_disk(jetson_ctx(free=100 * 2**20))
    assert f.severity == "fail" and f.found.startswith("models: 0.1 GiB free")


def test_port_taken(jetson_ctx: MakeCtx) -> None:
    f = board_checks.check_port(jetson_ctx(port="already in use"))
    assert f.severity == "warn" and f.found == "127.0.0.1:8080: already in use"
    assert "sport = :8080" in f.fix


def test_probe_port_on_loopback() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert probe_port("127.0.0.1", port) == "already in use"
    assert probe_port("127.0.0.1", port) is None


def test_unknown_clocks_without_root(tmp_path: Path, make_ctx: MakeCtx) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    fake.fail[("jetson_clocks", "--show")] = "must be run as root"
    for entry in fake.board.root.path("/sys/class/devfreq").iterdir():
        for freq in entry.iterdir():
            freq.unlink()
    f = board_checks.check_clocks(make_ctx(fake.board.root, fake.runner))
    assert f.severity == "info" and f.fix == "run sudo orin-llm doctor to check"


def test_a_crashing_check_makes_exit_code_70(tmp_path: Path, make_ctx: MakeCtx) -> None:
    board, runner = x86_machine(tmp_path / "board")

    def broken(ctx: DoctorContext) -> Finding:
        raise RuntimeError("boom")

    report = run_checks(make_ctx(board.root, runner), [("broken", broken)])
    assert report.exit_code == 70 and report.crashed == ("broken",)  # internal, not usage
    assert report.findings[0].found == "the check itself failed: RuntimeError: boom"
