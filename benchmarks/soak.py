"""Does `orin-llm serve` hold its memory over hours of traffic?

A service that runs for weeks on a board with unified memory must not grow: a
few kilobytes kept per request is a gigabyte after some hundred thousand
requests, and on an Orin that memory is the GPU's too. This benchmark runs
one `orin-llm serve` on the generated demo model and sends it rounds of the
traffic a deployment sees, then reads the server process after each round:

- streamed completions, several at once (continuous batching);
- a chat completion, not streamed;
- a streamed request the client drops after a few tokens (cancellation);
- a request the API refuses (400), and one for an unknown route (404);
- a streamed chat behind the system prompt every round shares (prefix reuse:
  the cached cells kept in an idle slot or copied into another one), asking
  for a sentence back word for word.

``--speculative`` runs the server with n-gram speculation on, drafting wherever
the lookup finds a match (drafted cells written and the rejected ones removed
every step), and ``--prompt-cache`` with that system prompt in a persistent
prompt cache (its state saved at the first start and restored at start): the
step-shaping features, whose cells are copied, moved and removed, soaked like
the rest. The demo model's answers (random weights) gave speculation nothing to
draft in the runs of docs/performance.md: ``--model smollm2`` runs the packaged
SmolLM2-135M-Instruct instead, whose quoted sentence is drafted.

After each round: the resident set (RSS), the open file descriptors and the
threads of the server process. The first rounds warm caches (allocator
arenas, llama.cpp's buffers, Python's), so the growth is fitted by least
squares over the rounds after ``--warmup``: bytes per request, and what that
slope would add over a day at the round rate measured. Some memory grows with
time rather than requests until it is full: the dashboard keeps five minutes
of one-second rows (``dashboard.HISTORY_S``, about 230 KB), so a fit that
starts within the server's first five minutes sees that ring filling; at about
two rounds a second on 2 cores, ``--warmup 800`` leaves it out. At the end the
server's own counters say what was exercised: prompt tokens served from cached
cells, drafted tokens verified and accepted, prompt-cache saves, restores and
hits.

    .venv/bin/python -m benchmarks.soak                       # 40 rounds, ~20 s on 2 cores
    .venv/bin/python -m benchmarks.soak --rounds 3000 --warmup 800 --json soak.json
    .venv/bin/python -m benchmarks.soak --speculative --prompt-cache --rounds 3000 --warmup 800
    .venv/bin/python -m benchmarks.soak --model smollm2 --speculative --prompt-cache \\
        --rounds 800 --warmup 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.peers import orin_profile, serve_argv, write_profile
from benchmarks.server_throughput import stop, wait_up
from orin.model import demo, packaged
from tests.serverutil import free_port

SLOTS = 4
CTX_PER_SLOT = 512
# what the server's /metrics says the soak exercised (counter totals at the end)
EXERCISED = {
    "orin_llm_requests": "finished requests (every reason)",
    "orin_llm_prompt_tokens_cached": "prompt tokens served from cached cells",
    "orin_llm_spec_drafted_tokens": "drafted tokens verified",
    "orin_llm_spec_accepted_tokens": "drafted tokens accepted",
    "orin_llm_prompt_cache_saves": "prompt-cache states saved to disk",
    "orin_llm_prompt_cache_loads": "prompt-cache restores from disk",
    "orin_llm_prompt_cache_hits": "requests that found their prompt in the prompt cache",
}
SHARED = "You are the cabin assistant of a delivery van. Answer in one short sentence. " * 4


@dataclass(frozen=True)
class Sample:
    """The server process after a round."""

    round: int
    requests: int  # sent so far, all rounds
    rss: int  # bytes
    fds: int
    threads: int
    t: float  # seconds since the first round began


@dataclass(frozen=True)
class Soak:
    """A soak's samples, and what the server says it exercised."""

    samples: list[Sample]
    counters: dict[str, float]


@dataclass(frozen=True)
class Growth:
    """Least-squares growth over the samples after the warm-up."""

    bytes_per_request: float
    bytes_per_day: float  # at the measured request rate
    # the same fit over the later half of those rounds: growth that levels off
    # (a cache filling up) has a late slope near zero, a leak keeps its slope
    late_bytes_per_request: float
    rss_first: int
    rss_last: int
    rss_max: int
    fds_first: int
    fds_last: int
    threads_first: int
    threads_last: int
    samples: int


