"""The request side of benchmarks/peers.py's side-by-side scenarios, and their figures.

What a scenario sends, how each stream is timed and how the token arrival times
become the reported metrics. Nothing here starts a server: peers.py starts each
server with the settings a scenario needs and hands it the URL, so the same code
measures `orin-llm serve` and `llama-server`.

Streams are read the way orin/bench/client.py reads them (blocking http.client,
one thread per stream, each chunk stamped when it arrives, split by the one SSE
decoder), with two additions the scenarios need: chat requests, whose token
chunks carry ``delta.content`` rather than ``text``, and events a caller can wait
on (the request has been sent; the first token has arrived), so that one request
goes out once others are decoding without guessing a delay. Every event is
parsed (the scenarios read the final ``timings`` for cached and drafted tokens);
that costs microseconds per token, the same for every server.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from orin.bench.client import http_error
from orin.bench.prompts import words
from orin.bench.sse import SSEDecoder

Metrics = dict[str, float | None]
READ_SIZE = 65536
TIMEOUT_S = 900.0

# mixed: 4 running streams, one prompt of most of a slot, then a few short ones
MIXED_RUNNING, MIXED_SHORT = 4, 3
LONG_PROMPT = "long context " * 100  # ~400 tokens of the demo tokenizer: most of a 512-cell slot
SHORT_TOKENS = 8

# shared_prefix / restart: one long system prompt, different questions
SHARED_USERS = 8
SYSTEM_WORDS = 380  # ~1,000 tokens of the demo tokenizer
QUESTION_WORDS = 4  # ~16 tokens

# copy_task / no_match on SmolLM2-135M-Instruct, greedy
COPY_TOKENS, FREE_TOKENS = 400, 128  # SmolLM2 starts repeating itself after ~150 free tokens
COPY_REQUESTS = 3
FREE_REQUESTS = 6  # 128 tokens each: cheap, and more pairs to take the median of
PASSAGE = (
    "The lighthouse on the northern cape was built in 1871 from granite cut in a quarry "
    "two miles inland. Oxen pulled the blocks to the shore on wooden sledges, and the "
    "masons laid them in rings, each ring a little narrower than the one below it. The "
    "tower is forty metres tall. Its lamp first burned whale oil, then paraffin, and "
    "from 1923 an electric bulb fed by a diesel generator in the shed beside the "
    "keeper's house. Three families lived on the cape in those years. The keepers "
    "climbed the one hundred and twelve steps four times a night to wind the clockwork "
    "that turned the lens, and they wrote the weather into a log book every three "
    "hours: the wind, the sea, the visibility and the ships that passed. In the winter "
    "of 1947 a storm cut the cape off for nineteen days, and the families lived on "
    "salted fish, potatoes and the tins kept for such times. The light was automated in "
    "1989. The last keeper left in the spring of that year, and the house is now a "
    "small museum, open from May to September, where visitors can read the old log "
    "books and climb the tower on clear afternoons. The lens itself, made in Paris and "
    "shipped in eleven crates, still turns every night, although a small lamp now does "
    "the work that once needed a keeper awake until dawn."
)
COPY_ASK = "Repeat the following passage exactly, word for word, and write nothing else."
FREE_ASK = "Write a short story about a fox who learns to play the violin in a big city."


# -- figures from token arrival times ---------------------------------------------------


def pct(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def gaps_ms(times: Sequence[float]) -> list[float]:
    """Inter-token latencies in ms from arrival times in seconds."""
    return [(b - a) * 1e3 for a, b in itertools.pairwise(times)]


def tpot_ms(times: Sequence[float], tokens: int) -> float | None:
    """Mean time per output token after the first: first to last arrival over the
    tokens after the first, by the server's count (a chunk may carry several tokens,
    as speculative decoding's do)."""
    if len(times) < 2 or tokens < 2:
        return None
    return (times[-1] - times[0]) * 1e3 / (tokens - 1)


def median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


class HasTpot(Protocol):
    @property
    def tpot_ms(self) -> float | None: ...


def pair_ratio(base: Sequence[HasTpot], other: Sequence[HasTpot]) -> float | None:
    """The median over i of ``other[i]``'s TPOT over ``base[i]``'s, the pairs where both
    have one: requests of a pair that ran seconds apart (``in_turns``)."""
    pairs = [
        a / b
        for x, y in zip(other, base, strict=False)
        if (a := x.tpot_ms) is not None and (b := y.tpot_ms)
    ]
    return median(pairs) if pairs else None


