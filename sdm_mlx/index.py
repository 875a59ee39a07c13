"""Support index over training exemplar vectors h', and the Similarity q.

Two interchangeable backends share one small interface:

* :class:`ExactIndex` (default) — exact squared L2 by tiled MLX matmuls,
  ``‖a‖² + ‖b‖² − 2a·bᵀ`` after centring every vector on support row 0,
  clamped at 0; neighbours ordered by (distance, support index); near-ties are
  re-ranked in float64 on the host.
* :class:`HnswIndex` — hnswlib HNSW graph (approximate, opt-in, for large
  support sets). Its neighbours, and therefore q, may differ from exact.

Both expose ``search(queries, n, exclude=None)`` (top-n neighbours) and
``similarity(queries, y_hat, good_by_class, k, exclude=None)`` returning the
Similarity q (``equation:q`` in the paper) and d0, the squared L2 distance
to the nearest support vector.

Similarity q of a query with prediction ŷ: the number of its nearest
neighbours, in order, that are correctly predicted and share the prediction
(``label_j == pred_j == ŷ``); the first neighbour failing this ends the count.
It is capped at k.  Training queries exclude their own support index *before*
the k cap, so they scan at most k − 1 neighbours (DESIGN #5).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

#: Bytes the exact index may use for one block of query × support distances.
DISTANCE_BLOCK_BYTES = 256 * 1024 * 1024


def good_neighbours_by_class(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """[C, N_support] bool: support j counts towards q of class c iff label_j == pred_j == c."""
    labels = np.asarray(labels)
    predictions = np.asarray(predictions)
    correct = labels == predictions
    return np.stack([correct & (predictions == c) for c in range(num_classes)])


def similarity_from_neighbours(neighbour_idx: np.ndarray, y_hat: np.ndarray, good_by_class: np.ndarray) -> np.ndarray:
    """q from sorted neighbour lists (``equation:q``): length of the leading run of good neighbours.

    ``neighbour_idx`` is [N, k] sorted nearest first; entries < 0 are padding (end the run).
    """
    neighbour_idx = np.asarray(neighbour_idx)
    if neighbour_idx.shape[1] == 0:
        return np.zeros(neighbour_idx.shape[0], dtype=np.int64)
    valid = neighbour_idx >= 0
    good = good_by_class[np.asarray(y_hat)[:, None], np.where(valid, neighbour_idx, 0)] & valid
    return np.cumprod(good, axis=1).sum(axis=1).astype(np.int64)


def _as_float32_matrix(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array [rows, dim], got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains NaN or Inf values")
    return a


def _exclusion(exclude, n_queries: int) -> np.ndarray | None:
    if exclude is None:
        return None
    ex = np.asarray(exclude, dtype=np.int64).reshape(-1)
    if ex.shape[0] != n_queries:
        raise ValueError(f"exclude must hold one support index per query ({n_queries}), got {ex.shape[0]}")
    return ex


# Not mx.compile'd: the group sizes change every epoch, and on the CPU backend each new shape
# costs a ~2 s recompilation against a ~25% steady-state gain (shapeless compilation crashed).
def _squared_distances(qc, support, support_sq):
    """Squared L2 [b, N_s] between centred queries and centred support, clamped at 0; and ‖q‖²."""
    q_sq = (qc * qc).sum(axis=1)
    return mx.maximum(q_sq[:, None] + support_sq[None, :] - 2.0 * (qc @ support.T), 0.0), q_sq


def _count_before_first_bad(good_dist, first_bad, q_sq, good_sq, tol):
    """(#good closer than the first bad, any good within the float32 error band of it, nearest good)."""
    fb = first_bad[:, None]
    count = (good_dist < fb).sum(axis=1)
    band = tol * (q_sq[:, None] + good_sq[None, :]) + 1e-30
    near = (mx.abs(good_dist - fb) <= band).any(axis=1)
    return count, near


class _Grouping:
    """Support columns permuted into contiguous groups G_0 … G_{C−1}, then the incorrect rows.

    G_c holds the support rows that count towards q of class c (label = prediction = c).
    Within a group the original order is kept, so ties stay ordered by support index.
    """

    def __init__(self, good_by_class: np.ndarray, support: mx.array, support_sq: mx.array):
        num_classes, n = good_by_class.shape
        if (good_by_class.sum(axis=0) > 1).any():
            raise ValueError("good_by_class must mark each support row good for at most one class")
        category = np.full(n, num_classes, dtype=np.int64)
        for c in range(num_classes):
            category[good_by_class[c]] = c
        self.good_by_class = good_by_class.copy()
        self.perm = np.argsort(category, kind="stable")
        self.inverse = np.empty(n, dtype=np.int64)
        self.inverse[self.perm] = np.arange(n)
        self.bounds = np.searchsorted(category[self.perm], np.arange(num_classes + 1))
        perm_mx = mx.array(self.perm)
        self.support = support[perm_mx]
        self.support_sq = support_sq[perm_mx]
        mx.eval(self.support, self.support_sq)
        self.support_sq_np = np.array(self.support_sq)


class ExactIndex:
    """Exact squared-L2 support index for q and d (``equation:q``, ``equation:d``), tiled MLX matmuls.

    Parameters
    ----------
    support : [N_s, M] float array of exemplar vectors.
    block_bytes : memory budget for one query-block × support distance matrix.
    """

    backend = "exact"

    def __init__(self, support, block_bytes: int = DISTANCE_BLOCK_BYTES):
        s = _as_float32_matrix(support, "support")
        if s.shape[0] == 0:
            raise ValueError("support set is empty")
        self.size, self.dim = s.shape
        self._center = s[0].copy()
        self._support_np = s - self._center  # centred float32 (host), used for float64 re-ranking
        self._support = mx.array(self._support_np)
        self._support_sq = (self._support * self._support).sum(axis=1)
        self._max_support_sq = float(self._support_sq.max().item())
        self.block_rows = max(1, min(4096, block_bytes // (4 * self.size)))

    # -- distances -----------------------------------------------------------------------------
    def _centre_queries(self, queries) -> np.ndarray:
        qn = _as_float32_matrix(queries, "queries")
        if qn.shape[1] != self.dim:
            raise ValueError(f"queries have dimension {qn.shape[1]}, the support set has {self.dim}")
        return qn - self._center

    def _block_distances(self, qc: mx.array) -> tuple[mx.array, mx.array]:
        """Squared L2 [b, N_s] between centred queries and the centred support, clamped at 0."""
        q_sq = (qc * qc).sum(axis=1)
        dist = q_sq[:, None] + self._support_sq[None, :] - 2.0 * (qc @ self._support.T)
        return mx.maximum(dist, 0.0), q_sq

    def _blocks(self, qc_np: np.ndarray):
        for start in range(0, qc_np.shape[0], self.block_rows):
            stop = min(start + self.block_rows, qc_np.shape[0])
            yield start, stop, mx.array(qc_np[start:stop])

    def _exact64(self, qc_row: np.ndarray, idx: np.ndarray) -> np.ndarray:
        diff = self._support_np[idx].astype(np.float64) - qc_row.astype(np.float64)
        return np.einsum("ij,ij->i", diff, diff)

    def _rerank_into(self, qc, rows, cand, ex, out_d, out_i) -> None:
        """Exact float64 ordering by (distance, index) of candidate indices ``cand`` [len(rows), c];
        writes the best ``out_d.shape[1]`` into ``out_d``/``out_i`` at ``rows`` (vectorised in chunks)."""
        n = out_d.shape[1]
        for c0 in range(0, rows.size, 256):
            r = rows[c0 : c0 + 256]
            idx = cand[c0 : c0 + 256]
            diff = self._support_np[idx].astype(np.float64) - qc[r, None, :]
            d64 = np.einsum("rcm,rcm->rc", diff, diff)
            if ex is not None:
                d64[idx == ex[r, None]] = np.inf
            order = np.lexsort((idx, d64), axis=-1)[:, :n]
            out_d[r, : order.shape[1]] = np.take_along_axis(d64, order, 1)
            out_i[r, : order.shape[1]] = np.take_along_axis(idx, order, 1)

    # -- top-n neighbours ---------------------------------------------------------------------
    def search(self, queries, n: int, exclude=None) -> tuple[np.ndarray, np.ndarray]:
        """Top-n nearest exemplars (the neighbours of ``equation:q``): (squared distances [N, n], indices [N, n]).

        Ordered by (distance, support index); distances are re-computed in float64 for the
        candidates, so near-ties are ranked exactly.  ``exclude[i]`` (a support index, or −1)
        is left out for query i.  Fewer than n available ⇒ padded with (inf, −1).
        """
        qc = self._centre_queries(queries)
        ex = _exclusion(exclude, qc.shape[0])
        n_avail = self.size
        n = int(n)
        n_cand = min(n_avail, n + 8 + (1 if ex is not None else 0))
        out_d = np.full((qc.shape[0], n), np.inf, dtype=np.float32)
        out_i = np.full((qc.shape[0], n), -1, dtype=np.int64)
        if n <= 0:
            return out_d, out_i
        cols = mx.arange(self.size)
        for start, stop, qb in self._blocks(qc):
            dist, _ = self._block_distances(qb)
            if ex is not None:
                dist = mx.where(cols[None, :] == mx.array(ex[start:stop])[:, None], mx.inf, dist)
            if n_cand < self.size:
                cand = mx.argpartition(dist, kth=n_cand - 1, axis=1)[:, :n_cand]
            else:
                cand = mx.broadcast_to(cols[None, :], dist.shape)
            rows = np.arange(start, stop)
            self._rerank_into(qc, rows, np.array(cand).astype(np.int64), ex, out_d, out_i)
        out_i[~np.isfinite(out_d)] = -1
        return out_d, out_i

    # -- similarity q and d0 ------------------------------------------------------------------
    def _grouping(self, good_by_class: np.ndarray) -> _Grouping:
        cached = getattr(self, "_grouping_cache", None)
        if cached is None or not np.array_equal(cached.good_by_class, good_by_class):
            cached = self._grouping_cache = _Grouping(good_by_class, self._support, self._support_sq)
        return cached

    def similarity(self, queries, y_hat, good_by_class, k: int, exclude=None, tol: float = 4e-6):
        """Similarity q (``equation:q``) and d0 (input of ``equation:d``): (q [N] int64, d0 [N] float32)."""
        q, d0, _, _ = self.similarity_and_neighbours(queries, y_hat, good_by_class, k, 0, exclude, tol)
        return q, d0

    def similarity_and_neighbours(self, queries, y_hat, good_by_class, k: int, n: int, exclude=None,
                                  tol: float = 4e-6):
        """(q, d0, top-n squared distances, top-n indices) in one pass over the support (``equation:q``).

        The top-n neighbours are those of :meth:`search`, taken from the same distance blocks.

        The support columns are grouped so that, for queries predicted ŷ = c, the good
        neighbours (label = prediction = c) are one contiguous slice: the first bad
        neighbour's distance is a row-min over the other slices and q is a count over
        the good slice, with no sorting.  Rows where a good neighbour lies within the
        float32 error band of that distance (ties included) are resolved exactly in
        float64 on the host, ordered by (distance, support index).  d0 is recomputed in
        float64 for the nearest support vector.
        """
        qc = self._centre_queries(queries)
        ex = _exclusion(exclude, qc.shape[0])
        y_hat = np.asarray(y_hat, dtype=np.int64).reshape(-1)
        if y_hat.shape[0] != qc.shape[0]:
            raise ValueError("y_hat must hold one prediction per query")
        good_np = np.asarray(good_by_class, dtype=bool)
        if good_np.ndim != 2 or good_np.shape[1] != self.size:
            raise ValueError(f"good_by_class must be [C, {self.size}], got {good_np.shape}")
        if y_hat.size and (y_hat.min() < 0 or y_hat.max() >= good_np.shape[0]):
            raise ValueError(f"y_hat must lie in 0..{good_np.shape[0] - 1}")
        grouping = self._grouping(good_np)
        k_eff = max(0, min(int(k), self.size) - (1 if ex is not None else 0))
        q_out = np.zeros(qc.shape[0], dtype=np.int64)
        nearest_out = np.zeros(qc.shape[0], dtype=np.int64)
        n = max(0, int(n))
        n_cand = min(self.size, n + 8 + (1 if ex is not None else 0))
        top_d = np.full((qc.shape[0], n), np.inf, dtype=np.float32)
        top_i = np.full((qc.shape[0], n), -1, dtype=np.int64)
        tol_mx = mx.array(tol, dtype=mx.float32)
        inf = mx.array(float("inf"), dtype=mx.float32)
        cols = mx.arange(self.size)
        for c in range(good_np.shape[0]):
            rows_c = np.flatnonzero(y_hat == c)
            a, b = int(grouping.bounds[c]), int(grouping.bounds[c + 1])
            for start in range(0, rows_c.size, self.block_rows):
                rows = rows_c[start : start + self.block_rows]
                dist, q_sq = _squared_distances(mx.array(qc[rows]), grouping.support, grouping.support_sq)
                if ex is not None:
                    dist = mx.where(cols[None, :] == mx.array(grouping.inverse[ex[rows]])[:, None], inf, dist)
                first_bad = mx.full((rows.size,), float("inf"))
                if a > 0:
                    first_bad = mx.minimum(first_bad, dist[:, :a].min(axis=1))
                if b < self.size:
                    first_bad = mx.minimum(first_bad, dist[:, b:].min(axis=1))
                nearest = mx.argmin(dist, axis=1)
                if b > a:
                    count, ambiguous = _count_before_first_bad(
                        dist[:, a:b], first_bad, q_sq, grouping.support_sq[a:b], tol_mx
                    )
                else:
                    count, ambiguous = mx.zeros((rows.size,), mx.int32), mx.zeros((rows.size,), mx.bool_)
                cand = None
                if n > 0:
                    cand = mx.argpartition(dist, kth=n_cand - 1, axis=1)[:, :n_cand] if n_cand < self.size else None
                mx.eval(count, ambiguous, nearest, first_bad, *([cand] if cand is not None else []))
                if n > 0:
                    if cand is not None:
                        positions = np.array(cand)
                    else:
                        positions = np.broadcast_to(np.arange(self.size), (rows.size, self.size))
                    self._rerank_into(qc, rows, grouping.perm[positions], ex, top_d, top_i)
                q_out[rows] = np.array(count)
                nearest_out[rows] = grouping.perm[np.array(nearest)]
                for r in np.flatnonzero(np.array(ambiguous)):
                    q_out[rows[r]] = self._resolve_near_ties(
                        qc[rows[r]], np.array(dist[int(r)]), float(first_bad[int(r)].item()), a, b,
                        float(q_sq[int(r)].item()), grouping, tol,
                    )
        np.minimum(q_out, k_eff, out=q_out)
        diff = self._support_np[nearest_out].astype(np.float64) - qc.astype(np.float64)
        d0_out = np.einsum("ij,ij->i", diff, diff).astype(np.float32)
        top_i[~np.isfinite(top_d)] = -1
        return q_out, d0_out, top_d, top_i

    def _resolve_near_ties(self, qc_row, dist_row, first_bad, a, b, q_sq, grouping, tol) -> int:
        """Exact q for one query whose first-bad distance is within float32 error of a good neighbour's."""
        excluded = ~np.isfinite(dist_row)
        band = tol * (q_sq + grouping.support_sq_np) + 1e-30
        near = (np.abs(dist_row - first_bad) <= band) & ~excluded
        good = np.zeros(self.size, dtype=bool)
        good[a:b] = True
        clear = int((good & ~near & (dist_row < first_bad)).sum())
        cand = np.flatnonzero(near)  # permuted positions
        original = grouping.perm[cand]
        d64 = self._exact64(qc_row, original)
        order = np.lexsort((original, d64))
        run = good[cand[order]]
        first = np.flatnonzero(~run)
        return clear + (int(first[0]) if first.size else int(run.sum()))


class HnswIndex:
    """Approximate hnswlib support index for q and d (``equation:q``, ``equation:d``), same interface.

    Approximate: neighbours, and so q and d0, can differ from :class:`ExactIndex`.
    ``ef`` is raised to the number of neighbours requested at query time.
    """

    backend = "hnsw"

    def __init__(self, support, m: int = 16, ef_construction: int = 200, ef: int = 64, seed: int = 0, num_threads: int = -1):
        import hnswlib

        s = _as_float32_matrix(support, "support")
        if s.shape[0] == 0:
            raise ValueError("support set is empty")
        self.size, self.dim = s.shape
        self.ef = int(ef)
        self._index = hnswlib.Index(space="l2", dim=self.dim)
        self._index.init_index(max_elements=self.size, ef_construction=ef_construction, M=m, random_seed=seed)
        self._index.add_items(s, np.arange(self.size), num_threads=num_threads)
        self._num_threads = num_threads

    def _knn(self, queries, n: int) -> tuple[np.ndarray, np.ndarray]:
        qn = _as_float32_matrix(queries, "queries")
        if qn.shape[1] != self.dim:
            raise ValueError(f"queries have dimension {qn.shape[1]}, the support set has {self.dim}")
        n = min(n, self.size)
        self._index.set_ef(max(self.ef, n))
        labels, dist = self._index.knn_query(qn, k=n, num_threads=self._num_threads)
        labels = labels.astype(np.int64)
        return np.maximum(dist.astype(np.float32), 0.0), labels

    def _neighbours(self, queries, n: int, exclude) -> tuple[np.ndarray, np.ndarray]:
        n_req = n + (1 if exclude is not None else 0)
        dist, idx = self._knn(queries, n_req)
        if exclude is not None:
            keep = idx != np.asarray(exclude)[:, None]
            # drop the self match (or the last column if self was not found)
            drop_last = keep.all(axis=1)
            keep[drop_last, -1] = False
            dist = dist[keep].reshape(dist.shape[0], -1)
            idx = idx[keep].reshape(idx.shape[0], -1)
        # deterministic order among equal distances: by support index
        order = np.lexsort((idx, dist), axis=-1)
        return np.take_along_axis(dist, order, 1), np.take_along_axis(idx, order, 1)

    def search(self, queries, n: int, exclude=None) -> tuple[np.ndarray, np.ndarray]:
        """Top-n approximate nearest exemplars (neighbours of ``equation:q``): (squared distances, indices)."""
        qn = np.asarray(queries, dtype=np.float32)
        ex = _exclusion(exclude, qn.shape[0])
        avail = self.size - (1 if ex is not None else 0)
        dist, idx = self._neighbours(qn, min(n, avail), ex)
        out_d = np.full((qn.shape[0], n), np.inf, dtype=np.float32)
        out_i = np.full((qn.shape[0], n), -1, dtype=np.int64)
        out_d[:, : dist.shape[1]] = dist
        out_i[:, : idx.shape[1]] = idx
        return out_d, out_i

    def similarity(self, queries, y_hat, good_by_class, k: int, exclude=None):
        """Similarity q (``equation:q``) and d0 from the k approximate nearest neighbours (k − 1 if self-excluded)."""
        q, d0, _, _ = self.similarity_and_neighbours(queries, y_hat, good_by_class, k, 0, exclude)
        return q, d0

    def similarity_and_neighbours(self, queries, y_hat, good_by_class, k: int, n: int, exclude=None):
        """(q, d0, top-n distances, top-n indices) from one approximate k-NN query (``equation:q``)."""
        qn = np.asarray(queries, dtype=np.float32)
        ex = _exclusion(exclude, qn.shape[0])
        k_eff = max(0, min(int(k), self.size) - (1 if ex is not None else 0))
        n = max(0, int(n))
        dist, idx = self._neighbours(qn, max(k_eff, n, 1), ex)
        q = similarity_from_neighbours(idx[:, :k_eff], np.asarray(y_hat, dtype=np.int64),
                                       np.asarray(good_by_class, bool))
        top_d = np.full((qn.shape[0], n), np.inf, dtype=np.float32)
        top_i = np.full((qn.shape[0], n), -1, dtype=np.int64)
        m = min(n, dist.shape[1])
        top_d[:, :m], top_i[:, :m] = dist[:, :m], idx[:, :m]
        return q, dist[:, 0].astype(np.float32), top_d, top_i


def make_index(support, backend: str = "exact", **kwargs):
    """Build a support index: ``backend`` is ``"exact"`` (MLX) or ``"hnsw"`` (hnswlib)."""
    if backend == "exact":
        return ExactIndex(support, **kwargs)
    if backend == "hnsw":
        return HnswIndex(support, **kwargs)
    raise ValueError(f"unknown index backend {backend!r}; choose 'exact' or 'hnsw'")


def default_k(train_labels: np.ndarray, num_classes: int) -> int:
    """The paper's k: the largest per-class count in the training split."""
    counts = np.bincount(np.asarray(train_labels, dtype=np.int64), minlength=num_classes)
    return int(counts.max()) if counts.size else 0


__all__ = [
    "ExactIndex",
    "HnswIndex",
    "make_index",
    "default_k",
    "good_neighbours_by_class",
    "similarity_from_neighbours",
]
