"""benchmarks/gguf_read.py runs end to end on a small generated vocabulary, and the
file it times reads back as the vocabulary it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import gguf_read
from orin.model.gguf import read_model_info


def test_the_generated_vocabulary_reads_back(tmp_path: Path) -> None:
    path = gguf_read.vocabulary_file(tmp_path / "v.gguf", 300, 500)
    info = read_model_info(path)
    assert (info.architecture, info.vocab_size, info.n_ctx_train) == ("llama", 300, 8192)


def test_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    gguf_read.main(["--reps", "1", "--tokens", "300", "--merges", "500", "--no-smollm2"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("| file | GGUFReader, s |") and rows[2].startswith("| 300 tokens")
