"""orin-llm model pull | list | rm | inspect | plan | demo"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from orin.cli.deps import deps
from orin.cli.errors import EXIT_FAILED, EXIT_INTERRUPTED, fail, handle_errors, usage_error
from orin.cli.help import Typer
from orin.cli.options import (
    CtxOpt,
    JsonOpt,
    RootOpt,
    file_to_write,
    folder_named,
    folder_to_write,
    named,
    path_named,
)
from orin.cli.output import DownloadBar, Output, human_bytes, progress_wanted
from orin.errors import ModelFileError, OrinError, ProfileError
from orin.model import store
from orin.model.gguf import ModelInfo, read_model_info
from orin.model.hub import Chown
from orin.model.memplan import KV_TYPES, MemoryPlan, plan_memory
from orin.model.mmproj import ProjectorInfo
from orin.profile.kvmatch import QUANTIZED_KV, check_kv
from orin.profile.schema import EngineSection, Profile
from orin.system.commands import CommandRunner
from orin.system.memory import read_meminfo
from orin.system.root import SysRoot

app = Typer(
    help="Pull, list and remove models; inspect GGUF files, plan their memory, "
    "generate demo models."
)
DEFAULT_CTX = 4096

PathArg = Annotated[
    Path, typer.Argument(parser=path_named, help="GGUF model file.", show_default=False)
]


@app.command()
@handle_errors
def inspect(path: PathArg, as_json: JsonOpt = False) -> None:
    """Show a GGUF file's metadata without loading its weights (a vision projector's too)."""
    try:
        info = read_model_info(path)
    except ModelFileError:
        proj = _projector_info(path)
        if proj is None:
            raise
        _show_projector(Output(as_json), path, proj)
        return
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


def _projector_info(path: Path) -> ProjectorInfo | None:
    from orin.model import mmproj

    try:
        return mmproj.read_projector_info(path)
    except mmproj.BrokenProjector as exc:
        raise ModelFileError(f"{path}: {exc}") from exc
    except (ValueError, OSError, KeyError, IndexError):
        return None


def _show_projector(out: Output, path: Path, proj: ProjectorInfo) -> None:
    if out.as_json:
        out.json({"kind": "vision projector", **asdict(proj), "path": str(path)})
        return
    side = proj.image_size // proj.patch_size if proj.patch_size else 0
    out.pairs(
        str(path),
        [
            ("kind", "vision projector (model.mmproj of a profile)"),
            ("projector type", proj.projector_type or "unknown"),
            ("vision encoder", "yes" if proj.has_vision else "no"),
            ("layers", proj.n_layer),
            ("attention heads", proj.n_head),
            ("embedding size", proj.n_embd),
            ("feed-forward size", proj.n_ff),
            ("image size", f"{proj.image_size} px, patches of {proj.patch_size} ({side}x{side})"),
            ("output width", proj.output_width or "unknown"),
            ("weights", human_bytes(proj.weights_bytes)),
            ("compute buffer (estimate)", human_bytes(proj.compute_bytes)),
        ],
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
    ctx: CtxOpt = None,
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
    draft_model: Annotated[
        Path | None,
        typer.Option(
            "--draft-model",
            parser=path_named,
            help="A speculative draft model loaded beside it (speculative.draft_model): its "
            "weights, f16 KV cache and compute buffers are counted.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    root: RootOpt = Path("/"),
) -> None:
    """Memory for weights, KV cache and compute buffers against what is available."""
    ctx = ctx if ctx is not None else DEFAULT_CTX
    _check_batches(n_ubatch, n_batch)
    info = read_model_info(path)
    draft = read_model_info(draft_model) if draft_model is not None else None
    try:
        available: int | None = read_meminfo(SysRoot(root)).available
    except OrinError:
        available = None
    p = plan_memory(
        info,
        ctx,
        slots,
        kv_type_k,
        kv_type_v,
        available,
        n_ubatch,
        flash_attn,
        n_batch,
        swa_full,
        draft=draft,
    )
    refused = _refusals(kv_type_k, kv_type_v, flash_attn)
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
        data = {"model": str(path), "model_info": model, **p.to_dict(), "refused": refused}
        if refused:
            data["fits"] = False
        if not flash_attn:
            data["max_ctx_usable_by_kv_type"] = {
                t: (None if t in QUANTIZED_KV else c)
                for t, c in data["max_ctx_usable_by_kv_type"].items()
            }
        out.json(data)
    else:
        _print_plan(out, info, p, refused)
    if info.n_swa_layers and not as_json:
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
    if refused or p.fits is False:  # a script can tell, as from profile validate's fail
        raise typer.Exit(EXIT_FAILED)


def _check_batches(n_ubatch: int, n_batch: int | None) -> None:
    """A micro-batch larger than the batch is refused as a profile refuses it
    (engine.n_ubatch above engine.n_batch): a usage error, not a plan for a
    configuration no profile can hold."""
    if n_batch is not None and n_ubatch > n_batch:
        raise usage_error(
            f"--ubatch {n_ubatch} exceeds --batch {n_batch}: a micro-batch is part of a "
            "batch (engine.n_ubatch must not exceed engine.n_batch)"
        )


def _refusals(type_k: str, type_v: str, flash_attn: bool) -> list[str]:
    """What llama.cpp refuses in this K/V configuration: the rule ``profile validate``
    applies (kvmatch.check_kv), so plan never says a refused configuration fits."""
    findings = check_kv(type_k, type_v, "on" if flash_attn else "off", EngineSection(), None)
    return [f.message for f in findings if f.severity == "fail"]


def _print_plan(out: Output, info: ModelInfo, p: MemoryPlan, refused: list[str]) -> None:
    fits = {True: "yes", False: "NO", None: "unknown (no /proc/meminfo)"}[p.fits]
    if refused:
        fits = "NO: llama.cpp refuses this configuration (below)"
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
    rows.append(("compute buffers (estimate)", human_bytes(p.compute_bytes)))
    if p.draft_bytes:
        rows.append(("draft model (weights, KV, compute)", human_bytes(p.draft_bytes)))
    rows += [
        ("total", human_bytes(p.total_bytes)),
        ("available (MemAvailable)", human_bytes(p.available_bytes)),
        ("fits", fits),
    ]
    out.pairs(f"{p.ctx} tokens x {p.slots} slot(s), K={p.type_k} V={p.type_v}", rows)
    for message in refused:
        out.note(f"refused: {message}")
    if p.ctx_train and p.ctx > p.ctx_train:
        out.note(
            f"--ctx {p.ctx} is past the model's training context ({p.ctx_train}): answers "
            "degrade past it unless the profile sets RoPE scaling for it"
        )
    if p.max_ctx_by_kv_type:
        out.table(
            f"largest context per slot that fits ({p.slots} slot(s))",
            ("KV type", "max context"),
            (
                (t, _max_ctx_cell(t, c, p, info.n_ctx_train))
                for t, c in p.max_ctx_by_kv_type.items()
            ),
        )
        capped = [t for t in p.capped_kv_types if p.flash_attn or t not in QUANTIZED_KV]
        if capped:
            out.note(
                f"capped at the model's training context ({p.ctx_train} tokens): memory "
                f"allows more with {', '.join(capped)}, but the model was not trained past it"
            )
    for kv_type, reason in p.unsupported_kv_types.items():
        out.note(f"{kv_type}: not usable with this model ({reason})")
    if p.kv_estimated:
        out.note(f"KV figures are estimates for the '{info.kv_layout}' layout: {info.kv_note}")


def _max_ctx_cell(kv_type: str, fits: int | None, p: MemoryPlan, ctx_train: int) -> str:
    if not p.flash_attn and kv_type in QUANTIZED_KV:
        return "needs flash attention"
    if fits is None:
        return "does not fit"
    if ctx_train and fits > ctx_train:
        return f"{ctx_train} (training context; memory allows {fits})"
    return str(fits)


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


def _demo_size(value: str) -> str:
    """Option callback: a size the generator has (another is a usage error, exit 2)."""
    from orin.model.demo import SIZES

    if value not in SIZES:
        raise typer.BadParameter(f"{value!r}: give one of {', '.join(SIZES)}")
    return value


def _demo_quant(value: str) -> str:
    """Option callback: a type the generator writes (another is a usage error, exit 2)."""
    from orin.model.demo import QUANTS

    if value not in QUANTS:
        raise typer.BadParameter(f"{value!r}: give one of {', '.join(QUANTS)}")
    return value


@app.command()
@handle_errors
def demo(
    size: Annotated[
        str, typer.Option(callback=_demo_size, help="tiny, small or medium.")
    ] = "small",
    quant: Annotated[
        str, typer.Option(callback=_demo_quant, help="f32, f16, q8_0, q6_k, q4_k_m, ...")
    ] = "q4_k_m",
    out_path: Annotated[
        Path | None,
        typer.Option(
            "--out",
            parser=path_named,
            callback=file_to_write,
            help="Write this file instead of the cache's.",
        ),
    ] = None,
) -> None:
    """Generate a deterministic random-weight GGUF model (for demos and tests)."""
    from orin.model import demo as demo_models

    with _working(f"building the {size} {quant} demo model"):
        if out_path is None:
            path = demo_models.ensure(size, quant)
        else:
            path = demo_models.generate(size, quant, out_path)
    print(path)


@contextmanager
def _working(description: str, quiet: bool = False) -> Iterator[None]:
    """An elapsed-time bar on stderr while something without steps runs; only for a
    person watching (output.progress_wanted)."""
    if not progress_wanted(quiet):
        yield
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        progress.add_task(description, total=None)
        yield


def _hub_ref(value: str) -> str:
    try:
        store.parse_ref(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


DirOpt = Annotated[
    Path | None,
    typer.Option(
        "--dir",
        parser=path_named,
        callback=folder_to_write,  # a file there, or a folder not writable: exit 2 at once
        help="Models directory (default: /var/lib/orin-llm/models as root, the service's; "
        "else ~/.cache/orin-llm/models).",
    ),
]
SeenDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--dir",
        parser=folder_named,  # '', or a file, is a usage error; a folder only read needs no writing
        help="Models directory (default: both that serve looks in: ~/.cache/orin-llm/models, "
        "then /var/lib/orin-llm/models, the installed service's).",
    ),
]
ProfilesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--profile", help="Also count this profile (a name or YAML file) as using its model."
    ),
]


def _models_dir(given: Path | None, uid: int, root: SysRoot) -> Path:
    """--dir; root's default is the installed service's models directory, anyone else's
    the user cache."""
    if given is not None:
        return given
    if uid == 0:
        return root.path(store.SYSTEM_MODELS_DIR)
    return store.default_dir()


def _serve_dirs(given: Path | None, root: SysRoot) -> list[Path]:
    """--dir, else the folders serve finds models in, in its order: the user cache (demo
    and packaged models, a user's pulls; root's own, under root's home, when root runs
    serve) and the installed service's models directory (root's pulls)."""
    if given is not None:
        return [given]
    return list(dict.fromkeys((store.default_dir(), root.path(store.SYSTEM_MODELS_DIR))))


def _dir_role(folder: Path, root: SysRoot) -> str:
    if folder == root.path(store.SYSTEM_MODELS_DIR):
        return "installed service's"
    if folder == store.default_dir():
        return "user cache"
    return "--dir"


def _service_chown(runner: CommandRunner, root: SysRoot) -> Chown | None:
    """Give pulled files to the service user, when there is one (root pulling into the
    service's models directory)."""
    from orin.install.layout import DEFAULT_USER, UNIT_DIR
    from orin.install.plan import installed_user

    user = installed_user(root, UNIT_DIR, DEFAULT_USER)
    if not runner.run(("getent", "passwd", user), timeout=10.0).ok:
        return None

    def chown(path: Path) -> None:  # -h: a symbolic link itself, never what it names
        res = runner.run(("chown", "-h", f"{user}:", str(path)), timeout=30.0)
        if not res.ok:
            raise OrinError(f"chown {user}: {path} failed: {(res.stderr or res.stdout).strip()}")

    return chown


@app.command()
@handle_errors
def pull(
    ctx: typer.Context,
    spec: Annotated[
        str,
        typer.Argument(
            callback=_hub_ref,
            metavar="OWNER/REPO[:FILE|:QUANT]",  # as the docs write it
            help="owner/repo, owner/repo:FILE.gguf or owner/repo:QUANT (e.g. Q4_K_M).",
            show_default=False,
        ),
    ],
    models_dir: DirOpt = None,
    revision: Annotated[
        str | None, typer.Option(help="Branch, tag or commit (default: main).")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace a different file of the same name.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    as_json: JsonOpt = False,
    root: RootOpt = Path("/"),
) -> None:
    """Download a GGUF file from the Hugging Face Hub, resumable and SHA-256 checked."""
    from orin.model import hub

    d = deps(ctx)
    sysroot, uid = SysRoot(root), d.effective_uid()
    folder = _models_dir(models_dir, uid, sysroot)
    chown = None
    if uid == 0 and folder == sysroot.path(store.SYSTEM_MODELS_DIR):
        chown = _service_chown(d.runner, sysroot)
    progress = DownloadBar if progress_wanted(quiet or as_json) else None
    try:
        result = hub.pull(
            store.parse_ref(spec),
            folder,
            revision=revision,
            progress=progress,
            chown=chown,
            force=force,
            disk_free=d.disk_free,
        )
    except hub.PullInterrupted as exc:
        of = f" of {human_bytes(exc.size)}" if exc.size else ""
        raise fail(
            f"interrupted: {human_bytes(exc.have)}{of} of {exc.what} kept in {exc.part}; "
            "run the same pull again to resume",
            EXIT_INTERRUPTED,
        ) from None
    out = Output(as_json)
    if as_json:
        out.json(result.to_dict())
        return
    size = human_bytes(result.file.size)
    if not result.downloaded:
        out.line(f"already pulled: {result.path} ({size}, SHA-256 matches the hub)")
        return
    resumed = f", resumed at {human_bytes(result.resumed_from)}" if result.resumed_from else ""
    out.line(f"pulled {result.ref.repo}/{result.file.path} -> {result.path}")
    out.line(f"{size}, SHA-256 {result.file.sha256} checked{resumed}")


@dataclass(frozen=True)
class _Listed:
    path: Path
    size: int | None  # None: a link whose file is not there
    quantization: str | None
    problem: str | None
    source: str | None
    used_by: tuple[str, ...]
    link_to: Path | None = None  # what a symbolic link points to (model rm removes the link)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.path.name,
            "path": str(self.path),
            "size": self.size,
            "quantization": self.quantization,
            "problem": self.problem,
            "source": self.source,
            "used_by": list(self.used_by),
            "link_to": str(self.link_to) if self.link_to is not None else None,
        }


def _profiles(root: SysRoot, extra: list[str] | None) -> list[tuple[str, Profile]]:
    """The profiles whose models matter here: built-in, the installed service's, --profile."""
    from orin.install.layout import PROFILE_FILE
    from orin.profile.loader import builtin_profiles, load_profile

    found: list[tuple[str, Profile]] = []
    for name in builtin_profiles():
        try:
            found.append((name, load_profile(name)))
        except ProfileError:
            continue
    installed = root.path(PROFILE_FILE)
    if installed.is_file():
        found.append((f"installed ({PROFILE_FILE})", _load(installed)))
    for name in extra or ():
        found.append((name, _load(name)))
    return found


def _load(name: str | Path) -> Profile:
    from orin.profile.loader import load_profile

    return load_profile(name)


MODEL_ROLE = "model"  # what a profile's model file is to it (else model.mmproj, ...)


def _names(
    profile: Profile, folder: Path, root: SysRoot, follow: bool = True
) -> list[tuple[Path, str]]:
    """The files in ``folder`` a profile would serve, found without fetching anything,
    each with what it is to the profile: its model, vision projector and draft model.
    With ``follow`` off, the paths it names, symbolic links not followed."""
    from orin.profile.loader import named_model_path

    try:
        model = named_model_path(profile, [folder])
    except OrinError:
        model = None
    named = [(model, MODEL_ROLE)] if model is not None else []
    for given, role in (
        (profile.model.mmproj, "model.mmproj"),
        (profile.speculative.draft_model, "speculative.draft_model"),
    ):
        if given is not None:
            named.append((profile.path_from(given), role))
    found = []
    for path, role in named:
        if path.is_absolute() and not (path.exists() or path.is_symlink()):
            path = root.path(str(path))
        if not follow:
            found.append((_unfollowed(path), role))
            continue
        try:
            found.append((path.resolve(), role))
        except RuntimeError:  # a loop of symbolic links: it names no file
            continue
    return found


def _unfollowed(path: Path) -> Path:
    """An absolute path with ``..`` taken out, symbolic links left as they are."""
    return Path(os.path.normpath(path.absolute()))


def _used_by(
    profiles: list[tuple[str, Profile]], folder: Path, root: SysRoot, follow: bool = True
) -> dict[Path, list[tuple[str, str]]]:
    """File -> (profile label, what the file is to it) for every profile naming it."""
    users: dict[Path, list[tuple[str, str]]] = {}
    for label, profile in profiles:
        for path, role in _names(profile, folder, root, follow):
            users.setdefault(path, []).append((label, role))
    return users


def _labels(users: list[tuple[str, str]]) -> tuple[str, ...]:
    """'qwen', or 'vis (model.mmproj)' for a profile's projector or draft model."""
    return tuple(label if role == MODEL_ROLE else f"{label} ({role})" for label, role in users)


def _naming(
    profiles: list[tuple[str, Profile]], folder: Path, root: SysRoot, path: Path
) -> list[tuple[str, str]]:
    """The profiles that lose their model when ``path`` goes: those that serve its
    file, or for a symbolic link (only the link goes) those that name the link."""
    if path.is_symlink():
        return _used_by(profiles, folder, root, follow=False).get(_unfollowed(path), [])
    return _used_by(profiles, folder, root).get(path.resolve(), [])


def _listing(folder: Path, profiles: list[tuple[str, Profile]], root: SysRoot) -> list[_Listed]:
    users = _used_by(profiles, folder, root)
    rows = []
    for path in store.gguf_files(folder):
        quant: str | None
        try:
            quant, problem = read_model_info(path).quantization, None
        except ModelFileError as exc:
            quant, problem = None, str(exc)
            try:
                proj = _projector_info(path)  # model.mmproj
            except ModelFileError as broken:
                proj, problem = None, str(broken)
            if proj is not None:
                quant, problem = f"vision projector ({proj.projector_type})", None
        prov = store.read_provenance(folder, path.name)
        source = f"hf:{prov.repo}:{prov.path}" if prov is not None else None
        used = _labels(users.get(path.resolve(), []))
        link = path.readlink() if path.is_symlink() else None
        rows.append(_Listed(path, path.stat().st_size, quant, problem, source, used, link))
    for path in store.broken_links(folder):
        link = path.readlink()
        problem = f"a link to {link}, which is not there (model rm removes the link)"
        used = _labels(_naming(profiles, folder, root, path))
        rows.append(_Listed(path, None, None, problem, None, used, link))
    return sorted(rows, key=lambda r: r.path)


@app.command("list")
@handle_errors
def list_models(
    models_dir: SeenDirOpt = None,
    profiles: ProfilesOpt = None,
    as_json: JsonOpt = False,
    root: RootOpt = Path("/"),
) -> None:
    """Every GGUF file in the folders serve finds models in, with the profiles that use it."""
    sysroot = SysRoot(root)
    every = _profiles(sysroot, profiles)
    listed = [
        (d, _listing(d, every, sysroot) if d.is_dir() else None)
        for d in _serve_dirs(models_dir, sysroot)
    ]
    out = Output(as_json)
    if as_json:
        out.json(
            {
                "dirs": [
                    {"dir": str(d), "exists": rows is not None, "role": _dir_role(d, sysroot)}
                    for d, rows in listed
                ],
                "models": [
                    {**r.to_dict(), "dir": str(d)} for d, rows in listed for r in rows or ()
                ],
            }
        )
        return
    for folder, rows in listed:
        where = f"{folder} ({_dir_role(folder, sysroot)})"
        if rows is None:
            out.line(f"{where}: no such folder")
        elif not rows:
            out.line(f"{where}: no GGUF files")
        else:
            out.table(
                where,
                ("name", "size", "quantization", "pulled from", "used by"),
                (
                    (
                        r.path.relative_to(folder).as_posix(),
                        human_bytes(r.size) if r.size is not None else "-",
                        r.quantization or f"unreadable: {r.problem}",
                        r.source or "-",
                        ", ".join(r.used_by) or "-",
                    )
                    for r in rows
                ),
                keep=("name",),
            )


def _find(folder: Path, name: str) -> Path:
    """NAME: a file name or path in the models directory, or a path to one in it."""
    candidate = Path(name)
    path = candidate if candidate.is_absolute() else folder / candidate
    if not store.entry_inside(folder, path):
        raise ModelFileError(
            f"{name} is not inside the models directory {folder}; model rm deletes nothing else"
        )
    if path.is_file() or path.is_symlink():  # a link, even to a card not mounted now
        return path
    same = [p for p in store.gguf_files(folder) if p.name == candidate.name]
    if len(same) == 1:
        return same[0]
    if not folder.is_dir():
        raise ModelFileError(f"no model {name}: the models directory {folder} does not exist")
    known = ", ".join(p.relative_to(folder).as_posix() for p in store.gguf_files(folder))
    raise ModelFileError(f"no model {name} in {folder} (there: {known or 'none'})")


def _find_in(folders: list[Path], name: str) -> tuple[Path, Path]:
    """NAME in the one folder of those model list shows that holds it: (folder, file)."""
    if len(folders) == 1:
        return folders[0], _find(folders[0], name)
    found: list[tuple[Path, Path]] = []
    problems: list[str] = []
    for folder in folders:
        if not folder.is_dir():
            problems.append(f"no folder {folder}")
            continue
        try:
            found.append((folder, _find(folder, name)))
        except ModelFileError as exc:
            problems.append(str(exc))
    if len(found) == 1:
        return found[0]
    if found:
        where = " and ".join(str(f) for f, _ in found)
        raise ModelFileError(f"{name} is in {where}: say which with --dir")
    raise ModelFileError("; ".join(problems))


@app.command()
@handle_errors
def rm(
    name: Annotated[
        str, typer.Argument(callback=named, help="File name (as model list shows it).")
    ],
    models_dir: SeenDirOpt = None,
    profiles: ProfilesOpt = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Delete it even though a profile in use names it."),
    ] = False,
    root: RootOpt = Path("/"),
) -> None:
    """Delete a model file from the models directory (not one a profile in use names)."""
    sysroot = SysRoot(root)
    folder, path = _find_in(_serve_dirs(models_dir, sysroot), name)
    every = _profiles(sysroot, profiles)
    in_use = [
        label for label, _ in every if label.startswith("installed") or label in (profiles or ())
    ]
    users = _naming(every, folder, sysroot, path)
    blocking = [(label, role) for label, role in users if label in in_use]
    if blocking and not force:
        what = "; ".join(
            f"{'the model' if role == MODEL_ROLE else role} of profile {label}"
            for label, role in blocking
        )
        raise OrinError(
            f"{path.name} is {what}: the service would not start without it; use --force "
            "to delete it anyway"
        )
    out = Output()
    if users:
        out.note(f"{path.name} is named by profile {', '.join(_labels(users))}")
    target = path.readlink() if path.is_symlink() else None  # only the link goes
    if not yes:
        what = f"{path} ({human_bytes(path.stat().st_size)})"
        if target is not None:
            what = f"the link {path} (to {target}, which stays)"
        typer.confirm(f"delete {what}?", abort=True)
    for removed in store.remove(folder, path):
        if removed == path and target is not None:
            out.line(f"removed the link {removed} ({target} stays)")
        else:
            out.line(f"removed {removed}")
