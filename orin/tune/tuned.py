"""The tuned profile: the input profile with the chosen engine settings, as YAML whose
comments record what was measured, on what, and when.

Figures are stated as the project states them (pitfalls.md): "TTFT_p95 from
420 ms to 180 ms at 512 tokens x 4 streams", never "faster". The "from" is
the profile's own configuration measured in the same run; when the budget
measured it less often than the chosen one, the comment says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from orin.profile.loader import parse_profile
from orin.tune.explain import speculation
from orin.tune.explain import streams as _streams
from orin.tune.figures import Measurement, Point, score
from orin.tune.run import TuneResult


def _ms(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f} ms"


def point_lines(chosen: Measurement, before: Measurement | None) -> list[str]:
    """One line per grid point: TTFT_p95, TPOT_p90 and throughput, with the before."""
    lines = []
    for key, p in chosen.points.items():
        old: Point | None = before.points.get(key) if before is not None else None
        ttft = f"TTFT_p95 {_ms(p.ttft_p95)}"
        tpot = f"TPOT_p90 {_ms(p.tpot_p90, 1)}"
        if old is not None:
            ttft = f"TTFT_p95 from {_ms(old.ttft_p95)} to {_ms(p.ttft_p95)}"
            tpot = f"TPOT_p90 from {_ms(old.tpot_p90, 1)} to {_ms(p.tpot_p90, 1)}"
        lines.append(
            f"{p.prompt_tokens} prompt tokens x {_streams(p.concurrency)}: {ttft}, {tpot}, "
            f"{p.throughput:.1f} tokens/s"
        )
    return lines


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted leaf fields of plain profile data (a list is one value)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


Change = tuple[str, Any, Any]  # dotted profile field, the profile's value, the tuned value
UNCOUNTED = frozenset({"name", "description"})  # the tuned profile always renames itself


def profile_changes(r: TuneResult) -> list[Change]:
    """Every field the tuned profile sets differently from the profile as given: the
    chosen settings, ``auto`` values made explicit, --ctx and --model. Slot counts go
    below the profile's only with --allow-fewer-slots (space.slot_options)."""
    given = r.original if r.original is not None else r.profile
    before = _flat(given.model_dump(mode="json"))
    after = _flat(profile_data(r))
    return [
        (k, before.get(k), after.get(k))
        for k in dict.fromkeys([*before, *after])
        if k not in UNCOUNTED and before.get(k) != after.get(k)
    ]


def change_lines(changes: list[Change]) -> list[str]:
    return [f"{k}: {_value(a)} -> {_value(b)}" for k, a, b in changes]


def _value(v: Any) -> str:
    return "(none)" if v is None else str(v)


