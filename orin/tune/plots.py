"""The report's four PNG plots, drawn with the pyplot module the caller imported
(matplotlib is optional, so nothing here imports it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orin.tune.figures import Measurement
from orin.tune.run import TuneResult

MAX_LABELLED = 6


def shown(r: TuneResult) -> list[Measurement]:
    """The measurements worth a legend entry: chosen, the profile's, then the most
    repeated (the last rounds') by throughput."""
    ms = sorted(
        (m for m in r.measurements.values() if not m.error and m.points),
        key=lambda m: (m.candidate != r.chosen, m.candidate != r.space.baseline, -m.reps,
                       -m.throughput()),
    )  # fmt: skip
    return ms[:MAX_LABELLED]


def _name(r: TuneResult, m: Measurement) -> str:
    tag = " (chosen)" if m.candidate == r.chosen else ""
    tag += " (profile)" if m.candidate == r.space.baseline else ""
    return m.candidate.label + tag


def _lines(
    plt: Any, r: TuneResult, path: Path, groups: tuple[int, ...], xs: tuple[int, ...],
    key: Any, attr: str, labels: tuple[str, str, str],
) -> None:  # fmt: skip
    """One panel per group value; per candidate a line of ``attr`` over ``xs``."""
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    top = shown(r)
    labelled = {m.candidate for m in top}
    for ax, g in zip(axes[0], groups, strict=True):
        for m in r.measurements.values():
            if m.candidate in labelled or m.error:
                continue
            ys = [getattr(m.points[key(g, x)], attr) for x in xs if key(g, x) in m.points]
            if len(ys) == len(xs):
                ax.plot(xs, ys, color="0.8", linewidth=0.7)
        for m in top:
            ys = [getattr(m.points[key(g, x)], attr) for x in xs if key(g, x) in m.points]
            if len(ys) == len(xs):
                ax.plot(xs, ys, marker="o", label=_name(r, m))
        ax.set_title(labels[2].format(g))
        ax.set_xlabel(labels[0])
        ax.set_ylabel(labels[1])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def utilization(plt: Any, r: TuneResult, path: Path) -> None:
    top = shown(r)
    gpu = any(f.gpu_util is not None for m in top for f in m.phases.values())
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(top)), 4))
    for i, phase in enumerate(("prefill", "decode")):
        vals = []
        for m in top:
            f = m.phases.get(phase)
            v = (f.gpu_util if gpu else f.cpu_util) if f is not None else None
            vals.append(100 * (v or 0.0))
        ax.bar([j + 0.4 * i for j in range(len(top))], vals, width=0.4, label=phase)
    ax.set_xticks([j + 0.2 for j in range(len(top))])
    ax.set_xticklabels([_name(r, m) for m in top], rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("GPU utilization %" if gpu else "process CPU % of all cores")
    ax.set_title("utilization in prefill vs decode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def distribution(plt: Any, r: TuneResult, path: Path) -> None:
    m = r.chosen_m
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for p in m.points.values():
        label = f"{p.prompt_tokens} tok x {p.concurrency}"
        a.hist(p.ttft_ms, bins=20, alpha=0.5, label=label)
        if p.tpot_ms:
            b.hist(p.tpot_ms, bins=20, alpha=0.5, label=label)
    a.set_xlabel("TTFT ms")
    b.set_xlabel("TPOT ms")
    for ax in (a, b):
        ax.set_ylabel("requests")
        ax.legend(fontsize=7)
    fig.suptitle(f"chosen: {m.candidate.label} ({m.reps} repetitions)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_all(plt: Any, r: TuneResult, folder: Path) -> list[str]:
    g = r.grid
    _lines(
        plt, r, folder / "ttft_vs_prompt.png", g.concurrency, g.prompt_tokens,
        lambda c, p: (p, c), "ttft_p95", ("prompt tokens", "TTFT p95 ms", "{} streams"),
    )  # fmt: skip
    _lines(
        plt, r, folder / "tpot_vs_concurrency.png", g.prompt_tokens, g.concurrency,
        lambda p, c: (p, c), "tpot_p90", ("concurrent streams", "TPOT p90 ms", "{} prompt tokens"),
    )  # fmt: skip
    utilization(plt, r, folder / "phase_utilization.png")
    distribution(plt, r, folder / "chosen_latency.png")
    return ["ttft_vs_prompt.png", "tpot_vs_concurrency.png", "phase_utilization.png",
            "chosen_latency.png"]  # fmt: skip
