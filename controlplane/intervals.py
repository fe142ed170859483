"""95 % confidence intervals for accuracies. Pure functions: no Django, no I/O.

A share of right (0/1) answers gets the Wilson score interval, which stays inside [0, 1] and
is honest for small sets and shares near 0 or 1 (where the normal approximation is not). A
mean of graded scores (ANLS, VQA accuracy) or a figure made of several counts (F1) gets a
percentile bootstrap over the items, seeded so that the same answers give the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20260101


def wilson(successes: int, total: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of `successes` out of `total`; None for no trials."""
    if total <= 0:
        return None
    if not 0 <= successes <= total:
        raise ValueError("successes must lie between 0 and the total")
    share = successes / total
    z2 = z * z
    centre = (share + z2 / (2 * total)) / (1 + z2 / total)
    half = z * math.sqrt(share * (1 - share) / total + z2 / (4 * total * total)) / (1 + z2 / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap(values: Sequence, statistic: Callable[[np.ndarray], np.ndarray] | None = None, *,
              resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
              level: float = 0.95) -> tuple[float, float] | None:
    """The percentile bootstrap interval of `statistic` (the mean when None) over `values`,
    resampled with replacement. `statistic` takes an array of resamples (one per row, of
    items, or of item rows when `values` holds rows) and returns one figure per resample.
    None for no values."""
    data = np.asarray(values, dtype=float)
    if len(data) == 0:
        return None
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(data), size=(resamples, len(data)))
    samples = data[picks]
    figures = samples.mean(axis=1) if statistic is None else statistic(samples)
    tail = (1 - level) / 2
    low, high = np.quantile(figures, [tail, 1 - tail])
    return float(low), float(high)


def mean_interval(scores: Sequence[float]) -> tuple[float, float] | None:
    """The interval of a mean score: Wilson when every score is 0 or 1, else a bootstrap."""
    if not scores:
        return None
    if all(s in (0, 1) for s in scores):
        return wilson(int(sum(scores)), len(scores))
    return bootstrap(scores)
