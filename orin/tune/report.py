"""The tune report: report.md for people, report.json for programs, PNG plots.

Plots need matplotlib (the ``report`` extra); it is imported at run time, so
orin-llm works without it and the report then says the plots were skipped.
The plotted candidates are the ones measured longest (the last round's), the
profile's own and the chosen one; the rest are drawn thin and unlabelled.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from orin.tune.explain import speculation, worst_point
from orin.tune.figures import Measurement, score, verdict
from orin.tune.plots import draw_all
from orin.tune.run import TuneResult
from orin.tune.tuned import (
    change_lines,
    configurations,
    count,
    point_lines,
    profile_changes,
    why_chosen,
)

SKIPPED = (
    "Plots were skipped: matplotlib is not installed "
    "(install the report extra: `pip install 'orin-llm[report]'`)."
)


INTERRUPTED = (
    "a partial report of what was measured before the search was stopped; the "
    "chosen configuration is the best of those, not the search's answer."
)


def _ms(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _util(m: Measurement, phase: str) -> float | None:
    f = m.phases.get(phase)
    if f is None:
        return None
    return f.gpu_util if f.gpu_util is not None else f.cpu_util


def _worst(m: Measurement, attr: str) -> float | None:
    p = worst_point(m, attr)
    return None if p is None else getattr(p, attr)


def measurement_rows(r: TuneResult) -> list[str]:
    rows = [
        "| configuration | reps | tok/s | worst TTFT_p95 ms | worst TPOT_p90 ms | meets SLO "
        "| prefill util | decode util | note |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    ordered = sorted(r.measurements.values(), key=lambda m: (-m.reps, -m.throughput()))
    for m in ordered:
        tags = [t for t, c in (("chosen", r.chosen), ("profile", r.space.baseline))
                if m.candidate == c]  # fmt: skip
        sc = score(m, r.profile.slo)
        meets = None if sc.failed or not r.has_targets else sc.meets_slo
        rows.append(
            f"| {m.candidate.label} | {m.reps} | {m.throughput():.1f} | "
            f"{_ms(_worst(m, 'ttft_p95'))} | {_ms(_worst(m, 'tpot_p90'), 1)} | "
            f"{'-' if meets is None else ('yes' if meets else 'no')} | "
            f"{_pct(_util(m, 'prefill'))} | {_pct(_util(m, 'decode'))} | "
            f"{', '.join(tags)}{(' ' + m.error) if m.error else ''} |"
        )
    return rows


def _axis(values: tuple[Any, ...]) -> str:
    return ", ".join("/".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in values)


AXES = {  # space.axes keys, as the settings they stand for
    "batch": "n_batch/n_ubatch",
    "flash_attn": "flash_attn",
    "kv": "type_k/type_v",
    "threads": "threads",
    "slots": "slots",
    "gpu_layers": "gpu_layers",
    "speculative": "speculative (tried on the search's winner)",
}


def space_section(r: TuneResult) -> list[str]:
    """The values searched per setting, and the profile's own: what was tried."""
    base = r.space.baseline
    own = {
        "batch": f"{base.n_batch}/{base.n_ubatch}", "flash_attn": base.flash_attn,
        "kv": f"{base.type_k}/{base.type_v}", "threads": base.threads, "slots": base.slots,
        "gpu_layers": base.gpu_layers, "speculative": base.speculation.label,
    }  # fmt: skip
    rows = [
        f"| {AXES.get(k, k)} | {_axis(v)} | {own.get(k, '-')} |" for k, v in r.space.axes.items()
    ]
    return [
        "## Settings searched",
        "",
        "| setting | values tried | the profile's |",
        "|---|---|---|",
        *rows,
        "",
    ]


def spec_section(r: TuneResult) -> list[str]:
    """Speculative decoding: the verdict, each setting tried on the winner, the workload."""
    if r.speculation is None:
        return []
    lines = speculation(r.speculation, r.measurements, r.profile.slo)
    return ["## Speculative decoding", "", *(f"- {line}" for line in lines), ""]


def changes_section(r: TuneResult) -> list[str]:
    """Every field the tuned profile changes, with the profile's value: nothing is
    changed that this list does not name."""
    changed = change_lines(profile_changes(r))
    body = [f"- `{c}`" for c in changed] or ["- nothing: the profile's settings won"]
    return ["## Changes from the profile", "", *body, ""]


def markdown(r: TuneResult, images: list[str] | None) -> str:
    s = r.search
    gpu = any(f.gpu_util is not None for m in r.measurements.values() for f in m.phases.values())
    util = "GPU" if gpu else "process CPU, share of all cores"
    lines = [
        f"# orin-llm tune: {r.profile.name}",
        "",
        *([f"**Interrupted ({r.interrupted_by})**: {INTERRUPTED}", ""] if r.interrupted else []),
        f"- date: {r.started_at}; model: `{r.model_path}` ({r.info.quantization})",
        f"- budget {r.settings.budget_s:.0f} s; measuring {s.spent_s:.0f} s; "
        f"the search took {r.elapsed_s:.0f} s (before writing this report); "
        f"telemetry: {r.telemetry_source or 'off'}",
        f"- grid: prompt tokens {list(r.grid.prompt_tokens)} x concurrency "
        f"{list(r.grid.concurrency)}, {r.grid.output_tokens} generated tokens per request",
        f"- search: {configurations(r)}, successive halving over repetitions "
        f"{list(s.fidelities)}; first round {s.first_round}; {count(len(s.trials), 'measurement')}"
        + (f"; {s.stopped}" if s.stopped else ""),
        *(f"- note: {n}" for n in [*r.notes, *r.space.notes]),
        "",
        "## Chosen configuration",
        "",
        f"`{r.chosen.label}` — {verdict(r.meets_slo, r.has_targets)}",
        "",
        f"- **chosen because** {why_chosen(r)}",
        *(
            [f"- **the profile's own settings failed**: {r.baseline_m.error}"]
            if r.baseline_m is not None and r.baseline_m.error
            else []
        ),
        *(f"- {line}" for line in point_lines(r.chosen_m, r.baseline_m)),
        *(f"- **why**: {e}" for e in r.explanation),
        "",
        *space_section(r),
        *changes_section(r),
        *spec_section(r),
        f"## Every measured configuration (utilization: {util})",
        "",
        *measurement_rows(r),
        "",
        "## Plots",
        "",
    ]
    if images is None:
        lines.append(SKIPPED)
    else:
        lines += [f"![{Path(i).stem}]({i})" for i in images]
    return "\n".join(lines) + "\n"


def _pyplot() -> Any | None:
    try:
        mpl = importlib.import_module("matplotlib")
    except ImportError:
        return None
    mpl.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def write(r: TuneResult, folder: Path) -> dict[str, Any]:
    """Write report.md, report.json and the plots; returns what was written."""
    folder.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    images = draw_all(plt, r, folder) if plt is not None else None
    (folder / "report.md").write_text(markdown(r, images), encoding="utf-8")
    changes = [{"field": k, "profile": a, "tuned": b} for k, a, b in profile_changes(r)]
    data = {**r.to_dict(), "changes": changes, "plots": images, "plots_skipped": images is None}
    (folder / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    return {"folder": str(folder), "plots": images}
