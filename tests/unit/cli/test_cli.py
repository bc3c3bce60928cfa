from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orin.cli.app import app
from tests.fakes.board import FakeBoard, GiB
from tests.ggufutil import LLAMA2_7B, write_gguf

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), env={"COLUMNS": "240"})
    return result.exit_code, result.stdout, result.stderr


def test_inspect_json(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    code, out, _ = invoke("model", "inspect", str(path), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["quantization"] == "Q4_K_M"
    assert data["n_head_kv"] == 32 and data["n_layer"] == 32


def test_inspect_table(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    code, out, _ = invoke("model", "inspect", str(path))
    assert code == 0
    assert "Q4_K_M (file type 15)" in out and "training context" in out


def test_inspect_errors_are_one_line() -> None:
    for target in ("/etc/passwd", "/nonexistent/model.gguf", "/"):
        code, out, err = invoke("model", "inspect", target)
        assert code == 3, (target, err)
        assert out == ""
        assert len(err.strip().splitlines()) == 1
        assert "Traceback" not in err


def test_a_vision_projector_is_inspected_as_one_and_refused_by_plan(tmp_path: Path) -> None:
    """`model list` calls a projector GGUF a vision projector; `model inspect` shows its
    metadata, and the commands that need a language model say what the file is instead
    of naming a metadata key it lacks."""
    from orin.model import mmproj

    path = mmproj.generate("tiny", tmp_path / "mmproj.gguf")
    code, out, err = invoke("model", "inspect", str(path))
    assert code == 0, err
    assert "vision projector (model.mmproj of a profile)" in out and "mlp" in out
    code, out, _ = invoke("model", "inspect", str(path), "--json")
    data = json.loads(out)
    assert code == 0 and data["kind"] == "vision projector" and data["projector_type"] == "mlp"
    assert data["path"] == str(path)
    code, out, err = invoke("model", "plan", str(path))
    assert code == 3 and out == ""
    assert err.strip() == (
        f"orin-llm: {path}: a vision projector (mmproj), not a language model; a profile "
        "names it as model.mmproj beside the model it serves"
    )


def test_model_list_shows_every_folder_serve_finds_models_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, root = tmp_path / "cache" / "models", tmp_path / "root"
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(cache.parent))
    cache.mkdir(parents=True)
    root.mkdir()
    write_gguf(cache / "m.gguf", params=LLAMA2_7B, file_type=15)
    service = root / "var/lib/orin-llm/models"
    code, out, err = invoke("model", "list", "--root", str(root))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].strip() == f"{cache} (user cache)"
    assert "m.gguf" in out and "Q4_K_M" in out
    assert lines[-1] == f"{service} (installed service's): no such folder"
    code, out, _ = invoke("model", "list", "--root", str(root), "--json")
    data = json.loads(out)
    assert [(d["dir"], d["exists"]) for d in data["dirs"]] == [
        (str(cache), True),
        (str(service), False),
    ]
    assert [(m["name"], m["dir"]) for m in data["models"]] == [("m.gguf", str(cache))]
    service.mkdir(parents=True)
    code, out, _ = invoke("model", "list", "--root", str(root))
    assert out.splitlines()[-1] == f"{service} (installed service's): no GGUF files"
    code, out, err = invoke("model", "rm", "m.gguf", "--root", str(root), "--yes")
    assert code == 0, err  # found where model list shows it, without --dir
    assert not (cache / "m.gguf").exists()


def test_model_list_names_a_vision_projector_as_one(tmp_path: Path) -> None:
    from orin.model import mmproj

    mmproj.generate("tiny", tmp_path / "mmproj-tiny.gguf")
    write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    code, out, err = invoke("model", "list", "--dir", str(tmp_path), "--json")
    assert code == 0, err
    found = {m["name"]: (m["quantization"], m["problem"]) for m in json.loads(out)["models"]}
    assert found == {
        "mmproj-tiny.gguf": ("vision projector (mlp)", None),
        "m.gguf": ("Q4_K_M", None),
    }


def test_plan_json_against_fake_board(tmp_path: Path, board: FakeBoard) -> None:
    board.meminfo(total=64 * GiB, available=48 * GiB)
    path = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B)
    code, out, err = invoke(
        "model",
        "plan",
        str(path),
        "--ctx",
        "512",
        "--slots",
        "1",
        "--kv-type-k",
        "f16",
        "--kv-type-v",
        "f16",
        "--json",
        "--root",
        str(board.base),
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["kv_bytes"] == 256 << 20
    assert data["available_bytes"] == 48 * GiB
    assert data["fits"] is True
    assert data["max_ctx_by_kv_type"]["q4_0"] > data["max_ctx_by_kv_type"]["f16"]


def test_plan_without_meminfo_says_unknown(tmp_path: Path, board: FakeBoard) -> None:
    path = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B)
    code, out, _ = invoke("model", "plan", str(path), "--root", str(board.base))
    assert code == 0  # an unknown fit is not a failure
    assert "unknown" in out


