"""Summaries of samples: percentiles, and ratios of arms measured side by side."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), so p95 of 20 samples
    sits between the 19th and 20th instead of jumping to the maximum."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: Sequence[float], digits: int = 1) -> dict[str, Any]:
    """n, p50, p95, min, max, mean; an empty arm says so instead of inventing zeros."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": round(percentile(values, 50), digits),
        "p95": round(percentile(values, 95), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "mean": round(statistics.fmean(values), digits),
    }


def ratio(numerator: dict[str, Any], denominator: dict[str, Any], key: str = "p50") -> float | None:
    """``numerator[key] / denominator[key]`` for two summaries; None when either arm is empty."""
    top, bottom = numerator.get(key), denominator.get(key)
    if top is None or not bottom:
        return None
    return round(top / bottom, 2)


def paired_ratio(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Median of per-round ratios: each pair was measured back to back, so slow
    drift in the machine's load cancels within a pair."""
    ratios = [a / b for a, b in pairs if b]
    return round(statistics.median(ratios), 2) if ratios else None
