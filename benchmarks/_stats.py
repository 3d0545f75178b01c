"""Summary statistics shared by the benchmark scripts: medians with their spread and a confidence interval.

The targets are ratios within a few percent, measured on a shared 2-core machine where single rounds vary by
tens of percent; the confidence interval of the median says whether a run could resolve the target at all.
"""

from __future__ import annotations

import math
import statistics


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles, range and a 95% confidence interval of the median of ``values``."""
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    # distribution-free 95% confidence interval of the median: order statistics n/2 -+ 1.96 sqrt(n)/2
    half = 1.96 * math.sqrt(len(ordered)) / 2
    lo = max(0, math.floor(len(ordered) / 2 - half) - 1)
    hi = min(len(ordered) - 1, math.ceil(len(ordered) / 2 + half) - 1)
    return {
        "median": statistics.median(ordered),
        "p25": q1,
        "p75": q3,
        "ci95_lo": ordered[lo],
        "ci95_hi": ordered[hi],
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }
