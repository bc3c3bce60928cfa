"""The CUDA probe: run inside the server's sandbox before install enables the service.

``orin-llm install`` starts this module with systemd-run and every sandbox
setting of ``orin-llm.service`` (the user, its groups, the device policy and
``DeviceAllow`` list, the hardening), so CUDA meets exactly what the server
will meet::

    python -I -m orin.install.cudaprobe /dev/nvmap /dev/nvgpu/igpu0/ctrl ...

It initializes CUDA for real through the driver API (``cuInit``, a context on
device 0 and a 1 MiB allocation), then asks llama.cpp whether it can offload.
Only when that fails does it open each GPU node, the allowed ones (the
arguments) and the others found under /dev, so the report names the node the
sandbox refused: ``EPERM`` is the device filter (not in ``DeviceAllow``),
``EACCES`` the node's own permissions (a missing group). One JSON object goes
to stdout; the exit status is 1 when CUDA failed. Kept to the standard library
(and orin.llamacpp) so it starts fast and fails for CUDA's reasons only.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

CUDA_LIBRARIES = ("libcuda.so.1", "libcuda.so")
# Every node a GPU stack might open, whether the unit allows it or not.
NODE_GLOBS = (
    "/dev/nvmap",
    "/dev/nvgpu/*/*",
    "/dev/nvhost-*",
    "/dev/host1x-*",
    "/dev/dri/renderD*",
    "/dev/nvidia*",
)
ALLOC_BYTES = 1 << 20


def load_cuda() -> Any:
    """The CUDA driver library, or None when this machine has none."""
    for name in CUDA_LIBRARIES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def cuda_init(lib: Any) -> dict[str, Any]:
    """cuInit, a primary context on device 0 and one allocation; the first failing call."""
    count, dev, ctx, ptr = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_void_p(), ctypes.c_uint64()
    calls = (
        ("cuInit", lambda: lib.cuInit(0)),
        ("cuDeviceGetCount", lambda: lib.cuDeviceGetCount(ctypes.byref(count))),
        ("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(dev), 0)),
        ("cuDevicePrimaryCtxRetain", lambda: lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
        ("cuCtxSetCurrent", lambda: lib.cuCtxSetCurrent(ctx)),
        ("cuMemAlloc", lambda: lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(ALLOC_BYTES))),
        ("cuMemFree", lambda: lib.cuMemFree_v2(ptr)),
    )
    for name, call in calls:
        result = int(call())
        if result != 0:
            return {"ok": False, "call": name, "result": result, "name": _error_name(lib, result)}
        if name == "cuDeviceGetCount" and count.value == 0:
            return {"ok": False, "call": name, "result": 100, "name": "CUDA_ERROR_NO_DEVICE"}
    lib.cuDevicePrimaryCtxRelease(dev)
    return {"ok": True, "devices": count.value}


def _error_name(lib: Any, result: int) -> str:
    text = ctypes.c_char_p()
    try:
        if lib.cuGetErrorName(result, ctypes.byref(text)) == 0 and text.value:
            return str(text.value.decode())
    except (AttributeError, OSError):
        pass
    return f"CUresult {result}"


def llama_gpu() -> dict[str, Any]:
    """Whether llama.cpp (the server's engine) can offload to the GPU in here."""
    try:
        from orin.llamacpp import build_info

        info = build_info()
    except Exception as exc:  # the report says why, whatever it is
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": info.gpu_offload or not info.cuda, "cuda": info.cuda, "offload": info.gpu_offload}


def check_nodes(
    allowed: Sequence[str], patterns: Sequence[str] = NODE_GLOBS
) -> list[dict[str, Any]]:
    """Open each GPU node read-write, as CUDA does; the errno of each that fails."""
    found = {p for pattern in patterns for p in glob.glob(pattern) if not os.path.isdir(p)}
    report = []
    for path in sorted(found | set(allowed)):
        error = None
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK))
        except OSError as exc:
            error = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        report.append({"path": path, "allowed": path in allowed, "error": error})
    return report


def probe(allowed: Sequence[str]) -> dict[str, Any]:
    lib = load_cuda()
    if lib is None:
        return {"status": "no-driver", "detail": f"none of {', '.join(CUDA_LIBRARIES)} loads"}
    cuda = cuda_init(lib)
    report: dict[str, Any] = {"status": "failed", "cuda": cuda}
    if cuda["ok"]:
        report["llama"] = llama_gpu()
        if report["llama"]["ok"]:
            report["status"] = "ok"
            return report
    report["nodes"] = check_nodes(allowed)
    return report


def main(argv: Sequence[str]) -> int:
    report = probe(list(argv))
    print(json.dumps(report), flush=True)
    return 1 if report["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
