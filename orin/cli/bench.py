"""orin-llm bench: load an OpenAI-compatible server and report TTFT, TPOT, ITL and E2EL."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orin.bench.bandwidth import BandwidthRequest
from orin.bench.stats import SLO, RequestResult, by_bucket
from orin.cli.errors import fail, handle_errors, usage_error
from orin.cli.help import Typer
from orin.cli.options import ApiKeyOpt, JsonOpt, OutputOpt, check_url, finite, path_named
from orin.cli.output import Output, human_bytes, progress_wanted

if TYPE_CHECKING:  # the HTTP client stack loads only when a benchmark runs
    from orin.bench.loadgen import BenchRun, LoadSpec

EXIT_ALL_FAILED = 1
EXIT_SLO_MISSED = 1


def _check_lens(text: str) -> str:
    """Option callback: the buckets parse (a mistake is a usage error, exit 2)."""
    _lens(text)
    return text


def _lens(text: str) -> tuple[int, ...]:
    try:
        lens = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("comma-separated token counts, e.g. 10,200,512") from None
    if not lens or min(lens) < 1:
        raise typer.BadParameter("token counts must be >= 1")
    twice = sorted({n for n in lens if lens.count(n) > 1})
    if twice:  # one bucket each: the report would list a bucket it never measured apart
        raise typer.BadParameter(f"{', '.join(map(str, twice))} given twice; list each once")
    from orin.bench.loadgen import MAX_INPUT_LEN

    if max(lens) > MAX_INPUT_LEN:
        raise typer.BadParameter(
            f"token counts must be at most {MAX_INPUT_LEN} (orin-llm's largest context)"
        )
    return lens


def _slo(text: str | None) -> SLO:
    try:
        return SLO.parse(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _check_slo(text: str | None) -> str | None:
    """Option callback: ``--slo ttft=5`` is a usage error (exit 2), found before any
    request is sent."""
    _slo(text)
    return text


def _check_rate(value: float | None) -> float | None:
    """Option callback: a rate that is not positive (nan included) is a usage error
    naming --request-rate; inf sends every request at once."""
    if value is not None and not value > 0:
        raise typer.BadParameter("the request rate must be positive (inf: all at once)")
    return value


def _check_burstiness(value: float) -> float:
    """Option callback: the gamma shape is a positive finite number."""
    if not 0 < value < math.inf:
        raise typer.BadParameter("burstiness must be positive and finite")
    return value


def _kv_type(value: str | None) -> str | None:
    from orin.model.memplan import KV_TYPES

    if value is not None and value.lower() not in KV_TYPES:
        raise typer.BadParameter(f"one of {', '.join(KV_TYPES)}")
    return value.lower() if value is not None else None


@handle_errors
def bench(
    url: Annotated[
        str, typer.Option(callback=check_url, help="Server base URL, e.g. http://127.0.0.1:8080.")
    ],
    model: Annotated[
        str | None,
        typer.Option(
            help="Model name to send, one the server lists in /v1/models "
            "(default: the server's first)."
        ),
    ] = None,
    num_requests: Annotated[int, typer.Option(min=1, help="Measured requests.")] = 64,
    input_len: Annotated[
        str,
        typer.Option(
            callback=_check_lens,
            help="Prompt tokens; several buckets comma-separated (10,200,512).",
        ),
    ] = "128",
    output_len: Annotated[int, typer.Option(min=1, help="Generated tokens per request.")] = 64,
    concurrency: Annotated[
        int | None, typer.Option(min=1, help="Closed loop: requests in flight (a cap with a rate).")
    ] = None,
    request_rate: Annotated[
        float | None,
        typer.Option(
            callback=_check_rate, help="Open loop: requests/s, Poisson arrivals (inf: at once)."
        ),
    ] = None,
    burstiness: Annotated[
        float,
        typer.Option(
            callback=_check_burstiness,
            help="Gamma shape of the arrival gaps: 1 Poisson, <1 burstier.",
        ),
    ] = 1.0,
    warmup: Annotated[int, typer.Option(min=0, help="Unmeasured requests first.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of prompts, order and arrivals.")] = 0,
    slo: Annotated[
        str | None,
        typer.Option(
            callback=_check_slo, help="Targets for goodput: ttft_p95_ms=200,tpot_p90_ms=50."
        ),
    ] = None,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
    api_key: ApiKeyOpt = None,
    timeout: Annotated[
        float, typer.Option(min=1, callback=finite, help="Seconds per request.")
    ] = 600.0,
    model_file: Annotated[
        Path | None,
        typer.Option(
            parser=path_named,
            help="The served GGUF file, for decode bytes per step and bandwidth utilization "
            "(default: the file an orin-llm server names, when it is on this machine; "
            "other servers report utilization only with this option).",
        ),
    ] = None,
    cache_type_k: Annotated[
        str | None,
        typer.Option(
            callback=_kv_type, help="The server's K cache type (default: orin-llm's, else f16)."
        ),
    ] = None,
    cache_type_v: Annotated[
        str | None,
        typer.Option(
            callback=_kv_type, help="The server's V cache type (default: orin-llm's, else f16)."
        ),
    ] = None,
    mem_bandwidth: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            callback=finite,
            help="The server machine's memory bandwidth in GB/s (default: this machine's, "
            "from the Jetson data sheet or a cached copy probe, for a server on this machine).",
        ),
    ] = None,
) -> None:
    """Measure a server under load: fixed input and output lengths, streaming, greedy."""
    from orin.bench.loadgen import LoadSpec

    spec = LoadSpec(
        url=url,
        num_requests=num_requests,
        input_lens=_lens(input_len),
        output_len=output_len,
        concurrency=concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        warmup=warmup,
        seed=seed,
        model=model,
        api_key=api_key,
        timeout_s=timeout,
        slo=_slo(slo),
        bandwidth=BandwidthRequest(model_file, cache_type_k, cache_type_v, mem_bandwidth),
    )
    try:
        spec.check()
    except ValueError as exc:
        raise usage_error(str(exc)) from None
    if model_file is not None:  # missing or not GGUF: exit 3 now, not a note after the run
        from orin.model.gguf import read_model_info

        read_model_info(model_file)
    out = Output(as_json)
    from orin.bench.server import InputTooLong, UnknownModel

    try:
        result = _run_with_progress(spec, out)
    except UnknownModel as exc:  # found from /v1/models, before any request is sent
        raise typer.BadParameter(str(exc), param_hint="'--model'") from None
    except InputTooLong as exc:  # the context the server says it has, likewise
        hint = " / ".join(f"'--{name}-len'" for name in exc.options)
        raise typer.BadParameter(str(exc), param_hint=hint) from None
    if as_json:
        out.json(result.to_json())
    else:
        show(out, result)
    if output is not None:
        try:  # checked at the start; a folder that changed since is said, not a bug
            output.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise fail(f"cannot write {output}: {exc.strerror or exc}", 1) from None
        out.note(f"wrote {output}")
    if not any(r.ok for r in result.results):  # said on stderr, --json or not
        raise fail(_all_failed(result.summary()["errors"]), EXIT_ALL_FAILED)
    missed = _slo_missed(result.summary()["slo"])
    if missed:  # targets given are a test: CI fails when one is missed
        raise fail(missed, EXIT_SLO_MISSED)


def _slo_missed(checked: dict[str, dict[str, Any]]) -> str | None:
    """``SLO missed: ttft_p95_ms 312.40 ms > 200 ms``, or None when every target is met."""
    parts = [
        f"{key} not measured (target {v['target']:g} ms)"
        if v["measured"] is None
        else f"{key} {_ms(v['measured'])} ms > {v['target']:g} ms"
        for key, v in checked.items()
        if not v["met"]
    ]
    return "SLO missed: " + ", ".join(parts) if parts else None


def _all_failed(errors: dict[str, int]) -> str:
    """``every request failed: http 400 context_length_exceeded 63, timeout 1``."""
    kinds = sorted(errors.items(), key=lambda kv: -kv[1])
    return "every request failed: " + ", ".join(f"{kind} {n}" for kind, n in kinds)


def _run_with_progress(spec: LoadSpec, out: Output) -> BenchRun:
    from orin.bench.loadgen import run

    columns = (
        TextColumn("[bold]bench[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"),
        TimeElapsedColumn(),
    )
    with Progress(
        *columns, console=out.err, transient=True, disable=not progress_wanted()
    ) as progress:
        task = progress.add_task("bench", total=spec.num_requests, failed=0)
        failed = 0

        def on_result(r: RequestResult) -> None:
            nonlocal failed
            failed += not r.ok
            progress.update(task, advance=1, failed=failed)

        return run(spec, on_result=on_result)


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def show(out: Output, r: BenchRun) -> None:
    """The summary tables: totals, latency distributions, buckets, SLOs, telemetry."""
    s = r.summary()
    for note in r.server.notes:
        out.note(note)
    rate = "inf" if r.spec.all_at_once else f"{r.spec.request_rate:g}/s"
    out.pairs(
        f"bench: {r.server.kind} {r.server.model or ''} at {r.spec.base_url}",
        [
            ("requests completed / failed", f"{s['completed']} / {s['failed']}"),
            ("load", f"concurrency {r.spec.concurrency or '-'}, rate {rate}"),
            ("duration s", f"{s['duration']:.2f}"),
            ("input / output tokens", f"{s['total_input_tokens']} / {s['total_output_tokens']}"),
            ("request throughput req/s", f"{s['request_throughput']:.3f}"),
            ("output throughput tok/s", f"{s['output_throughput']:.2f}"),
            ("total token throughput tok/s", f"{s['total_token_throughput']:.2f}"),
            ("goodput req/s", _ms(s["request_goodput"])),
            ("token counts from", ", ".join(f"{k} {v}" for k, v in s["count_sources"].items())),
        ],
    )
    stats = ("mean", "median", "p50", "p90", "p95", "p99")
    out.table(
        "latency (ms)",
        ("metric", *stats),
        (
            (m.upper(), *(_ms(s[f"{st}_{m}_ms"]) for st in stats))
            for m in ("ttft", "tpot", "itl", "e2el")
        ),
    )
    _show_buckets(out, r)
    if s["errors"]:
        out.table("errors", ("error", "requests"), s["errors"].items())
    if s["slo"]:
        out.table(
            "SLO",
            ("target", "goal ms", "measured ms", "met"),
            (
                (k, v["target"], _ms(v["measured"]), "yes" if v["met"] else "NO")
                for k, v in s["slo"].items()
            ),
        )
    _show_telemetry(out, r.telemetry)
    show_bandwidth(out, r)


def _show_buckets(out: Output, r: BenchRun) -> None:
    buckets = by_bucket(r.results)
    if len(buckets) < 2:
        return
    out.table(
        "by input length",
        ("input", "ok", "failed", "mean prompt tok", "TTFT p95", "TPOT p90", "E2EL p50"),
        (
            (
                k,
                b["completed"],
                b["failed"],
                _ms(b["mean_input_tokens"]),
                _ms(b["p95_ttft_ms"]),
                _ms(b["p90_tpot_ms"]),
                _ms(b["p50_e2el_ms"]),
            )
            for k, b in buckets.items()
        ),
    )


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _show_telemetry(out: Output, t: dict[str, Any] | None) -> None:
    if t is None:
        return
    if t.get("source") is None and not t.get("per_request_mean"):
        out.note(t.get("note", "no server telemetry"))
        return
    rows = [
        (name, f"{p['seconds']:.2f}", p["tokens"], _pct(p["gpu_util"]), _pct(p["cpu_util"]))
        for name, p in (t.get("phases") or {}).items()
    ]
    out.table(
        f"server phases during the run (telemetry: {t.get('source')})",
        ("phase", "seconds", "tokens", "GPU util", "server CPU util"),
        rows,
    )
    for key, value in (t.get("per_request_mean") or {}).items():
        out.note(f"mean per-request {key}: {_pct(value)}")


def show_bandwidth(out: Output, r: BenchRun) -> None:
    """Decode bytes per step, achieved GB/s and their share of the memory bandwidth."""
    u = r.bandwidth
    if u is None:
        if r.bandwidth_note:
            out.note(r.bandwidth_note)
        return
    j = u.to_json()
    bw, util = j["mem_bandwidth_gb_per_s"], j["utilization_pct"]
    out.pairs(
        "decode memory traffic",
        [
            ("model / KV types", f"{Path(u.model_file).name} / {u.type_k}, {u.type_v}"),
            ("streams per step / attended cells", f"{u.streams:.2f} / {u.mean_kv_cells:.0f}"),
            ("decode bytes per step", human_bytes(u.bytes_per_step)),
            ("decode steps/s", f"{u.steps_per_s:.2f}"),
            ("achieved GB/s", _sig(j["achieved_gb_per_s"])),
            ("memory bandwidth GB/s", "-" if bw is None else f"{bw:.1f} ({u.bandwidth.source})"),
            ("bandwidth utilization", "-" if util is None else f"{_sig(util)}%"),
        ],
    )
    if not u.bandwidth.known and u.bandwidth.detail:
        out.note(u.bandwidth.detail)


def _sig(v: float) -> str:
    """Two decimals, or three significant digits below 1 (a tiny model's GB/s)."""
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"


app = Typer(help="Benchmark a running server.", add_completion=False)
app.command("bench")(bench)
