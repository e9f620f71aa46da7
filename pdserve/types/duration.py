"""Durations as people write them: the one grammar for every duration pdserve reads, from its
command line (``cli.common.duration``) and from a custom resource's ``spec.slo``.

Imports the standard library only.
"""

from __future__ import annotations

import re

# A number, then an optional unit. A bare number is seconds: every duration in pdserve's
# structs is in seconds, so "1.5" means what the same value means in the stored JSON.
_DURATION = re.compile(r"\s*(?P<value>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>us|ms|s|m)?\s*")
_UNIT_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``"500ms"``, ``"0.5s"``, ``"2s"``, ``"250us"``, ``"1m"``, or a bare
    number of seconds (``"1.5"``). Raises ValueError naming the text when it is not one."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(
            f"duration {text!r} is not a number with an optional unit us, ms, s or m (e.g. 500ms, 0.5s, 2)"
        )
    return float(match["value"]) * _UNIT_SECONDS[match["unit"]]
