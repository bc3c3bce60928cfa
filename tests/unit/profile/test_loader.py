from __future__ import annotations

import os
from pathlib import Path

import pytest

from orin.errors import ProfileError
from orin.profile.loader import (
    builtin_profiles,
    find_profile,
    load_profile,
    parse_profile,
    resolve_model_path,
)
from orin.profile.schema import RoutingMetricsSection, SystemSection

EXPECTED_BUILTINS = {
    "demo",
    "llama2-7b-q4_k_m",
    "llama2-13b-q4_k_m",
    "llama2-13b-q4_k_m-32gb",
    "llama3.1-8b-q4_k_m",
    "llama3.1-8b-q8_0",
    "mistral-7b-q5_k_m",
    "qwen2.5-1.5b-q8_0",
}


def test_builtin_profiles_all_load() -> None:
    found = builtin_profiles()
    assert set(found) >= EXPECTED_BUILTINS
    for name, path in found.items():
        p = load_profile(path)
        assert p.name == name
        assert p.source == path.resolve()
        assert p.server.host == "127.0.0.1"


def test_typo_names_file_line_and_field() -> None:
    text = "name: x\nengine:\n  n_ctx: 2048\n  slotz: 4\n"
    with pytest.raises(ProfileError) as exc:
        parse_profile(text, "my.yaml")
    assert str(exc.value) == "my.yaml:4: engine.slotz: unknown field; did you mean 'slots'?"


def test_bad_value_names_line_and_bound() -> None:
    text = "name: x\nengine:\n  n_ctx: 2048\n  slots: 0\n"
    with pytest.raises(
        ProfileError, match=r"^p.yaml:4: engine.slots: .*greater than or equal to 1"
    ):
        parse_profile(text, "p.yaml")


def test_a_number_that_is_not_finite_is_named_as_such() -> None:
    text = "name: x\nsampling:\n  temperature: .nan\n"
    with pytest.raises(ProfileError, match=r"^p.yaml:3: sampling.temperature: .*finite number"):
        parse_profile(text, "p.yaml")


@pytest.mark.parametrize(
    ("text", "field"),
    [("engine:\n  n_ctx: true\n", "engine.n_ctx"), ("sampling:\n  top_p: yes\n", "sampling.top_p")],
)
def test_a_yaml_boolean_is_no_number(text: str, field: str) -> None:
    """pydantic would take true as 1, and report n_ctx: true as below its bound."""
    with pytest.raises(ProfileError, match=rf"^p.yaml:3: {field}: Input should be a number"):
        parse_profile("name: x\n" + text, "p.yaml")


@pytest.mark.parametrize("word", ["off", "no", "yes", "on"])
def test_a_word_yaml_reads_as_a_boolean_says_to_quote_it(word: str) -> None:
    """`name: off` said only "Input should be a valid string", naming no cause."""
    with pytest.raises(ProfileError, match=r"^p.yaml:1: name: .*put the word in quotes"):
        parse_profile(f"name: {word}\n", "p.yaml")
    assert parse_profile(f"name: '{word}'\n", "p.yaml").name == word


@pytest.mark.parametrize(
    ("slo", "line", "message"),
    [
        ("  prompt_tokens: [128, 0]\n", 5, "slo.prompt_tokens[1]: Input should be greater than"),
        ("  concurrency:\n    - 4\n    - 100\n", 7, "slo.concurrency[1]: Input should be less"),
        ("  concurrency: []\n", 5, "slo.concurrency: List should have at least 1 item"),
    ],
)
def test_slo_points_tune_cannot_measure_are_refused_at_load(
    slo: str, line: int, message: str
) -> None:
    """A prompt of no tokens, more streams than a profile may have slots, or no point at
    all: `profile validate` says so with the line, instead of passing a profile that
    `tune run` then refuses without one (or fails on as a configuration error)."""
    text = f"name: x\nmodel:\n  demo: {{size: tiny, quant: f16}}\nslo:\n{slo}"
    with pytest.raises(ProfileError) as exc:
        parse_profile(text, "p.yaml")
    assert str(exc.value).startswith(f"p.yaml:{line}: {message}"), str(exc.value)


@pytest.mark.parametrize("value", ["16", "-1", "fast"])
def test_a_value_no_member_of_a_union_takes_is_one_line_naming_the_field(value: str) -> None:
    """`power_mode` is a mode id or 'fastest': a value that is neither is one line for
    the field as the profile names it, not one per member under pydantic's names for
    them (`system.power_mode.constrained-int`, `system.power_mode.literal['fastest']`)."""
    text = f"name: x\nsystem:\n  power_mode: {value}\n"
    with pytest.raises(ProfileError) as exc:
        parse_profile(text, "p.yaml")
    assert str(exc.value).startswith("p.yaml:3: system.power_mode: "), str(exc.value)
    assert len(str(exc.value).splitlines()) == 1
    assert "; or Input should be 'fastest'" in str(exc.value)
    assert "literal" not in str(exc.value) and "int" not in str(exc.value).split(": ", 2)[1]


