"""Where orin-llm keeps files of its own."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache directory: ORIN_LLM_CACHE_DIR, else XDG_CACHE_HOME/orin-llm."""
    explicit = os.environ.get("ORIN_LLM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "orin-llm"


def models_cache_dir() -> Path:
    return cache_dir() / "models"
