"""An image arriving while 8 streams decode: orin-llm against llama-server --mmproj.

    make install-bench
    .venv/bin/python -m benchmarks.vision [--size medium] [--reps 10] [--tokens 192] [--json FILE]

Both servers run the generated demo model (f16) with its generated LLaVA-style
vision projector (orin/model/mmproj.py): orin-llm with ``model.mmproj`` in its
profile, ``llama-server`` (built by benchmarks/peers.py from the pinned sources)
with ``--mmproj``; 9 slots, the same context per slot, threads and KV types
(f16, as orin-llm picks for an f16 model). Per rep, each server in turn (who goes
first rotates), freshly started and warmed up with one image request:

1. 8 streaming chats, greedy, ``ignore_eos``, ``--tokens`` tokens each;
2. once every one of them has a token, one chat with an image (a PNG of the
   projector's input size, random pixels seeded by rep and server, so no image
   is ever in a cache) and a short question, 4 tokens.

Reported per server: the image request's TTFT, its prompt tokens, the server's
own ``timings.prompt_ms`` and, where the server reports it, ``timings.encode_ms``
(orin-llm: the time spent encoding the image, part of prompt_ms; llama-server
reports no encode figure); and the stall of the 8 text streams: the largest gap
between two tokens of a stream that overlaps the window from the image request's
send to its first token, against the median and the mean gap outside that window
(stall_over_itl: the largest gap over the mean one; see ``stall`` for why the mean).

Prints a Markdown table like peers.py's: per metric each server's median
(min-max) over the reps and orin-llm / llama-server, the ratio of the medians.
The figures are only as quiet as the machine: run it on an idle one.
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from benchmarks import scenarios as sc
from benchmarks.peers import (
    LLAMA,
    ORIN,
    Peer,
    RepResult,
    Runs,
    Settings,
    build_llama_server,
    llama_server_argv,
    orin_profile,
    rotate,
    running,
    serve_argv,
    settings,
    summarize,
    taskset,
    write_profile,
)
from orin.model import demo, mmproj

SLOTS = 9  # 8 text streams and the image request
CTX_PER_SLOT = 512
TEXT_STREAMS = 8
IMAGE_TOKENS_OUT = 4
QUESTION = "What is on this board?"
SCENARIO = "image_during_decode"


@dataclass(frozen=True)
class Vision:
    """The comparison's inputs: the server settings, the projector, llama-server."""

    s: Settings
    projector: Path
    server_bin: Path
    tokens: int
    work: Path

    def peer(self, name: str) -> Peer:
        if name == ORIN:
            profile = self.profile()
            return Peer.make(name, lambda port: orin_argv(self.s, port, profile), self.work)
        return Peer.make(name, self.llama_server_argv, self.work)

    def llama_server_argv(self, port: int) -> list[str]:
        return [*llama_server_argv(self.server_bin, self.s, port), "--mmproj", str(self.projector)]

    def profile(self) -> Path:
        """orin-llm's profile: the threads (peers.orin_profile) and the projector."""
        profile = orin_profile("vision", self.s.threads)
        profile["model"] = {"mmproj": str(self.projector)}
        folder = Path(tempfile.mkdtemp(prefix="vision-", dir=self.work))
        return write_profile(profile, folder)


def orin_argv(s: Settings, port: int, profile: Path) -> list[str]:
    """`orin-llm serve` with the settings and the vision profile."""
    return taskset(serve_argv(s.model, s.slots, s.ctx_per_slot, port, profile), s.cores)


# -- requests ------------------------------------------------------------------------------


def png_url(seed: int, size: int = mmproj.VISION.image_size) -> str:
    """A data: URL of a PNG of random pixels, ``size`` square (the projector's input
    size: no resize on either server)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size * size * 3, np.uint8).tobytes()
    buf = io.BytesIO()
    Image.frombytes("RGB", (size, size), pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def text_body(i: int, n: int) -> dict[str, Any]:
    return {**sc.chat_body(f"Stream {i}: tell me about the edge board.", n), "ignore_eos": True}


def image_body(seed: int) -> dict[str, Any]:
    body = sc.chat_body(QUESTION, IMAGE_TOKENS_OUT)
    body["messages"] = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url(seed)}},
        {"type": "text", "text": QUESTION},
    ]}]  # fmt: skip
    return body


def chat(url: str, body: dict[str, Any], first: threading.Event | None = None) -> sc.Streamed:
    return sc.post_stream(url, "/v1/chat/completions", body, first=first)


# -- one measurement -----------------------------------------------------------------------


def stall(
    streams: Sequence[Sequence[float]], start: float, end: float
) -> tuple[float | None, float | None, float | None]:
    """Over the streams' token times, in ms: the largest gap overlapping [start, end],
    and the median and the mean gap outside it. The mean is the baseline of the
    ratio: when steps are short the client reads several tokens of a stream in one
    read, which makes many gaps 0 and the median meaningless, while the gaps' sum,
    and so their mean, stays the stream's decode time."""
    inside: list[float] = []
    outside: list[float] = []
    for times in streams:
        for a, b in itertools.pairwise(times):
            (inside if b > start and a < end else outside).append((b - a) * 1e3)
    if not outside:
        return (max(inside) if inside else None), None, None
    return (
        max(inside) if inside else None,
        statistics.median(outside),
        statistics.fmean(outside),
    )


