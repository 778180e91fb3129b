"""Flag values every readie command reads the same way (decision 15).

Durations are written as in the config file and requests (``10s``, ``500ms``,
``2m``: ``readie_protocol.units``); a bare number is seconds, decimals
allowed, as these flags took before. Log formats are ``console`` and
``json`` on every command.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from readie_protocol.units import parse_duration_ms

from readie_protocol.errors import ConfigError, UnitError

from .config import CLI_SOURCE
from .config_values import EGRESS_DNS, NETNS_NAME, Reading, ValueKind

__all__ = [
    "LOG_CHOICES",
    "comma_separated",
    "duration_seconds",
    "egress_dns",
    "egress_netns",
    "non_negative_int",
    "positive_duration",
    "positive_int",
]

#: ``readie pool`` also takes ``none``, the first name of ``console`` (config.LOG_FORMATS).
LOG_CHOICES = ("console", "json")


def duration_seconds(text: str) -> float:
    """Seconds for a duration flag: ``10s``, ``250ms``, ``2m``, or a number of seconds (``0.5``)."""
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more, e.g. 10s or 500ms")
        return value
    try:
        return parse_duration_ms(text) / 1000
    except UnitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_duration(text: str) -> float:
    """A duration flag that paces a loop: 0 would make the loop spin."""
    value = duration_seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be more than 0, e.g. 5s")
    return value


def positive_int(text: str) -> int:
    """A count of things to run at once (slots, workers): 0 would serve nothing."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    """A count that may be 0 (sessions kept open: 0 turns sessions off)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def comma_separated(text: str) -> tuple[str, ...]:
    """A list flag written ``A,B``: each item stripped, empty ones dropped (``--egress-dns=`` is an empty list)."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def egress_netns(text: str) -> str:
    """``--egress-netns NAME``, checked as ``[pool] egress_netns`` is."""
    return _as_pool_key(NETNS_NAME, "--egress-netns", text)


def egress_dns(text: str) -> tuple[str, ...]:
    """``--egress-dns IP[,IP...]``, checked as ``[pool] egress_dns`` is."""
    return _as_pool_key(EGRESS_DNS, "--egress-dns", list(comma_separated(text)))


def _as_pool_key(kind: ValueKind, flag: str, value: object) -> Any:
    # Neither value is a path: the base and resolver of the reading are never used.
    try:
        return kind.read(Reading(CLI_SOURCE, Path("/"), os.path.realpath), flag, value)
    except ConfigError as exc:  # argparse names the flag; the reason names the value
        raise argparse.ArgumentTypeError(exc.reason) from None
