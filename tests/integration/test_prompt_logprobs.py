"""A prompt's log-probabilities (SamplingParams.prompt_logprobs) on real llama.cpp,
against llama-cpp-python's own computation of every position's logits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from orin.engine.config import engine_config
from orin.engine.engine import Engine
from orin.engine.types import SamplingParams
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile

pytestmark = pytest.mark.llama

# four slots and 64-token batches: a prompt of a few hundred tokens takes several
# chunks, and other slots hold the same prompt's cells (prefix reuse, copies)
PROFILE = """
name: t
engine: {n_ctx: 512, slots: 4, n_batch: 64, n_ubatch: 64}
"""
# the log-probabilities of one position computed in another batch layout than the
# reference's differ by about 1e-3 on the CPU; a prompt scored from the wrong
# position, or a context other than its own, is off by 0.1 and more
ATOL = 5e-3


@pytest.fixture(scope="module")
def model() -> Path:
    return demo.ensure("small", "f16")


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[Engine]:
    profile = parse_profile(PROFILE)
    with Engine(engine_config(profile, model, read_model_info(model))) as e:
        yield e


Reference = Callable[[list[int]], tuple[list[float], list[float]]]


@pytest.fixture(scope="module")
def reference(model: Path) -> Iterator[Reference]:
    """For each prompt token after the first: its log-probability given the tokens
    before it, and the most likely token's, from llama_cpp.Llama's logits of every
    position (one sequence alone, in one batch)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(model), n_ctx=1024, n_batch=512, logits_all=True, verbose=False)

    def logprobs(prompt: list[int]) -> tuple[list[float], list[float]]:
        llm.reset()
        llm.eval(prompt)
        logps, best = [], []
        for i in range(1, len(prompt)):
            row = np.asarray(llm.scores[i - 1], dtype=np.float64)
            row = row - row.max()
            row = row - np.log(np.exp(row).sum())
            logps.append(float(row[prompt[i]]))
            best.append(float(row.max()))
        return logps, best

    try:
        yield logprobs
    finally:
        llm.close()


def words(engine: Engine, n: int) -> list[int]:
    text = " ".join(f"board {i} runs the model at the edge." for i in range(n))
    return engine.tokenize(text, add_special=False)


# -- the engine ---------------------------------------------------------------------------


def test_prompt_logprobs_equal_llama_cpps_whatever_holds_the_prompt(
    engine: Engine, reference: Reference
) -> None:
    """The prompt is cached in one slot and decoding in another: a request that scores
    it still computes every position (nothing cached, nothing copied), in chunks,
    and its log-probabilities are llama.cpp's own for each position."""
    prompt = words(engine, 25)
    assert len(prompt) > 3 * 64  # several chunks
    engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0))  # cached after
    busy = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    scored = engine.generate(
        prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=True)
    )
    busy.result()
    want, best = reference(prompt)
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(prompt) - 1
    assert scored.timings is not None and scored.timings.cached_tokens == 0
    got = scored.prompt_logprobs
    assert [lp.token_id for lp in got] == prompt[1:]
    np.testing.assert_allclose([lp.logprob for lp in got], want, atol=ATOL)
    np.testing.assert_allclose([lp.top[0].logprob for lp in got], best, atol=ATOL)
    assert all(len(lp.top) == 2 for lp in got)
    # the answer's own logprobs are those of the generated tokens, as before
    assert len(scored.token_ids) == 3 == len(scored.logprobs)
    # the same prompt without the need takes its cached cells
    again = engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    assert again.timings is not None and again.timings.cached_tokens == len(prompt) - 1


def test_max_tokens_0_computes_the_prompt_and_generates_nothing(
    engine: Engine, reference: Reference
) -> None:
    prompt = words(engine, 6)
    c = engine.generate(
        prompt, SamplingParams(max_tokens=0, temperature=0, logprobs=0, prompt_logprobs=True)
    )
    assert (c.finish_reason, c.token_ids, c.text, c.logprobs) == ("length", (), "", ())
    assert c.timings is not None and c.timings.generated_tokens == 0
    assert c.prompt_logprobs is not None
    np.testing.assert_allclose(
        [lp.logprob for lp in c.prompt_logprobs], reference(prompt)[0], atol=ATOL
    )
    with engine.idle():
        assert engine.slots_busy == 0 and engine.kv_cells_used == 0
