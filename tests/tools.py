"""Command-line tools some tests run, which `make test` installs where it can."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest


def make_note(name: str, otherwise: str) -> str:
    """Why a tool is missing: the reason its Makefile target (`make browser`, `make
    promtool`) wrote into the virtual environment when it could not install it, or
    ``otherwise``."""
    note = Path(sys.prefix) / name
    return (note.read_text().strip() if note.is_file() else "") or otherwise


def promtool_or_skip() -> str:
    """promtool's path, from PATH or the virtual environment's bin (where `make
    promtool` puts it); the test skips with the reason when there is none."""
    found = shutil.which("promtool") or shutil.which("promtool", path=Path(sys.prefix) / "bin")
    if found is None:
        pytest.skip(make_note("promtool-unavailable.txt", "no promtool: run `make promtool`"))
    return found