def rotate(names: Sequence[str], rep: int) -> list[str]:
    """Who goes first changes from rep to rep."""
    k = rep % len(names)
    return [*names[k:], *names[:k]]


def in_turns(names: Sequence[str], k: int, rep: int) -> Iterator[str]:
    """``k`` rounds of one request to each of ``names`` (servers that are up at once),
    in turns: A B, B A, A B, ... (who opens rotates by ``rep``, names sorted), so that
    the i-th requests of all run seconds apart and the machine's drift, which moves
    one server's run against the next by 10 % and more on a shared VM, hits them
    alike."""
    order = rotate(sorted(names), rep)
    for i in range(k):
        yield from order if i % 2 == 0 else order[::-1]


def itl_metrics(streams: Sequence[Sequence[float]]) -> Metrics:
    """ITL p50 / p99 / max over every gap of every stream (arrival times in seconds)."""
    itl = [g for times in streams for g in gaps_ms(times)]
    return {
        "itl_p50_ms": pct(itl, 0.5),
        "itl_p99_ms": pct(itl, 0.99),
        "itl_max_ms": max(itl) if itl else None,
    }


def ttft_metrics(ttfts: Sequence[float | None], prefix: str = "ttft") -> Metrics:
    got = [t for t in ttfts if t is not None]
    return {
        f"{prefix}_p50_ms": pct(got, 0.5),
        f"{prefix}_p95_ms": pct(got, 0.95),
        f"{prefix}_max_ms": max(got) if got else None,
    }


# -- one streamed request ---------------------------------------------------------------


@dataclass
class Streamed:
    """One streamed request as the client saw it: when each token chunk arrived, the
    text, and the server's own counts and figures from its final events."""

    t0: float  # perf_counter when the request was sent
    token_times: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        """One SSE event's data, received at ``now`` (pure: times are passed in)."""
        if data.strip() == b"[DONE]":
            return
        chunk = json.loads(data)
        if chunk.get("error"):
            err = chunk["error"]
            code = err.get("code") or err.get("type") if isinstance(err, dict) else None
            self.error = f"stream error {code or ''}".strip()
            return
        self.usage = chunk.get("usage") or self.usage
        self.timings = chunk.get("timings") or self.timings
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            piece = choice.get("text") or delta.get("content") or delta.get("reasoning_content")
            if piece:
                self.token_times.append(now)
                self.pieces.append(piece)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def tokens(self) -> int:
        """Output tokens, by the server's count where it gives one."""
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        if self.timings and self.timings.get("predicted_n") is not None:
            return int(self.timings["predicted_n"])
        return len(self.token_times)

    @property
    def prompt_tokens(self) -> int | None:
        if self.usage and self.usage.get("prompt_tokens") is not None:
            return int(self.usage["prompt_tokens"])
        return None

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the server took from its cache (usage details, else timings)."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            return int(details["cached_tokens"])
        if self.timings and self.timings.get("cache_n") is not None:
            return int(self.timings["cache_n"])
        return None

    @property
    def drafted(self) -> tuple[int, int] | None:
        """(drafted, accepted) tokens where the server reports them (llama-server's
        ``timings.draft_n`` / ``draft_n_accepted``)."""
        t = self.timings or {}
        if t.get("draft_n") is None or t.get("draft_n_accepted") is None:
            return None
        return int(t["draft_n"]), int(t["draft_n_accepted"])

    @property
    def ttft_ms(self) -> float | None:
        return (self.token_times[0] - self.t0) * 1e3 if self.token_times else None

    @property
    def tpot_ms(self) -> float | None:
        return tpot_ms(self.token_times, self.tokens)