def image_during_decode(url: str, tokens: int, seed: int) -> dict[str, float | None]:
    """8 text chats decoding; once each has a token, the image chat."""
    with ThreadPoolExecutor(max_workers=TEXT_STREAMS + 1) as pool:
        firsts = [threading.Event() for _ in range(TEXT_STREAMS)]
        texts = [
            pool.submit(chat, url, text_body(i, tokens), first=firsts[i])
            for i in range(TEXT_STREAMS)
        ]
        for ev in firsts:
            ev.wait(sc.TIMEOUT_S)
        image = pool.submit(chat, url, image_body(seed)).result()
        done = [f.result() for f in texts]
    timings = image.timings or {}
    worst, median, mean = (
        stall([r.token_times for r in done], image.t0, image.token_times[0])
        if image.token_times
        else (None, None, None)
    )
    late = sum(1 for r in done if r.token_times and r.token_times[-1] < image.t0)
    return {
        "image_ttft_ms": image.ttft_ms,
        "image_prompt_ms": _num(timings.get("prompt_ms")),
        "image_encode_ms": _num(timings.get("encode_ms")),
        "image_prompt_tokens": _num(image.prompt_tokens),
        "text_stall_max_ms": worst,
        "text_itl_median_ms": median,
        "text_itl_mean_ms": mean,
        "stall_over_itl": worst / mean if worst is not None and mean else None,
        "text_done_before_image": float(late),  # > 0: --tokens too small for the window
        "errors": sc.errors([*done, image]),
    }


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) else None


def run_rep(v: Vision, rep: int) -> dict[str, RepResult]:
    out: dict[str, RepResult] = {}
    for k, name in enumerate(rotate([ORIN, LLAMA], rep)):
        with running(v.peer(name)) as peer:
            warm = chat(peer.url, image_body(seed=1_000_000 + 2 * rep + k))  # warm-up
            if warm.error:
                raise RuntimeError(f"{name}: the warm-up image request failed: {warm.error}")
            seed = 2 * rep + (name == LLAMA)
            out[name] = {SCENARIO: image_during_decode(peer.url, v.tokens, seed)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="medium", choices=sorted(demo.SIZES))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=192, help="tokens per text stream")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = demo.ensure(args.size, "f16")
    s = settings(model, CTX_PER_SLOT, SLOTS)
    work = Path(tempfile.mkdtemp(prefix="orin-vision-"))
    print(f"server logs: {work}", file=sys.stderr)
    v = Vision(s, mmproj.ensure(args.size), build_llama_server(), args.tokens, work)
    runs: Runs = {}
    t0 = time.perf_counter()
    for rep in range(args.reps):
        for name, result in run_rep(v, rep).items():
            runs.setdefault(name, []).append(result)
            print(f"[{args.size}] rep {rep} {name}: {json.dumps(result)}", file=sys.stderr)
    seconds = time.perf_counter() - t0
    print(f"\n### {args.size} f16, {SLOTS} slots x {CTX_PER_SLOT}, {s.threads} threads, "
          f"KV {s.type_k}/{s.type_v}, {TEXT_STREAMS} streams x {args.tokens} tokens\n")  # fmt: skip
    print("\n".join(summarize(runs)))
    print(f"\n{args.reps} reps in {seconds:.0f} s")
    if args.json:
        settings_out = vars(args) | {"json": str(args.json), "slots": SLOTS,
                                     "ctx_per_slot": CTX_PER_SLOT, "threads": s.threads,
                                     "type_k": s.type_k, "type_v": s.type_v}  # fmt: skip
        report = {"settings": settings_out, "runs": runs, "seconds": seconds}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
