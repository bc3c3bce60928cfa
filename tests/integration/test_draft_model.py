"""The draft model on real llama.cpp: a generated demo model drafts for itself, so its
drafts must be exactly the served model's greedy continuation."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

from orin.engine.backend import Backend
from orin.engine.config import EngineConfig, SpecConfig, engine_config
from orin.engine.errors import BackendError
from orin.engine.speculative import DraftModel, DraftModelError, load_draft_model
from orin.model import demo
from orin.model import vocab as vocab_mod
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile
from tests import archmodels

pytestmark = pytest.mark.llama

SLOTS = 4


def config(path: Path) -> EngineConfig:
    profile = parse_profile(
        "name: t\nengine: {n_ctx: 512, slots: 4, n_batch: 64, n_ubatch: 64, threads: 2}\n"
    )
    return engine_config(profile, path, read_model_info(path))


def open_draft(path: Path, n_ctx: int = 512, slots: int = SLOTS) -> DraftModel:
    return DraftModel(path, slots=slots, n_ctx=n_ctx, n_batch=64, n_ubatch=64, threads=2)


@pytest.fixture(scope="module")
def target(tiny_f16: Path) -> Iterator[Backend]:
    backend = Backend(config(tiny_f16))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def draft(tiny_f16: Path, target: Backend) -> Iterator[DraftModel]:
    model = open_draft(tiny_f16)
    model.check_vocab(target)
    yield model
    model.close()


@pytest.fixture
def fresh(draft: DraftModel) -> DraftModel:
    """The shared draft model with every slot emptied."""
    for seq in range(SLOTS):
        draft.release(seq)
    return draft


@pytest.fixture(scope="module")
def reference(tiny_f16: Path) -> Iterator[object]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(tiny_f16), n_ctx=1024, n_batch=512, logits_all=True, verbose=False)
    yield llm
    llm.close()


def greedy(llm: object, prompt: list[int], n: int) -> list[int]:
    """The served model's own greedy continuation, one sequence alone in llama_cpp.Llama."""
    from llama_cpp import Llama

    assert isinstance(llm, Llama)
    llm.reset()
    out: list[int] = []
    for _ in range(n):
        llm.eval([*prompt, *out][llm.n_tokens :])
        logits = np.asarray(llm.scores[llm.n_tokens - 1])
        out.append(int(np.argmax(logits)))
    return out


def prompt(target: Backend, seed: int, n: int = 40, top: int = 0) -> list[int]:
    """Text then ``n`` random normal tokens (ids below ``top``, or any of the model's)."""
    rng = random.Random(seed)
    head = target.tokenize("Drafting on the edge:")
    top = top or target.n_vocab
    return head + [rng.randrange(vocab_mod.FIRST_NORMAL_ID, top) for _ in range(n)]


# -- drafts ---------------------------------------------------------------------------


def test_same_model_drafts_its_greedy_continuation(
    fresh: DraftModel, target: Backend, reference: object
) -> None:
    contexts = {0: prompt(target, 1), 1: prompt(target, 2, 7), 3: prompt(target, 3, 90)}
    drafts = fresh.draft(contexts, {0: 8, 1: 5, 3: 8})
    assert drafts[0] == greedy(reference, contexts[0], 8)
    assert drafts[1] == greedy(reference, contexts[1], 5)
    assert drafts[3] == greedy(reference, contexts[3], 8)
    for seq, context in contexts.items():  # the last draft is never fed
        assert fresh.cells(seq) == (*context, *drafts[seq][:-1])
    assert fresh.cells(2) == ()


def test_slots_without_a_budget_draft_nothing_and_keep_their_cells(
    fresh: DraftModel, target: Backend
) -> None:
    context = prompt(target, 4)
    first = fresh.draft({0: context}, {0: 4})
    held = fresh.cells(0)
    assert fresh.draft({0: context, 1: context}, {0: 0}) == {0: [], 1: []}
    assert fresh.cells(0) == held and fresh.cells(1) == ()
    assert fresh.draft({0: context}, {0: 4}) == first  # the same context asked again


def test_each_step_feeds_only_the_tokens_the_cells_lack(
    fresh: DraftModel, target: Backend, reference: object
) -> None:
    context = prompt(target, 5)
    d = fresh.draft({0: context}, {0: 6})[0]
    # the target accepted 3 drafts and sampled another token in place of the 4th
    context = [*context, *d[:3], vocab_mod.FIRST_NORMAL_ID + 7]
    fed = fresh.fed
    d = fresh.draft({0: context}, {0: 6})[0]
    assert fresh.fed - fed == 1
    assert d == greedy(reference, context, 6)
    # all 6 accepted plus the token after them: the 6th draft and that token are new
    context = [*context, *d, greedy(reference, [*context, *d], 1)[0]]
    fed = fresh.fed
    d = fresh.draft({0: context}, {0: 6})[0]
    assert fresh.fed - fed == 2
    assert d == greedy(reference, context, 6)