def test_plan_rejects_unknown_kv_type(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B)
    code, _, err = invoke("model", "plan", str(path), "--kv-type-k", "q3_k")
    assert code == 2
    assert "q3_k" in err


def test_profile_list_and_show() -> None:
    code, out, _ = invoke("profile", "list", "--json")
    assert code == 0
    names = {p["name"] for p in json.loads(out)}
    assert {"demo", "llama3.1-8b-q4_k_m"} <= names
    code, out, _ = invoke("profile", "show", "llama2-7b-q4_k_m")
    assert code == 0
    assert "engine.n_ctx" in out and "Context (KV cells) per slot" in out
    code, out, _ = invoke("profile", "show", "llama2-7b-q4_k_m", "--json")
    assert json.loads(out)["engine"]["flash_attn"] == "on"


def validate_kv(tmp_path: Path, name: str, flash_attn: str) -> tuple[int, str, str]:
    """`profile validate` of a Q4_K_M profile with a q8_0 cache and ``flash_attn``."""
    f = tmp_path / "p.yaml"
    f.write_text(
        f"name: {name}\nmodel: {{demo: {{size: tiny, quant: q4_k_m}}, quantization: Q4_K_M}}\n"
        f"engine: {{type_k: q8_0, type_v: q8_0, flash_attn: {flash_attn}}}\n"
    )
    return invoke("profile", "validate", str(f))


def test_validate_rejects_quantized_v_without_flash_attention(tmp_path: Path) -> None:
    code, out, _ = validate_kv(tmp_path, "bad", "off")
    assert code == 1
    assert "kv-quant-v-needs-fa" in out
    code, out, _ = invoke("profile", "validate", str(tmp_path / "p.yaml"), "--json")
    data = json.loads(out)
    assert data["valid"] is False
    assert [x["rule"] for x in data["findings"] if x["severity"] == "fail"] == [
        "kv-quant-v-needs-fa"
    ]


def test_validate_without_findings_prints_no_empty_table(tmp_path: Path) -> None:
    """Every KV setting explicit and allowed (what tune writes): one line, not a table
    with headers and no rows."""
    code, out, _ = validate_kv(tmp_path, "tuned", "'on'")
    assert code == 0
    assert out.splitlines() == ["tuned: K=q8_0 V=q8_0 flash_attn=on: no findings", "valid"]


def test_validate_warns_of_a_profile_that_names_no_model(tmp_path: Path) -> None:
    """Valid as a base for `serve --model FILE`, but alone it stops serve with exit 4:
    it said "valid" and nothing else."""
    f = tmp_path / "base.yaml"
    f.write_text("name: base\n")
    code, out, _ = invoke("profile", "validate", str(f), "--json")
    data = json.loads(out)
    assert code == 0 and data["valid"] is True
    found = [x for x in data["findings"] if x["rule"] == "model-file"]
    assert [x["severity"] for x in found] == ["warn"]
    assert "names no model" in found[0]["message"] and "exit 4" in found[0]["message"]
    code, out, _ = invoke("profile", "validate", str(f), "--model", str(tmp_path / "m.gguf"))
    assert "names no model" not in out  # given with --model: nothing missing