@pytest.mark.parametrize(
    ("value", "given"),
    [(" 5", "5"), ("\n  - 1", "[1]"), (" 2024-01-01", '"2024-01-01"')],
)
def test_a_value_where_a_section_belongs_says_a_section_is_wanted(value: str, given: str) -> None:
    """Not pydantic's 'a valid dictionary or instance of EngineSection' (a date, which
    YAML reads as one, is named as written)."""
    with pytest.raises(ProfileError) as exc:
        parse_profile(f"name: x\nengine:{value}\n", "p.yaml")
    wanted = "Input should be a section (its fields indented under it)"
    assert str(exc.value) == f"p.yaml:2: engine: {wanted}, not {given}"


def test_a_section_with_every_field_commented_out_is_its_defaults() -> None:
    """`system:` with nothing under it is YAML's null: the section left out, not an
    error; a section that may be none (`model.demo`) stays none."""
    text = (
        "name: x\nmodel:\n  path: m.gguf\n  demo:\nsystem:\n  # swappiness: 10\n"
        "server:\n  port: 9000\n  routing_metrics:\n"
    )
    p = parse_profile(text, "p.yaml")
    assert p.system == SystemSection() and p.model.demo is None
    assert p.server.port == 9000 and p.server.routing_metrics == RoutingMetricsSection()


def test_bad_enum_value() -> None:
    text = "name: x\nengine:\n  type_k: q3_k\n"
    with pytest.raises(ProfileError, match=r"p.yaml:3: engine.type_k: Input should be 'auto'"):
        parse_profile(text, "p.yaml")


def test_every_error_is_reported() -> None:
    text = "name: x\nengine:\n  slots: -1\nserver:\n  port: 70000\n"
    with pytest.raises(ProfileError) as exc:
        parse_profile(text, "p.yaml")
    lines = str(exc.value).splitlines()
    assert [line.split(": ")[0:2] for line in lines] == [
        ["p.yaml:3", "engine.slots"],
        ["p.yaml:5", "server.port"],
    ]


def test_bare_on_off_mean_flash_attention_modes() -> None:
    assert parse_profile("name: x\nengine: {flash_attn: on}\n").engine.flash_attn == "on"
    assert parse_profile("name: x\nengine: {flash_attn: off}\n").engine.flash_attn == "off"


def test_bare_on_off_mean_mmap_policies() -> None:
    """`system.mmap: off`, as doctor's mmap fix writes it, is the policy, not a boolean
    refused with "Input should be 'auto', 'on' or 'off'"."""
    assert parse_profile("name: x\nsystem: {mmap: on}\n").system.mmap == "on"
    assert parse_profile("name: x\nsystem:\n  mmap: off\n").system.mmap == "off"


def test_missing_name() -> None:
    with pytest.raises(ProfileError, match=r"p.yaml:1: name: required field is missing"):
        parse_profile("engine:\n  slots: 2\n", "p.yaml")


def test_yaml_syntax_error_line() -> None:
    with pytest.raises(ProfileError, match=r"^p.yaml:4: YAML syntax error: mapping values"):
        parse_profile("name: x\nengine:\n  slots: 2\n   n_ctx: 5\n", "p.yaml")


def test_an_alias_inside_the_value_it_names_is_an_error_with_its_line() -> None:
    with pytest.raises(ProfileError, match=r"^p.yaml:3: a YAML alias refers to the value"):
        parse_profile("name: x\nserver:\n  cors_origins: &a [*a]\n", "p.yaml")


