"""The literals that several modules share (configuration, policy, actors, control), defined
once. A leaf: it imports nothing from hloserve, so anything may import it."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["DISCIPLINES", "RESIDENCIES", "Discipline", "Residency"]

Discipline = Literal["fair", "fifo", "edf"]
"""How the dispatcher picks the next model: weighted fair share, oldest first, earliest deadline."""
DISCIPLINES: tuple[Discipline, ...] = get_args(Discipline)

Residency = Literal["unpinned", "system", "device"]
"""A model's residency floor: weights re-read from the file at each load (`unpinned`), kept in
host memory (`system`), or pinned on the device (`device`)."""
RESIDENCIES: tuple[Residency, ...] = get_args(Residency)
