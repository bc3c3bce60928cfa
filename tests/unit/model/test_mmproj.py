"""The generated vision projector: deterministic, and shaped as clip.cpp's LLaVA
loader reads it, its output as wide as the demo text model's embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from orin.errors import DemoModelError
from orin.model import demo, mmproj


def test_same_size_and_seed_give_the_same_file(tmp_path: Path) -> None:
    a = mmproj.generate("tiny", tmp_path / "a.gguf")
    b = mmproj.generate("tiny", tmp_path / "b.gguf")
    assert a.read_bytes() == b.read_bytes()
    c = mmproj.generate("tiny", tmp_path / "c.gguf", seed=1)
    assert c.read_bytes() != a.read_bytes()


def test_metadata_and_tensors_fit_the_text_model(tmp_path: Path) -> None:
    path = mmproj.generate("small", tmp_path / "p.gguf")
    r = gguf.GGUFReader(path)
    fields = {name: f.contents() for name, f in r.fields.items()}
    assert fields["general.architecture"] == "clip"
    assert fields["clip.projector_type"] == "mlp"
    assert fields["clip.vision.projection_dim"] == demo.SIZES["small"].n_embd
    tensors = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    assert tensors["mm.2.weight"] == [64, demo.SIZES["small"].n_embd]  # ggml order: ne0 first
    assert tensors["v.patch_embd.weight"] == [8, 8, 3, 32]
    assert tensors["v.position_embd.weight"] == [32, mmproj.image_tokens()]
    assert mmproj.image_tokens() == 16


def test_ensure_caches_by_size(tmp_path: Path) -> None:
    path = mmproj.ensure("tiny", tmp_path)
    assert path.name == mmproj.file_name("tiny") and path.is_file()
    stamp = path.stat().st_mtime_ns
    assert mmproj.ensure("tiny", tmp_path).stat().st_mtime_ns == stamp


def test_unknown_sizes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DemoModelError):
        mmproj.file_name("huge")
    with pytest.raises(DemoModelError):
        mmproj.generate("tiny", tmp_path / "x.gguf", seed=-1)


def test_the_memory_plans_count_the_projector(tmp_path: Path) -> None:
    """memory-fit and the service's limits add the projector's weights and compute
    buffer; without its file (not generated yet) they count nothing for it."""
    from orin.install.units import service_plan
    from orin.model.gguf import read_model_info
    from orin.profile.fit import memory_fit, projector_bytes, projector_path
    from orin.profile.loader import parse_profile

    model = demo.ensure("tiny", "f16")
    proj = mmproj.generate("tiny", tmp_path / "p.gguf")
    text = parse_profile("name: t\nmodel: {path: m.gguf}\n")
    vision = parse_profile(f"name: v\nmodel: {{path: m.gguf, mmproj: {proj}}}\n")
    missing = parse_profile("name: v\nmodel: {path: m.gguf, mmproj: nowhere.gguf}\n")
    size = mmproj.read_projector_info(proj).total_bytes
    assert size > 0 and projector_path(vision) == proj
    counted = [projector_bytes(p) for p in (text, vision, missing)]
    assert counted == [0, size, 0]
    info = read_model_info(model)
    base, more = service_plan(text, info), service_plan(vision, info)
    assert more.total_bytes == base.total_bytes + size
    e = text.engine
    fit = memory_fit(info, e, "f16", "f16", True, 2**40, projector_bytes(vision))
    assert fit.plan is not None and fit.plan.total_bytes == base.total_bytes + size


def test_profile_validate_counts_the_projector(tmp_path: Path) -> None:
    """profile validate's memory-fit left the projector out: a vision profile that
    does not fit beside it was called fine (doctor and the unit counted it)."""
    from orin.model.gguf import read_model_info
    from orin.profile.fit import WHY_FAIL, WHY_WARN, memory_fit
    from orin.profile.loader import parse_profile
    from orin.profile.validate import validate_profile

    model = demo.ensure("tiny", "f16")
    proj = mmproj.generate("tiny", tmp_path / "p.gguf")
    size = mmproj.read_projector_info(proj).total_bytes
    text = parse_profile(f"name: t\nmodel: {{path: {model}}}\n")
    vision = parse_profile(f"name: v\nmodel: {{path: {model}, mmproj: {proj}}}\n")
    plan = memory_fit(read_model_info(model), text.engine, "f16", "f16", True, 2**40).plan
    assert plan is not None
    room = plan.total_bytes + size // 2  # the text model fits; with the projector, not
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(
        f"MemTotal: {2 * room // 1024} kB\nMemAvailable: {room // 1024} kB\n"
    )

    def fit_of(profile: object) -> list[str]:
        report = validate_profile(profile, model, None, tmp_path)  # type: ignore[arg-type]
        return [f"{f.severity} {f.message}" for f in report.findings if f.rule == "memory-fit"]

    (alone,) = fit_of(text)  # it fits, within the headroom kept for the runtime
    (beside,) = fit_of(vision)  # it does not
    assert WHY_WARN in alone and "projector" not in alone
    assert WHY_FAIL in beside and "+ vision projector 0.00 GiB" in beside


def test_a_truncated_projector_is_named_as_one_by_inspect_and_list(tmp_path: Path) -> None:
    """It was shown by inspect as a good projector (exit 0), and by list as 'a vision
    projector, not a language model'; llama.cpp maps the missing bytes."""
    from typer.testing import CliRunner

    from orin.cli.app import app

    folder = tmp_path / "models"
    folder.mkdir()
    path = mmproj.generate("tiny", folder / "mmproj.gguf")
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(mmproj.BrokenProjector, match=r"truncated GGUF file \(a vision projector\)"):
        mmproj.read_projector_info(path)
    r = CliRunner().invoke(app, ["model", "inspect", str(path)])
    assert r.exit_code == 3 and r.stdout == ""
    assert r.stderr.startswith(f"orin-llm: {path}: truncated GGUF file (a vision projector): ")
    r = CliRunner().invoke(app, ["model", "list", "--dir", str(folder), "--json"])
    (listed,) = json.loads(r.stdout)["models"]
    assert listed["quantization"] is None
    assert listed["problem"].startswith(f"{path}: truncated GGUF file (a vision projector)")
