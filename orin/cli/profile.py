"""orin-llm profile list | show | validate

``validate`` exits 0 when no finding fails, 1 when one does, 4 when the profile
cannot be loaded, 3 when a --model file cannot be read. A profile whose
``model.path`` names a file that is not there fails (rule ``model-file``, the
check doctor makes): serve would stop on it, so the profile is not ready to serve.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel

from orin.cli.deps import Deps, deps
from orin.cli.errors import EXIT_FAILED, handle_errors
from orin.cli.help import Typer
from orin.cli.options import BoardRootOpt, CtxOpt, JsonOpt, apply_ctx, named, path_named
from orin.cli.output import Output
from orin.doctor.context import model_path_for
from orin.engine.config import draft_model_problem, mmproj_problem, prompt_file_problems
from orin.errors import LlamaCppError, ModelFileError, OrinError, ProfileError
from orin.llamacpp import BuildInfo
from orin.profile.kvmatch import KVFinding
from orin.profile.loader import builtin_profiles, load_profile
from orin.profile.schema import Profile
from orin.profile.validate import ValidationReport, validate_profile

app = Typer(help="List, show and validate profiles.")


@app.command("list")
@handle_errors
def list_profiles(as_json: JsonOpt = False) -> None:
    """Built-in profiles."""
    rows = []
    for name, path in builtin_profiles().items():
        p = load_profile(path)
        quant = p.model.quantization or (p.model.demo.quant.upper() if p.model.demo else None)
        rows.append(
            {"name": name, "board": p.board, "quantization": quant, "description": p.description}
        )
    out = Output(as_json)
    if as_json:
        out.json(rows)
        return
    out.table(
        "built-in profiles",
        ("name", "board", "quantization", "description"),
        ((r["name"], r["board"], r["quantization"], r["description"]) for r in rows),
        keep=("name", "board", "quantization"),
    )


def field_rows(model: BaseModel, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """(dotted field, value, description) for every leaf field of a profile."""
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        path = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            yield from field_rows(value, path + ".")
        else:
            yield path, value, info.description or ""


@app.command()
@handle_errors
def show(
    name: Annotated[
        str, typer.Argument(callback=named, help="Built-in profile name or YAML file.")
    ],
    as_json: JsonOpt = False,
) -> None:
    """Every setting of a profile with what it means."""
    p = load_profile(name)
    out = Output(as_json)
    if as_json:
        out.json({"source": str(p.source), **p.model_dump(mode="json")})
        return
    out.table(
        f"{p.name} ({p.source})", ("field", "value", "meaning"), field_rows(p), keep=("field",)
    )


@app.command()
@handle_errors
def validate(
    ctx: typer.Context,
    file: Annotated[
        str, typer.Argument(callback=named, help="Profile YAML file or built-in name.")
    ],
    model: Annotated[
        Path | None,
        typer.Option(
            "--model", parser=path_named, help="Check the profile against this GGUF file."
        ),
    ] = None,
    n_ctx: CtxOpt = None,
    as_json: JsonOpt = False,
    root: BoardRootOpt = Path("/"),
) -> None:
    """Check a profile (and optionally the model it will serve) against the KV rules."""
    profile = apply_ctx(load_profile(file), n_ctx)
    build = _build_info_or_none(deps(ctx))
    if model is not None:
        report = validate_profile(profile, model, build, root)
    else:
        report = _with_own_model(profile, build, root)
    report = _with_prompt_dir(report, profile)
    served = model if model is not None else model_path_for(profile, None)[0]
    report = _with_draft_model(report, profile, served)
    report = _with_mmproj(report, profile)
    out = Output(as_json)
    if as_json:
        out.json(report.to_dict())
    else:
        kv = f"K={report.type_k} V={report.type_v} flash_attn={report.flash_attn}"
        title = f"{profile.name}: {kv}"
        if report.findings:
            out.table(
                title,
                ("severity", "rule", "finding"),
                ((f.severity, f.rule, f.message) for f in report.findings),
                keep=("severity", "rule"),
            )
        else:  # every setting explicit and allowed: no table of no rows
            out.line(f"{title}: no findings")
        out.line("valid" if report.ok else "INVALID: fix the errors above")
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


def _with_own_model(profile: Profile, build: BuildInfo | None, root: Path) -> ValidationReport:
    """The profile against the file serve would load: its model.path, or its hub model
    (model.hf) once pulled, read as --model reads a file, so that ``auto`` resolves to
    the KV types serve picks for that file's quantization. A file that is missing, not
    pulled or unreadable fails the model-file rule (doctor's check), as it stops serve
    with exit 3. A demo or packaged model is made or fetched when serve starts, so it
    is not required here."""
    path, source = model_path_for(profile, None)
    problem = None
    if source == "hf" and path is None:
        problem = (
            f"model.hf {profile.model.hf} is not pulled yet: serve would stop (exit 3); "
            f"run: orin-llm model pull {profile.model.hf}"
        )
    elif source in ("profile", "hf") and path is not None and not path.exists():
        problem = (
            f"model.path {path} does not exist: serve would stop (exit 3); put the file "
            "there, or check the profile against another file with --model PATH"
        )
    elif source in ("profile", "hf") and path is not None:
        try:
            return validate_profile(profile, path, build, root)
        except ModelFileError as exc:
            problem = f"{exc}: serve would stop (exit 3)"
    report = validate_profile(profile, None, build, root)
    if problem is None and path is None and source != "hf":  # no model named at all
        # a base profile for `serve --model FILE` is valid; used alone it stops serve
        none = f"{source} (serve and tune run stop with exit 4 without it)"
        return dataclasses.replace(
            report, findings=(*report.findings, KVFinding("model-file", "warn", none))
        )
    if problem is None:
        return report
    finding = KVFinding("model-file", "fail", problem)
    return dataclasses.replace(report, findings=(*report.findings, finding))


def _with_prompt_dir(report: ValidationReport, profile: Profile) -> ValidationReport:
    """prompt_cache.prompt_dir must be a folder whose prompt files are UTF-8 text, or
    serve stops at start (doctor's prompt-cache check)."""
    try:
        problems = prompt_file_problems(profile)
    except ProfileError as exc:
        problems = [str(exc)]
    findings = (
        KVFinding("prompt-cache", "fail", f"{p}: serve would stop (exit 4)") for p in problems
    )
    return dataclasses.replace(report, findings=(*report.findings, *findings))


def _with_draft_model(
    report: ValidationReport, profile: Profile, served: Path | None
) -> ValidationReport:
    """With speculative.mode draft, the draft model must read as a GGUF file with the
    ``served`` model's vocabulary, or serve stops at start (doctor's draft-model
    check)."""
    draft = draft_model_problem(profile, served)
    if draft is None or draft[1] is None:
        return report
    finding = KVFinding(
        "draft-model", "fail", f"speculative.draft_model: {draft[1]}: serve would stop (exit 3)"
    )
    return dataclasses.replace(report, findings=(*report.findings, finding))


def _with_mmproj(report: ValidationReport, profile: Profile) -> ValidationReport:
    """model.mmproj must read as a projector GGUF, or serve stops at start (doctor's
    mmproj check)."""
    problem = mmproj_problem(profile)
    if problem is None:
        return report
    message = f"model.mmproj: {problem[1]}: serve would stop (exit 3)"
    finding = KVFinding("mmproj", "fail", message)
    return dataclasses.replace(report, findings=(*report.findings, finding))


def _build_info_or_none(d: Deps) -> BuildInfo | None:
    try:
        return d.build_info()
    except (LlamaCppError, OrinError):
        return None
