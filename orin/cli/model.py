"""orin-llm model inspect | plan | demo"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from orin.cli.errors import handle_errors
from orin.cli.options import JsonOpt, RootOpt
from orin.cli.output import Output, human_bytes
from orin.errors import OrinError
from orin.model.gguf import ModelInfo, read_model_info
from orin.model.memplan import KV_TYPES, MemoryPlan, plan_memory
from orin.system.memory import read_meminfo
from orin.system.root import SysRoot

app = typer.Typer(help="Inspect GGUF files, plan their memory, generate demo models.")

PathArg = Annotated[Path, typer.Argument(help="GGUF model file.", show_default=False)]


@app.command()
@handle_errors
def inspect(path: PathArg, as_json: JsonOpt = False) -> None:
    """Show a GGUF file's metadata without loading its weights."""
    info = read_model_info(path)
    out = Output(as_json)
    if as_json:
        out.json(info.to_dict())
        return
    out.pairs(str(path), _summary_rows(info))
    out.table(
        "tensor types",
        ("type", "tensors", "parameters", "bytes"),
        ((t.type, t.tensors, f"{t.elements:,}", human_bytes(t.bytes)) for t in info.tensor_types),
    )


def _summary_rows(info: ModelInfo) -> list[tuple[str, Any]]:
    d = info.to_dict()
    rope = info.rope
    scaling = f"{rope.scaling_type} x{rope.scaling_factor}" if rope.scaling_type else "none"
    return [
        ("architecture", info.architecture),
        ("name", info.name),
        ("quantization", f"{info.quantization} (file type {info.file_type})"),
        ("parameters", f"{info.parameter_count:,}"),
        ("file size", human_bytes(info.file_size)),
        ("weights", human_bytes(info.weights_bytes)),
        ("layers", info.n_layer),
        ("attention heads", d["n_head"]),
        ("KV heads", d["n_head_kv"]),
        ("head dim (K/V)", f"{info.head_dim_k}/{info.head_dim_v}"),
        ("embedding size", info.n_embd),
        ("feed-forward size", info.n_ff),
        ("training context", info.n_ctx_train),
        ("RoPE freq base", rope.freq_base),
        ("RoPE scaling", scaling),
        ("vocab size", info.vocab_size),
        ("BOS", f"{info.bos_token_id} {info.bos_token!r}"),
        ("EOS", f"{info.eos_token_id} {info.eos_token!r}"),
        ("chat template", "yes" if info.has_chat_template else "no"),
    ]


def _kv_type(value: str) -> str:
    v = value.lower()
    if v not in KV_TYPES:
        raise typer.BadParameter(f"'{value}' is not one of {', '.join(KV_TYPES)}")
    return v


KVTypeOpt = Annotated[str, typer.Option(callback=_kv_type, help=f"One of {', '.join(KV_TYPES)}.")]


@app.command()
@handle_errors
def plan(
    path: PathArg,
    ctx: Annotated[int, typer.Option("--ctx", min=1, help="Context per slot (tokens).")] = 4096,
    slots: Annotated[int, typer.Option(min=1, help="Concurrent sequences.")] = 1,
    kv_type_k: KVTypeOpt = "f16",
    kv_type_v: KVTypeOpt = "f16",
    n_ubatch: Annotated[int, typer.Option("--ubatch", min=1, help="Micro-batch size.")] = 512,
    flash_attn: Annotated[
        bool, typer.Option("--flash-attn/--no-flash-attn", help="Flash attention.")
    ] = True,
    as_json: JsonOpt = False,
    root: RootOpt = Path("/"),
) -> None:
    """Memory for weights, KV cache and compute buffers against what is available."""
    info = read_model_info(path)
    try:
        available: int | None = read_meminfo(SysRoot(root)).available
    except OrinError:
        available = None
    p = plan_memory(info, ctx, slots, kv_type_k, kv_type_v, available, n_ubatch, flash_attn)
    out = Output(as_json)
    if as_json:
        out.json({"model": str(path), **p.to_dict()})
        return
    _print_plan(out, p)


def _print_plan(out: Output, p: MemoryPlan) -> None:
    fits = {True: "yes", False: "NO", None: "unknown (no /proc/meminfo)"}[p.fits]
    out.pairs(
        f"{p.ctx} tokens x {p.slots} slot(s), K={p.type_k} V={p.type_v}",
        [
            ("KV cells (llama.cpp padding)", p.cells),
            ("weights", human_bytes(p.weights_bytes)),
            ("KV cache K", human_bytes(p.kv_k_bytes)),
            ("KV cache V", human_bytes(p.kv_v_bytes)),
            ("compute buffers (estimate)", human_bytes(p.compute_bytes)),
            ("total", human_bytes(p.total_bytes)),
            ("available (MemAvailable)", human_bytes(p.available_bytes)),
            ("fits", fits),
        ],
    )
    if p.max_ctx_by_kv_type:
        out.table(
            f"largest context per slot that fits ({p.slots} slot(s))",
            ("KV type", "max context"),
            ((t, c if c is not None else "does not fit") for t, c in p.max_ctx_by_kv_type.items()),
        )
    for kv_type, reason in p.unsupported_kv_types.items():
        out.note(f"{kv_type}: not usable with this model ({reason})")


@app.command()
@handle_errors
def demo(
    size: Annotated[str, typer.Option(help="tiny, small or medium.")] = "small",
    quant: Annotated[str, typer.Option(help="f32, f16, q8_0, q6_k, q4_k_m, ...")] = "q4_k_m",
    out_path: Annotated[
        Path | None, typer.Option("--out", help="Write here instead of the cache.")
    ] = None,
) -> None:
    """Generate a deterministic random-weight GGUF model (for demos and tests)."""
    from orin.model import demo as demo_models

    if out_path is None:
        path = demo_models.ensure(size, quant)
    else:
        path = demo_models.generate(size, quant, out_path)
    print(path)
