"""The load mode the engine passes to llama.cpp: mmap or not, decided once.

Shared by ``tune system`` (which reports it), doctor's ``mmap`` check and the
engine (which uses it), so all three say the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

MMAP_MODES = frozenset({"mmap", "mmap+mlock"})


@dataclass(frozen=True)
class LoadSettings:
    """What a profile says about loading the model, as plain values.

    Built from a profile by ``orin.profile.board.load_settings``; the board layer
    never sees the profile itself.
    """

    load_mode: str = "auto"  # engine.load_mode: auto, or a mode to use as is
    mmap: str = "auto"  # system.mmap: auto, on or off
    gpu_layers: int = -1  # engine.gpu_layers: -1 = all


@dataclass(frozen=True)
class MmapDecision:
    load_mode: str
    full_offload: bool
    reason: str

    @property
    def uses_mmap(self) -> bool:
        return self.load_mode in MMAP_MODES


def mmap_policy(
    load: LoadSettings,
    unified_memory: bool,
    n_layer: int | None = None,
    gpu_offload: bool | None = None,
) -> MmapDecision:
    """The load mode the engine should pass to llama.cpp.

    On unified memory a fully offloaded model mapped from its file sits twice
    in the same DRAM: once in the page cache, once in the GPU's buffers. So
    ``system.mmap: auto`` reads the file instead (load mode ``none``) when every
    layer is on the GPU of a Jetson, and maps it otherwise (CPU layers then
    read the mapping directly and nothing is copied).
    """
    layers = load.gpu_layers
    full = gpu_offload is not False and (layers < 0 or (n_layer is not None and layers > n_layer))
    explicit, policy = load.load_mode, load.mmap
    if explicit != "auto":
        return MmapDecision(explicit, full, f"engine.load_mode is set to {explicit}")
    if policy != "auto":
        mode = "mmap" if policy == "on" else "none"
        return MmapDecision(mode, full, f"system.mmap is {policy}")
    if full and unified_memory:
        return MmapDecision(
            "none", full, "every layer is on the GPU, which shares DRAM with the CPU"
        )
    if gpu_offload is False:
        why = "this build cannot offload: every layer reads the mapping directly"
    elif not full:
        why = "some layers run on the CPU and read the mapping directly"
    else:
        why = "no unified memory here: the mapping is not a second copy beside the GPU's"
    return MmapDecision("mmap", full, why)