def test_a_divergent_context_drafts_like_a_fresh_sequence(
    fresh: DraftModel, target: Backend, reference: object
) -> None:
    a = prompt(target, 6, 80)
    fresh.draft({0: a}, {0: 8})
    b = [*a[:50], *prompt(target, 7, 20)]
    fed = fresh.fed
    got = fresh.draft({0: b}, {0: 8})[0]
    assert fresh.fed - fed == len(b) - 50  # the shared 50 tokens stay
    assert fresh.cells(0) == (*b, *got[:-1])
    alone = fresh.draft({2: b}, {2: 8})[2]  # an empty slot
    assert got == alone == greedy(reference, b, 8)
    # a shorter context inside the cells: only its last token is refed
    c = b[:30]
    fed = fresh.fed
    assert fresh.draft({0: c}, {0: 8})[0] == greedy(reference, c, 8)
    assert fresh.fed - fed == 1


def test_a_context_longer_than_the_window_is_drafted_from_its_tail(
    tiny_f16: Path, target: Backend
) -> None:
    model = open_draft(tiny_f16, n_ctx=256, slots=2)
    try:
        model.check_vocab(target)
        context = prompt(target, 8, model.n_ctx_seq + 100)
        d = model.draft({0: context}, {0: 8})[0]
        assert len(d) == 8
        window = model.cells(0)[: len(model.cells(0)) - 7]
        assert len(window) + 8 <= model.n_ctx_seq
        assert tuple(context[len(context) - len(window) :]) == window
        assert model.draft({1: list(window)}, {1: 8})[1] == d
        # the next step continues in the same window: only the new tokens are fed
        context += [*d[:2], vocab_mod.FIRST_NORMAL_ID]
        fed = model.fed
        model.draft({0: context}, {0: 8})
        assert model.fed - fed == 1
    finally:
        model.close()


def test_a_recurrent_draft_model_refeeds_what_it_cannot_drop(
    tmp_path_factory: pytest.TempPathFactory, target: Backend
) -> None:
    """A recurrent state drops whole sequences only: after a rejection the slot starts
    over, and drafts the same as an empty slot does."""
    path = archmodels.ensure(tmp_path_factory.getbasetemp() / "archmodels", ("mamba",))["mamba"]
    model = open_draft(path, slots=2)
    try:
        model.check_vocab(target)
        a = prompt(target, 9)
        d = model.draft({0: a}, {0: 4})[0]
        b = [*a, d[0], vocab_mod.FIRST_NORMAL_ID + 3]
        fed = model.fed
        got = model.draft({0: b}, {0: 4})[0]
        assert model.fed - fed == len(b)
        assert got == model.draft({1: b}, {1: 4})[1]
        assert model.cells(0) == (*b, *got[:-1])
    finally:
        model.close()


def test_load_draft_model_follows_the_profile(tiny_f16: Path, target: Backend) -> None:
    cfg = config(tiny_f16).with_(
        speculative=SpecConfig(mode="draft", draft_model=tiny_f16, draft_gpu_layers=0)
    )
    model = load_draft_model(cfg, target)
    try:
        assert model.slots == cfg.slots and model.n_batch == cfg.n_batch
        assert model.n_ctx_seq >= cfg.n_ctx and model.n_out == target.n_vocab
    finally:
        model.close()
        model.close()  # idempotent
    with pytest.raises(DraftModelError, match="draft_model"):
        DraftModel.from_config(config(tiny_f16))


# -- refusals --------------------------------------------------------------------------


def write_model(path: Path, voc: vocab_mod.Vocab, bos: int = vocab_mod.BOS_ID) -> Path:
    """A tiny demo-style llama model over the vocabulary ``voc``."""
    shape = demo.SIZES["tiny"]
    w = gguf.GGUFWriter(path, demo.ARCH)
    demo._add_model_metadata(w, "tiny", shape, len(voc), 0)
    w.add_tokenizer_model("llama")
    w.add_token_list(list(voc.tokens))
    w.add_token_scores(list(voc.scores))
    w.add_token_types([int(t) for t in voc.types])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(vocab_mod.EOS_ID)
    w.add_unk_token_id(vocab_mod.UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    for name, tensor in demo.weights(shape, voc, 0).items():
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def vocab_variant(drop: int = 0, permute: bool = False) -> vocab_mod.Vocab:
    """The demo vocabulary without its last ``drop`` tokens, or with the texts of its
    normal tokens reversed (same size, other meanings)."""
    voc = vocab_mod.build_vocab()
    tokens, scores, types = list(voc.tokens), list(voc.scores), list(voc.types)
    if permute:
        first = vocab_mod.FIRST_NORMAL_ID
        tokens[first:] = reversed(tokens[first:])
    if drop:
        tokens, scores, types = tokens[:-drop], scores[:-drop], types[:-drop]
    return vocab_mod.Vocab(tuple(tokens), tuple(scores), tuple(types), voc.merges)


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("draft-vocab")
    return {
        "permuted": write_model(d / "permuted.gguf", vocab_variant(permute=True)),
        "smaller": write_model(d / "smaller.gguf", vocab_variant(drop=200)),
        "padded": write_model(d / "padded.gguf", vocab_variant(drop=50)),
        "bos": write_model(d / "bos.gguf", vocab_mod.build_vocab(), bos=vocab_mod.IM_START_ID),
    }


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("permuted", r"tokenizer\.ggml\.tokens\[\d+\] is .*, the served model's "),
        ("smaller", r"tokenizer\.ggml\.tokens has \d+ tokens, the served model's \d+"),
        ("bos", r"BOS token differs .*tokenizer\.ggml\.bos_token_id"),
    ],
)
def test_another_vocabulary_is_refused(
    variants: dict[str, Path], target: Backend, variant: str, message: str
) -> None:
    model = open_draft(variants[variant], slots=1)
    try:
        with pytest.raises(DraftModelError, match=message) as err:
            model.check_vocab(target)
        assert isinstance(err.value, BackendError)
        assert str(variants[variant]) in str(err.value)
    finally:
        model.close()