def completion_body(prompt: str, n: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


def chat_body(user: str, n: int, system: str | None = None) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    return {"messages": messages, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


def post_stream(
    url: str,
    path: str,
    body: Mapping[str, Any],
    sent: threading.Event | None = None,
    first: threading.Event | None = None,
    timeout: float = TIMEOUT_S,
) -> Streamed:
    """POST a streaming request and time its token chunks; never raises. ``sent`` is
    set once the request is written, ``first`` once a token has arrived (both also
    on failure, so that nobody waits for a request that died)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    out = Streamed(time.perf_counter())
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        if sent is not None:
            sent.set()
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = http_error(resp.status, resp.read())
            return out
        decoder = SSEDecoder()
        while chunk := resp.read1(READ_SIZE):
            now = time.perf_counter()
            for data in decoder.feed(chunk):
                out.feed(data, now)
            if first is not None and out.token_times:
                first.set()
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        for event in (sent, first):
            if event is not None:
                event.set()
    return out


def completion(
    url: str,
    prompt: str,
    n: int,
    sent: threading.Event | None = None,
    first: threading.Event | None = None,
) -> Streamed:
    return post_stream(url, "/v1/completions", completion_body(prompt, n), sent, first)


def chat(url: str, user: str, n: int, system: str | None = None, **extra: Any) -> Streamed:
    """One streamed chat request; ``extra`` goes into the body (llama-server's
    ``id_slot``)."""
    return post_stream(url, "/v1/chat/completions", {**chat_body(user, n, system), **extra})


def errors(results: Sequence[Streamed]) -> float:
    return float(sum(1 for r in results if r.error))


# -- prompts ------------------------------------------------------------------------------


def system_prompt(n_words: int = SYSTEM_WORDS, seed: int = 0) -> str:
    """A long system prompt of ordinary words, the same for every server and run."""
    return "You answer questions about the robot fleet. " + words(
        random.Random(f"peers:system:{seed}"), n_words
    )


def questions(k: int, seed: int = 0) -> list[str]:
    """``k`` different short user questions."""
    rng = random.Random(f"peers:questions:{seed}")
    return [f"Question {i}: {words(rng, QUESTION_WORDS)}?" for i in range(k)]


# -- scenarios ------------------------------------------------------------------------------


def mixed(url: str, n: int) -> Metrics:
    """4 streams decoding; once each has a token, a prompt of most of a slot, and once
    that is sent, 3 short prompts. ITL of the running streams, TTFT of the long
    prompt and of the short ones."""
    with ThreadPoolExecutor(max_workers=MIXED_RUNNING + 1 + MIXED_SHORT) as pool:
        firsts = [threading.Event() for _ in range(MIXED_RUNNING)]
        running = [
            pool.submit(completion, url, f"Decode {i} on the edge board.", n, first=firsts[i])
            for i in range(MIXED_RUNNING)
        ]
        for ev in firsts:
            ev.wait(TIMEOUT_S)
        sent = threading.Event()
        long = pool.submit(completion, url, LONG_PROMPT, 4, sent=sent)
        sent.wait(TIMEOUT_S)
        shorts = [
            pool.submit(completion, url, f"Short question {i}.", SHORT_TOKENS)
            for i in range(MIXED_SHORT)
        ]
        done = _results(running)
        intruder = long.result()
        short = _results(shorts)
    return {
        **itl_metrics([r.token_times for r in done]),
        "long_ttft_ms": intruder.ttft_ms,
        "long_prompt_tokens": _float(intruder.prompt_tokens),
        "short_ttft_p50_ms": pct([t for r in short if (t := r.ttft_ms) is not None], 0.5),
        "short_ttft_max_ms": max((t for r in short if (t := r.ttft_ms) is not None), default=None),
        "errors": errors([*done, intruder, *short]),
    }


def shared_prefix(url: str, n: int, system: str, users: int = SHARED_USERS) -> Metrics:
    """One user asks first (its prefill fills the server's cache with the system
    prompt), then ``users`` users with the same system prompt and different
    questions at once: TTFT p50/p95 of those, and how many prompt tokens each took
    from the cache."""
    asks = questions(users + 1)
    prime = chat(url, asks[0], n, system)
    with ThreadPoolExecutor(max_workers=users) as pool:
        done = list(pool.map(lambda q: chat(url, q, n, system), asks[1:]))
    ttft = ttft_metrics([r.ttft_ms for r in done])
    return {
        "prime_ttft_ms": prime.ttft_ms,
        "ttft_p50_ms": ttft["ttft_p50_ms"],
        "ttft_p95_ms": ttft["ttft_p95_ms"],
        "prompt_tokens": _float(prime.prompt_tokens),
        "cached_tokens_median": median([_float(r.cached_tokens) for r in done]),
        "errors": errors([prime, *done]),
    }


@dataclass(frozen=True)
class CopyRun:
    """One server's copy_task and no_match requests with speculation off or on."""

    copy: list[Streamed]
    free: list[Streamed]


def copy_requests(
    urls: Mapping[str, str],
    picked: frozenset[str],
    rep: int = 0,
    k: int = COPY_REQUESTS,
    k_free: int = FREE_REQUESTS,
) -> dict[str, CopyRun]:
    """``k`` requests to quote PASSAGE (copy_task) and ``k_free`` free-text requests
    (no_match), for those of the two picked, to each of two servers that are up at
    once (speculation off and on: ``urls`` by mode), in turns (``in_turns``)."""
    copies = k if "copy_task" in picked else 0
    frees = k_free if "no_match" in picked else 0
    got = {name: CopyRun([], []) for name in urls}
    for name in in_turns(list(urls), copies, rep):
        got[name].copy.append(chat(urls[name], f"{COPY_ASK}\n\n{PASSAGE}", COPY_TOKENS))
    for name in in_turns(list(urls), frees, rep):
        got[name].free.append(chat(urls[name], FREE_ASK, FREE_TOKENS))
    return got


def accept_rate(results: Sequence[Streamed]) -> float | None:
    pairs = [d for r in results if (d := r.drafted) is not None]
    drafted = sum(d for d, _ in pairs)
    return sum(a for _, a in pairs) / drafted if drafted else None


def speculation_metrics(off: Sequence[Streamed], on: Sequence[Streamed]) -> Metrics:
    """TPOT with speculation off and on (medians over the requests), their ratio
    on/off (below 1: faster with it), whether greedy output stayed the same, and the
    share of drafted tokens accepted where the server reports it."""
    t_off = median([r.tpot_ms for r in off])
    t_on = median([r.tpot_ms for r in on])
    same = [a.text == b.text for a, b in zip(off, on, strict=False) if not (a.error or b.error)]
    return {
        "tpot_off_ms": t_off,
        "tpot_ngram_ms": t_on,
        "ngram_over_off": ratio(t_on, t_off),
        "pair_ratio": pair_ratio(off, on),
        "tokens": median([float(r.tokens) for r in off]),
        "same_output": float(all(same)) if same else None,
        "accept_rate": accept_rate(on),
        "errors": errors([*off, *on]),
    }


def copy_metrics(off: CopyRun, on: CopyRun) -> dict[str, Metrics]:
    out: dict[str, Metrics] = {}
    if off.copy or on.copy:
        out["copy_task"] = speculation_metrics(off.copy, on.copy)
    if off.free or on.free:
        out["no_match"] = speculation_metrics(off.free, on.free)
    return out


def restart_metrics(
    cold: Streamed,
    warm: Streamed,
    start_cold_s: float | None,
    start_warm_s: float | None,
    restore_ms: float | None = None,
    saved_bytes: int = 0,
) -> Metrics:
    """The first request's TTFT after a cold start and after a restart with the system
    prompt's state saved (plus ``restore_ms``, the restore call a client makes before
    it, where there is one), the restarted/cold ratio, both start times (launch to
    ready), the prompt tokens the restarted server took from its cache and the size
    of the saved state."""
    ttft_warm = warm.ttft_ms
    if ttft_warm is not None and restore_ms is not None:
        ttft_warm += restore_ms
    return {
        "ttft_cold_ms": cold.ttft_ms,
        "ttft_restart_ms": ttft_warm,
        "restart_over_cold": ratio(ttft_warm, cold.ttft_ms),
        "restore_ms": restore_ms,
        "start_cold_s": start_cold_s,
        "start_restart_s": start_warm_s,
        "cached_tokens": _float(warm.cached_tokens),
        "saved_mib": saved_bytes / 2**20,
        "errors": errors([cold, warm]),
    }


def bandwidth_utilization(
    bytes_per_step: int | None, tpot: float | None, bytes_per_s: float | None
) -> float | None:
    """Share of the machine's memory bandwidth a single stream's decode uses: the
    bytes one step reads, times steps per second, over the bandwidth."""
    if not bytes_per_step or not tpot or not bytes_per_s:
        return None
    return bytes_per_step * 1e3 / tpot / bytes_per_s


def _results(futures: Sequence[Future[Streamed]]) -> list[Streamed]:
    return [f.result() for f in futures]


def _float(value: int | None) -> float | None:
    return float(value) if value is not None else None
