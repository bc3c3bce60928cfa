"""What the benchmark learns from the server before and after the run.

``probe`` finds out which server it is talking to (orin-llm says so in
``/v1/models``), whether it accepts ``ignore_eos``, and how to build prompts of
an exact length for it. ``scrape`` reads orin-llm's ``/metrics`` counters; two
scrapes around a run give the time the engine spent in prefill and decode and
the GPU (or process CPU) utilization in each phase over exactly that run.
Both are blocking, over the load generator's own client (client.py).
"""

from __future__ import annotations

import http.client
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from orin.bench.client import Connections, Reply, Target, http_error, request
from orin.bench.prompts import WORDS, TokenPool, fit_word_count, words
from orin.errors import OrinError, os_error_text, unreachable

CALIBRATION_ROUNDS = 3
PHASES = ("prefill", "decode")
PROBE_TEXT = "The board boots and"
POOL_CHUNK = 32  # words per pool probe: a few dozen tokens, within any context


class BenchError(OrinError):
    """The server cannot be benchmarked (unreachable, or it refuses every request)."""


class UnknownModel(BenchError):
    """The model asked for is not one the server lists in ``/v1/models``: nothing is
    sent (a server that answers for any name would report figures under a name it
    does not serve)."""

    def __init__(self, base: str, model: str, listed: Sequence[str]) -> None:
        self.model, self.listed = model, tuple(listed)
        super().__init__(
            f"{base} does not serve a model '{model}'; its /v1/models lists: " + ", ".join(listed)
        )


class InputTooLong(BenchError):
    """An input length the server's context cannot take with the output asked for:
    every request would fail (or, on a server that slides its context, measure
    something else), so nothing is sent (and no prompt of that length is built)."""

    def __init__(
        self, base: str, length: int, context: int, source: str, output_len: int = 1
    ) -> None:
        self.length, self.context, self.output_len = length, context, output_len
        fits = []
        if length < context:
            fits.append(f"an output of at most {context - length} with this input")
        if output_len < context:
            fits.append(f"an input of at most {context - output_len} with this output")
        super().__init__(
            f"{length} input tokens and {output_len} output tokens do not fit {base}'s "
            f"context of {context} tokens per request ({source}): together at most "
            f"{context}" + (f" ({', or '.join(fits)})" if fits else "")
        )

    @property
    def options(self) -> tuple[str, ...]:
        """Which of the lengths has to change: each one the context cannot hold on its
        own, else both."""
        alone = [
            name
            for name, n in (("input", self.length), ("output", self.output_len))
            if n >= self.context
        ]
        return tuple(alone) or ("input", "output")


@dataclass
class ServerInfo:
    kind: str  # "orin-llm" or "openai" (any other OpenAI-compatible server)
    model: str | None
    ignore_eos: bool
    pool: TokenPool | None = None  # token-id prompts (exact lengths) when set
    word_counts: dict[int, int] = field(default_factory=dict)  # text prompts otherwise
    notes: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # orin-llm's model file and KV types

    def target(
        self,
        base_url: str,
        headers: dict[str, str],
        timeout_s: float = 600.0,
        live: Connections | None = None,
    ) -> Target:
        extra: dict[str, Any] = {"ignore_eos": True} if self.ignore_eos else {}
        if self.kind == "orin-llm":
            extra["return_token_ids"] = True  # one chunk per token: exact per-token gaps
        return Target(base_url, self.model, headers, extra, timeout_s, live)

    def prompt(self, rng: random.Random, length: int) -> str | list[int]:
        if self.pool is not None:
            return self.pool.prompt(rng, length)
        return words(rng, self.word_counts.get(length, fit_word_count(length, 0, 0)))


def _get(
    base: str, path: str, headers: dict[str, str], timeout: float, live: Connections | None
) -> Any:
    """A GET's JSON body, or None when there is none (a 404, no server, not JSON)."""
    try:
        resp = request("GET", f"{base}{path}", headers=headers, timeout=timeout, live=live)
        return resp.json() if resp.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return None


def _models(
    base: str, headers: dict[str, str], timeout: float, live: Connections | None
) -> list[Any]:
    data = _get(base, "/v1/models", headers, timeout, live)
    listed = data.get("data") if isinstance(data, dict) else None
    return listed if isinstance(listed, list) else []