def growth(samples: list[Sample], warmup: int) -> Growth:
    """Fit RSS against requests sent over the samples after ``warmup`` rounds."""
    kept = [s for s in samples if s.round >= warmup]
    if len(kept) < 2:
        raise ValueError(f"need at least 2 rounds after the {warmup} warm-up rounds")
    fit = _slope(kept)
    late = _slope(kept[len(kept) // 2 :]) if len(kept) >= 4 else fit
    span_s = kept[-1].t - kept[0].t
    rate = (kept[-1].requests - kept[0].requests) / span_s if span_s > 0 else 0.0
    first, last = kept[0], kept[-1]
    return Growth(
        bytes_per_request=fit,
        bytes_per_day=fit * rate * 86400,
        late_bytes_per_request=late,
        rss_first=first.rss,
        rss_last=last.rss,
        rss_max=max(s.rss for s in kept),
        fds_first=first.fds,
        fds_last=last.fds,
        threads_first=first.threads,
        threads_last=last.threads,
        samples=len(kept),
    )


def _slope(samples: list[Sample]) -> float:
    """Least-squares bytes of RSS per request sent."""
    xs, ys = [s.requests for s in samples], [s.rss for s in samples]
    return statistics.linear_regression(xs, ys).slope


def _stream(url: str, path: str, body: dict[str, Any], keep: int | None = None) -> None:
    """Read a streamed answer to its end, or walk away after ``keep`` lines."""
    with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=300) as r:
        r.raise_for_status()
        for i, _ in enumerate(r.iter_lines()):
            if keep is not None and i >= keep:
                break


def _completion(url: str, prompt: str, tokens: int) -> None:
    _stream(url, "/v1/completions", {"prompt": prompt, "max_tokens": tokens, "temperature": 0})


def _assistant(url: str, question: str) -> None:
    """A streamed chat behind the system prompt every round shares, asking for a
    sentence back word for word (greedy): a real model's answer repeats its prompt,
    which n-gram speculation drafts from."""
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]
    body = {"messages": messages, "max_tokens": 24, "temperature": 0}
    _stream(url, "/v1/chat/completions", body)


def _dropped(url: str, prompt: str) -> None:
    """A stream the client walks away from after three events (data lines and the
    blank lines between them)."""
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0}
    _stream(url, "/v1/completions", body, keep=6)


