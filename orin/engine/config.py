"""A Profile resolved against the model file and the build: what the engine runs with.

Resolved once (``auto`` KV types, thread counts, the window) and passed
everywhere; nothing re-reads the profile later.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import psutil

from orin.engine.scheduler import ContextPolicy
from orin.errors import KVConfigError, ProfileError
from orin.llamacpp import BuildInfo
from orin.model.gguf import (
    KV_LAYOUT_HYBRID,
    KV_LAYOUT_ISWA,
    KV_LAYOUT_NONE,
    KV_LAYOUT_RECURRENT,
    ModelInfo,
)
from orin.model.memplan import kv_cells_per_seq
from orin.paths import cache_dir
from orin.profile.board import load_settings
from orin.profile.fit import projector_path
from orin.profile.kvmatch import resolve_kv
from orin.profile.schema import Profile
from orin.system.loadmode import mmap_policy
from orin.system.platform import is_jetson, usable_cpus
from orin.system.root import SysRoot

# Prompt tokens per step when layers run on a GPU, where llama.cpp's abort callback
# cannot stop a decode: a cancel waits for the chunk (docs/engine.md, Cancellation).
GPU_PREFILL_CHUNK = 256

log = logging.getLogger("orin.engine")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (the profile's ``speculative`` section, paths resolved)."""

    mode: Literal["off", "ngram", "draft"] = "off"
    n_draft: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: Path | None = None
    draft_gpu_layers: int = -1
    cost_aware: bool = True
    min_acceptance: float = 0.2
    probation: int = 32


@dataclass(frozen=True)
class PromptCacheConfig:
    """The persistent prompt cache: system prompts (texts) and where their KV state goes."""

    prompts: tuple[str, ...]
    directory: Path
    max_bytes: int = 2 * 1024**3


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    n_ctx: int  # per slot, as asked; llama.cpp pads it (n_ctx_seq)
    slots: int
    n_batch: int
    n_ubatch: int
    threads: int
    threads_batch: int
    gpu_layers: int
    flash_attn: Literal["auto", "on", "off"]
    type_k: str
    type_v: str
    load_mode: str
    numa: str
    context: ContextPolicy
    max_queue: int = 64
    prefix_cache: bool = True
    # the model's memory can drop the tail of a sequence (a recurrent state cannot):
    # reusing a prompt prefix, in a slot or copied from another, needs it
    prefix_reuse: bool = True
    swa_full: bool = False  # sliding-window layers cache the whole context
    # tokens of attention window whose cells a reused prefix needs (0: no window cache)
    swa_window: int = 0
    rope_freq_base: float | None = None  # None: llama.cpp takes it from the metadata
    max_backlog: int = 4096  # unread events before a slow client's request is cut off
    prefill_chunk: int = 0  # prompt tokens per step, all slots together; 0: n_batch
    # prompt tokens a copy of another slot's cells must save; 0: measured at load
    share_min: int = 0
    chat_template: str | None = None  # the profile's; None: the model's own
    pooling: str | None = None  # embeddings: the profile's mean|cls|last; None: the GGUF's
    kv_unified: bool = False  # one KV buffer for all slots instead of one stream each
    even_tails: bool = True  # prompt tails evened up to save passes (Scheduler._even_tails)
    split_bursts: bool = True  # a burst's prompts run as two steps (Scheduler._split_for_mean)
    # the profile's slo.tpot_p90_ms: prompt chunks shrink so running streams keep it
    tpot_target_ms: float | None = None
    speculative: SpecConfig = SpecConfig()
    prompt_cache: PromptCacheConfig | None = None
    # llama.cpp RPC workers (host:port) registered as devices before the model loads
    rpc: tuple[str, ...] = ()
    mmproj: Path | None = None  # the vision projector (orin.engine.vision); None: text only
    # hand a step's events to the event loops just before the next decode instead of at
    # the step's end (Engine.hold_events): only where the decode leaves the loop a core
    events_before_decode: bool = False

    def with_(self, **changes: object) -> EngineConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


