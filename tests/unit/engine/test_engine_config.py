from __future__ import annotations

from pathlib import Path

import pytest

from orin.engine.config import GPU_PREFILL_CHUNK, engine_config, loop_has_a_core
from orin.errors import KVConfigError
from orin.llamacpp import BuildInfo
from orin.model.gguf import ModelInfo, read_model_info
from orin.profile.loader import parse_profile
from orin.system.platform import usable_cpus
from tests.fakes.board import FakeBoard
from tests.ggufutil import LLAMA2_7B, write_gguf


def model(tmp_path: Path) -> tuple[Path, ModelInfo]:
    path = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    return path, read_model_info(path)


def test_fully_offloaded_model_on_a_jetson_is_not_mmapped(tmp_path: Path, board: FakeBoard) -> None:
    path, info = model(tmp_path)
    board.write(
        "/etc/nv_tegra_release", "# R36 (release), REVISION: 4.3, GCID: 1, BOARD: generic\n"
    )
    cfg = engine_config(parse_profile("name: p\n"), path, info, root=board.root)
    assert cfg.load_mode == "none"
    plain = engine_config(
        parse_profile("name: p\n"), path, info, root=FakeBoard(tmp_path / "x86").root
    )
    assert plain.load_mode != "none"
    explicit = parse_profile("name: p\nengine: {load_mode: mmap}\n")
    assert engine_config(explicit, path, info, root=board.root).load_mode == "mmap"


def test_resolution_of_kv_threads_and_window(tmp_path: Path) -> None:
    path, info = model(tmp_path)
    p = parse_profile(
        "name: p\nengine: {n_ctx: 1000, slots: 2}\ncontext: {window: 900, keep: 10}\n"
    )
    cfg = engine_config(p, path, info)
    assert (cfg.type_k, cfg.type_v, cfg.flash_attn) == ("q8_0", "q8_0", "on")
    assert cfg.context.window == 900 and cfg.context.keep == 10
    assert cfg.threads >= 1 and cfg.threads_batch == cfg.threads


def test_kv_rule_violation_is_a_typed_error(tmp_path: Path) -> None:
    path, info = model(tmp_path)
    bad = parse_profile("name: p\nengine: {type_k: q8_0, type_v: q8_0, flash_attn: off}\n")
    with pytest.raises(KVConfigError, match="kv-quant-v-needs-fa"):
        engine_config(bad, path, info)


def test_prefill_chunk_is_smaller_when_layers_are_offloaded(tmp_path: Path) -> None:
    """A GPU decode ignores llama.cpp's abort callback: the chunk bounds a cancel."""
    path, info = model(tmp_path)
    cuda = BuildInfo(version="x", gpu_offload=True, system_info="CUDA : ARCHS = 870 |")
    cpu = BuildInfo(version="x", gpu_offload=False, system_info="CPU : NEON = 1 |")

    def chunk(yaml_engine: str, build: BuildInfo | None) -> int:
        profile = parse_profile(f"name: p\nengine: {yaml_engine}\n")
        return engine_config(profile, path, info, build).prefill_chunk

    assert chunk("{n_batch: 1024}", cuda) == GPU_PREFILL_CHUNK == 256
    assert chunk("{n_batch: 128, n_ubatch: 128}", cuda) == 128  # never past n_batch
    assert chunk("{n_batch: 1024, gpu_layers: 0}", cuda) == 1024  # nothing offloaded
    assert chunk("{n_batch: 1024}", cpu) == 1024  # the abort callback stops a CPU decode
    assert chunk("{n_batch: 1024}", None) == 1024
    assert chunk("{n_batch: 1024, prefill_chunk: 64}", cuda) == 64
    assert chunk("{n_batch: 1024, prefill_chunk: 64}", cpu) == 64
    assert chunk("{n_batch: 256, n_ubatch: 256, prefill_chunk: 512}", cpu) == 256