def test_load_draft_model_closes_a_refused_model(
    variants: dict[str, Path], tiny_f16: Path, target: Backend
) -> None:
    cfg = config(tiny_f16).with_(
        speculative=SpecConfig(mode="draft", draft_model=variants["permuted"])
    )
    with pytest.raises(DraftModelError, match="must share the served model's vocabulary"):
        load_draft_model(cfg, target)


def test_a_slightly_different_vocabulary_drafts_within_the_common_ids(
    variants: dict[str, Path], tiny_f16: Path, target: Backend
) -> None:
    """Sizes 50 apart pass, as in llama-server; a context holding an id the draft model
    lacks gets no draft, the other slots draft as usual, and no draft holds an id the
    served model lacks."""
    small = open_draft(variants["padded"], slots=2)
    try:
        small.check_vocab(target)
        assert small.n_out == small.n_vocab == target.n_vocab - 50
        ok = prompt(target, 10, top=small.n_vocab)
        beyond = [*ok, target.n_vocab - 1]
        drafts = small.draft({0: beyond, 1: ok}, {0: 4, 1: 4})
        assert drafts[0] == [] and len(drafts[1]) == 4
        assert all(t < small.n_out for t in drafts[1])
    finally:
        small.close()
    # the other way round: the served model has the smaller vocabulary
    smaller_target = Backend(config(variants["padded"]))
    big = open_draft(tiny_f16, slots=1)
    try:
        big.check_vocab(smaller_target)
        assert big.n_out == smaller_target.n_vocab
        d = big.draft({0: prompt(target, 11)}, {0: 8})[0]
        assert all(t < smaller_target.n_vocab for t in d)
    finally:
        big.close()
        smaller_target.close()


def test_a_missing_or_corrupt_draft_file_is_a_clear_error(tmp_path: Path, tiny_f16: Path) -> None:
    with pytest.raises(DraftModelError, match="no such file"):
        open_draft(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all" * 100)
    with pytest.raises(DraftModelError, match="not a GGUF file"):
        open_draft(junk)
    half = tmp_path / "half.gguf"
    half.write_bytes(tiny_f16.read_bytes()[: tiny_f16.stat().st_size // 2])
    with pytest.raises(DraftModelError, match=r"draft model .*half\.gguf"):
        open_draft(half)


def test_the_memory_plan_counts_the_cache_llama_cpp_gives_the_draft_model(
    tiny_f16: Path, target: Backend
) -> None:
    """The plans' draft figure (memplan.draft_bytes) holds the KV cache llama.cpp
    allocates for the draft model, as load_draft_model creates it."""
    import re

    from orin.llamacpp import capture_log
    from orin.model.memplan import DRAFT_KV_TYPE, kv_caches

    cfg = config(tiny_f16).with_(
        speculative=SpecConfig(mode="draft", draft_model=tiny_f16, draft_gpu_layers=0)
    )
    with capture_log() as lines:
        model = load_draft_model(cfg, target)
    model.close()
    sizes = re.findall(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells", "".join(lines))
    info = read_model_info(tiny_f16)
    planned = kv_caches(
        info, cfg.n_ctx, cfg.slots, DRAFT_KV_TYPE, DRAFT_KV_TYPE, cfg.n_ubatch, cfg.n_batch,
        swa_full=True,
    )  # fmt: skip
    assert [(f"{c.total / 2**20:.2f}", str(c.cells_per_seq)) for c in planned] == sizes


def test_the_header_check_refuses_what_the_load_time_check_refuses(
    variants: dict[str, Path], tiny_f16: Path
) -> None:
    """serve, doctor and profile validate read the same fields from the files before
    anything loads (vocabmatch); the BOS rule needs llama.cpp's defaults, and is left
    to the load."""
    from orin.model.vocabmatch import vocab_mismatch

    assert vocab_mismatch(tiny_f16, tiny_f16) is None
    assert vocab_mismatch(tiny_f16, variants["padded"]) is None
    permuted = vocab_mismatch(tiny_f16, variants["permuted"])
    assert permuted is not None and permuted.startswith("tokenizer.ggml.tokens[")
    smaller = vocab_mismatch(tiny_f16, variants["smaller"])
    assert smaller is not None and "tokenizer.ggml.tokens has" in smaller
