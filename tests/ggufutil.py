"""Write small GGUF files with chosen metadata (no weights needed for metadata tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter

LLAMA2_7B = {
    "block_count": 32,
    "embedding_length": 4096,
    "feed_forward_length": 11008,
    "attention.head_count": 32,
    "attention.head_count_kv": 32,
    "context_length": 4096,
    "rope.freq_base": 10000.0,
}


def write_gguf(
    path: Path,
    arch: str = "llama",
    params: dict[str, Any] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    name: str = "test model",
    file_type: int | None = None,
) -> Path:
    """A GGUF file with ``{arch}.<key>`` metadata from ``params`` and optional tensors."""
    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    if file_type is not None:
        w.add_file_type(file_type)
    for key, value in (params or {}).items():
        full = f"{arch}.{key}"
        if isinstance(value, list):
            w.add_array(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, int(value))
    for tname, arr in (tensors or {}).items():
        w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