def test_validate_typo_names_line(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("name: t\nengine:\n  n_ctx: 2048\n  flash_atn: on\n")
    code, _, err = invoke("profile", "validate", str(f))
    assert code == 4
    assert (
        err.strip()
        == f"orin-llm: {f}:4: engine.flash_atn: unknown field; did you mean 'flash_attn'?"
    )


def test_validate_names_the_window_line_without_pydantics_prefix(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("name: t\nengine:\n  n_ctx: 512\ncontext:\n  window: 9999\n")
    code, _, err = invoke("profile", "validate", str(f))
    assert code == 4
    assert err.strip() == f"orin-llm: {f}:5: context.window (9999) exceeds engine.n_ctx (512)"
    f.write_text("name: t\nengine:\n  rpc: [nohost]\n")
    code, _, err = invoke("profile", "validate", str(f))
    assert code == 4
    assert (
        err.strip()
        == f"orin-llm: {f}:3: engine.rpc: 'nohost' is not host:port: the port is missing"
    )


def test_validate_builtin_resolves_kv_and_needs_its_model_file(tmp_path: Path) -> None:
    code, out, _ = invoke("profile", "validate", "llama3.1-8b-q4_k_m", "--json")
    data = json.loads(out)
    assert (data["type_k"], data["type_v"], data["flash_attn"]) == ("q8_0", "q8_0", "on")
    # the profile's model.path is not on this machine: serve would stop, so not valid
    assert code == 1 and data["valid"] is False
    failed = [x for x in data["findings"] if x["severity"] == "fail"]
    assert [x["rule"] for x in failed] == ["model-file"]
    assert "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf does not exist" in failed[0]["message"]


def test_validate_a_profile_whose_model_file_exists(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    f = tmp_path / "p.yaml"
    f.write_text("name: here\nmodel: {path: m.gguf, quantization: Q4_K_M}\n")
    code, out, err = invoke("profile", "validate", str(f))
    assert code == 0, err
    assert out.strip().endswith("valid") and "model-file" not in out
    (tmp_path / "m.gguf").unlink()
    code, out, _ = invoke("profile", "validate", str(f))
    assert code == 1 and "model-file" in out and "INVALID" in out


def test_validate_reads_the_profiles_own_model_as_serve_does(tmp_path: Path) -> None:
    """Without --model, the file of model.path decides 'auto' as it does for serve (it
    was left unread: f16 for a Q4_K_M file that serve runs with q8_0), and a file serve
    would refuse fails the model-file rule instead of passing."""
    model = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    f = tmp_path / "p.yaml"
    f.write_text("name: here\nmodel: {path: m.gguf}\n")
    code, out, err = invoke("profile", "validate", str(f), "--json")
    data = json.loads(out)
    assert code == 0, err
    assert (data["type_k"], data["type_v"], data["flash_attn"]) == ("q8_0", "q8_0", "on")
    assert data["model"] == str(model)
    model.write_bytes(model.read_bytes()[:100])
    code, out, _ = invoke("profile", "validate", str(f), "--json")
    failed = [x for x in json.loads(out)["findings"] if x["severity"] == "fail"]
    assert code == 1 and [x["rule"] for x in failed] == ["model-file"]
    assert failed[0]["message"].startswith(f"{model}: truncated or corrupt GGUF file")


def test_validate_names_the_pull_for_a_hub_model_not_pulled_yet(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("name: hub\nmodel: {hf: 'owner/repo:never-pulled-7f3a.gguf'}\n")
    code, out, _ = invoke("profile", "validate", str(f), "--json")
    failed = [x for x in json.loads(out)["findings"] if x["severity"] == "fail"]
    assert code == 1 and [x["rule"] for x in failed] == ["model-file"]
    assert "run: orin-llm model pull owner/repo:never-pulled-7f3a.gguf" in failed[0]["message"]


def test_validate_fails_a_prompt_dir_serve_could_not_read(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(
        "name: pc\nmodel: {demo: {size: tiny, quant: f16}}\nprompt_cache: {prompt_dir: p}\n"
    )
    code, out, _ = invoke("profile", "validate", str(f), "--json")
    failed = [x for x in json.loads(out)["findings"] if x["severity"] == "fail"]
    assert code == 1 and [x["rule"] for x in failed] == ["prompt-cache"]
    assert failed[0]["message"] == (
        f"{f}: prompt_cache.prompt_dir: {tmp_path / 'p'} is not a directory: "
        "serve would stop (exit 4)"
    )
    (tmp_path / "p").mkdir()
    code, out, _ = invoke("profile", "validate", str(f), "--json")
    assert code == 0 and "prompt-cache" not in out


def test_a_prompt_file_that_is_not_utf8_fails_validate_as_it_stops_serve(
    tmp_path: Path, tiny_f16: Path
) -> None:
    """validate fails on the file serve would stop on (exit 4), with serve's own words:
    the file, the offset and line of the first byte that is not UTF-8."""
    from tests.serverutil import free_port

    (tmp_path / "p").mkdir()
    bad = tmp_path / "p" / "greeting.txt"
    bad.write_bytes("Grüß Gott\n".encode("latin-1"))
    f = tmp_path / "p.yaml"
    f.write_text(
        f"name: pc\nmodel: {{path: {tiny_f16}}}\n"
        f"prompt_cache: {{prompt_dir: p, directory: {tmp_path / 'states'}}}\n"
    )
    said = (
        f"{f}: prompt_cache.prompt_dir: cannot read {bad}: not UTF-8 text: byte 0xfc at "
        "offset 2 (line 1): invalid start byte (save the file as UTF-8)"
    )
    code, out, _ = invoke("profile", "validate", str(f), "--json")
    failed = [x for x in json.loads(out)["findings"] if x["severity"] == "fail"]
    assert code == 1 and [x["message"] for x in failed] == [f"{said}: serve would stop (exit 4)"]
    code, _, err = invoke("serve", "--profile", str(f), "--port", str(free_port()))
    assert code == 4 and err.strip() == f"orin-llm: {said}"
    assert not (tmp_path / "states").exists()  # stopped before anything was computed
    bad.write_text("Grüß Gott\n", encoding="utf-8")
    code, out, _ = invoke("profile", "validate", str(f), "--json")
    assert code == 0 and "prompt-cache" not in out


def test_validate_takes_a_packaged_models_quantization_from_the_package(tmp_path: Path) -> None:
    """No quantization in the profile, no file needed: the KV types serve will pick."""
    f = tmp_path / "p.yaml"
    f.write_text("name: pk\nmodel: {packaged: smollm2-135m-instruct}\n")
    code, out, _ = invoke("profile", "validate", str(f), "--json")
    data = json.loads(out)
    assert code == 0 and (data["type_k"], data["type_v"]) == ("q8_0", "q8_0")


def test_validate_with_model_checks_quantization(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=7)  # Q8_0
    code, out, _ = invoke(
        "profile", "validate", "llama2-7b-q4_k_m", "--model", str(model), "--json"
    )
    assert code == 0
    data = json.loads(out)
    assert "model-quantization" in {x["rule"] for x in data["findings"]}
    assert data["type_k"] == "q8_0"


def test_version() -> None:
    code, out, _ = invoke("--version")
    assert code == 0 and out.startswith("orin-llm ")