def _context(
    base: str,
    entry: dict[str, Any],
    headers: dict[str, str],
    timeout: float,
    live: Connections | None,
) -> tuple[int, str] | None:
    """(tokens a request may hold, where the figure came from), from what the server
    says of itself: orin-llm's ``meta.n_ctx_per_slot`` and vLLM's ``max_model_len`` in
    ``/v1/models``, llama-server's ``/props`` (``default_generation_settings.n_ctx``,
    per slot). None for a server that does not say (Ollama, llama-cpp-python)."""
    meta = entry.get("meta")
    found: list[tuple[Any, str]] = [
        (meta.get("n_ctx_per_slot") if isinstance(meta, dict) else None, "meta.n_ctx_per_slot"),
        (entry.get("max_model_len"), "max_model_len"),
    ]
    if entry.get("owned_by") == "llamacpp":
        props = _get(base, "/props", headers, timeout, live)
        settings = props.get("default_generation_settings") if isinstance(props, dict) else None
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        found.append((n_ctx, "/props n_ctx"))
    for n, source in found:
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n, source
    return None


def _entry(base: str, model: str | None, listed: list[Any]) -> dict[str, Any]:
    """The ``/v1/models`` entry of the model to benchmark: the one named, else the
    first. A name the list lacks raises UnknownModel; a server that lists nothing
    (no ``/v1/models``) cannot be checked and gets the name as given."""
    entries = [e for e in listed if isinstance(e, dict)]
    names = [e["id"] for e in entries if isinstance(e.get("id"), str)]
    if model is None or not names:
        return entries[0] if entries else {}
    if model not in names:
        raise UnknownModel(base, model, names)
    return next(e for e in entries if e.get("id") == model)


def _complete(target: Target, prompt: str | list[int]) -> Reply:
    body = target.body(prompt, 1, stream=False)
    url = f"{target.base_url}/v1/completions"
    try:
        return request("POST", url, body, target.headers, target.timeout_s, target.live)
    except ConnectionRefusedError as exc:
        raise BenchError(unreachable(target.base_url, os_error_text(str(exc)))) from exc
    except (OSError, http.client.HTTPException) as exc:
        raise BenchError(f"{target.base_url}: {type(exc).__name__}: {exc}") from exc


def probe(
    base: str,
    model: str | None,
    headers: dict[str, str],
    lengths: Sequence[int],
    seed: int,
    timeout: float = 600.0,
    live: Connections | None = None,
    output_len: int = 1,
) -> ServerInfo:
    """Identify the server and prepare prompts for every input length. An input
    length that, with ``output_len`` tokens after it, goes beyond the context the
    server says it has raises InputTooLong before any completion is asked for."""
    first = _entry(base, model, _models(base, headers, timeout, live))
    context = _context(base, first, headers, timeout, live)
    if context is not None and max(lengths) + output_len > context[0]:
        raise InputTooLong(base, max(lengths), *context, output_len=output_len)
    kind = "orin-llm" if first.get("owned_by") == "orin-llm" else "openai"
    meta = first.get("meta") if kind == "orin-llm" else None
    info = ServerInfo(kind, model or first.get("id"), ignore_eos=True)
    info.meta = meta if isinstance(meta, dict) else {}
    resp = _complete(info.target(base, headers, timeout, live), PROBE_TEXT)
    if resp.status == 401:  # not a refused ignore_eos: no request will pass
        if "Authorization" in headers:
            raise BenchError(
                f"{base} refused the API key (401): check --api-key or ORIN_LLM_API_KEY"
            )
        raise BenchError(
            f"{base} refused the request (401): it requires an API key; give it with "
            "--api-key or ORIN_LLM_API_KEY"
        )
    if 400 <= resp.status < 500:
        info.ignore_eos = False
        resp = _complete(info.target(base, headers, timeout, live), PROBE_TEXT)
        if resp.status < 400:
            info.notes.append("the server refused ignore_eos: output lengths rely on max_tokens")
    if resp.status >= 400:
        error = http_error(resp.status, resp.data)
        raise BenchError(f"{base}: a probe completion failed with {error}")
    if _prompt_ids(resp) is not None:
        info.pool = _token_pool(info.target(base, headers, timeout, live))
        info.notes.append("token-id prompts: input lengths are exact")
    else:
        _calibrate(info, info.target(base, headers, timeout, live), lengths, seed)
    return info


