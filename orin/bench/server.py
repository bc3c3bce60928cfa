"""What the benchmark learns from the server before and after the run.

``probe`` finds out which server it is talking to (orin-llm says so in
``/v1/models``), whether it accepts ``ignore_eos``, and how to build prompts of
an exact length for it. ``scrape`` reads orin-llm's ``/metrics`` counters; two
scrapes around a run give the time the engine spent in prefill and decode and
the GPU (or process CPU) utilization in each phase over exactly that run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from orin.bench.client import Target, http_error
from orin.bench.prompts import WORDS, TokenPool, fit_word_count, words
from orin.errors import OrinError

CALIBRATION_ROUNDS = 3
PHASES = ("prefill", "decode")
PROBE_TEXT = "The board boots and"
POOL_CHUNK = 32  # words per pool probe: a few dozen tokens, within any context


class BenchError(OrinError):
    """The server cannot be benchmarked (unreachable, or it refuses every request)."""


@dataclass
class ServerInfo:
    kind: str  # "orin-llm" or "openai" (any other OpenAI-compatible server)
    model: str | None
    ignore_eos: bool
    pool: TokenPool | None = None  # token-id prompts (exact lengths) when set
    word_counts: dict[int, int] = field(default_factory=dict)  # text prompts otherwise
    notes: list[str] = field(default_factory=list)

    def target(self, base_url: str, headers: dict[str, str]) -> Target:
        extra: dict[str, Any] = {"ignore_eos": True} if self.ignore_eos else {}
        if self.kind == "orin-llm":
            extra["return_token_ids"] = True  # one chunk per token: exact per-token gaps
        return Target(base_url, self.model, headers, extra)

    def prompt(self, rng: random.Random, length: int) -> str | list[int]:
        if self.pool is not None:
            return self.pool.prompt(rng, length)
        return words(rng, self.word_counts.get(length, fit_word_count(length, 0, 0)))


async def _models(client: httpx.AsyncClient, base: str, headers: dict[str, str]) -> list[Any]:
    try:
        resp = await client.get(f"{base}/v1/models", headers=headers)
        data = resp.json().get("data") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return []
    return data if isinstance(data, list) else []


async def _complete(
    client: httpx.AsyncClient, target: Target, prompt: str | list[int]
) -> httpx.Response:
    body = target.body(prompt, 1, stream=False)
    try:
        return await client.post(
            f"{target.base_url}/v1/completions", json=body, headers=target.headers
        )
    except httpx.HTTPError as exc:
        raise BenchError(f"{target.base_url}: {type(exc).__name__}: {exc}") from exc


async def probe(
    client: httpx.AsyncClient,
    base: str,
    model: str | None,
    headers: dict[str, str],
    lengths: Sequence[int],
    seed: int,
) -> ServerInfo:
    """Identify the server and prepare prompts for every input length."""
    listed = await _models(client, base, headers)
    first = listed[0] if listed and isinstance(listed[0], dict) else {}
    kind = "orin-llm" if first.get("owned_by") == "orin-llm" else "openai"
    info = ServerInfo(kind, model or first.get("id"), ignore_eos=True)
    resp = await _complete(client, info.target(base, headers), PROBE_TEXT)
    if 400 <= resp.status_code < 500:
        info.ignore_eos = False
        resp = await _complete(client, info.target(base, headers), PROBE_TEXT)
        if resp.status_code < 400:
            info.notes.append("the server refused ignore_eos: output lengths rely on max_tokens")
    if resp.status_code >= 400:
        raise BenchError(f"{base}: a probe completion failed with {http_error(resp)}")
    if _prompt_ids(resp) is not None:
        info.pool = await _token_pool(client, info.target(base, headers))
        info.notes.append("token-id prompts: input lengths are exact")
    else:
        await _calibrate(client, info, base, headers, lengths, seed)
    return info


async def _token_pool(client: httpx.AsyncClient, target: Target) -> TokenPool:
    """Real token ids of ordinary words, learnt from short probes that fit any context."""
    tokenizations = []
    for i in range(0, len(WORDS), POOL_CHUNK):
        resp = await _complete(client, target, " ".join(WORDS[i : i + POOL_CHUNK]))
        ids = _prompt_ids(resp) if resp.status_code < 400 else None
        if ids is not None:
            tokenizations.append(ids)
    if len(tokenizations) < 2:
        raise BenchError(f"{target.base_url}: the server did not return prompt_token_ids")
    pool = TokenPool.from_tokenizations(tokenizations[0], tokenizations[1])
    body = {t for ids in tokenizations for t in ids[len(pool.prefix) :]} - set(pool.prefix)
    return TokenPool(pool.prefix, tuple(sorted(body)))


def _prompt_ids(resp: httpx.Response) -> list[int] | None:
    try:
        ids = resp.json()["choices"][0].get("prompt_token_ids")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return [int(i) for i in ids] if isinstance(ids, list) and ids else None


def _usage_prompt_tokens(resp: httpx.Response) -> int | None:
    try:
        n = resp.json()["usage"]["prompt_tokens"]
    except (ValueError, KeyError, TypeError):
        return None
    return int(n) if isinstance(n, int) and n > 0 else None


async def _calibrate(
    client: httpx.AsyncClient,
    info: ServerInfo,
    base: str,
    headers: dict[str, str],
    lengths: Sequence[int],
    seed: int,
) -> None:
    """Fit a word count per input length from the server's own prompt token counts."""
    rng = random.Random(f"calibrate:{seed}")
    target = info.target(base, headers)
    for length in lengths:
        n = fit_word_count(length, 0, 0)
        for _ in range(CALIBRATION_ROUNDS):
            resp = await _complete(client, target, words(rng, n))
            seen = _usage_prompt_tokens(resp) if resp.status_code < 400 else None
            if seen is None:
                info.notes.append(
                    f"no usage from the server: {length}-token prompts are estimated at {n} words"
                )
                break
            if seen == length:
                break
            n = fit_word_count(length, n, seen)
        info.word_counts[length] = n
    if not any("no usage" in note for note in info.notes):
        info.notes.append(
            "text prompts, word counts fitted to the server's usage.prompt_tokens: "
            "input lengths are approximate; each request's own count is reported"
        )


