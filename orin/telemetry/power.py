"""The board's power from its rails: the module's input rail where it has one.

An Orin NX or Orin Nano monitors its module input (``VDD_IN``) beside two rails fed
from it (``VDD_CPU_GPU_CV``, ``VDD_SOC``), so the sum of its rails counts those two
twice; the AGX Orin has no input rail, and its rails add up. This is how
jetson-stats totals them (``jtop/core/power.py``, ``total_power``: ``VDD_IN`` or, on
older Jetsons, ``POM_5V_IN`` is the total when present, else the rails are summed).
"""

from __future__ import annotations

from collections.abc import Mapping

INPUT_RAILS = ("VDD_IN", "POM_5V_IN")


def board_power_mw(rails: Mapping[str, float] | None) -> float | None:
    """Total power in mW from rail label -> mW; None without rails."""
    if not rails:
        return None
    for label in INPUT_RAILS:
        if label in rails:
            return rails[label]
    return sum(rails.values())