def _chat(url: str, question: str) -> None:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 16}
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def _refused(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": "x"}, timeout=60)
    if r.status_code != 400:
        raise RuntimeError(f"a bad request got {r.status_code}, not 400")
    if httpx.get(f"{url}/v1/nowhere", timeout=60).status_code != 404:
        raise RuntimeError("an unknown route did not get 404")


def exercised(url: str) -> dict[str, float]:
    """The counters of ``EXERCISED`` as /metrics reports them, summed over labels."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    out = dict.fromkeys(EXERCISED, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in out:
            out[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def one_round(url: str, index: int, pool: ThreadPoolExecutor) -> int:
    """Send one round of traffic; the requests it sent."""
    jobs = [
        pool.submit(_completion, url, f"Round {index}, stream {i}: the route ahead is", 24)
        for i in range(SLOTS - 1)
    ]
    quote = f"Repeat exactly: stop {index} is the depot on the north side of the river."
    jobs.append(pool.submit(_assistant, url, quote))
    for job in jobs:
        job.result()
    _chat(url, f"Round {index}: how far is the depot?")
    _dropped(url, f"Round {index}: a long story about the road")
    _refused(url)
    return len(jobs) + 4  # the chat, the dropped stream, the 400, the 404


def sample(proc: psutil.Process, index: int, requests: int, t0: float) -> Sample:
    return Sample(
        round=index,
        requests=requests,
        rss=proc.memory_info().rss,
        fds=proc.num_fds(),
        threads=proc.num_threads(),
        t=time.monotonic() - t0,
    )


def profile(work: Path, speculative: bool, prompt_cache: bool) -> Path | None:
    """The profile the server runs under: None for `serve --model` alone."""
    if not (speculative or prompt_cache):
        return None
    cache = ([SHARED], work / "prompt-cache") if prompt_cache else None
    chosen = orin_profile("soak", speculative="ngram" if speculative else None, prompt_cache=cache)
    if speculative:  # draft wherever the lookup finds a match: drafted cells written and removed
        chosen["speculative"]["cost_aware"] = False
    return write_profile(chosen, work)


def run(
    model: Path,
    rounds: int,
    settle_s: float,
    speculative: bool = False,
    prompt_cache: bool = False,
    quiet: bool = False,
) -> Soak:
    with tempfile.TemporaryDirectory() as tmp:
        chosen = profile(Path(tmp), speculative, prompt_cache)
        return _soak(model, chosen, rounds, settle_s, quiet)


def _soak(model: Path, profile: Path | None, rounds: int, settle_s: float, quiet: bool) -> Soak:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = serve_argv(model, SLOTS, CTX_PER_SLOT, port, profile)
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples: list[Sample] = []
    try:
        wait_up(url, server)
        proc = psutil.Process(server.pid)
        sent = 0
        t0 = time.monotonic()
        with ThreadPoolExecutor(SLOTS) as pool:
            for index in range(rounds):
                sent += one_round(url, index, pool)
                time.sleep(settle_s)  # let a dropped stream's cancellation land
                samples.append(sample(proc, index, sent, t0))
                if quiet:
                    continue
                print(
                    f"round {index:4d}: {sent:6d} requests, RSS {samples[-1].rss / 2**20:7.1f} MiB,"
                    f" {samples[-1].fds} fds, {samples[-1].threads} threads",
                    file=sys.stderr,
                )
        counters = exercised(url)
    finally:
        stop(server)
    return Soak(samples, counters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        help="a GGUF file, or 'smollm2' for the packaged SmolLM2-135M-Instruct (a real "
        "model, whose quoted answers speculation drafts); default: the demo model",
    )
    ap.add_argument("--size", default="small", help="demo model size (tiny, small, medium)")
    ap.add_argument("--quant", default="q4_k_m", help="demo model quantization")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of traffic")
    ap.add_argument("--warmup", type=int, default=10, help="rounds left out of the fit")
    ap.add_argument("--settle", type=float, default=0.2, help="seconds between rounds")
    ap.add_argument("--speculative", action="store_true", help="n-gram speculation on")
    ap.add_argument(
        "--prompt-cache", action="store_true", help="the system prompt in a persistent prompt cache"
    )
    ap.add_argument("--json", type=Path, help="write the samples and the fit to this file")
    a = ap.parse_args()
    if a.rounds < a.warmup + 2:
        ap.error(f"--rounds must be at least --warmup + 2 ({a.warmup + 2})")
    if a.model == "smollm2":
        model = packaged.fetch(packaged.SMOLLM2)
    else:
        model = Path(a.model) if a.model else demo.ensure(a.size, a.quant)
    soak = run(model, a.rounds, a.settle, a.speculative, a.prompt_cache)
    samples = soak.samples
    g = growth(samples, a.warmup)
    mib = 2**20
    first, last, top = g.rss_first / mib, g.rss_last / mib, g.rss_max / mib
    print(
        f"{samples[-1].requests} requests in {a.rounds} rounds ({samples[-1].t:.0f} s);"
        f" after {a.warmup} warm-up rounds: RSS {first:.1f} -> {last:.1f} MiB"
        f" (max {top:.1f}), {g.bytes_per_request:+.0f} B per request"
        f" ({g.bytes_per_day / mib:+.1f} MiB a day at this rate),"
        f" {g.late_bytes_per_request:+.0f} B per request over the later half;"
        f" fds {g.fds_first} -> {g.fds_last}, threads {g.threads_first} -> {g.threads_last}"
    )
    for name, what in EXERCISED.items():
        print(f"  {what}: {soak.counters[name]:.0f}")
    if a.json:
        out: dict[str, Any] = {
            "model": str(model),
            "settings": {
                "slots": SLOTS,
                "ctx_per_slot": CTX_PER_SLOT,
                "rounds": a.rounds,
                "warmup": a.warmup,
                "speculative": a.speculative,
                "prompt_cache": a.prompt_cache,
            },
            "samples": [asdict(s) for s in samples],
            "growth": asdict(g),
            "exercised": soak.counters,
        }
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
