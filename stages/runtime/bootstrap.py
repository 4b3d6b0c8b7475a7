"""Bootstrap intervals that contain their point estimate (METHOD §5).

The point is the statistic computed on all the data, and each resample computes the same statistic
on a resample of it; the 95% interval is the percentile interval of the resamples, widened to the
point where a skewed statistic puts the point outside (reported as `widened`). So an interval
never excludes its own estimate, which the sweep's and the score's intervals once did when their
point was computed one way (the mean of the seeds, the score's first draw) and their resamples
another.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 1000


def interval(point: float, resamples, level: float = 0.95) -> dict:
    """{lo, hi, widened}: the percentile interval of the finite resamples, containing point."""
    values = np.asarray([v for v in resamples if np.isfinite(v)], dtype=float)
    if not np.isfinite(point) or values.size == 0:
        return {"lo": float("nan"), "hi": float("nan"), "widened": False}
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return {"lo": float(min(lo, point)), "hi": float(max(hi, point)), "widened": bool(point < lo or point > hi)}
