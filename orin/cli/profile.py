"""orin-llm profile list | show | validate"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel

from orin.cli.deps import Deps, deps
from orin.cli.errors import EXIT_FAILED, handle_errors
from orin.cli.options import JsonOpt, RootOpt
from orin.cli.output import Output
from orin.errors import LlamaCppError, OrinError
from orin.llamacpp import BuildInfo
from orin.profile.loader import builtin_profiles, load_profile
from orin.profile.validate import validate_profile

app = typer.Typer(help="List, show and validate profiles.")


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
    name: Annotated[str, typer.Argument(help="Built-in profile name or YAML file.")],
    as_json: JsonOpt = False,
) -> None:
    """Every setting of a profile with what it means."""
    p = load_profile(name)
    out = Output(as_json)
    if as_json:
        out.json({"source": str(p.source), **p.model_dump(mode="json")})
        return
    out.table(f"{p.name} ({p.source})", ("field", "value", "meaning"), field_rows(p))


@app.command()
@handle_errors
def validate(
    ctx: typer.Context,
    file: Annotated[str, typer.Argument(help="Profile YAML file or built-in name.")],
    model: Annotated[
        Path | None, typer.Option("--model", help="Check the profile against this GGUF file.")
    ] = None,
    as_json: JsonOpt = False,
    root: RootOpt = Path("/"),
) -> None:
    """Check a profile (and optionally the model it will serve) against the KV rules."""
    profile = load_profile(file)
    build = _build_info_or_none(deps(ctx))
    report = validate_profile(profile, model, build, root)
    out = Output(as_json)
    if as_json:
        out.json(report.to_dict())
    else:
        out.table(
            f"{profile.name}: K={report.type_k} V={report.type_v} flash_attn={report.flash_attn}",
            ("severity", "rule", "finding"),
            ((f.severity, f.rule, f.message) for f in report.findings),
        )
        out.line("valid" if report.ok else "INVALID: fix the errors above")
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


def _build_info_or_none(d: Deps) -> BuildInfo | None:
    try:
        return d.build_info()
    except (LlamaCppError, OrinError):
        return None