def test_aliases_that_expand_to_billions_of_values_are_refused_at_once() -> None:
    lines = ["name: x", "l0: &l0 [a, a, a, a, a, a, a, a, a, a]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    with pytest.raises(ProfileError, match=r"^p.yaml:\d+: its YAML aliases expand to more than"):
        parse_profile("\n".join(lines) + "\n", "p.yaml")


def test_yaml_nested_past_the_parsers_depth_is_a_profile_error() -> None:
    with pytest.raises(ProfileError, match=r"^p.yaml: YAML nested too deeply"):
        parse_profile("name: [" + "[" * 5000 + "]" * 5001 + "\n", "p.yaml")


def test_anchors_aliases_and_merge_keys_still_load() -> None:
    text = (
        "name: x\nengine: &e {n_ctx: 512, slots: 2}\n"
        "server:\n  cors_origins: &o [http://a, http://b]\n  image_url_hosts: *o\n"
    )
    profile = parse_profile(text, "p.yaml")
    assert (profile.engine.n_ctx, profile.engine.slots) == (512, 2)
    assert profile.server.image_url_hosts == profile.server.cors_origins == ["http://a", "http://b"]


def test_a_key_given_twice_is_an_error_naming_both_lines() -> None:
    """YAML itself keeps the last value: the first section would be dropped silently."""
    text = "name: x\nengine:\n  n_ctx: 512\nserver:\n  port: 9000\nengine:\n  slots: 3\n"
    with pytest.raises(ProfileError) as exc:
        parse_profile(text, "p.yaml")
    assert str(exc.value) == (
        "p.yaml:6: engine: given twice (first on line 2); YAML would keep only this one: "
        "merge the two"
    )
    twice = r"^p.yaml:4: engine.slots: given twice \(first on line 3\)"
    with pytest.raises(ProfileError, match=twice):
        parse_profile("name: x\nengine:\n  slots: 2\n  slots: 4\n", "p.yaml")
    # YAML merge keys ('<<') are not fields: two of them are not a repeat
    merged = "name: x\nengine:\n  <<: {slots: 2}\n  <<: {n_ctx: 512}\n"
    assert parse_profile(merged).engine.slots == 2


def test_not_a_mapping() -> None:
    with pytest.raises(ProfileError, match="must be a YAML mapping"):
        parse_profile("- a\n- b\n", "p.yaml")


def test_cross_field_rules() -> None:
    with pytest.raises(ProfileError, match=r"context\.window \(2048\) exceeds engine\.n_ctx"):
        parse_profile("name: x\nengine: {n_ctx: 1024}\ncontext: {window: 2048}\n")
    with pytest.raises(ProfileError, match=r"n_ubatch \(512\) must not exceed n_batch"):
        parse_profile("name: x\nengine: {n_batch: 256, n_ubatch: 512}\n")
    one_source = r"one of model\.path, model\.demo, model\.packaged or model\.hf"
    with pytest.raises(ProfileError, match=one_source):
        parse_profile("name: x\nmodel: {path: a.gguf, demo: {size: tiny}}\n")


def test_a_rule_between_fields_points_at_the_field_it_names() -> None:
    text = "name: x\nengine:\n  n_ctx: 512\ncontext:\n  sliding: true\n  window: 9999\n"
    with pytest.raises(ProfileError) as exc:
        parse_profile(text, "p.yaml")
    assert str(exc.value) == "p.yaml:6: context.window (9999) exceeds engine.n_ctx (512)"
    with pytest.raises(ProfileError) as exc:
        parse_profile("name: x\nengine:\n  n_batch: 256\n  n_ubatch: 512\n", "p.yaml")
    assert (
        str(exc.value) == "p.yaml:4: engine.n_ubatch: n_ubatch (512) must not exceed n_batch (256)"
    )


def test_validator_messages_lose_pydantics_prefix() -> None:
    texts = [
        "name: x\nmodel: {path: a.gguf, demo: {size: tiny}}\n",
        "name: x\nengine: {rpc: [nohost]}\n",
        "name: x\nspeculative: {mode: draft}\n",
    ]
    for text in texts:
        with pytest.raises(ProfileError) as exc:
            parse_profile(text, "p.yaml")
        assert "Value error" not in str(exc.value), str(exc.value)
    assert str(exc.value) == "p.yaml:2: speculative.mode: mode draft needs speculative.draft_model"


def test_unknown_profile_name_suggests() -> None:
    with pytest.raises(ProfileError, match="did you mean 'llama2-7b-q4_k_m'"):
        find_profile("llama2-7b-q4km")


def test_missing_profile_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no such profile file"):
        find_profile(tmp_path / "nope.yaml")


def test_a_profile_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_bytes("name: x\nengine:\n  # Größe\n".encode("latin-1"))
    with pytest.raises(ProfileError) as exc:
        load_profile(f)
    assert str(exc.value) == (
        f"{f}:3: not UTF-8 text: byte 0xf6 at offset 22: invalid start byte "
        "(save the file as UTF-8)"
    )


def test_a_fifo_is_not_a_profile_file(tmp_path: Path) -> None:
    """It is there ('no such profile file' said it was not), and reading it would wait."""
    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ProfileError, match=r"p\.yaml: not a regular file"):
        find_profile(fifo)


def test_a_folder_is_not_a_profile_file(tmp_path: Path) -> None:
    """It is there: saying there is no such file would send the user looking for a typo."""
    (tmp_path / "profiles.yaml").mkdir()
    for folder in (tmp_path, tmp_path / "profiles.yaml"):
        with pytest.raises(ProfileError) as caught:
            find_profile(folder)
        assert str(caught.value) == f"{folder}: a folder, not a profile file"


def test_relative_model_path_from_profile_folder(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("name: p\nmodel: {path: models/m.gguf}\n")
    p = load_profile(f)
    assert resolve_model_path(p) == tmp_path.resolve() / "models" / "m.gguf"
    assert resolve_model_path(p, "/other.gguf") == Path("/other.gguf")
    empty = parse_profile("name: e\n")
    with pytest.raises(ProfileError, match="names no model"):
        resolve_model_path(empty)


def test_paths_a_profile_names_start_at_its_folder(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("name: p\nmodel: {path: m.gguf}\n")
    profile = load_profile(str(f))
    assert profile.path_from("m.gguf") == tmp_path / "m.gguf"
    assert profile.path_from("/abs/m.gguf") == Path("/abs/m.gguf")
    assert profile.path_from("~/m.gguf") == Path.home() / "m.gguf"
    assert parse_profile("name: q\n").path_from("m.gguf") == Path("m.gguf")