def test_events_go_before_the_decode_only_where_it_leaves_the_loop_a_core(
    tmp_path: Path,
) -> None:
    """A GPU decodes, or llama.cpp's threads are fewer than the CPUs: the loop keeps a
    core while the decode runs. Every core taken by the decode: the end of the step."""
    assert loop_has_a_core(offloaded=True, threads=8, cpus=8)
    assert loop_has_a_core(offloaded=False, threads=4, cpus=8)
    assert not loop_has_a_core(offloaded=False, threads=8, cpus=8)
    assert not loop_has_a_core(offloaded=False, threads=2, cpus=1)  # pinned to one core
    path, info = model(tmp_path)
    cuda = BuildInfo(version="x", gpu_offload=True, system_info="CUDA : ARCHS = 870 |")
    cpu = BuildInfo(version="x", gpu_offload=False, system_info="CPU : NEON = 1 |")
    n = usable_cpus()  # the CPUs this process may run on

    def held(yaml_engine: str, build: BuildInfo | None) -> bool:
        profile = parse_profile(f"name: p\nengine: {yaml_engine}\n")
        return engine_config(profile, path, info, build).events_before_decode

    assert held("{threads: 256}", cuda)  # offloaded: the threads do not matter
    assert held("{threads: 256, gpu_layers: 0}", cuda) == (n > 256)  # nothing offloaded
    assert held("{threads: 256}", cpu) == (n > 256)
    assert held("{threads: 1, threads_batch: 256}", cpu) == (n > 256)  # prompt steps: all
    assert held("{threads: 1}", cpu) == (n > 1)


def test_the_kv_layout_decides_prefix_reuse_and_serving(tmp_path: Path) -> None:
    """A recurrent state cannot be cut back to a prefix (no reuse, no kept cache);
    a window-sized cache of sliding-window layers cannot shift (no sliding unless
    asked); an encoder has no KV cache to generate with (a clear error, no crash)."""
    import dataclasses

    path, info = model(tmp_path)
    profile = parse_profile("name: p\n")
    plain = engine_config(profile, path, info)
    assert plain.prefix_reuse and plain.prefix_cache and plain.context.sliding
    recurrent = engine_config(profile, path, dataclasses.replace(info, kv_layout="recurrent"))
    assert not recurrent.prefix_reuse and not recurrent.prefix_cache
    windowed = dataclasses.replace(info, kv_layout="iswa", sliding_window=512)
    swa = engine_config(profile, path, windowed)
    assert (swa.swa_window, swa.swa_full, swa.context.sliding) == (512, False, False)
    full = engine_config(parse_profile("name: p\nengine: {swa_full: true}\n"), path, windowed)
    assert (full.swa_window, full.context.sliding) == (0, True)
    asked = engine_config(parse_profile("name: p\ncontext: {sliding: true}\n"), path, windowed)
    assert asked.context.sliding  # the backend refuses it with both ways out
    with pytest.raises(KVConfigError, match="no KV cache"):
        engine_config(profile, path, dataclasses.replace(info, kv_layout="none"))


def test_a_prompt_file_that_is_not_utf8_is_named_with_its_first_bad_byte(tmp_path: Path) -> None:
    """serve reads prompt_dir's files through kept_prompts; validate and doctor through
    prompt_file_problems: both say which file, where and why, in the same words."""
    from orin.engine.config import kept_prompts, prompt_file_problems
    from orin.errors import ProfileError
    from orin.profile.loader import load_profile

    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "a.txt").write_text("You are a robot.\n")
    bad = tmp_path / "prompts" / "b.txt"
    bad.write_bytes("Line one\nCafé robot\n".encode("latin-1"))  # é is 0xe9 in Latin-1
    f = tmp_path / "p.yaml"
    f.write_text("name: t\nprompt_cache: {prompt_dir: prompts, prompts: [hi]}\n")
    profile = load_profile(f)
    expected = (
        f"{f}: prompt_cache.prompt_dir: cannot read {bad}: not UTF-8 text: byte 0xe9 at "
        "offset 12 (line 2): invalid continuation byte (save the file as UTF-8)"
    )
    with pytest.raises(ProfileError) as refused:
        kept_prompts(profile)
    assert str(refused.value) == expected
    assert prompt_file_problems(profile) == [expected]
    bad.write_text("Café robot\n", encoding="utf-8")
    assert prompt_file_problems(profile) == []
    assert kept_prompts(profile) == ["hi", "You are a robot.\n", "Café robot\n"]


def test_prompt_files_this_user_cannot_open_are_not_judged(tmp_path: Path) -> None:
    """validate and doctor may run as another user than the server (root, or an
    operator): a file they cannot open is left to serve, as before."""
    import os

    from orin.engine.config import prompt_file_problems
    from orin.profile.loader import load_profile

    if os.geteuid() == 0:
        pytest.skip("root opens every file")
    (tmp_path / "prompts").mkdir()
    locked = tmp_path / "prompts" / "a.txt"
    locked.write_bytes(b"\xff\xfe not text")
    locked.chmod(0)
    f = tmp_path / "p.yaml"
    f.write_text("name: t\nprompt_cache: {prompt_dir: prompts}\n")
    assert prompt_file_problems(load_profile(f)) == []
