"""docs/troubleshooting.md against the pitfall table and the checks that exist."""

from __future__ import annotations

import re
from pathlib import Path

from orin.doctor.checks import CHECK_IDS
from orin.doctor.pitfalls import PITFALLS

DOC = Path(__file__).resolve().parents[3] / "docs" / "troubleshooting.md"
NOT_IN_LLAMA_CPP = (
    "-DGGML_CUDA_FORCE_MALLOPT",
    "-DGGML_CUDA_ROPE",
    "--max-batch-size",
    "--keep-batch",
    "--no-dequant",
)


def sections() -> dict[int, str]:
    parts = re.split(r"^### (\d)\. ", DOC.read_text(), flags=re.M)
    return {int(parts[i]): parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def test_every_pitfall_names_existing_checks_or_a_mechanism() -> None:
    assert [p.number for p in PITFALLS] == list(range(1, 8))
    for p in PITFALLS:
        assert set(p.checks) <= set(CHECK_IDS), p
        assert p.checks or p.prevented_by, p


def test_the_doc_lists_each_pitfall_with_its_checks() -> None:
    docs = sections()
    assert sorted(docs) == list(range(1, 8))
    for p in PITFALLS:
        text = docs[p.number]
        assert "**Symptom**" in text and "**Fix**" in text, p.number
        checks_line = next(ln for ln in text.splitlines() if ln.startswith("- **Checks**"))
        named = re.findall(r"`([a-z-]+)`", text.split("- **Checks**")[1].split("- **")[0])
        assert set(named) == set(p.checks), (p.number, checks_line)


def test_every_check_is_documented() -> None:
    table = DOC.read_text().split("## Every check")[1]
    assert re.findall(r"^\| `([a-z-]+)` \|", table, flags=re.M) == list(CHECK_IDS)


def test_flags_that_do_not_exist_are_only_named_as_such() -> None:
    text = " ".join(DOC.read_text().split())
    for flag in NOT_IN_LLAMA_CPP:
        for m in re.finditer(re.escape(flag), text):
            assert "not exist" in text[m.start() : m.start() + 120], flag
