"""Command-line tools some tests run: found on PATH or where the Makefile puts them."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

# `make promtool` extracts promtool into the virtual environment's bin, and writes the
# reason here when it could not
PROMTOOL_NOTE = Path(sys.prefix) / "promtool-unavailable.txt"


def promtool() -> str | None:
    """promtool's path, or None."""
    found = shutil.which("promtool")
    if found is not None:
        return found
    local = Path(sys.prefix) / "bin" / "promtool"
    return str(local) if local.is_file() else None


def promtool_or_skip() -> str:
    found = promtool()
    if found is None:
        why = PROMTOOL_NOTE.read_text().strip() if PROMTOOL_NOTE.is_file() else ""
        pytest.skip(why or "promtool is not installed (make promtool extracts it)")
    return found
