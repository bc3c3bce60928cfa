"""Log output for long-running commands: text for people, JSON lines for collectors."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

_STANDARD = set(vars(logging.makeLogRecord({})))


class JsonFormatter(logging.Formatter):
    """One JSON object per line; an ``extra={"fields": {...}}`` dict is merged in."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key == "fields" and isinstance(value, dict):
                out.update(value)  # structured fields (the access log) at the top level
            elif key not in _STANDARD and key != "message":
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(fmt: str = "text") -> None:
    """INFO to stderr (DEBUG with ORIN_LLM_DEBUG); llama.cpp's own log stays at WARNING."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if os.environ.get("ORIN_LLM_DEBUG") else logging.INFO)
    logging.getLogger("orin.llama").setLevel(logging.WARNING)
    for noisy in ("uvicorn.access", "httpx", "sse_starlette"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
