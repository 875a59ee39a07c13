"""Distance quantile d: class-wise eCDFs of the nearest-neighbour distance d0.

Paper: ``equation:d`` (Distance).  For each true class c the eCDF is
the sorted d0 of calibration rows with label c *and* q > 0 (q = 0 rows are
out-of-distribution and excluded).  For a query,

    d_c = 1 − #{x ∈ L_c : x < d0} / |L_c|          (strict-left count)
    d   = min_c d_c,      and an empty L_c forces d = 0

so d0 = 0 ⇒ d = 1 and d0 beyond every stored distance ⇒ d = 0.  Training rows
use eCDFs built from the training split (self-excluded q, d0); calibration and
test rows use the calibration eCDFs.
"""

from __future__ import annotations

import numpy as np


def distance_ecdfs(d0: np.ndarray, labels: np.ndarray, q: np.ndarray, num_classes: int) -> list[np.ndarray]:
    """Per true class, the sorted d0 of rows with that label and q > 0 (``equation:d``)."""
    d0 = np.asarray(d0, dtype=np.float32)
    labels = np.asarray(labels)
    keep = np.asarray(q) > 0
    return [np.sort(d0[keep & (labels == c)]) for c in range(num_classes)]


def distance_quantile(d0: np.ndarray, ecdfs: list[np.ndarray]) -> np.ndarray:
    """d = min_c (1 − strict-left eCDF_c(d0)), empty class ⇒ 0 (``equation:d``)."""
    d0 = np.maximum(np.asarray(d0, dtype=np.float32).reshape(-1), 0.0)
    d = np.ones(d0.shape[0], dtype=np.float32)
    for sorted_c in ecdfs:
        if sorted_c.size == 0:
            return np.zeros_like(d)
        below = np.searchsorted(sorted_c, d0, side="left")
        d = np.minimum(d, (1.0 - below / sorted_c.size).astype(np.float32))
    return d
