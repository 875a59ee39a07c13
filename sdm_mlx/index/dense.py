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
    them, with float32 distances.  Not batch-invariant (a BLAS product's rounding depends on the block)."""

    backend = "dense"

    def __init__(self, support, block_bytes: int = BLOCK_BYTES):
        s = _as_float32_matrix(support, "support")
        self.size, self.dim = s.shape
        self._center = s.mean(axis=0, dtype=np.float64).astype(np.float32)
        self._support = np.ascontiguousarray(s - self._center)
        self._support_sq = np.einsum("ij,ij->i", self._support, self._support)
        self._support_mx = None
        self.block_rows = max(1, block_bytes // (4 * max(self.size, 1)))

    def _distances(self, qc: np.ndarray) -> np.ndarray:
        """Squared L2 [b, N_s] of centred queries to the support, clamped at 0."""
        if qc.shape[0] * self.size * self.dim <= HOST_MULTIPLY_ADDS:
            dots = qc @ self._support.T
        else:
            if self._support_mx is None:
                self._support_mx = mx.array(self._support)
            dots = np.array(mx.matmul(mx.array(qc), self._support_mx.T, stream=mx.cpu))
        q_sq = np.einsum("ij,ij->i", qc, qc)
        dots *= np.float32(-2.0)
        dots += q_sq[:, None]
        dots += self._support_sq[None, :]
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
        columns = np.arange(self.size)
        qc = queries - self._center
        for start in range(0, queries.shape[0], self.block_rows):
            rows = np.arange(start, min(start + self.block_rows, queries.shape[0]))
            dist = self._distances(qc[rows])
            if ex is not None:
                hit = np.flatnonzero(ex[rows] >= 0)
                dist[hit, ex[rows][hit]] = np.inf
            if self.size:
                d0[rows] = dist.min(axis=1)
            for c in np.unique(y_hat[rows]).tolist():
                at = np.flatnonzero(y_hat[rows] == c)
                block = dist[at] if at.size < rows.size else dist
                q_out[rows[at]] = _leading_good(block, good[c], columns)
        np.minimum(q_out, k_eff, out=q_out)
        return q_out, d0


def _leading_good(dist: np.ndarray, good: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """Per row, the good columns before the first bad one in (distance, column) order (excluded columns are
    +inf: neither counts)."""
    if not good.any():
        return np.zeros(dist.shape[0], dtype=np.int64)
    bad_dist = np.where(good[None, :], np.float32(np.inf), dist)
    first = bad_dist.argmin(axis=1)  # the first bad column: smallest distance, then smallest index
    limit = bad_dist[np.arange(dist.shape[0]), first]
    good_dist = np.where(good[None, :], dist, np.float32(np.inf))
    count = (good_dist < limit[:, None]).sum(axis=1)
    tied = np.isfinite(limit) & (good_dist == limit[:, None]).any(axis=1)
    if tied.any():  # good columns at the first bad distance come first when their index is smaller
        t = np.flatnonzero(tied)
        count[t] += ((good_dist[t] == limit[t, None]) & (columns[None, :] < first[t, None])).sum(axis=1)
    return count.astype(np.int64)


__all__ = ["DenseIndex"]
