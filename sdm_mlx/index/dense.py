"""The float32 support index of Alg. 1's epochs: q and d0 (``equation:q``, ``equation:d``) from one float32
distance block per query block, ties by support index.

Alg. 1 refreshes q, d0 and d of every training and calibration row after every epoch, to weight the next epoch's
loss and to choose the epoch.  None of those values is stored: the epoch a round keeps is recomputed by the
exact index (:class:`~sdm_mlx.index.exact.ExactIndex`) and the batch-invariant forward, and only that state is
calibrated and saved.  So the epochs need neither the exact index's float64 re-ranking of near-ties (a Python
step per ambiguous row, most rows of clustered data: ``docs/performance.md``) nor its batch invariance: here a
query block's squared distances ``‖q‖² + ‖s‖² − 2 q·s`` (centred on the support mean) come from one BLAS
product, and q is the count of good support rows before the first bad one in (float32 distance, support
index) order, capped at k, as :func:`~sdm_mlx.index.similarity_from_neighbours` defines it.  Where float32
rounding orders two neighbours differently from float64, q may differ from the exact index's by the length
of a tie; nothing downstream of an epoch's choice depends on it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ._arrays import _as_float32_matrix, _exclusion, check_predictions

#: Bytes of one block of query × support float32 distances.
BLOCK_BYTES = 64 * 1024 * 1024
#: Products with at most this many multiply-adds run in NumPy on the calling thread (MLX's dispatch costs more).
HOST_MULTIPLY_ADDS = 1 << 20


class DenseIndex:
    """Float32 all-pairs support index: :meth:`similarity` (q, d0) as :class:`~sdm_mlx.index.ExactIndex` defines
    them, with float32 distances.  Not batch-invariant (a BLAS product's rounding depends on the block).

    As in the exact index, the support columns are grouped by the class they are good for (label = prediction
    = c), the rows good for none last, so that for a query predicted c the good columns are one slice: the first
    bad neighbour is a row minimum over the two other slices and q a count over the good slice (three passes
    over a distance block).  The grouping follows the ``good_by_class`` of the last call.
    """

    backend = "dense"

    def __init__(self, support, block_bytes: int = BLOCK_BYTES):
        s = _as_float32_matrix(support, "support")
        self.size, self.dim = s.shape
        self._center = s.mean(axis=0, dtype=np.float64).astype(np.float32)
        self._raw = s
        self._grouped = None  # (good_by_class, perm, inverse, bounds, support, ‖s‖², MLX support)
        self.block_rows = max(1, block_bytes // (4 * max(self.size, 1)))

    def _grouping(self, good: np.ndarray):
        g = self._grouped
        if g is not None and (g[0] is good or np.array_equal(g[0], good)):
            return g
        classes = good.shape[0]
        category = np.full(self.size, classes, dtype=np.int64)
        for c in range(classes):
            category[good[c]] = c
        perm = np.argsort(category, kind="stable")
        inverse = np.empty_like(perm)
        inverse[perm] = np.arange(self.size)
        bounds = np.searchsorted(category[perm], np.arange(classes + 1))
        support = np.ascontiguousarray(self._raw[perm] - self._center)
        sq = np.einsum("ij,ij->i", support, support)
        self._grouped = (good, perm, inverse, bounds, support, sq, None)
        return self._grouped

    def _distances(self, qc: np.ndarray, grouped) -> np.ndarray:
        """Squared L2 [b, N_s] of centred queries to the grouped support, clamped at 0."""
        support, sq = grouped[4], grouped[5]
        if qc.shape[0] * self.size * self.dim <= HOST_MULTIPLY_ADDS:
            dots = qc @ support.T
        else:
            if grouped[6] is None:
                grouped = self._grouped = (*grouped[:6], mx.array(support))
            dots = np.array(mx.matmul(mx.array(qc), grouped[6].T, stream=mx.cpu))
        q_sq = np.einsum("ij,ij->i", qc, qc)
        dots *= np.float32(-2.0)
        dots += q_sq[:, None]
        dots += sq[None, :]
        return np.maximum(dots, np.float32(0.0), out=dots)

    def similarity(self, queries, y_hat, good_by_class, k: int, exclude=None) -> tuple[np.ndarray, np.ndarray]:
        """(q [N] int64, d0 [N] float32) of ``equation:q`` for queries predicted ``y_hat``; ``exclude[i]`` (a
        support index, or −1) is left out for query i before the k cap (DESIGN #5)."""
        queries = _as_float32_matrix(queries, "queries")
        y_hat, good = check_predictions(queries, y_hat, good_by_class, self.size)
        ex = _exclusion(exclude, queries.shape[0])
        k_eff = max(0, min(int(k), self.size) - (1 if ex is not None else 0))
        q_out = np.zeros(queries.shape[0], dtype=np.int64)
        d0 = np.full(queries.shape[0], np.inf, dtype=np.float32)
        if self.size == 0:
            return q_out, d0
        grouped = self._grouping(good)
        perm, inverse, bounds = grouped[1], grouped[2], grouped[3]
        qc = queries - self._center
        for start in range(0, queries.shape[0], self.block_rows):
            rows = np.arange(start, min(start + self.block_rows, queries.shape[0]))
            dist = self._distances(qc[rows], grouped)
            if ex is not None:
                hit = np.flatnonzero(ex[rows] >= 0)
                dist[hit, inverse[ex[rows][hit]]] = np.inf
            d0[rows] = dist.min(axis=1)
            for c in np.unique(y_hat[rows]).tolist():
                at = np.flatnonzero(y_hat[rows] == c)
                block = dist[at] if at.size < rows.size else dist
                q_out[rows[at]] = _leading_good(block, int(bounds[c]), int(bounds[c + 1]), perm)
        np.minimum(q_out, k_eff, out=q_out)
        return q_out, d0


def _leading_good(dist: np.ndarray, a: int, b: int, perm: np.ndarray) -> np.ndarray:
    """Per row of a distance block whose columns are grouped (column j is support ``perm[j]``, the good ones
    [a, b)): the good columns before the first bad one in (distance, support index) order.  Excluded columns
    are +inf: neither counts."""
    n = dist.shape[0]
    if b == a:
        return np.zeros(n, dtype=np.int64)
    inf = np.full(n, np.inf, dtype=np.float32)
    limit = np.minimum(dist[:, :a].min(axis=1) if a > 0 else inf, dist[:, b:].min(axis=1) if b < dist.shape[1] else inf)
    good = dist[:, a:b]
    count = (good < limit[:, None]).sum(axis=1)
    tied = np.flatnonzero(np.isfinite(limit) & (good == limit[:, None]).any(axis=1))
    if tied.size:  # a good and a bad column at one distance (exact ties): the smaller support index first
        at_limit = dist[tied] == limit[tied, None]
        bad_at_limit = at_limit.copy()
        bad_at_limit[:, a:b] = False
        first = np.where(bad_at_limit, perm[None, :], perm.size).min(axis=1)
        count[tied] += (at_limit[:, a:b] & (perm[None, a:b] < first[:, None])).sum(axis=1)
    return count.astype(np.int64)


__all__ = ["DenseIndex"]