def count(n: int, noun: str) -> str:
    """'1 repetition', '3 measurements'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def configurations(r: TuneResult) -> str:
    """'12 configurations', or with the profile's own settings when they are not
    among them ('12 configurations and the profile's own': 13 measured)."""
    n = count(len(r.space), "configuration")
    return n if r.space.baseline in r.space.candidates else f"{n} and the profile's own"


def _standing(m: Measurement, r: TuneResult) -> str:
    """A configuration's figure in the ranking: its throughput, or how far it misses."""
    sc = score(m, r.profile.slo)
    if sc.failed:
        return "failed"
    if sc.meets_slo or not r.has_targets:
        return f"{m.throughput():.1f} tokens/s"
    return f"worst point {sc.excess:+.0%} over its target"


def why_chosen(r: TuneResult) -> str:
    """Why the search's winner won: the ranking rule it came first by, its figure and
    the runner-up's in the last round measured; then speculation, when that changed."""
    winner = r.speculation.incumbent if r.speculation is not None else r.chosen
    m = r.measurements[winner]
    top = _streams(max(r.grid.concurrency))
    if not r.has_targets:
        rule = f"the highest throughput at {top} (no SLO targets to meet)"
    elif score(m, r.profile.slo).meets_slo:
        rule = f"it meets the SLO targets at every point, with the highest throughput at {top}"
    else:
        rule = "no configuration measured meets the SLO targets; it is the closest to them"
    rivals = [c for c in r.search.finalists if c != winner and c in r.measurements]
    reps = count(r.search.best_fidelity, "repetition")
    text = f"{rule}: {_standing(m, r)}"
    if len({t.candidate for t in r.search.trials}) == 1:
        text = (
            f"the only configuration the budget let the search measure ({_standing(m, r)}; "
            "a larger --budget compares others)"
        )
    elif rivals:
        last = f"the last round ({count(len(rivals) + 1, 'configuration')}, {reps})"
        text += (
            f"; runner-up in {last}: {rivals[0].label}, {_standing(r.measurements[rivals[0]], r)}"
        )
    else:
        text += f"; the only one left in the last round ({reps})"
    if r.speculation is not None and r.speculation.changed:
        text += f"; then speculation {r.chosen.speculation.label} on it (see speculative decoding)"
    return text


def header(r: TuneResult) -> list[str]:
    chosen, before = r.chosen_m, r.baseline_m
    lines = [
        f"Tuned by `orin-llm tune` on {r.started_at} from profile '{r.profile.name}'.",
        *(
            [
                f"Interrupted ({r.interrupted_by}) before the search finished: "
                "the best of what was measured."
            ]
            if r.interrupted
            else []
        ),
        f"Model {r.model_path.name} ({r.info.quantization}); engine in-process, greedy, "
        f"{r.grid.output_tokens} generated tokens per request, telemetry "
        f"{r.telemetry_source or 'off'}.",
        f"Search: {count(len(r.search.trials), 'measurement')} of {configurations(r)} "
        f"(successive halving, repetitions {list(r.search.fidelities)}), "
        f"{r.search.spent_s:.0f} s of a {r.settings.budget_s:.0f} s budget.",
        f"Chosen {r.chosen.label}: {why_chosen(r)}.",
        f"Measured ({count(chosen.reps, 'repetition')} per point; before = the profile's own "
        f"settings, {count(before.reps if before else 0, 'repetition')}):",
        *(f"  {line}" for line in point_lines(chosen, before)),
        *(
            [f"The profile's own settings failed: {before.error}"]
            if before and before.error
            else []
        ),
    ]
    slo = r.profile.slo
    goals = (("ttft_p95_ms", slo.ttft_p95_ms), ("tpot_p90_ms", slo.tpot_p90_ms))
    targets = [f"{k} {v:g}" for k, v in goals if v is not None]
    if targets:
        verdict = "met at every point" if r.meets_slo else "NOT met; closest configuration"
        lines.append(f"SLO {', '.join(targets)}: {verdict}.")
    else:
        lines.append("No SLO targets (the profile's slo section sets none): ranked by throughput.")
    lines += [f"  {e}" for e in r.explanation]
    if r.speculation is not None:
        spec = speculation(r.speculation, r.measurements, slo)
        lines += [
            spec[0][0].upper() + spec[0][1:] + ".",
            f"  Measured on {r.speculation.workload}; what n-gram speculation gains depends "
            "on how often the output repeats its context (the report says more).",
        ]
    changed = change_lines(profile_changes(r))
    lines.append("Changed from the profile:" if changed else "Nothing changed from the profile.")
    lines += [f"  {c}" for c in changed]
    return lines


def profile_data(r: TuneResult) -> dict[str, Any]:
    """The tuned profile as plain data: the input profile, the chosen engine and
    speculation settings (KV types explicit; flash attention as measured) and absolute model
    paths (the file may be written elsewhere than the profile's directory)."""
    p = r.chosen.apply(r.profile)
    data = p.model_dump(mode="json")
    data["name"] = f"{r.profile.name}-tuned"[:128]
    data["description"] = f"{r.profile.name} tuned by orin-llm tune on {r.started_at}"
    m = r.profile.model
    if (m.demo is None and m.packaged is None and m.hf is None) or r.model_given:
        data["model"]["path"] = str(r.model_path.resolve())  # a demo, packaged or hub
        data["model"]["demo"] = None  # model stays named as it was unless --model
        data["model"]["packaged"] = None  # replaced it
        data["model"]["hf"] = None
    written_for = data["model"]["quantization"]
    if written_for is not None and written_for.upper() != r.info.quantization.upper():
        # the settings were measured on this file (--model, or a file the profile's
        # quantization did not describe): the tuned profile is written for it
        data["model"]["quantization"] = r.info.quantization
    draft = p.speculative.draft_model
    if draft is not None and not draft.expanduser().is_absolute() and p.source is not None:
        data["speculative"]["draft_model"] = str((p.source.parent / draft).resolve())
    return data


def render(r: TuneResult) -> str:
    """The YAML text; parsed back through the profile loader before it is returned."""
    body = yaml.safe_dump(profile_data(r), sort_keys=False, allow_unicode=True)
    text = "".join(f"# {line}\n" for line in header(r)) + body
    parse_profile(text, "tuned profile")  # the same validation `profile validate` runs first
    return text


def write(r: TuneResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(r), encoding="utf-8")
    return path