# -- /metrics ----------------------------------------------------------------------

Key = tuple[str, tuple[tuple[str, str], ...]]


async def scrape(client: httpx.AsyncClient, base: str) -> dict[Key, float] | None:
    """orin-llm's counters (name, sorted labels) -> value; None when unavailable."""
    try:
        resp = await client.get(f"{base}/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_metrics(resp.text)


def parse_metrics(text: str) -> dict[Key, float]:
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("orin_llm_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def _source(m: dict[Key, float]) -> str | None:
    for name, labels in m:
        if name == "orin_llm_telemetry_source_info":
            return dict(labels).get("source")
    return None


def phase_delta(before: dict[Key, float], after: dict[Key, float]) -> dict[str, Any] | None:
    """Per phase over the run: seconds, tokens and mean utilization (busy seconds /
    phase seconds). GPU figures only from a source that measures a GPU."""
    source = _source(after)
    if source is None:
        return None

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    phases: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        seconds = delta("orin_llm_phase_seconds_total", phase=phase)
        gpu = delta("orin_llm_gpu_busy_seconds_total", phase=phase)
        cpu = delta("orin_llm_process_cpu_busy_seconds_total", phase=phase)
        phases[phase] = {
            "seconds": seconds,
            "tokens": int(delta("orin_llm_engine_batch_tokens_total", kind=phase)),
            "gpu_util": gpu / seconds if seconds > 0 and source != "cpu" else None,
            "cpu_util": cpu / seconds if seconds > 0 else None,
        }
    return {"source": source, "phases": phases}
