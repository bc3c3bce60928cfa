"""One streaming completion request, timed token by token.

Token counts come from the server whenever it reports them (``usage``, then
llama.cpp-style ``timings.predicted_n``, then orin-llm's per-token
``token_ids``); counting stream chunks is the last resort, for servers that
report nothing, because a server may hold text back and send several tokens in
one chunk. The stream's chunk times give TTFT, E2EL and the inter-token gaps;
with orin-llm's ``return_token_ids`` every token arrives in its own chunk, so
the gaps are per token.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from orin.bench.stats import RequestResult

SERVER_TIMING_KEYS = (
    "queue_ms",
    "prefill_ms",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "prompt_n",
    "cache_n",
    "predicted_n",
    "prefill_gpu_util",
    "decode_gpu_util",
    "prefill_cpu_util",
    "decode_cpu_util",
)


@dataclass(frozen=True)
class Target:
    """Where and how to send: the base URL, model name, headers and the extra body
    fields this server understands (``ignore_eos``, ``return_token_ids``)."""

    base_url: str
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, prompt: str | list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
            **self.extra,
        }
        if stream:
            out["stream_options"] = {"include_usage": True}
        if self.model:
            out["model"] = self.model
        return out


@dataclass
class StreamParser:
    """Accumulates SSE lines of one completion stream (pure: times are passed in)."""

    t0: float
    token_times: list[float] = field(default_factory=list)
    token_ids: int = 0
    saw_token_ids: bool = False
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False

    def feed(self, line: str, t: float) -> None:
        if not line.startswith("data:"):
            return
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            err = chunk["error"] if isinstance(chunk["error"], dict) else {}
            self.error = f"stream error {err.get('type') or err.get('code') or ''}".strip()
            return
        self.usage = chunk.get("usage") or self.usage
        self.timings = chunk.get("timings") or self.timings
        for choice in chunk.get("choices") or ():
            if self._has_token(choice):
                self.token_times.append(t)

    def _has_token(self, choice: dict[str, Any]) -> bool:
        ids = choice.get("token_ids")
        if ids is not None:
            self.saw_token_ids = True
            self.token_ids += len(ids)
            return bool(ids)
        delta = choice.get("delta") or {}
        return bool(choice.get("text") or delta.get("content"))

    def output_tokens(self) -> tuple[int, str]:
        """(n_out, where it came from), preferring the server's own counts."""
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"]), "usage"
        if self.timings and self.timings.get("predicted_n") is not None:
            return int(self.timings["predicted_n"]), "timings"
        if self.saw_token_ids:
            return self.token_ids, "token_ids"
        return len(self.token_times), "chunks"

    def prompt_tokens(self) -> int | None:
        if self.usage and self.usage.get("prompt_tokens") is not None:
            return int(self.usage["prompt_tokens"])
        if self.timings and self.timings.get("prompt_n") is not None:
            return int(self.timings["prompt_n"]) + int(self.timings.get("cache_n") or 0)
        return None

    def result(self, index: int, input_len: int, start_s: float) -> RequestResult:
        if self.error is not None or not self.token_times:
            error = self.error or "no tokens"
            return RequestResult(index, input_len, False, error, start_s=start_s)
        n_out, source = self.output_tokens()
        times = [(t - self.t0) * 1e3 for t in self.token_times]
        timings = self.timings or {}
        return RequestResult(
            index,
            input_len,
            True,
            prompt_tokens=self.prompt_tokens(),
            output_tokens=n_out,
            count_source=source,
            ttft_ms=times[0],
            e2el_ms=times[-1],
            itl_ms=tuple(b - a for a, b in itertools.pairwise(times)),
            start_s=start_s,
            server={k: timings[k] for k in SERVER_TIMING_KEYS if k in timings},
        )


def http_error(response: httpx.Response) -> str:
    """``http 400 context_length_exceeded``: the status and the OpenAI error code,
    never the message text (it changes between server versions)."""
    code = None
    try:
        err = response.json().get("error")
        if isinstance(err, dict):
            code = err.get("code") or err.get("type")
    except (ValueError, AttributeError):
        pass
    return f"http {response.status_code}" + (f" {code}" if code else "")


async def send(
    client: httpx.AsyncClient,
    target: Target,
    prompt: str | list[int],
    max_tokens: int,
    index: int,
    input_len: int,
    run_start: float,
) -> RequestResult:
    """Stream one request; every failure becomes a failed result, never an exception."""
    t0 = time.perf_counter()
    parser = StreamParser(t0)
    start_s = t0 - run_start
    url = f"{target.base_url}/v1/completions"
    body = target.body(prompt, max_tokens, stream=True)
    try:
        async with client.stream("POST", url, json=body, headers=target.headers) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                return RequestResult(index, input_len, False, http_error(resp), start_s=start_s)
            async for line in resp.aiter_lines():
                parser.feed(line, time.perf_counter())
                if parser.done:
                    break
    except httpx.TimeoutException:
        return RequestResult(index, input_len, False, "timeout", start_s=start_s)
    except httpx.HTTPError as exc:
        return RequestResult(index, input_len, False, type(exc).__name__, start_s=start_s)
    except (ValueError, KeyError, TypeError):
        return RequestResult(index, input_len, False, "malformed stream", start_s=start_s)
    return parser.result(index, input_len, start_s)
