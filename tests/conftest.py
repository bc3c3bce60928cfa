from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.board import FakeBoard


@pytest.fixture(autouse=True)
def _root_logging() -> Iterator[None]:
    """Each test starts from the same logging set-up: a command that configures
    logging (serve's setup_logging) in one test must not decide what the next test's
    commands print."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


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
