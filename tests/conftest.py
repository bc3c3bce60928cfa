from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.board import FakeBoard


@pytest.fixture
def board(tmp_path: Path) -> FakeBoard:
    return FakeBoard(tmp_path / "root")


@pytest.fixture(scope="session")
def tiny_f16() -> Path:
    from orin.model import demo

    return demo.ensure("tiny", "f16")


@pytest.fixture(scope="session")
def small_q4km() -> Path:
    from orin.model import demo

    return demo.ensure("small", "q4_k_m")
