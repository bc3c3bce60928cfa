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
        *_kv_rows(info),
    ]


def _kv_rows(info: ModelInfo) -> list[tuple[str, Any]]:
    """What decides the KV cache: layout, sliding window, experts, recurrent state."""
    rows: list[tuple[str, Any]] = [
        ("KV layout", info.kv_layout + ("" if info.kv_exact else " (planner estimates)"))
    ]
    if info.n_swa_layers:
        swa = [i for i, s in enumerate(info.swa_layers) if s]
        rows.append(
            (
                "sliding window",
                f"{info.sliding_window} tokens on {len(swa)} of {info.n_layer} layers "
                f"({_ranges(swa)})",
            )
        )
        if info.head_dim_k_swa is not None or info.head_dim_v_swa is not None:
            k, v = info.head_dims(swa[0])
            rows.append(("head dim on window layers (K/V)", f"{k}/{v}"))
    elif "sliding_window_metadata" in info.extra:
        window = info.extra["sliding_window_metadata"]
        if info.kv_exact:
            rows.append(("sliding window", f"none (llama.cpp ignores the file's {window})"))
        else:
            rows.append(("sliding window", f"{window} tokens (layers not known to the planner)"))
    if info.is_moe:
        ff = f", {info.n_ff_exp} FFN each" if info.n_ff_exp else ""
        rows.append(("experts", f"{info.n_expert_used} of {info.n_expert} per token{ff}"))
    if info.recurrent_state is not None:
        st = info.recurrent_state
        rows.append(("recurrent state per layer", f"r {st.r} + s {st.s} values (f32)"))
    if info.kv_note:
        rows.append(("KV note", info.kv_note))
    return rows


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 4]`` -> ``0-2, 4``."""
    parts: list[str] = []
    start = prev = layers[0]
    for il in [*layers[1:], None]:
        if il is not None and il == prev + 1:
            prev = il
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if il is not None:
            start = prev = il
    return ", ".join(parts)


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
    n_batch: Annotated[
        int | None, typer.Option("--batch", min=1, help="Batch size (default: the micro-batch).")
    ] = None,
    flash_attn: Annotated[
        bool, typer.Option("--flash-attn/--no-flash-attn", help="Flash attention.")
    ] = True,
    swa_full: Annotated[
        bool,
        typer.Option(
            "--swa-full/--no-swa-full",
            help="Sliding-window layers cache the whole context or only the window "
            "(the default, as the engine runs unless the profile sets engine.swa_full).",
        ),
    ] = False,
    as_json: JsonOpt = False,
    root: RootOpt = Path("/"),
) -> None:
    """Memory for weights, KV cache and compute buffers against what is available."""
    info = read_model_info(path)
    try:
        available: int | None = read_meminfo(SysRoot(root)).available
    except OrinError:
        available = None
    p = plan_memory(
        info, ctx, slots, kv_type_k, kv_type_v, available, n_ubatch, flash_attn, n_batch, swa_full
    )
    out = Output(as_json)
    if as_json:
        model = {
            "architecture": info.architecture,
            "kv_layout": info.kv_layout,
            "sliding_window": info.sliding_window,
            "swa_layers": info.n_swa_layers,
            "n_expert": info.n_expert,
            "n_expert_used": info.n_expert_used,
        }
        out.json({"model": str(path), "model_info": model, **p.to_dict()})
        return
    _print_plan(out, info, p)
    if info.n_swa_layers:
        other = plan_memory(
            info,
            ctx,
            slots,
            kv_type_k,
            kv_type_v,
            None,
            n_ubatch,
            flash_attn,
            n_batch,
            not swa_full,
        )
        _note_swa(out, p, other)


def _print_plan(out: Output, info: ModelInfo, p: MemoryPlan) -> None:
    fits = {True: "yes", False: "NO", None: "unknown (no /proc/meminfo)"}[p.fits]
    kv_label = " (estimate)" if p.kv_estimated else ""
    experts = f", all {info.n_expert} experts" if info.is_moe else ""
    rows: list[tuple[str, Any]] = [("KV cells (llama.cpp padding)", p.cells)]
    window = next((c for c in p.kv_caches if c.kind == "swa"), None)
    if window is not None:
        rows.append(
            (
                "KV cells per slot",
                f"{p.cells // p.slots} on full-attention layers, {window.cells_per_seq} on "
                f"{window.layers} sliding-window layers (window {info.sliding_window})",
            )
        )
    rows += [
        (f"weights (exact{experts})", human_bytes(p.weights_bytes)),
        (f"KV cache K{kv_label}", human_bytes(p.kv_k_bytes)),
        (f"KV cache V{kv_label}", human_bytes(p.kv_v_bytes)),
    ]
    if p.state_bytes or info.kv_layout in ("recurrent", "hybrid"):
        rows.append(("recurrent state (estimate)", human_bytes(p.state_bytes)))
    rows += [
        ("compute buffers (estimate)", human_bytes(p.compute_bytes)),
        ("total", human_bytes(p.total_bytes)),
        ("available (MemAvailable)", human_bytes(p.available_bytes)),
        ("fits", fits),
    ]
    out.pairs(f"{p.ctx} tokens x {p.slots} slot(s), K={p.type_k} V={p.type_v}", rows)
    if p.max_ctx_by_kv_type:
        out.table(
            f"largest context per slot that fits ({p.slots} slot(s))",
            ("KV type", "max context"),
            ((t, c if c is not None else "does not fit") for t, c in p.max_ctx_by_kv_type.items()),
        )
    for kv_type, reason in p.unsupported_kv_types.items():
        out.note(f"{kv_type}: not usable with this model ({reason})")
    if p.kv_estimated:
        out.note(f"KV figures are estimates for the '{info.kv_layout}' layout: {info.kv_note}")


def _note_swa(out: Output, p: MemoryPlan, other: MemoryPlan) -> None:
    """The sliding-window cache under the other swa_full setting, for comparison."""
    if p.swa_full:
        out.note(
            f"sliding-window layers cache the whole context (engine.swa_full: true); "
            f"without it (--no-swa-full, the default) they hold only the window: KV "
            f"{human_bytes(other.kv_bytes)} instead of {human_bytes(p.kv_bytes)}"
        )
    else:
        out.note(
            f"sliding-window layers hold only the window (the default): that cache cannot "
            f"shift positions (the context stops at its end instead of sliding) or keep old "
            f"prompt cells; engine.swa_full: true (--swa-full) slides, with "
            f"{human_bytes(other.kv_bytes)} of KV"
        )


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