def default_threads() -> int:
    """One thread per physical core: llama.cpp gains nothing from SMT siblings."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def engine_config(
    profile: Profile,
    model_path: Path,
    info: ModelInfo,
    build: BuildInfo | None = None,
    available: int | None = None,
    root: SysRoot | None = None,
) -> EngineConfig:
    """Resolve a profile for one model; KV rule violations raise KVConfigError.

    ``load_mode: auto`` follows the mmap policy: no mmap for a fully offloaded
    model on a Jetson's unified memory (the page cache would hold a second copy).
    """
    e, c = profile.engine, profile.context
    if info.kv_layout == KV_LAYOUT_NONE:
        raise KVConfigError(
            f"{model_path.name}: {info.architecture} has no KV cache (an encoder such as an "
            "embedding model); the engine serves decoder models, which generate text"
        )
    decision = resolve_kv(e, info.quantization, info, build, available)
    if decision.errors:
        raise KVConfigError("; ".join(f"{f.rule}: {f.message}" for f in decision.errors))
    window = min(c.window or e.n_ctx, kv_cells_per_seq(e.n_ctx, e.slots))
    threads = e.threads or default_threads()
    gpu = build.gpu_offload if build is not None else None
    load = mmap_policy(load_settings(profile), is_jetson(root or SysRoot()), info.n_layer, gpu)
    offloaded = bool(gpu) and e.gpu_layers != 0
    partial = info.kv_layout not in (KV_LAYOUT_RECURRENT, KV_LAYOUT_HYBRID)
    windowed = info.kv_layout == KV_LAYOUT_ISWA and not e.swa_full
    sliding = c.sliding
    if windowed and sliding and "sliding" not in c.model_fields_set:
        # a window-sized cache cannot shift positions: stop at the limit instead
        log.info(
            "%s has sliding-window layers and engine.swa_full is off: the context stops at "
            "the window instead of sliding (engine.swa_full: true slides, with more memory)",
            model_path.name,
        )
        sliding = False
    return EngineConfig(
        model_path=model_path,
        n_ctx=e.n_ctx,
        slots=e.slots,
        n_batch=e.n_batch,
        n_ubatch=e.n_ubatch,
        threads=threads,
        threads_batch=e.threads_batch or threads,
        gpu_layers=e.gpu_layers,
        flash_attn=decision.flash_attn,
        type_k=decision.type_k,
        type_v=decision.type_v,
        load_mode=load.load_mode,
        numa=e.numa,
        context=ContextPolicy(
            window=window,
            keep=min(c.keep, window - 1),
            discard=c.discard,
            sliding=sliding,
            truncate_prompt=c.overflow == "truncate",
        ),
        max_queue=profile.server.max_queue,
        prefix_cache=partial,
        prefix_reuse=partial,
        swa_full=e.swa_full,
        swa_window=(info.sliding_window or 0) if windowed else 0,
        rope_freq_base=e.rope_freq_base,
        max_backlog=profile.server.max_stream_backlog,
        prefill_chunk=prefill_chunk(e.prefill_chunk, e.n_batch, offloaded),
        share_min=e.share_min,
        chat_template=profile.model.chat_template,
        pooling=profile.model.pooling,
        # a recurrent state is split per sequence whatever the layout: keep streams
        kv_unified=e.kv_unified and partial,
        even_tails=e.even_tails,
        split_bursts=e.split_bursts,
        tpot_target_ms=profile.slo.tpot_p90_ms,
        speculative=spec_config(profile),
        prompt_cache=prompt_cache_config(profile),
        rpc=tuple(e.rpc),
        mmproj=mmproj_path(profile),
        events_before_decode=loop_has_a_core(offloaded, max(threads, e.threads_batch or 0)),
    )


def loop_has_a_core(offloaded: bool, threads: int, cpus: int | None = None) -> bool:
    """Whether the event loop keeps a core while llama.cpp decodes: the layers are on a
    GPU, or llama.cpp's threads are fewer than the CPUs this process may run on.

    Only then does the engine hand a step's events over just before the next decode
    (docs/engine.md, on request streams): the loop's SSE work then runs beside the
    decode. Where the decode threads take every core, the woken loop waits for the
    kernel to give it one, and burst TTFT at 4 streams came out longer on the 2-core
    development VM; handed over at the step's end, the engine thread waiting for the
    GIL leaves its core to the loop (docs/performance.md, "Events handed over before
    the next decode")."""
    return offloaded or threads < (usable_cpus() if cpus is None else cpus)


def mmproj_path(profile: Profile) -> Path | None:
    """The profile's vision projector: its file, or the demo model's, generated here
    on first use."""
    m = profile.model
    if m.mmproj is None and m.mmproj_demo and m.demo is not None:
        from orin.model import mmproj

        return mmproj.ensure(m.demo.size)
    return projector_path(profile)


def mmproj_problem(profile: Profile) -> tuple[Path, str] | None:
    """The profile's model.mmproj and why serve could not load it (missing, a folder or
    FIFO, not a projector GGUF, corrupt), or None when it reads or there is none (a demo
    projector is generated at start). Doctor, ``profile validate`` and serve ask before
    the model loads: llama.cpp's clip loader would fail only after it, and wait forever
    on a FIFO."""
    from orin.model import mmproj

    if profile.model.mmproj is None:
        return None
    path = profile.path_from(profile.model.mmproj)
    if not path.exists():
        return path, f"{path} does not exist"
    try:
        mmproj.read_projector_info(path)
    except (OSError, ValueError) as exc:
        return path, f"{path}: {exc}"
    return None


def draft_model_problem(
    profile: Profile, served: Path | None = None
) -> tuple[Path, str | None] | None:
    """With ``speculative.mode: draft``, the draft model's file and why serve could not
    use it (missing, unreadable, not GGUF, truncated: its header is read; with the
    ``served`` model's file, a vocabulary that differs from it, by the GGUF field), or
    None for the reason when it reads; None without a draft model. Doctor, ``profile
    validate`` and serve ask before the model loads."""
    from orin.errors import ModelFileError
    from orin.model.gguf import read_model_info
    from orin.model.vocabmatch import vocab_mismatch

    s = profile.speculative
    if s.mode != "draft" or s.draft_model is None:
        return None
    path = profile.path_from(s.draft_model)
    try:
        read_model_info(path)
    except ModelFileError as exc:
        return path, str(exc)
    if served is None or not served.is_file():
        return path, None
    try:
        mismatch = vocab_mismatch(served, path)
    except ModelFileError:  # the served model's own problem: reported as the model's
        return path, None
    return path, None if mismatch is None else f"{path}: {mismatch}"


def spec_config(profile: Profile) -> SpecConfig:
    s = profile.speculative
    return SpecConfig(
        mode=s.mode,
        n_draft=s.n_draft,
        ngram_min=s.ngram_min,
        ngram_max=s.ngram_max,
        draft_model=None if s.draft_model is None else profile.path_from(s.draft_model),
        draft_gpu_layers=s.draft_gpu_layers,
        cost_aware=s.cost_aware,
        min_acceptance=s.min_acceptance,
        probation=s.probation,
    )


def prompt_files(profile: Profile) -> list[Path]:
    """The *.txt files of prompt_cache.prompt_dir in name order (none without one),
    listed, not read; a ProfileError naming the profile when the folder is missing."""
    pc = profile.prompt_cache
    if pc.prompt_dir is None:
        return []
    folder = profile.path_from(pc.prompt_dir)
    if not folder.is_dir():
        raise ProfileError(f"{_where(profile)}prompt_cache.prompt_dir: {folder} is not a directory")
    return sorted(folder.glob("*.txt"))


def _where(profile: Profile) -> str:
    """The profile's file, before a message about one of its fields."""
    return f"{profile.source}: " if profile.source is not None else ""


def kept_prompts(profile: Profile) -> list[str]:
    """The prompts the prompt cache keeps: the profile's, then each *.txt of prompt_dir
    in name order, read; a ProfileError naming the file that cannot be read, or that
    is not UTF-8 text (with the offset of the first byte that is not)."""
    prompts = list(profile.prompt_cache.prompts)
    for f in prompt_files(profile):
        try:
            prompts.append(prompt_text(f.read_bytes()))
        except (OSError, ValueError) as exc:
            raise ProfileError(_unreadable(profile, f, exc)) from exc
    return prompts


def prompt_text(data: bytes) -> str:
    """A prompt file's bytes as text; a ValueError that gives the offset and line of
    the first byte that is not UTF-8 (a file saved in Latin-1 or UTF-16, say)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
            f"(line {line}): {exc.reason} (save the file as UTF-8)"
        ) from None


def _unreadable(profile: Profile, f: Path, exc: Exception) -> str:
    return f"{_where(profile)}prompt_cache.prompt_dir: cannot read {f}: {exc}"


def prompt_file_problems(profile: Profile) -> list[str]:
    """What serve would stop on among prompt_dir's files, in kept_prompts' words: a
    file that is not UTF-8 text. Only regular files this user can open are read (the
    checks may run as another user than the server, root included): a file that cannot
    be opened here is not judged. A ProfileError when the folder is missing."""
    problems = []
    for f in prompt_files(profile):
        try:
            if not f.is_file():
                continue
            data = f.read_bytes()
        except OSError:
            continue
        try:
            prompt_text(data)
        except ValueError as exc:
            problems.append(_unreadable(profile, f, exc))
    return problems


def prompt_cache_config(profile: Profile) -> PromptCacheConfig | None:
    """The prompts to keep (``kept_prompts``) and where; None when the profile names
    none."""
    prompts = kept_prompts(profile)
    if not prompts:
        return None
    return PromptCacheConfig(
        tuple(prompts), cache_directory(profile), profile.prompt_cache.max_bytes
    )


def cache_directory(profile: Profile) -> Path:
    """Where the prompt cache's saved states go (prompt_cache.directory, or the cache's)."""
    d = profile.prompt_cache.directory
    return profile.path_from(d) if d is not None else cache_dir() / "prompt-cache"


def prefill_chunk(asked: int, n_batch: int, offloaded: bool) -> int:
    """The prompt tokens one step feeds, all slots together.

    On the CPU backend llama.cpp's abort callback stops a decode between graph
    nodes, so a chunk may fill the whole batch. A GPU decode runs to its end
    once started, so with layers offloaded the default chunk is smaller: a
    cancelled prompt (and a running stream waiting behind it) waits for at most
    that many prompt tokens. Without build information the CPU rule applies.
    """
    if asked:
        return min(asked, n_batch)
    return min(n_batch, GPU_PREFILL_CHUNK) if offloaded else n_batch
