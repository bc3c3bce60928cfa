"""What a profile asks of the board, as the plain values ``orin.system`` takes.

The board layer sits below the profiles: its settings and the mmap policy
take these values, never a ``Profile``, so the field names of the profile
schema are read here and nowhere under ``orin/system``.
"""

from __future__ import annotations

from orin.profile.schema import Profile
from orin.system.loadmode import LoadSettings
from orin.system.settings import BoardSettings


def load_settings(profile: Profile) -> LoadSettings:
    """engine.load_mode, system.mmap and engine.gpu_layers, for the mmap policy."""
    e = profile.engine
    return LoadSettings(load_mode=e.load_mode, mmap=profile.system.mmap, gpu_layers=e.gpu_layers)


def board_settings(profile: Profile) -> BoardSettings:
    """The profile's system section (and the engine's NUMA and load settings)."""
    s = profile.system
    return BoardSettings(
        swappiness=s.swappiness,
        disable_zram=s.disable_zram,
        power_mode=s.power_mode,
        lock_clocks=s.lock_clocks,
        drop_caches=s.drop_caches,
        numa=profile.engine.numa,
        load=load_settings(profile),
    )
