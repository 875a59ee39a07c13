"""The exact support index: :class:`ExactIndex`, float32 screening by tiled MLX matmuls with provable error
bands (:mod:`.screening`), and float64 re-ranking on the host (the package docstring, :mod:`sdm_mlx.index`,
says how q is defined).  This module holds the index's bookkeeping: the support rows and their appends and
removals, the grouping of the support columns by class, the query blocks, and the exact float64 answers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import InputError
from ._arrays import _as_float32_matrix, _exclusion, _kept, check_predictions
from .screening import (  # noqa: F401  (HOST_*, screening_tolerance: re-exported, callers find them here too)
    HOST_MATMUL_MULTIPLY_ADDS,
    HOST_MATMUL_PRODUCTS,
    HOST_SCREEN_ELEMENTS,
    _count_before_first_bad,
    _evaluate,
    _excluded_inf,
    _hard_positions,
    _host_view,
    _screen_top,
    _squared_distances,
    _xp,
    screening_tolerance,
)

#: Bytes the exact index may use for one block of query × support distances.
DISTANCE_BLOCK_BYTES = 256 * 1024 * 1024


class _Grouping:
    """Support columns permuted into contiguous groups G_0 … G_{C−1}, then the incorrect rows.

    G_c holds the support rows that count towards q of class c (label = prediction = c).
    Within a group the original order is kept, so ties stay ordered by support index.
    """

    def __init__(self, good_by_class: np.ndarray, support: mx.array, support_sq: mx.array):
        num_classes, n = good_by_class.shape
        if (good_by_class.sum(axis=0) > 1).any():
            raise InputError("good_by_class must mark each support row good for at most one class")
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
        self.support_host = _host_view(self.support)  # a NumPy view for host screening
        self.seen = None  # the read-only mask last checked equal to good_by_class (ExactIndex._grouping)


class ExactIndex:
    """Exact squared-L2 support index for q and d (``equation:q``, ``equation:d``), tiled MLX matmuls.

    Results depend only on float64 distances of the float32 vectors (computed per pair, in a
    fixed order, on the host), so a query's q, d0 and neighbours are bit-identical alone or in
    any batch: float32 MLX matmuls only *screen* candidates, with bands that provably contain
    every float64 answer (:func:`screening_tolerance`).  Exact ties are ordered by support index.

    Parameters
    ----------
    support : [N_s, M] float array of exemplar vectors.
    block_bytes : memory budget for one query-block × support distance matrix.
    """

    backend = "exact"

    #: Bytes of float64 differences one re-ranking chunk may hold: small enough to stay in the L2/L3 cache
    #: (2 MB: 3.6x less CPU than 64 MB with the float64 support copy, bit for bit the same, docs/performance.md).
    RERANK_BYTES = 2 * 1024 * 1024
    #: The support is kept as a float64 copy for the re-ranking up to this many bytes (a gather of float64 rows
    #: instead of a gather of float32 rows and a conversion); above it the rows are converted per chunk.
    FLOAT64_SUPPORT_BYTES = 256 * 1024 * 1024

    def __init__(self, support, block_bytes: int = DISTANCE_BLOCK_BYTES):
        s = _as_float32_matrix(support, "support")
        if s.shape[0] == 0:
            raise InputError("support set is empty")
        self.size, self.dim = s.shape
        self._raw = s  # float64 distances are taken between these uncentred float32 vectors
        self._center = s[0].copy()
        self._support = mx.array(s - self._center)  # centring keeps the float32 screening accurate
        self._support_sq = (self._support * self._support).sum(axis=1)
        self._max_support_sq = float(self._support_sq.max().item())
        self._tau = screening_tolerance(self.dim)
        self._block_bytes = block_bytes
        self.block_rows = max(1, min(4096, block_bytes // (4 * self.size)))

    # -- appends and removals (support-set feedback) -------------------------------------------
    def append(self, vectors) -> None:
        """Append support rows in place (their indices continue from ``size``); no rebuild.

        The centring row (support row 0) is kept, so every existing row's centred float32 vector and
        every float64 result are unchanged; the screening bands widen with the new max ‖s_c‖².
        """
        v = _as_float32_matrix(vectors, "appended support")
        if v.shape[1] != self.dim:
            raise InputError(f"appended support has dimension {v.shape[1]}, the support set has {self.dim}")
        vc = mx.array(v - self._center)
        vc_sq = (vc * vc).sum(axis=1)
        self._raw = np.concatenate([self._raw, v])
        self._support = mx.concatenate([self._support, vc])
        self._support_sq = mx.concatenate([self._support_sq, vc_sq])
        mx.eval(self._support, self._support_sq)
        if v.shape[0]:
            self._max_support_sq = max(self._max_support_sq, float(vc_sq.max().item()))
        self._resized()

    def remove(self, positions) -> None:
        """Remove support rows by index (later rows move up); row 0, the centring row, cannot be removed."""
        keep = _kept(positions, self.size)
        self._raw = self._raw[keep]
        keep_mx = mx.array(np.flatnonzero(keep))
        self._support = self._support[keep_mx]
        self._support_sq = self._support_sq[keep_mx]
        mx.eval(self._support, self._support_sq)
        self._max_support_sq = float(self._support_sq.max().item())
        self._resized()

    def _on_host(self, block_rows: int) -> bool:
        """Screen this block with NumPy (:data:`HOST_SCREEN_ELEMENTS`): MLX on the CPU, or a small block."""
        return mx.default_device() == mx.cpu or block_rows * self.size <= HOST_SCREEN_ELEMENTS

    def _support_blocks(self, host: bool) -> tuple:
        """(support, ‖s‖², support view) arguments of :func:`_squared_distances` (NumPy ‖s‖² and view: host)."""
        if not host:
            return self._support, self._support_sq, None
        cached = getattr(self, "_support_host", None)
        if cached is None:
            cached = self._support_host = (self._support, np.array(self._support_sq), _host_view(self._support))
        return cached

    def _resized(self) -> None:
        self.size = self._raw.shape[0]
        self.block_rows = max(1, min(4096, self._block_bytes // (4 * self.size)))
        self._grouping_cache = None
        self._support_host = None

    # -- distances -----------------------------------------------------------------------------
    def _check_queries(self, queries) -> np.ndarray:
        qn = _as_float32_matrix(queries, "queries")
        if qn.shape[1] != self.dim:
            raise InputError(f"queries have dimension {qn.shape[1]}, the support set has {self.dim}")
        return qn

    def _exact64(self, query: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """float64 squared distances between float32 ``query`` rows [..., dim] and support rows ``idx``.

        One fixed-order reduction per pair: the value depends on the two vectors alone.
        """
        raw64 = getattr(self, "_raw64", None)
        if raw64 is None or raw64[0] is not self._raw:
            keep = self._raw.size * 8 <= self.FLOAT64_SUPPORT_BYTES
            raw64 = self._raw64 = (self._raw, self._raw.astype(np.float64) if keep else None)
        if raw64[1] is None:
            diff = self._raw[idx].astype(np.float64)
        else:
            diff = raw64[1][idx]  # a gathered copy
        diff -= query  # float32 → float64 exactly, then the same subtraction
        np.square(diff, out=diff)
        return diff.sum(axis=-1)

    def _rerank_into(self, queries, rows, cand, ex, *, out: tuple, counts=None) -> None:
        """Exact float64 ordering by (distance, index) of the candidate indices ``cand`` [len(rows), c] (of each row
        only the first ``counts[i]``, the rest padding; None: all c); writes the best ``out[0].shape[1]`` into
        ``out`` = (distances, indices) at ``rows``.  The float64 distances of the (query, candidate) pairs are
        computed in cache-sized chunks of pairs."""
        out_d, out_i = out
        width = np.arange(cand.shape[1])[None, :]
        valid = np.broadcast_to(True, cand.shape) if counts is None else width < counts[:, None]
        at, slot = np.nonzero(valid)
        idx = np.where(valid, cand, self.size)  # padding: after every support index and every distance
        d64 = np.full(cand.shape, np.inf)
        flat = np.empty(at.size)
        step = max(1, self.RERANK_BYTES // (8 * self.dim))
        for c0 in range(0, at.size, step):
            pairs = at[c0 : c0 + step]
            flat[c0 : c0 + step] = self._exact64(queries[rows[pairs]], idx[pairs, slot[c0 : c0 + step]])
        d64[at, slot] = flat
        if ex is not None:
            d64[idx == ex[rows, None]] = np.inf
        order = np.lexsort((idx, d64), axis=-1)[:, : out_d.shape[1]]
        at = np.arange(order.shape[0])[:, None]  # (take_along_axis without its per-call index building)
        out_d[rows, : order.shape[1]] = d64[at, order]
        out_i[rows, : order.shape[1]] = idx[at, order]

    def _top_into(self, queries, rows, dist, q_sq, col_sq, perm, *, ex, out: tuple) -> None:
        """Exact top-n (n = ``out[0].shape[1]``) of a distance block whose column j is support ``perm[j]``, written
        into ``out`` = (distances, indices), the caller's [N, n] buffers."""
        out_d, out_i = out
        n = out_d.shape[1]
        if n + (8 if n > 1 else 0) >= self.size:
            every = np.broadcast_to(np.arange(self.size), (rows.size, self.size))
            self._rerank_into(queries, rows, perm[every], ex, out=out)
            return
        key, first, count = _screen_top(dist, q_sq, col_sq, self._max_support_sq, n, self._tau)
        easy = count <= first.shape[1]
        if isinstance(key, np.ndarray) and first.shape[1] > 1:  # the screened columns first: re-rank only those
            first = np.take_along_axis(first, np.argsort(np.take_along_axis(key, first, axis=1), axis=1), axis=1)
            rerank = lambda at: self._rerank_into(queries, rows[at], perm[first[at]], ex, out=out,  # noqa: E731
                                                  counts=count[at])
        else:
            rerank = lambda at: self._rerank_into(queries, rows[at], perm[first[at]], ex, out=out)  # noqa: E731
        if easy.all():  # (the usual case: no row has more near-tied candidates than screened)
            rerank(slice(None))
            return
        rerank(easy)
        hard = np.flatnonzero(~easy)  # rows with more near-tied candidates (e.g. duplicates)
        if hard.size:
            c = int(count[hard].max())
            if c >= self.size:
                positions = np.broadcast_to(np.arange(self.size), (hard.size, self.size))
            else:
                positions = _hard_positions(key, hard, c)
            self._rerank_into(queries, rows[hard], perm[positions], ex, out=out)

    # -- top-n neighbours ---------------------------------------------------------------------
    def search(self, queries, n: int, exclude=None) -> tuple[np.ndarray, np.ndarray]:
        """Top-n nearest exemplars (the neighbours of ``equation:q``): (squared distances [N, n], indices [N, n]).

        Ordered by (float64 distance, support index), distances rounded to float32 at the end.
        ``exclude[i]`` (a support index, or −1) is left out for query i.  Fewer than n available ⇒
        padded with (inf, −1).
        """
        queries = self._check_queries(queries)
        ex = _exclusion(exclude, queries.shape[0])
        n = max(0, int(n))
        top_d = np.full((queries.shape[0], n), np.inf, dtype=np.float64)
        top_i = np.full((queries.shape[0], n), -1, dtype=np.int64)
        if n == 0:
            return top_d.astype(np.float32), top_i
        qc = queries - self._center
        cols = mx.arange(self.size)
        identity = np.arange(self.size)
        for start in range(0, qc.shape[0], self.block_rows):
            rows = np.arange(start, min(start + self.block_rows, qc.shape[0]))
            host = self._on_host(rows.size)
            support = self._support_blocks(host)
            dist, q_sq = _squared_distances(qc[rows] if host else mx.array(qc[rows]), *support)
            if ex is not None:
                dist = _excluded_inf(dist, ex[rows], cols)
            _evaluate(dist, q_sq)
            self._top_into(queries, rows, dist, q_sq, support[1], identity, ex=ex, out=(top_d, top_i))
        top_i[~np.isfinite(top_d)] = -1
        return top_d.astype(np.float32), top_i

    # -- similarity q and d0 ------------------------------------------------------------------
    def _grouping(self, good_by_class: np.ndarray) -> _Grouping:
        cached = getattr(self, "_grouping_cache", None)
        if cached is not None and good_by_class is cached.seen:
            return cached  # the same read-only mask as last time (the estimator keeps one per support set)
        if cached is None or not np.array_equal(cached.good_by_class, good_by_class):
            cached = self._grouping_cache = _Grouping(good_by_class, self._support, self._support_sq)
        # a mask that owns its data and is read-only cannot change: the next call may skip the comparison
        cached.seen = good_by_class if not good_by_class.flags.writeable and good_by_class.base is None else None
        return cached

    def similarity(self, queries, y_hat, good_by_class, k: int, exclude=None):
        """Similarity q (``equation:q``) and d0 (input of ``equation:d``): (q [N] int64, d0 [N] float32)."""
        q, d0, _, _ = self.similarity_and_neighbours(queries, y_hat, good_by_class, k, 0, exclude)
        return q, d0

    def _check_similarity_args(self, queries, y_hat, good_by_class):
        queries = self._check_queries(queries)
        return (queries, *check_predictions(queries, y_hat, good_by_class, self.size))

    def similarity_and_neighbours(self, queries, y_hat, good_by_class, k: int, n: int, exclude=None, *,
                                  check_input: bool = True):
        """(q, d0, top-n squared distances, top-n indices) in one pass over the support (``equation:q``).

        ``check_input=False`` skips the checks of arrays the caller made itself (the estimator's): ``queries``
        finite float32 [N, dim], ``y_hat`` int64 [N] in 0..C−1, ``good_by_class`` bool [C, size].

        The top-n neighbours are those of :meth:`search`, taken from the same distance blocks,
        and d0 is the float64 distance of the first of them (rounded to float32): d0 ==
        top-n distances[:, 0] whenever n ≥ 1.

        The support columns are grouped so that, for queries predicted ŷ = c, the good
        neighbours (label = prediction = c) are one contiguous slice: the first bad
        neighbour's distance is a row-min over the other slices and q is a count over
        the good slice, with no sorting.  Rows where a good neighbour lies within the
        float32 error band of that distance (ties included) are resolved exactly in
        float64 on the host, ordered by (distance, support index).
        """
        if check_input:
            queries, y_hat, good_np = self._check_similarity_args(queries, y_hat, good_by_class)
        else:
            good_np = good_by_class
        ex = _exclusion(exclude, queries.shape[0])
        qc = queries - self._center
        grouping = self._grouping(good_np)
        k_eff = max(0, min(int(k), self.size) - (1 if ex is not None else 0))
        n = max(0, int(n))
        q_out = np.zeros(queries.shape[0], dtype=np.int64)
        top_d = np.full((queries.shape[0], max(n, 1)), np.inf, dtype=np.float64)
        top_i = np.full((queries.shape[0], max(n, 1)), -1, dtype=np.int64)
        cols = None if ex is None else mx.arange(self.size)
        for c, count in enumerate(np.bincount(y_hat, minlength=good_np.shape[0]).tolist()):
            if not count:
                continue
            rows_c = np.arange(count) if count == y_hat.size else np.flatnonzero(y_hat == c)
            for start in range(0, rows_c.size, self.block_rows):
                rows = rows_c[start : start + self.block_rows]
                host = self._on_host(rows.size)
                support = ((grouping.support, grouping.support_sq_np, grouping.support_host) if host
                           else (grouping.support, grouping.support_sq, None))
                dist, q_sq = _squared_distances(qc[rows] if host else mx.array(qc[rows]), *support)
                if ex is not None:
                    ex_cols = np.where(ex[rows] >= 0, grouping.inverse[ex[rows]], -1)  # −1: nothing excluded
                    dist = _excluded_inf(dist, ex_cols, cols)
                _evaluate(dist, q_sq)  # once: the q count and the top-n screening both read it
                q_out[rows] = self._block_similarity(queries, rows, dist, q_sq, grouping, c)
                self._top_into(queries, rows, dist, q_sq, support[1], grouping.perm, ex=ex, out=(top_d, top_i))
        np.minimum(q_out, k_eff, out=q_out)
        top_i[~np.isfinite(top_d)] = -1
        d0 = top_d[:, 0].astype(np.float32)
        return q_out, d0, top_d[:, :n].astype(np.float32), top_i[:, :n].copy()

    def _block_similarity(self, queries, rows, dist, q_sq, grouping, c) -> np.ndarray:
        """Uncapped q of one block of queries predicted c: float32 count, exact where ambiguous."""
        a, b = int(grouping.bounds[c]), int(grouping.bounds[c + 1])
        xp = _xp(dist)
        # the nearest bad neighbour: the row-min over the columns outside the good group (inf: none)
        sides = ([dist[:, :a].min(axis=1)] if a > 0 else []) + ([dist[:, b:].min(axis=1)] if b < self.size else [])
        if len(sides) == 2:
            first_bad = xp.minimum(*sides)
        else:
            first_bad = sides[0] if sides else xp.full((rows.size,), float("inf"), dtype=xp.float32)
        if b == a:
            return np.zeros(rows.size, dtype=np.int64)
        good_sq = grouping.support_sq_np[a:b] if xp is np else grouping.support_sq[a:b]
        count, ambiguous = _count_before_first_bad(
            dist[:, a:b], first_bad, q_sq, good_sq, self._tau, self._max_support_sq
        )
        _evaluate(count, ambiguous, first_bad)
        q = np.asarray(count).astype(np.int64)
        tied = np.flatnonzero(np.asarray(ambiguous))
        if tied.size:
            tied_dist = np.asarray(dist[tied if xp is np else mx.array(tied)])
            q[tied] = self._resolve_near_ties(queries[rows[tied]], tied_dist, np.asarray(first_bad)[tied], a, b,
                                              np.asarray(q_sq)[tied], grouping=grouping)
        return q

    def _resolve_near_ties(self, query, dist, first_bad, a, b, q_sq, *, grouping) -> np.ndarray:
        """Exact q for queries [r, dim] whose first-bad distance is within float32 error of a good neighbour's
        (``dist`` [r, size] their distance rows, permuted columns): the near-tied columns of every row (a few, of
        2,000) are ordered by (float64 distance, support index), padded to the row with the most."""
        band = self._tau * (2.0 * q_sq[:, None] + grouping.support_sq_np[None, :] + self._max_support_sq) + 1e-30
        near = (np.abs(dist - first_bad[:, None]) <= band) & np.isfinite(dist)
        clear = (~near[:, a:b] & (dist[:, a:b] < first_bad[:, None])).sum(axis=1)
        row, col = np.nonzero(near)  # row-major: each row's near columns in order
        counts = np.bincount(row, minlength=dist.shape[0])
        slot = np.arange(row.size) - np.repeat(np.cumsum(counts) - counts, counts)
        cand = np.full((dist.shape[0], max(int(counts.max()), 1)), -1, dtype=np.int64)  # permuted positions
        cand[row, slot] = col
        original = np.full(cand.shape, self.size, dtype=np.int64)  # padding: after every support index …
        original[row, slot] = grouping.perm[col]
        d64 = np.full(cand.shape, np.inf)  # … and every distance
        flat = np.empty(row.size)
        step = max(1, self.RERANK_BYTES // (8 * self.dim))
        for c0 in range(0, row.size, step):  # the (query, candidate) pairs, unpadded
            flat[c0 : c0 + step] = self._exact64(query[row[c0 : c0 + step]], original[row[c0 : c0 + step],
                                                                                       slot[c0 : c0 + step]])
        d64[row, slot] = flat
        order = np.lexsort((original, d64), axis=-1)
        ranked = np.take_along_axis(cand, order, axis=1)
        bad = (ranked >= 0) & ((ranked < a) | (ranked >= b))
        good_run = ((ranked >= a) & (ranked < b)).sum(axis=1)
        return clear + np.where(bad.any(axis=1), bad.argmax(axis=1), good_run)


__all__ = ["ExactIndex", "screening_tolerance"]