def _token_pool(target: Target) -> TokenPool:
    """Real token ids of ordinary words, learnt from short probes that fit any context."""
    tokenizations = []
    for i in range(0, len(WORDS), POOL_CHUNK):
        resp = _complete(target, " ".join(WORDS[i : i + POOL_CHUNK]))
        ids = _prompt_ids(resp) if resp.status < 400 else None
        if ids is not None:
            tokenizations.append(ids)
    if len(tokenizations) < 2:
        raise BenchError(f"{target.base_url}: the server did not return prompt_token_ids")
    pool = TokenPool.from_tokenizations(tokenizations[0], tokenizations[1])
    body = {t for ids in tokenizations for t in ids[len(pool.prefix) :]} - set(pool.prefix)
    return TokenPool(pool.prefix, tuple(sorted(body)))


def _prompt_ids(resp: Reply) -> list[int] | None:
    try:
        ids = resp.json()["choices"][0].get("prompt_token_ids")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return [int(i) for i in ids] if isinstance(ids, list) and ids else None


def _usage_prompt_tokens(resp: Reply) -> int | None:
    try:
        n = resp.json()["usage"]["prompt_tokens"]
    except (ValueError, KeyError, TypeError):
        return None
    return int(n) if isinstance(n, int) and n > 0 else None


def _calibrate(info: ServerInfo, target: Target, lengths: Sequence[int], seed: int) -> None:
    """Fit a word count per input length from the server's own prompt token counts."""
    rng = random.Random(f"calibrate:{seed}")
    for length in lengths:
        n = fit_word_count(length, 0, 0)
        for _ in range(CALIBRATION_ROUNDS):
            resp = _complete(target, words(rng, n))
            seen = _usage_prompt_tokens(resp) if resp.status < 400 else None
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


def scrape(
    base: str, timeout: float = 600.0, headers: dict[str, str] | None = None
) -> dict[Key, float] | None:
    """orin-llm's counters (name, sorted labels) -> value; None when unavailable.
    ``headers`` carry the API key: /metrics needs it like every route but /health."""
    try:
        resp = request("GET", f"{base}/metrics", headers=headers, timeout=timeout)
    except (OSError, http.client.HTTPException):
        return None
    if resp.status != 200:
        return None
    return parse_metrics(resp.text)


def parse_metrics(text: str) -> dict[Key, float]:
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("orin_llm_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def value(m: Mapping[Key, float], name: str, **labels: str) -> float | None:
    """One sample of parsed /metrics (``parse_metrics``); None when it is absent."""
    return m.get((name, tuple(sorted(labels.items()))))


def rejected_drafts(m: Mapping[Key, float]) -> float:
    """The speculative drafts the model rejected (drafted - accepted): they ride in the
    decode batches' tokens without being generated."""
    drafted = value(m, "orin_llm_spec_drafted_tokens_total") or 0.0
    return drafted - (value(m, "orin_llm_spec_accepted_tokens_total") or 0.0)


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
        return (value(after, name, **labels) or 0.0) - (value(before, name, **labels) or 0.0)

    rejected = rejected_drafts(after) - rejected_drafts(before)
    phases: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        seconds = delta("orin_llm_phase_seconds_total", phase=phase)
        gpu = delta("orin_llm_gpu_busy_seconds_total", phase=phase)
        cpu = delta("orin_llm_process_cpu_busy_seconds_total", phase=phase)
        tokens = delta("orin_llm_engine_batch_tokens_total", kind=phase)
        phases[phase] = {
            "seconds": seconds,
            "tokens": int(tokens - rejected if phase == "decode" else tokens),
            "gpu_util": gpu / seconds if seconds > 0 and source != "cpu" else None,
            "cpu_util": cpu / seconds if seconds > 0 else None,
        }
    return {"source": source, "phases": phases}
