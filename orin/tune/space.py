"""The settings tune may change, derived from the profile, the model and the build.

Each axis is kept only where it can matter here, so the space stays small
enough to measure:

- n_batch / n_ubatch: a few prompt-chunk sizes (with the profile's own);
- flash attention on and off;
- K/V cache types: only pairs the matching rules (orin/profile/kvmatch.py)
  allow without error *and* without lowering precision below the weights', so
  tune never trades accuracy for speed behind the user's back;
- threads: one per physical core and half that (on a shared or busy CPU the
  smaller pool often wins: llama.cpp's threads spin while waiting);
- slots: the profile's own count, and the largest SLO concurrency when that is
  more. Never fewer than the profile's: its slot count is a promise to its
  clients (how many requests run at once), which an SLO grid that lists only
  low concurrency does not withdraw. ``allow_fewer_slots`` (``tune
  --allow-fewer-slots``) also tries the largest SLO concurrency when it is
  fewer (more slots than streams changes slot placement, see
  docs/performance.md finding 1);
- gpu layers and load mode (mmap or read): only when the build can offload and
  the whole model does not fit, where partial offload and mmap matter;
- speculative decoding (``speculation_options``): off, n-gram drafts of at most
  8 or 4 tokens, and a draft model only when the profile names one. Every
  candidate of the grid carries the profile's own setting; the alternatives are
  tried on the search's winner alone (orin/tune/speculation.py says why).

Candidates whose weights + KV + compute would not fit in available memory are
dropped with a note.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from orin.engine.config import default_threads
from orin.llamacpp import BuildInfo
from orin.model.gguf import ModelInfo
from orin.model.memplan import total_bytes
from orin.profile.fit import draft_info
from orin.profile.kvmatch import check_kv, resolve_kv
from orin.profile.schema import EngineSection, Profile

BATCH_SIZES = (128, 256, 512)
KV_PAIRS = (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"))
FLASH = ("on", "off")
PARTIAL_OFFLOAD = (1.0, 0.75, 0.5)
NGRAM_DRAFTS = (8, 4)  # speculative.n_draft values tried with n-gram drafts
ENGINE_FIELDS = frozenset(EngineSection.model_fields)


@dataclass(frozen=True, order=True)
class Speculation:
    """The speculative section's searched fields: the mode and the drafts' length."""

    mode: str = "off"
    n_draft: int = 8

    @property
    def label(self) -> str:
        return "off" if self.mode == "off" else f"{self.mode}/{self.n_draft}"


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration: EngineSection fields, then the speculative section's mode and
    n_draft (the rest of that section stays the profile's)."""

    n_batch: int
    n_ubatch: int
    flash_attn: str
    type_k: str
    type_v: str
    threads: int
    slots: int
    gpu_layers: int = -1
    load_mode: str = "auto"
    speculative: str = "off"  # speculative.mode
    n_draft: int = 8  # speculative.n_draft

    @property
    def speculation(self) -> Speculation:
        return Speculation(self.speculative, self.n_draft)

    @property
    def label(self) -> str:
        layers = "" if self.gpu_layers < 0 else f" ngl={self.gpu_layers} {self.load_mode}"
        spec = "" if self.speculative == "off" else f" spec={self.speculation.label}"
        return (
            f"b{self.n_batch}/u{self.n_ubatch} fa={self.flash_attn} "
            f"kv={self.type_k}/{self.type_v} t{self.threads} s{self.slots}{layers}{spec}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_speculation(self, s: Speculation) -> Candidate:
        return replace(self, speculative=s.mode, n_draft=s.n_draft)

    def engine(self, base: EngineSection) -> EngineSection:
        """The profile's engine section with this candidate's settings."""
        data = base.model_dump()
        mine = {f.name: getattr(self, f.name) for f in fields(self) if f.name in ENGINE_FIELDS}
        data.update(mine, threads_batch=0)
        return EngineSection.model_validate(data)

    def apply(self, profile: Profile) -> Profile:
        """A copy of ``profile`` that runs this candidate (validated like a loaded file)."""
        data = profile.model_dump()
        data["engine"] = self.engine(profile.engine).model_dump()
        data["speculative"].update(mode=self.speculative, n_draft=self.n_draft)
        return profile.revalidated(data)


@dataclass(frozen=True)
class Space:
    candidates: tuple[Candidate, ...]
    baseline: Candidate  # what the profile runs today (measured for the before/after)
    axes: dict[str, tuple[Any, ...]]
    notes: tuple[str, ...] = field(default_factory=tuple)
    # the speculation settings to try on the winner, the profile's own first
    speculation: tuple[Speculation, ...] = field(default_factory=tuple)

    def __len__(self) -> int:
        return len(self.candidates)


def baseline_of(profile: Profile, info: ModelInfo, build: BuildInfo | None) -> Candidate:
    """The profile's own settings, with ``auto`` KV types resolved as the engine would."""
    e = profile.engine
    kv = resolve_kv(e, info.quantization, info, build)
    return Candidate(
        n_batch=e.n_batch,
        n_ubatch=e.n_ubatch,
        flash_attn=kv.flash_attn,
        type_k=kv.type_k,
        type_v=kv.type_v,
        threads=e.threads or default_threads(),
        slots=e.slots,
        gpu_layers=e.gpu_layers,
        load_mode=e.load_mode,
        speculative=profile.speculative.mode,
        n_draft=profile.speculative.n_draft,
    )


def speculation_options(profile: Profile) -> tuple[Speculation, ...]:
    """The profile's own setting, then off, n-gram drafts of 8, the draft model (only
    when the profile names one: tune never picks a model) and n-gram drafts of 4: the
    order the budget cuts from the end. ``off`` keeps the profile's n_draft, which it
    does not use, so the tuned profile changes only what speculation needs."""
    s = profile.speculative
    own = Speculation(s.mode, s.n_draft)
    options = [own, Speculation("off", s.n_draft), Speculation("ngram", NGRAM_DRAFTS[0])]
    if s.draft_model is not None:
        options.append(Speculation("draft", s.n_draft))
    options += [Speculation("ngram", n) for n in NGRAM_DRAFTS[1:]]
    return tuple(dict.fromkeys(options))


def _allowed_kv(
    profile: Profile, info: ModelInfo, build: BuildInfo | None, flash: str
) -> list[tuple[str, str]]:
    """K/V pairs with neither an error nor a precision warning under this flash mode."""
    out = []
    for k, v in KV_PAIRS:
        findings = check_kv(k, v, flash, profile.engine, info.quantization, info, build)
        if not any(f.severity == "fail" or f.rule == "kv-below-weights" for f in findings):
            out.append((k, v))
    return out


def _layer_options(
    profile: Profile, info: ModelInfo, build: BuildInfo | None, available: int | None
) -> tuple[list[int], list[str], str | None]:
    e = profile.engine
    if build is None or not build.gpu_offload or available is None:
        return [e.gpu_layers], [e.load_mode], None
    full = total_bytes(
        info, e.n_ctx, e.slots, "f16", "f16", e.n_ubatch, True, e.n_batch, e.swa_full
    )
    if full <= available:
        return [e.gpu_layers], [e.load_mode], None
    layers = sorted({max(1, round(info.n_layer * f)) for f in PARTIAL_OFFLOAD}, reverse=True)
    note = "the whole model does not fit: partial offload and mmap are searched"
    return layers, ["mmap", "none"], note


def slot_options(profile: Profile, allow_fewer: bool = False) -> tuple[tuple[int, ...], str | None]:
    """The slot counts to search, and a note when the profile's count held tune back
    from trying fewer (the SLO's largest concurrency is below it), or when
    ``allow_fewer`` has nothing fewer to try."""
    own, streams = profile.engine.slots, max(profile.slo.concurrency)
    if streams >= own:
        unused = (
            f"--allow-fewer-slots: nothing fewer to try, the SLO's largest concurrency "
            f"({streams}) is not below the profile's {own} slots"
        )
        return (streams,), unused if allow_fewer else None
    if allow_fewer:
        return (streams, own), None
    return (own,), (
        f"slots kept at the profile's {own} although the SLO's largest concurrency is "
        f"{streams}; --allow-fewer-slots also tries {streams}"
    )


def _axes(profile: Profile, cores: int, slots: tuple[int, ...]) -> dict[str, tuple[Any, ...]]:
    e = profile.engine
    threads = {cores, max(1, cores // 2)} | ({e.threads} if e.threads else set())
    batches = {(b, b) for b in BATCH_SIZES} | {(e.n_batch, e.n_ubatch)}
    return {
        "batch": tuple(sorted(p for p in batches if p[0] >= max(slots))),
        "flash_attn": FLASH,
        "threads": tuple(sorted(threads)),
        "slots": slots,
    }


def build_space(
    profile: Profile,
    info: ModelInfo,
    build: BuildInfo | None = None,
    available: int | None = None,
    cores: int | None = None,
    allow_fewer_slots: bool = False,
) -> Space:
    """Every combination of the engine axes that the rules allow and memory holds, each
    with the profile's own speculation setting; ``Space.speculation`` lists the
    settings to try on the search's winner."""
    slots, slot_note = slot_options(profile, allow_fewer_slots)
    axes = _axes(profile, cores or default_threads(), slots)
    layers, loads, note = _layer_options(profile, info, build, available)
    notes = [n for n in (slot_note, note) if n]
    kv = {f: _allowed_kv(profile, info, build, f) for f in FLASH}
    axes.update(kv=tuple(sorted(set(kv["on"]) | set(kv["off"]))), gpu_layers=tuple(layers))
    spec = speculation_options(profile)
    axes["speculative"] = tuple(s.label for s in spec)
    own = spec[0]
    draft = draft_info(profile) if own.mode == "draft" else None
    out, dropped = [], 0
    for (b, ub), fa, th, sl, ngl, load in itertools.product(
        axes["batch"], FLASH, axes["threads"], axes["slots"], layers, loads
    ):
        for k, v in kv[fa]:
            c = Candidate(b, ub, fa, k, v, th, sl, ngl, load, own.mode, own.n_draft)
            if not fits(profile, info, available, c, draft):
                dropped += 1
                continue
            out.append(c)
    if dropped:
        notes.append(f"{dropped} configurations would not fit in available memory: skipped")
    baseline = baseline_of(profile, info, build)
    return Space(tuple(out), baseline, axes, tuple(notes), spec)


def fits(
    profile: Profile,
    info: ModelInfo,
    available: int | None,
    c: Candidate,
    draft: ModelInfo | None = None,
) -> bool:
    """Whether candidate ``c`` holds in ``available`` bytes (unknown: it does), the
    draft model's weights and cache counted when ``c`` speculates with it (``draft``,
    its header: ``orin.profile.fit.draft_info``)."""
    if available is None:
        return True
    beside = draft if c.speculative == "draft" else None
    return _bytes(profile, info, c, beside) <= available


def _bytes(profile: Profile, info: ModelInfo, c: Candidate, draft: ModelInfo | None) -> int:
    n_ctx = profile.engine.n_ctx
    e = profile.engine
    return total_bytes(
        info,
        n_ctx,
        c.slots,
        c.type_k,
        c.type_v,
        c.n_ubatch,
        c.flash_attn != "off",
        e.n_batch,
        e.swa_full,
        draft,
    )
