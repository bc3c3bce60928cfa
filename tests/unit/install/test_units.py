"""Rendering the unit templates: golden files for two profiles, and each derived value."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import yaml

from orin.install.layout import SERVICE, TUNE_SERVICE
from orin.install.plan import service_model
from orin.install.units import (
    DEFAULT_GPU_DEVICES,
    WATCHDOG_SEC,
    TemplateError,
    UnitConfig,
    command_line,
    find_gpu_devices,
    render_template,
    render_units,
    service_plan,
    unit_config,
)
from orin.profile.loader import load_profile, parse_profile
from orin.profile.schema import PATH_FIELDS, Profile
from orin.system.root import SysRoot
from tests.unit.install.conftest import EXECUTABLE, make_root

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
PROFILES = ("llama3.1-8b-q4_k_m", "llama2-13b-q4_k_m-32gb")
UPDATE = os.environ.get("ORIN_LLM_UPDATE_GOLDEN") == "1"


def config_for(base: Path, profile_name: str, **overrides: object) -> UnitConfig:
    root = SysRoot(make_root(base, profile_name))
    profile = load_profile(profile_name)
    model_path, info = service_model(profile, root)
    cfg = unit_config(
        profile,
        service_plan(profile, info),
        EXECUTABLE,
        "orin-llm",
        ("video", "render"),
        find_gpu_devices(root),
        model_path=model_path,
    )
    return dataclasses.replace(cfg, **overrides)  # type: ignore[arg-type]


@pytest.mark.parametrize("profile_name", PROFILES)
def test_rendered_units_match_the_golden_files(tmp_path: Path, profile_name: str) -> None:
    units = render_units(config_for(tmp_path, profile_name))
    for unit, text in units.items():
        golden = GOLDEN / profile_name / unit
        if UPDATE:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert text == golden.read_text(), f"{golden} differs (ORIN_LLM_UPDATE_GOLDEN=1 rewrites)"


def test_memory_limits_follow_the_memory_plan(tmp_path: Path) -> None:
    cfg = config_for(tmp_path, "llama3.1-8b-q4_k_m")
    plan = cfg.plan
    # llama3.1 profile: auto KV -> q8_0 for Q4_K_M weights, 4 slots x 8192 tokens
    assert (plan.type_k, plan.type_v, plan.slots, plan.ctx) == ("q8_0", "q8_0", 4, 8192)
    assert cfg.memory_high >= plan.total_bytes + (1 << 30)
    assert cfg.memory_high % (1 << 20) == 0
    assert cfg.memory_max > cfg.memory_high
    text = render_units(cfg)[SERVICE]
    assert f"MemoryHigh={cfg.memory_high >> 20}M" in text
    assert f"MemoryMax={cfg.memory_max >> 20}M" in text


def test_timeouts_cover_the_drain_and_the_load(tmp_path: Path) -> None:
    cfg = config_for(tmp_path, "llama3.1-8b-q4_k_m", grace_seconds=45.5)
    text = render_units(cfg)[SERVICE]
    assert "TimeoutStopSec=76" in text  # grace 45.5 s rounded up + 30 s
    assert f"WatchdogSec={WATCHDOG_SEC}" in text
    assert "Type=notify" in text and "Restart=on-failure" in text


def test_mlock_port_and_home_options(tmp_path: Path) -> None:
    plain = render_units(config_for(tmp_path / "a", "llama3.1-8b-q4_k_m"))[SERVICE]
    assert "LimitMEMLOCK" not in plain
    assert "ProtectHome=yes" in plain
    assert "--port" not in plain
    changed = render_units(
        config_for(
            tmp_path / "b",
            "llama3.1-8b-q4_k_m",
            memlock=True,
            port=9000,
            protect_home="read-only",
            groups=(),
        )
    )[SERVICE]
    assert "LimitMEMLOCK=infinity" in changed
    assert "ProtectHome=read-only" in changed
    assert "--profile /etc/orin-llm/profile.yaml --port 9000" in changed
    assert "SupplementaryGroups" not in changed  # no group exists: no empty assignment


def test_profile_load_mode_decides_memlock(tmp_path: Path) -> None:
    root = SysRoot(make_root(tmp_path, "llama3.1-8b-q4_k_m"))
    profile = load_profile("llama3.1-8b-q4_k_m")
    profile.engine.load_mode = "mmap+mlock"
    _, info = service_model(profile, root)
    cfg = unit_config(profile, service_plan(profile, info), EXECUTABLE, "u", (), ())
    assert cfg.memlock


def test_rpc_workers_lift_the_start_limit(tmp_path: Path) -> None:
    root = SysRoot(make_root(tmp_path, "llama3.1-8b-q4_k_m"))
    profile = load_profile("llama3.1-8b-q4_k_m")
    _, info = service_model(profile, root)
    plain = render_units(unit_config(profile, service_plan(profile, info), EXECUTABLE, "u", (), ()))
    assert "StartLimitIntervalSec=600\n" in plain["orin-llm.service"]
    profile.engine.rpc = ["10.0.0.2:50052"]
    split = render_units(unit_config(profile, service_plan(profile, info), EXECUTABLE, "u", (), ()))
    assert "StartLimitIntervalSec=0\n" in split["orin-llm.service"]


def test_home_paths_make_homes_read_only(tmp_path: Path) -> None:
    root = SysRoot(make_root(tmp_path, "llama3.1-8b-q4_k_m"))
    profile = load_profile("llama3.1-8b-q4_k_m")
    _, info = service_model(profile, root)
    plan = service_plan(profile, info)
    venv_in_home = unit_config(profile, plan, "/home/me/orin/.venv/bin/orin-llm", "u", (), ())
    assert venv_in_home.protect_home == "read-only"
    model_in_home = unit_config(profile, plan, EXECUTABLE, "u", (), (), model_path="/root/m.gguf")
    assert model_in_home.protect_home == "read-only"
    assert unit_config(profile, plan, EXECUTABLE, "u", (), ()).protect_home == "yes"
    # every other file and folder the profile names is read by the service too: the
    # vision projector, a draft model, the prompt cache's folders
    others = [f for f in PATH_FIELDS if f.name != "model.path"]
    assert {f.name for f in others} >= {"model.mmproj", "prompt_cache.prompt_dir"}
    for named in others:
        data = profile.model_dump(mode="json", exclude_unset=True)
        data.setdefault(named.section, {})[named.key] = "/home/me/extra"
        other = Profile.model_validate(data)
        config = unit_config(other, plan, EXECUTABLE, "u", (), ())
        assert config.protect_home == "read-only", named.name


def test_a_prompt_cache_folder_outside_the_services_own_is_made_writable(
    tmp_path: Path,
) -> None:
    """ProtectSystem=strict leaves only the service's own folders writable: without a
    ReadWritePaths= of its own, a prompt_cache.directory elsewhere could not be
    written, and the prompts would be computed at every start, without a word."""
    root = SysRoot(make_root(tmp_path, "llama3.1-8b-q4_k_m"))
    profile = load_profile("llama3.1-8b-q4_k_m")
    _, info = service_model(profile, root)
    plan = service_plan(profile, info)

    def unit(**prompt_cache: object) -> str:
        data = profile.model_dump(mode="json", exclude_unset=True)
        data["prompt_cache"] = prompt_cache
        config = unit_config(Profile.model_validate(data), plan, EXECUTABLE, "u", (), ())
        return render_units(config)[SERVICE]

    prompts = ["You are a helpful assistant."]
    assert "ReadWritePaths=-/srv/prompt cache" not in unit(directory="/srv/prompt cache")
    elsewhere = unit(prompts=prompts, directory="/srv/prompt cache")
    assert 'ReadWritePaths="-/srv/prompt cache"\n' in elsewhere
    assert "ReadWritePaths=/var/lib/orin-llm /var/cache/orin-llm\n" in elsewhere
    assert unit(prompts=prompts, directory="/srv/a/../b").count("ReadWritePaths=-/srv/b\n") == 1
    for own in ("/var/cache/orin-llm/prompts", "/var/lib/orin-llm", None):
        assert unit(prompts=prompts, directory=own).count("ReadWritePaths=") == 1, own


def test_gpu_devices_found_on_the_board(tmp_path: Path) -> None:
    assert find_gpu_devices(SysRoot(tmp_path)) == ()
    assert (
        "/dev/host1x-fence" in DEFAULT_GPU_DEVICES and "/dev/dri/renderD128" in DEFAULT_GPU_DEVICES
    )
    for node in ("dev/nvmap", "dev/nvhost-ctrl-gpu", "dev/nvgpu/igpu0/ctrl", "dev/null"):
        (tmp_path / node).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / node).touch()
    assert find_gpu_devices(SysRoot(tmp_path)) == (
        "/dev/nvgpu/igpu0/ctrl",
        "/dev/nvhost-ctrl-gpu",
        "/dev/nvmap",
    )


def test_no_gpu_nodes_render_the_jetpack6_defaults(tmp_path: Path) -> None:
    cfg = config_for(tmp_path, "llama3.1-8b-q4_k_m")  # a fake root without /dev
    assert cfg.devices == DEFAULT_GPU_DEVICES and not cfg.devices_found
    text = render_units(cfg)[SERVICE]
    assert "DeviceAllow=/dev/host1x-fence rw\n" in text
    assert "PrivateDevices=no\nDevicePolicy=closed\n" in text


def test_tune_unit_applies_the_installed_profile_before_the_server(tmp_path: Path) -> None:
    text = render_units(config_for(tmp_path, "llama3.1-8b-q4_k_m"))[TUNE_SERVICE]
    assert (
        f"ExecStart={EXECUTABLE} tune system --apply --profile /etc/orin-llm/profile.yaml" in text
    )
    assert "Type=oneshot" in text and "Before=orin-llm.service" in text
    # root's state in a folder of root's own, not the service user's /var/lib/orin-llm
    assert "StateDirectory=orin-llm-root\nStateDirectoryMode=0700\n" in text


def test_template_rules() -> None:
    assert render_template("A={{a}}\n{{b}}\nC=1\n", {"a": "x", "b": ""}) == "A=x\nC=1\n"
    assert render_template("L={{a}}\nM=1\n", {"a": ""}) == "M=1\n"  # no empty assignment
    with pytest.raises(TemplateError, match="unknown value"):
        render_template("X={{nope}}\n", {})


def test_command_line_quoting() -> None:
    assert command_line(["/opt/a b/orin-llm", "serve", "50%", "$HOME"]) == (
        '"/opt/a b/orin-llm" serve 50%% $$HOME'
    )


def test_kv_rule_errors_stop_the_render(tmp_path: Path) -> None:
    root = SysRoot(make_root(tmp_path, "llama3.1-8b-q4_k_m"))
    profile = parse_profile(
        "name: bad\nmodel: {path: /var/lib/orin-llm/models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf}"
        "\nengine: {type_v: q8_0, flash_attn: 'off'}\n"
    )
    _, info = service_model(profile, root)
    from orin.errors import KVConfigError

    with pytest.raises(KVConfigError):
        service_plan(profile, info)


def test_a_draft_model_raises_the_memory_limits_by_its_plan(tmp_path: Path) -> None:
    """speculative.mode draft loads a second model with a cache of its own beside the
    served one: MemoryHigh and MemoryMax count its weights and cache, or the kernel
    would kill the server as the draft model loads."""
    import numpy as np

    from orin.model.gguf import read_model_info
    from orin.model.memplan import draft_bytes
    from tests.ggufutil import LLAMA2_7B, write_gguf

    small = dict(LLAMA2_7B, block_count=4, embedding_length=512, feed_forward_length=1024)
    path = write_gguf(
        tmp_path / "draft.gguf",
        params=small,
        tensors={"token_embd.weight": np.zeros((256, 512), np.float16)},
    )
    base = config_for(tmp_path / "a", "llama3.1-8b-q4_k_m")
    profile = load_profile("llama3.1-8b-q4_k_m")
    data = profile.model_dump(mode="json", exclude_unset=True)
    data["speculative"] = {"mode": "draft", "draft_model": str(path)}
    drafting = parse_profile(yaml.safe_dump(data))
    _, info = service_model(profile, SysRoot(make_root(tmp_path / "b", profile.name)))
    plan = service_plan(drafting, info)
    e = profile.engine
    extra = draft_bytes(read_model_info(path), e.n_ctx, e.slots, e.n_ubatch, True, e.n_batch)
    assert extra > read_model_info(path).weights_bytes > 0
    assert plan.draft_bytes == extra
    assert plan.total_bytes == base.plan.total_bytes + extra
    cfg = dataclasses.replace(base, plan=plan)
    assert cfg.memory_high >= base.memory_high + extra - (1 << 20)
    assert cfg.memory_max > base.memory_max
    assert "+ draft model ~" in render_units(cfg)[SERVICE]
    assert "draft model" not in render_units(base)[SERVICE]
