"""benchmarks/peers.py and benchmarks/scenarios.py without servers: figures from token
arrival times, stream parsing, the orin-llm profiles and llama-server flags each
scenario starts with, and the ratio summaries."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks import peers
from benchmarks import scenarios as sc
from orin.bench.client import Timed
from orin.profile.loader import load_profile

MODEL = Path("/models/medium.gguf")
SETTINGS = peers.Settings(
    MODEL, slots=8, ctx_per_slot=2048, threads=2, type_k="q8_0", type_v="q8_0"
)


def streamed(times: list[float], *final: dict[str, Any], t0: float = 0.0) -> sc.Streamed:
    """A stream whose token chunks arrived at ``times`` (one piece each), then ``final``."""
    s = sc.Streamed(t0)
    for i, t in enumerate(times):
        s.feed(json.dumps({"choices": [{"delta": {"content": f"w{i} "}}]}).encode(), t)
    for chunk in final:
        s.feed(json.dumps(chunk).encode(), times[-1] if times else t0)
    s.feed(b"[DONE]", times[-1] if times else t0)
    return s


def usage(completion: int, prompt: int = 10, cached: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"choices": [], "usage": u}


# -- figures ----------------------------------------------------------------------------------


def test_pct_interpolates_between_ranks() -> None:
    assert sc.pct([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert sc.pct([10.0, 20.0, 30.0, 40.0, 50.0], 0.95) == pytest.approx(48.0)
    assert sc.pct([7.0], 0.99) == 7.0
    assert sc.pct([], 0.5) is None


def test_itl_comes_from_the_gaps_within_each_stream_never_across_streams() -> None:
    a = [0.000, 0.010, 0.020, 0.520, 0.530]  # a 500 ms stall while a long prompt is prefilled
    b = [0.005, 0.015, 0.025]
    assert sc.gaps_ms(a) == pytest.approx([10.0, 10.0, 500.0, 10.0])
    m = sc.itl_metrics([a, b])
    # gaps: 10, 10, 500, 10 and 10, 10 (not 5 ms between the two streams' tokens)
    assert m["itl_p50_ms"] == pytest.approx(10.0)
    assert m["itl_max_ms"] == pytest.approx(500.0)
    assert m["itl_p99_ms"] == pytest.approx(10.0 + 0.95 * 490.0)  # rank 4.95 of 6
    assert sc.itl_metrics([[1.0], []]) == {"itl_p50_ms": None, "itl_p99_ms": None,
                                           "itl_max_ms": None}  # fmt: skip


def test_tpot_counts_the_servers_tokens_not_the_chunks() -> None:
    # speculative decoding sends several tokens in one chunk: 3 chunks, 11 tokens
    assert sc.tpot_ms([1.0, 1.1, 1.2], 11) == pytest.approx(20.0)
    assert sc.tpot_ms([1.0, 1.1, 1.2], 3) == pytest.approx(100.0)
    assert sc.tpot_ms([1.0], 1) is None
    assert sc.tpot_ms([], 0) is None


def test_ttft_summary_skips_requests_without_a_token() -> None:
    m = sc.ttft_metrics([30.0, None, 10.0, 20.0])
    assert m == {"ttft_p50_ms": 20.0, "ttft_p95_ms": pytest.approx(29.0), "ttft_max_ms": 30.0}


# -- one stream ---------------------------------------------------------------------------------


def test_a_chat_stream_is_timed_from_content_chunks_and_counted_by_usage() -> None:
    s = sc.Streamed(t0=10.0)
    s.feed(b'{"choices": [{"delta": {"role": "assistant", "content": null}}]}', 10.01)
    s.feed(b'{"choices": [{"delta": {"content": "Hel"}}]}', 10.05)
    s.feed(b'{"choices": [{"delta": {"content": "lo there"}}]}', 10.15)
    s.feed(b'{"choices": [{"delta": {}, "finish_reason": "length"}]}', 10.16)
    final = {"choices": [], "usage": {"prompt_tokens": 1000, "completion_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 990}},
             "timings": {"cache_n": 7, "draft_n": 8, "draft_n_accepted": 6}}  # fmt: skip
    s.feed(json.dumps(final).encode(), 10.17)
    s.feed(b"[DONE]", 10.17)
    assert s.token_times == [10.05, 10.15]  # the role-only chunk is no token
    assert s.text == "Hello there"
    assert s.ttft_ms == pytest.approx(50.0)
    assert s.tokens == 5
    assert s.tpot_ms == pytest.approx(25.0)  # 100 ms over the 4 tokens after the first
    assert s.prompt_tokens == 1000
    assert s.cached_tokens == 990  # usage details first, then timings' cache_n
    assert s.drafted == (8, 6)
    assert s.error is None


def test_a_completion_stream_with_llama_server_timings_only() -> None:
    s = sc.Streamed(t0=0.0)
    s.feed(b'{"choices": [{"text": "a"}]}', 0.1)
    s.feed(b'{"choices": [{"text": ""}], "timings": {"predicted_n": 3, "cache_n": 12}}', 0.2)
    assert s.token_times == [0.1]
    assert s.tokens == 3
    assert s.cached_tokens == 12
    assert s.drafted is None
    assert s.prompt_tokens is None


def test_an_error_event_marks_the_stream_failed() -> None:
    s = sc.Streamed(t0=0.0)
    s.feed(b'{"error": {"code": 500, "message": "boom", "type": "server_error"}}', 0.1)
    assert s.error == "stream error 500"
    assert s.token_times == []


def test_bodies_are_greedy_streams_with_usage() -> None:
    body = sc.chat_body("Why?", 16, system="Be brief.")
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Why?"}]  # fmt: skip
    assert (body["temperature"], body["max_tokens"], body["stream"]) == (0, 16, True)
    assert body["stream_options"] == {"include_usage": True}
    assert sc.chat_body("Hi", 4)["messages"] == [{"role": "user", "content": "Hi"}]
    assert sc.completion_body("x", 3)["prompt"] == "x"


def test_prompts_are_the_same_every_run_and_the_questions_differ() -> None:
    assert sc.system_prompt() == sc.system_prompt()
    assert sc.system_prompt(seed=1) != sc.system_prompt()
    assert len(sc.system_prompt().split()) == sc.SYSTEM_WORDS + 7
    qs = sc.questions(9)
    assert len(set(qs)) == 9
    assert sc.questions(2, seed=1) != qs[:2]


# -- scenario figures ---------------------------------------------------------------------


def test_speculation_metrics_compare_tpot_output_and_acceptance() -> None:
    off = [streamed([0.0, 1.0], usage(11)), streamed([0.0, 1.2], usage(11))]
    draft = {"choices": [], "timings": {"draft_n": 40, "draft_n_accepted": 30}}
    on = [streamed([0.0, 0.5], usage(11), draft), streamed([0.0, 0.7], usage(11), draft)]
    m = sc.speculation_metrics(off, on)
    assert m["tpot_off_ms"] == pytest.approx(110.0)  # median of 100 and 120
    assert m["tpot_ngram_ms"] == pytest.approx(60.0)
    assert m["ngram_over_off"] == pytest.approx(60.0 / 110.0)
    assert m["tokens"] == 11
    assert m["same_output"] == 1.0
    assert m["accept_rate"] == pytest.approx(0.75)
    assert m["errors"] == 0.0
    changed = [streamed([0.0, 0.25, 0.5], usage(11))]
    assert sc.speculation_metrics(off[:1], changed)["same_output"] == 0.0
    assert sc.speculation_metrics(off[:1], changed)["accept_rate"] is None


def test_copy_metrics_report_only_the_variants_that_ran() -> None:
    one = [streamed([0.0, 1.0], usage(11))]
    both = sc.copy_metrics(sc.CopyRun(one, one), sc.CopyRun(one, one))
    assert set(both) == {"copy_task", "no_match"}
    only = sc.copy_metrics(sc.CopyRun([], one), sc.CopyRun([], one))
    assert set(only) == {"no_match"}


def test_copy_requests_go_to_both_arms_in_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []

    def fake_chat(url: str, user: str, n: int, system: str | None = None) -> sc.Streamed:
        calls.append((url, n))
        return streamed([0.0, 1.0], usage(n))

    monkeypatch.setattr(sc, "chat", fake_chat)
    urls = {"off": "http://off", "ngram": "http://on"}
    got = sc.copy_requests(urls, frozenset({"copy_task", "no_match"}), rep=1, k=2, k_free=3)
    on, off = "http://on", "http://off"
    # rep 1: the arm without speculation opens; the order flips every pair, copies first
    assert [u for u, _ in calls] == [off, on, on, off, off, on, on, off, off, on]
    assert [n for _, n in calls[:4]] == [sc.COPY_TOKENS] * 4
    assert [n for _, n in calls[4:]] == [sc.FREE_TOKENS] * 6
    assert (len(got["off"].copy), len(got["off"].free)) == (2, 3)
    assert (len(got["ngram"].copy), len(got["ngram"].free)) == (2, 3)
    calls.clear()
    only = sc.copy_requests(urls, frozenset({"no_match"}), rep=0, k=2, k_free=2)
    assert [u for u, _ in calls] == [on, off, off, on]  # rep 0: the speculating arm opens
    assert only["off"].copy == [] and len(only["ngram"].free) == 2


def test_pair_ratio_is_the_median_of_per_pair_ratios_and_skips_failures() -> None:
    off = [streamed([0.0, 1.0], usage(11)), streamed([0.0, 2.0], usage(11)),
           streamed([0.0, 1.0], usage(11)), sc.Streamed(0.0, error="http 500")]  # fmt: skip
    on = [streamed([0.0, 1.1], usage(11)), streamed([0.0, 1.0], usage(11)),
          streamed([0.0, 1.3], usage(11)), streamed([0.0, 9.0], usage(11))]  # fmt: skip
    # pairs: 1.1, 0.5, 1.3; the failed fourth is left out
    assert sc.pair_ratio(off, on) == pytest.approx(1.1)
    assert sc.speculation_metrics(off, on)["pair_ratio"] == pytest.approx(1.1)
    assert sc.pair_ratio([], on) is None


def test_restart_counts_the_restore_call_in_the_ttft() -> None:
    cold = streamed([0.9], usage(8), t0=0.0)
    warm = streamed([0.05], usage(8, prompt=1019, cached=1000), t0=0.0)
    m = sc.restart_metrics(cold, warm, 2.0, 3.0, restore_ms=25.0, saved_bytes=3 * 2**20)
    assert m["ttft_cold_ms"] == pytest.approx(900.0)
    assert m["ttft_restart_ms"] == pytest.approx(75.0)  # 50 ms to the token + 25 ms restore
    assert m["restart_over_cold"] == pytest.approx(75.0 / 900.0)
    assert (m["start_cold_s"], m["start_restart_s"]) == (2.0, 3.0)
    assert m["cached_tokens"] == 1000
    assert m["saved_mib"] == pytest.approx(3.0)
    plain = sc.restart_metrics(cold, warm, 2.0, 3.0)  # orin-llm: no restore call
    assert plain["ttft_restart_ms"] == pytest.approx(50.0)
    assert plain["restore_ms"] is None


def test_bandwidth_utilization_is_bytes_per_step_times_steps_per_second() -> None:
    # 100 MB per step, 10 ms per token: 10 GB/s of a 100 GB/s machine
    assert sc.bandwidth_utilization(100_000_000, 10.0, 100e9) == pytest.approx(0.1)
    assert sc.bandwidth_utilization(None, 10.0, 100e9) is None
    assert sc.bandwidth_utilization(100_000_000, None, 100e9) is None
    assert sc.bandwidth_utilization(100_000_000, 10.0, None) is None


def test_bandwidth_goes_beside_every_single_stream_tpot() -> None:
    rep: dict[str, peers.RepResult] = {
        "orin-llm": {"single": {"tpot_median_ms": 10.0}, "single_free_core": {
            "tpot_median_ms": 20.0}},
        "llama-server": {"single": {"tpot_median_ms": None}, "mixed": {}},
    }  # fmt: skip
    peers.add_bandwidth(rep, 100_000_000, 100e9)
    assert rep["orin-llm"]["single"]["bw_util"] == pytest.approx(0.1)
    assert rep["orin-llm"]["single_free_core"]["bw_util"] == pytest.approx(0.05)
    assert rep["llama-server"]["single"]["bw_util"] is None
    assert "bw_util" not in rep["llama-server"]["mixed"]


# -- what each server is started with -------------------------------------------------------


def test_orin_profiles_validate_against_the_profile_schema(tmp_path: Path) -> None:
    system = sc.system_prompt()
    cache = tmp_path / "prompt-cache"
    path = peers.write_profile(
        peers.orin_profile("peers-restart", 2, prompt_cache=([system], cache)), tmp_path
    )
    p = load_profile(path)
    assert p.prompt_cache.prompts == [system]  # the exact text the requests send
    assert p.prompt_cache.directory == cache
    assert p.engine.threads == 2
    assert p.speculative.mode == "off"

    spec = load_profile(peers.write_profile(peers.orin_profile("s", speculative="ngram"), tmp_path))
    assert spec.speculative.mode == "ngram"
    assert (spec.speculative.n_draft, spec.speculative.ngram_min, spec.speculative.ngram_max) == (
        peers.NGRAM.n_draft, peers.NGRAM.ngram_min, peers.NGRAM.ngram_max)  # fmt: skip
    off = load_profile(peers.write_profile(peers.orin_profile("o", speculative="off"), tmp_path))
    assert off.speculative.mode == "off"
    assert off.prompt_cache.prompts == []
    assert p.engine.even_tails and off.engine.even_tails
    plain = peers.orin_profile("t", 2, even_tails=False)  # --orin-plain-tails
    tails = load_profile(peers.write_profile(plain, tmp_path))
    assert not tails.engine.even_tails and tails.engine.threads == 2
    assert tails.engine.split_bursts
    whole = load_profile(peers.write_profile(peers.orin_profile("w", split_bursts=False), tmp_path))
    assert not whole.engine.split_bursts and whole.engine.even_tails  # --orin-whole-bursts
    plain = peers.orin_profile("cold")
    assert plain == {"name": "cold"}  # everything else as `serve --model` runs it


def test_orin_argv_passes_slots_context_per_slot_and_profile() -> None:
    argv = peers.orin_argv(SETTINGS, 8123, Path("/tmp/p.yaml"))
    assert argv[1:4] == ["-m", "orin", "serve"]
    assert _flag(argv, "--slots") == "8"
    assert _flag(argv, "--ctx") == "2048"  # per slot, as serve reads it (llama-server's -c: total)
    assert _flag(argv, "--port") == "8123"
    assert _flag(argv, "--profile") == "/tmp/p.yaml"
    assert "--profile" not in peers.orin_argv(SETTINGS, 1)


def test_llama_server_gets_the_same_settings() -> None:
    argv = peers.llama_server_argv(Path("/bin/llama-server"), SETTINGS, 8124)
    assert argv[0] == "/bin/llama-server"
    assert _flag(argv, "-m") == str(MODEL)
    assert _flag(argv, "-c") == "16384"
    assert _flag(argv, "-np") == "8"
    assert _flag(argv, "-b") == _flag(argv, "-ub") == str(peers.N_BATCH)
    assert _flag(argv, "-t") == "2"
    assert (_flag(argv, "-ctk"), _flag(argv, "-ctv")) == ("q8_0", "q8_0")
    assert _flag(argv, "-fa") == "on"
    assert "--spec-type" not in argv
    assert "--slot-save-path" not in argv


def test_llama_server_ngram_and_slot_save_flags() -> None:
    argv = peers.llama_server_argv(
        Path("/bin/llama-server"), SETTINGS, 1, peers.NGRAM, Path("/tmp/slots")
    )
    assert _flag(argv, "--spec-type") == "ngram-simple"
    assert _flag(argv, "--spec-ngram-simple-size-n") == str(peers.NGRAM.ngram_max)
    assert _flag(argv, "--spec-ngram-simple-size-m") == str(peers.NGRAM.n_draft)
    assert _flag(argv, "--slot-save-path") == "/tmp/slots"


def test_free_core_pins_servers_to_all_cores_but_one() -> None:
    servers, client = peers.split_cores({3, 0, 2, 1})
    assert (servers, client) == ([0, 1, 2], 3)
    with pytest.raises(ValueError, match="two cores"):
        peers.split_cores({0})
    p = peers.pinned(SETTINGS, servers)
    assert p.cores == (0, 1, 2)
    assert p.threads == 2  # never more threads than before
    assert peers.pinned(SETTINGS, [0]).threads == 1
    argv = peers.llama_server_argv(Path("/bin/llama-server"), peers.pinned(SETTINGS, [0]), 1)
    assert argv[:3] == ["taskset", "-c", "0"]
    assert _flag(argv, "-t") == "1"
    assert peers.orin_argv(p, 1)[:3] == ["taskset", "-c", "0,1,2"]
    assert peers.taskset(["x"], ()) == ["x"]


def test_http_core_leaves_one_core_to_the_http_layer_unpinned() -> None:
    wide = replace(SETTINGS, threads=4)
    h = peers.http_core(wide, {0, 1, 2, 3})
    assert (h.threads, h.cores) == (3, ())
    assert peers.http_core(SETTINGS, {0, 1}).threads == 1  # 2 threads on 2 cores: one
    assert peers.http_core(SETTINGS, range(8)).threads == 2  # never more than before
    with pytest.raises(ValueError, match="two cores"):
        peers.http_core(SETTINGS, {0})
    argv = peers.llama_server_argv(Path("/bin/llama-server"), peers.http_core(SETTINGS, {0, 1}), 1)
    assert argv[0] != "taskset"
    assert _flag(argv, "-t") == "1"
    assert peers.orin_argv(h, 1)[0] != "taskset"
    assert "single_paired_http_core" in peers.SINGLE_STREAM  # bw_util beside its TPOT


def test_who_goes_first_rotates_by_rep() -> None:
    names = ["a", "b", "c"]
    assert [peers.rotate(names, r)[0] for r in range(4)] == ["a", "b", "c", "a"]
    assert sorted(peers.rotate(names, 2)) == names


def test_paired_requests_take_turns_and_compare_each_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    ms_per_token = {"http://orin": 6.0, "http://ls": 5.0}

    def fake_stream(url: str, prompt: str, n: int) -> Timed:
        calls.append((url, prompt))
        i = len(calls)  # each request a little slower than the one before: drift
        step = (ms_per_token[url] + 0.1 * i) / 1e3
        return Timed(0.0, [0.01 + k * step for k in range(n)], usage_tokens=n)

    monkeypatch.setattr(peers, "stream", fake_stream)
    urls = {peers.ORIN: "http://orin", peers.LLAMA: "http://ls"}
    out = peers.alternating(urls, 4, 5, rep=1)
    # rep 1: orin-llm opens; then the order flips every pair
    o, ls = "http://orin", "http://ls"
    assert [u for u, _ in calls] == [o, ls, ls, o, o, ls, ls, o]
    # both servers got the same prompts, the i-th pair the same one
    assert [p for u, p in calls if u == o] == [p for u, p in calls if u == ls]
    # pairs (orin, llama-server) in ms per token: (6.1, 5.2), (6.4, 5.3), (6.5, 5.6), (6.8, 5.7)
    want = sorted([6.1 / 5.2, 6.4 / 5.3, 6.5 / 5.6, 6.8 / 5.7])
    assert out[peers.ORIN]["tpot_pair_ratio"] == pytest.approx((want[1] + want[2]) / 2)
    assert "tpot_pair_ratio" not in out[peers.LLAMA]
    assert out[peers.ORIN]["tpot_median_ms"] == pytest.approx((6.4 + 6.5) / 2)
    assert peers.alternating(urls, 2, 5, rep=0)  # rep 0: llama-server opens
    assert calls[8][0] == ls
    assert out[peers.LLAMA]["errors"] == 0.0


def test_a_failed_request_leaves_its_pair_out(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_stream(url: str, prompt: str, n: int) -> Timed:
        if url == "http://ls" and prompt.startswith("Single stream 0"):
            return Timed(0.0, error="http 500")
        return Timed(0.0, [0.0, 0.01, 0.02], usage_tokens=3)

    monkeypatch.setattr(peers, "stream", fake_stream)
    out = peers.alternating({peers.ORIN: "http://orin", peers.LLAMA: "http://ls"}, 2, 3, rep=0)
    assert out[peers.ORIN]["tpot_pair_ratio"] == pytest.approx(1.0)
    assert out[peers.LLAMA]["errors"] == 1.0


def test_paired_bursts_take_turns_with_new_prompts_and_compare_each_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, list[str]]] = []
    ttft_s = {"http://orin": 0.030, "http://ls": 0.040}

    def fake_streams(url: str, prompts: list[str], n: int) -> tuple[float, list[Timed]]:
        calls.append((url, prompts))
        drift = 0.001 * len(calls)  # each burst a little slower than the one before
        first = ttft_s[url] + drift
        results = [
            Timed(0.0, [first + i * 0.001 + k * 0.01 for k in range(n)], usage_tokens=n)
            for i in range(len(prompts))
        ]
        wall = first + len(prompts) * 0.001 + (n - 1) * 0.01
        return wall, results

    monkeypatch.setattr(peers, "streams", fake_streams)
    urls = {peers.ORIN: "http://orin", peers.LLAMA: "http://ls"}
    out = peers.bursts_in_turns(urls, 4, 3, 5, rep=1)
    o, ls = "http://orin", "http://ls"
    assert [u for u, _ in calls] == [o, ls, ls, o, o, ls]
    # each round new prompts, the same for both servers
    rounds = [p for u, p in calls if u == o]
    assert rounds == [p for u, p in calls if u == ls]
    assert len({tuple(p) for p in rounds}) == 3 and all(len(p) == 4 for p in rounds)
    # TTFT p50 of a burst: its first token at ttft + drift, the streams 1 ms apart
    pairs = sorted([(0.031 + 0.0015) / (0.042 + 0.0015), (0.034 + 0.0015) / (0.043 + 0.0015),
                    (0.035 + 0.0015) / (0.046 + 0.0015)])  # fmt: skip
    assert out[peers.ORIN]["ttft_p50_ms_pair_ratio"] == pytest.approx(pairs[1])
    assert out[peers.ORIN]["ttft_p50_ms"] == pytest.approx((0.034 + 0.0015) * 1e3)
    assert out[peers.ORIN]["throughput_pair_ratio"] > 1.0  # the faster first tokens
    assert "throughput_pair_ratio" not in out[peers.LLAMA]
    assert out[peers.LLAMA]["errors"] == 0.0


def test_scenario_names_are_checked() -> None:
    assert peers.picked_scenarios("mixed, shared_prefix") == {"mixed", "shared_prefix"}
    assert peers.picked_scenarios(",".join(peers.SCENARIOS)) == set(peers.SCENARIOS)
    with pytest.raises(ValueError, match="unknown scenarios"):
        peers.picked_scenarios("mixed,warp_speed")
    with pytest.raises(ValueError):
        peers.picked_scenarios("")


# -- the report ---------------------------------------------------------------------------------


def test_ratio_cell_is_the_ratio_of_medians_with_the_spread_of_paired_reps() -> None:
    assert peers.ratio_cell([10.0, 12.0, 11.0], [10.0, 10.0, 11.0]) == "1.10 (1.00–1.20)"
    assert peers.ratio_cell([10.0], [5.0]) == "2.00"
    assert peers.ratio_cell([10.0, None], [5.0, 4.0]) == "2.22"  # one pair: no spread
    assert peers.ratio_cell([0.0, 0.0], [0.0, 0.0]) is None  # errors: no ratio
    assert peers.ratio_cell([1.0], [None]) is None


def test_summary_has_a_row_per_metric_and_dashes_where_a_server_did_not_run_it() -> None:
    runs: peers.Runs = {
        "orin-llm": [
            {"single": {"tpot_median_ms": 10.0}, "mixed": {"itl_p99_ms": 30.0}},
            {"single": {"tpot_median_ms": 12.0}, "mixed": {"itl_p99_ms": 40.0}},
        ],
        "llama-server": [
            {"single": {"tpot_median_ms": 10.0}, "mixed": {"itl_p99_ms": 20.0}},
            {"single": {"tpot_median_ms": 10.0}, "mixed": {"itl_p99_ms": 40.0}},
        ],
        "llama-cpp-python": [
            {"single": {"tpot_median_ms": 20.0}},
            {"single": {"tpot_median_ms": 24.0}},
        ],
    }
    rows = peers.summarize(runs)
    assert rows[0] == (
        "| scenario | metric | orin-llm | llama-server | llama-cpp-python | orin-llm / peer |"
    )
    single = next(r for r in rows if r.startswith("| single |"))
    assert "| 11.0 (10.0–12.0) | 10.0 (10.0–10.0) | 22.0 (20.0–24.0) |" in single
    assert "llama-server: 1.10 (1.00–1.20)" in single
    assert "llama-cpp-python: 0.50 (0.50–0.50)" in single
    mixed = next(r for r in rows if r.startswith("| mixed |"))
    assert "| 35.0 (30.0–40.0) | 30.0 (20.0–40.0) | - |" in mixed
    assert "llama-server: 1.17 (1.00–1.50)" in mixed
    assert "llama-cpp-python" not in mixed


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.llama
def test_copy_model_converts_the_packaged_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orin.model import demo

    shipped = demo.generate("tiny", "q8_0", tmp_path / "wheel" / "Shipped.Q8_0.gguf")
    monkeypatch.setattr(peers.packaged, "fetch", lambda model: shipped)
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path / "cache"))
    assert peers.copy_model(None) == shipped
    out = peers.copy_model("f16")
    assert out == tmp_path / "cache" / "models" / "Shipped.Q8_0.as-f16.gguf"
    assert out.stat().st_size > shipped.stat().st_size  # 16 bits a weight against 8.5
    stamp = out.stat().st_mtime_ns
    assert peers.copy_model("f16") == out
    assert out.stat().st_mtime_ns == stamp  # reused, not converted again


def test_paired_layouts_name_their_scenarios(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--free-core adds single_paired on pinned servers; --http-core adds both paired
    scenarios with one llama.cpp thread fewer; bursts never run with the client pinned."""
    started: list[tuple[str, int, tuple[int, ...]]] = []

    @contextlib.contextmanager
    def fake_running(peer: peers.Peer) -> Iterator[peers.Peer]:
        yield peer

    def fake_peer(b: peers.Bench, name: str, s: peers.Settings, *_: object) -> peers.Peer:
        started.append((name, s.threads, s.cores))
        return peers.Peer(name, [], len(started), tmp_path / "log")

    monkeypatch.setattr(peers, "running", fake_running)
    monkeypatch.setattr(peers.Bench, "peer", fake_peer)
    monkeypatch.setattr(peers.os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr(peers, "concurrent", lambda *a, **k: {})
    monkeypatch.setattr(peers, "alternating", lambda urls, *a: {n: {"single": 1.0} for n in urls})
    monkeypatch.setattr(
        peers, "bursts_in_turns", lambda urls, k, *a: {n: {"burst": float(k)} for n in urls}
    )
    b = peers.Bench(Path("/bin/llama-server"), 8, frozenset(peers.PAIRED), tmp_path,
                    free_core=True, http_core=True)  # fmt: skip
    out = peers.run_paired(b, SETTINGS, 0)
    assert sorted(out[peers.ORIN]) == [
        "single_paired", "single_paired_free_core", "single_paired_http_core",
        "streams_4_paired", "streams_4_paired_http_core", "streams_8_paired",
        "streams_8_paired_http_core",
    ]  # fmt: skip
    assert out[peers.LLAMA].keys() == out[peers.ORIN].keys()
    assert out[peers.ORIN]["streams_8_paired_http_core"] == {"burst": 8.0}
    # each layout starts both servers with the same settings: as given, pinned, one thread
    assert started == [
        (peers.ORIN, 2, ()), (peers.LLAMA, 2, ()),
        (peers.ORIN, 1, (0,)), (peers.LLAMA, 1, (0,)),
        (peers.ORIN, 1, ()), (peers.LLAMA, 1, ()),
    ]  # fmt: skip
    only_bursts = replace(b, picked=frozenset({"streams_paired"}), free_core=True)
    assert sorted(peers.run_paired(only_bursts, SETTINGS, 0)[peers.ORIN]) == [
        "streams_4_paired", "streams_4_paired_http_core", "streams_8_paired",
        "streams_8_paired_http_core",
    ]  # fmt: skip
