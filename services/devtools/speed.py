"""The ``--speed`` of the commands that run the simulated cluster (``demo``, ``up``, ``simulate``): the factor
every simulated controller delay is multiplied by."""

from __future__ import annotations

from typing import Final

from shared.errors import InvalidInput

MIN_SPEED: Final = 0.001
MAX_SPEED: Final = 10.0


def check_speed(speed: float) -> None:
    """:class:`InvalidInput` naming ``--speed`` unless it is within [:data:`MIN_SPEED`, :data:`MAX_SPEED`]."""
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise InvalidInput(
            f"must be between {MIN_SPEED} and {MAX_SPEED} (1.0 is KubeVirt's own timing), got {speed}", "--speed"
        )
