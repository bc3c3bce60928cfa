"""The demo vocabulary: fixed layout, deterministic BPE, and an SPM encoding that replays BPE."""

from __future__ import annotations

from itertools import pairwise

import pytest

from orin.model import vocab as v
from orin.model.corpus import CORPUS


@pytest.fixture(scope="module")
def voc() -> v.Vocab:
    return v.build_vocab()


def test_training_is_deterministic(voc: v.Vocab) -> None:
    alphabet, merges = v.train_bpe(v.word_counts(CORPUS))
    again = v.train_bpe(v.word_counts(CORPUS))
    assert (alphabet, merges) == again
    assert tuple(merges) == voc.merges


def test_fixed_layout(voc: v.Vocab) -> None:
    assert voc.tokens[:3] == ("<unk>", "<s>", "</s>")
    assert voc.types[:3] == (v.TokenType.UNKNOWN, v.TokenType.CONTROL, v.TokenType.CONTROL)
    for b in range(256):
        assert voc.tokens[v.BYTE_BASE + b] == f"<0x{b:02X}>"
        assert voc.types[v.BYTE_BASE + b] == v.TokenType.BYTE
    assert voc.tokens[v.IM_START_ID] == "<|im_start|>"
    assert voc.tokens[v.IM_END_ID] == "<|im_end|>"
    assert voc.types[v.IM_START_ID] == voc.types[v.IM_END_ID] == v.TokenType.CONTROL
    assert all(t == v.TokenType.NORMAL for t in voc.types[v.FIRST_NORMAL_ID :])


def test_size_and_uniqueness(voc: v.Vocab) -> None:
    assert 500 <= len(voc) <= 2000
    assert len(set(voc.tokens)) == len(voc.tokens)
    assert len(voc.scores) == len(voc.types) == len(voc)
    assert max(len(t.encode()) for t in voc.tokens) <= v.MAX_PIECE_BYTES


def test_every_corpus_character_is_a_piece(voc: v.Vocab) -> None:
    chars = set("".join(v.word_counts(CORPUS)))
    assert v.SPACE in chars
    assert all(c in voc.ids for c in chars)


def test_merged_pieces_come_from_two_earlier_pieces(voc: v.Vocab) -> None:
    first_merged = len(voc) - len(voc.merges)
    assert all(len(t) == 1 for t in voc.tokens[v.FIRST_NORMAL_ID : first_merged])
    for offset, (left, right) in enumerate(voc.merges):
        piece_id = first_merged + offset
        assert voc.tokens[piece_id] == left + right
        assert voc.ids[left] < piece_id
        assert voc.ids[right] < piece_id


def test_scores_fall_with_merge_order(voc: v.Vocab) -> None:
    first_merged = len(voc) - len(voc.merges)
    merged = voc.scores[first_merged:]
    assert all(a > b for a, b in pairwise(merged))
    chars = voc.scores[v.FIRST_NORMAL_ID : first_merged]
    assert max(chars) < min(merged)


def test_spm_merging_reproduces_bpe_segmentation(voc: v.Vocab) -> None:
    for word in v.word_counts(CORPUS):
        spm = [voc.tokens[i] for i in voc.encode(word[1:])]
        assert spm == v.bpe_segment(word, voc.merges), word


def test_common_chinese_characters_are_single_tokens(voc: v.Vocab) -> None:
    for ch in "模型内存的我们":
        assert ch in voc.ids
    assert "模型" in voc.ids


@pytest.mark.parametrize(
    "text",
    [
        "Running a large language model on an edge board.",
        "  two leading spaces, a tab\tand\nnew lines\n",
        "我们在边缘设备上运行模型。",
        "罕见字：饕餮、龘、𠀀",
        "emoji 🦙🚀 and ünïcödé",
        "",
    ],
)
def test_encode_decode_round_trip(voc: v.Vocab, text: str) -> None:
    ids = voc.encode(text)
    assert voc.decode(ids) == text
    assert all(0 <= i < len(voc) for i in ids)


def test_unknown_characters_fall_back_to_bytes(voc: v.Vocab) -> None:
    ids = voc.encode("🦙")
    assert ids[0] == voc.ids[v.SPACE]
    assert [i - v.BYTE_BASE for i in ids[1:]] == list("🦙".encode())


def test_chat_template_is_chatml() -> None:
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(v.CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not template.render(messages=messages).endswith("assistant\n")
