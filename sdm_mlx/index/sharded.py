"""Exact support index sharded over the ranks of ``mlx.launch`` (``equation:q``, ``equation:d``).

Rank r of R holds the contiguous support rows ``shard_bounds(N, r, R)`` (their exemplar vectors;
labels and predictions enter through ``good_by_class``) in a local :class:`~sdm_mlx.index.ExactIndex`.
Every rank holds the same query batch (checked, not sent).  Per block of queries predicted ŷ = c:

1. each rank finds, exactly in float64, its shard's first *bad* neighbour (not label = prediction = c,
   self excluded) as (distance, global index), and its shard's top-n neighbours;
2. one ``all_gather`` merges both by (distance, global index) — the global first bad neighbour B
   and the global top-n (so d0 = the distance of the first);
3. each rank counts its good neighbours ordered before B, in float64 where float32 cannot tell;
   the counts are summed (``all_sum``) into q, capped at k (k − 1 with self-exclusion, DESIGN #5).

The results are those of :class:`~sdm_mlx.index.ExactIndex` over the whole support set bit for bit:
the same float64 distances of the same float32 vectors, the same (distance, support index) order,
self-exclusion by global index before the k cap, the same (inf, −1) padding.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..runtime import distributed as dist
from ..errors import SDMError
from .exact import DISTANCE_BLOCK_BYTES, ExactIndex
from .screening import _squared_distances
from ._arrays import _as_float32_matrix, _exclusion, check_predictions


class ShardedExactIndex:
    """:class:`~sdm_mlx.index.ExactIndex`'s interface over a support set split across the ranks.

    Build it on every rank with :meth:`from_full` (each rank keeps its slice) or with the local shard:
    ``ShardedExactIndex(shard, offset, total)``.  Every call must be made by every rank with the same
    arguments (the collectives run in lockstep); a rank that dies ends the others' call with
    :class:`~sdm_mlx.runtime.distributed.DistributedError`, one that hangs stops them after ``timeout`` seconds
    (:func:`sdm_mlx.runtime.distributed.wait`).
    """

    backend = "exact"

    def __init__(self, shard, offset: int, total: int, timeout: float | None = None,
                 block_bytes: int = DISTANCE_BLOCK_BYTES, group=None):
        self.group = group or dist.group()
        self.timeout = timeout
        s = _as_float32_matrix(shard, "support shard")
        self.offset, self.size = int(offset), int(total)
        self._check_layout(s.shape[0])
        self.local = ExactIndex(s, block_bytes)
        self.dim = self.local.dim
        self.block_rows = max(1, min(4096, block_bytes // (4 * self._max_shard)))

    @classmethod
    def from_full(cls, support, group=None, timeout: float | None = None, **kwargs) -> "ShardedExactIndex":
        """Every rank passes the whole support set (checked to be identical) and keeps its own slice."""
        grp = group or dist.group()
        s = _as_float32_matrix(support, "support")
        dist.check_same("support sets", s, timeout=timeout, grp=grp)
        start, stop = dist.shard_bounds(s.shape[0], grp.rank(), grp.size())
        return cls(s[start:stop].copy(), start, s.shape[0], timeout=timeout, group=grp, **kwargs)  # not a view

    def _check_layout(self, rows: int) -> None:
        """The shards must tile 0..total−1 in rank order, none empty."""
        n = self.group.size()
        if self.size < n:
            raise SDMError(f"a support set of {self.size} rows cannot be split over {n} ranks (one row at least each)")
        layout = dist.all_gather_rows(np.array([self.offset, rows, self.size], np.int64), "checking the shards",
                                      self.timeout, self.group)
        starts = np.concatenate([[0], np.cumsum(layout[:, 1])[:-1]])
        if (layout[:, 1] < 1).any() or (layout[:, 0] != starts).any() or (layout[:, 2] != self.size).any() \
                or layout[:, 1].sum() != self.size:
            raise SDMError(f"the shards (offset, rows, total) per rank {layout.tolist()} do not tile a support set "
                           f"of {self.size} rows in rank order")
        self._max_shard = int(layout[:, 1].max())

    def append(self, vectors) -> None:
        raise SDMError("the sharded support index cannot append rows: add support rows in a single process "
                       "(sdm-mlx add-support without mlx.launch)")

    def remove(self, positions) -> None:
        raise SDMError("the sharded support index cannot remove rows: remove support rows in a single process "
                       "(sdm-mlx add-support without mlx.launch)")

    # -- helpers -------------------------------------------------------------------------------
    def _local_exclusion(self, ex):
        """Global excluded indices → this shard's local indices (−1 where the row is elsewhere)."""
        if ex is None:
            return None
        local = ex - self.offset
        return np.where((local >= 0) & (local < self.local.size), local, -1)

    def _blocks(self, rows: np.ndarray):
        for start in range(0, rows.size, self.block_rows):
            yield rows[start : start + self.block_rows]

    def _distances(self, qc, rows, support, support_sq, ex_cols):
        """Float32 screening block [rows, shard] (self column → inf) and ‖q‖², evaluated."""
        dist_b, q_sq = _squared_distances(mx.array(qc[rows]), support, support_sq)
        if ex_cols is not None:
            cols = mx.arange(self.local.size)
            dist_b = mx.where(cols[None, :] == mx.array(ex_cols[rows])[:, None], mx.inf, dist_b)
        mx.eval(dist_b, q_sq)
        return dist_b, q_sq

    def _merge(self, d, i, what):
        return dist.merge_smallest(d, i, what, self.timeout, self.group)

    def _to_global(self, idx):
        return np.where(idx >= 0, idx + self.offset, -1)

    # -- top-n neighbours ------------------------------------------------------------------------
    def search(self, queries, n: int, exclude=None) -> tuple[np.ndarray, np.ndarray]:
        """Top-n nearest exemplars over all shards: (squared distances [N, n] float32, global indices [N, n])."""
        queries = self.local._check_queries(queries)
        ex = _exclusion(exclude, queries.shape[0])
        n = max(0, int(n))
        dist.check_same("query batches (search)", queries, np.array([n]), ex if ex is not None else np.zeros(0),
                        timeout=self.timeout, grp=self.group)
        top_d = np.full((queries.shape[0], n), np.inf, dtype=np.float64)
        top_i = np.full((queries.shape[0], n), -1, dtype=np.int64)
        if n == 0:
            return top_d.astype(np.float32), top_i
        ex_l = self._local_exclusion(ex)
        qc = queries - self.local._center
        identity = np.arange(self.local.size)
        for rows in self._blocks(np.arange(queries.shape[0])):
            dist_b, q_sq = self._distances(qc, rows, self.local._support, self.local._support_sq, ex_l)
            self.local._top_into(queries, rows, dist_b, q_sq, self.local._support_sq, identity,
                                 ex=ex_l, out=(top_d, top_i))
        top_d, top_i = self._merge(top_d, self._to_global(top_i), "merging the top-n neighbours")
        top_i[~np.isfinite(top_d)] = -1
        return top_d.astype(np.float32), top_i

    # -- similarity q and d0 ------------------------------------------------------------------
    def similarity(self, queries, y_hat, good_by_class, k: int, exclude=None):
        """Similarity q (``equation:q``) and d0 (input of ``equation:d``): (q [N] int64, d0 [N] float32)."""
        q, d0, _, _ = self.similarity_and_neighbours(queries, y_hat, good_by_class, k, 0, exclude)
        return q, d0

    def _check_similarity_args(self, queries, y_hat, good_by_class, exclude):
        queries = self.local._check_queries(queries)
        y_hat, good_np = check_predictions(queries, y_hat, good_by_class, self.size)
        return queries, y_hat, good_np, _exclusion(exclude, queries.shape[0])

    def similarity_and_neighbours(self, queries, y_hat, good_by_class, k: int, n: int, exclude=None, *,
                                  check_input: bool = True):
        """(q, d0, top-n squared distances, top-n global indices), as :meth:`ExactIndex.similarity_and_neighbours`
        (``check_input=False`` skips the local checks; the ranks still check that they hold the same batch)."""
        if check_input:
            queries, y_hat, good_np, ex = self._check_similarity_args(queries, y_hat, good_by_class, exclude)
        else:
            good_np, ex = good_by_class, _exclusion(exclude, queries.shape[0])
        n = max(0, int(n))
        dist.check_same("query batches (similarity)", queries, y_hat, good_np, np.array([k, n]),
                        ex if ex is not None else np.zeros(0), timeout=self.timeout, grp=self.group)
        ex_l = self._local_exclusion(ex)
        start, stop = self.offset, self.offset + self.local.size
        grouping = self.local._grouping(np.ascontiguousarray(good_np[:, start:stop]))
        ex_cols = None if ex_l is None else np.where(ex_l >= 0, grouping.inverse[np.maximum(ex_l, 0)], -1)
        qc = queries - self.local._center
        count = np.zeros(queries.shape[0], dtype=np.int64)
        top_d = np.full((queries.shape[0], max(n, 1)), np.inf, dtype=np.float64)
        top_i = np.full((queries.shape[0], max(n, 1)), -1, dtype=np.int64)
        for c in range(good_np.shape[0]):
            for rows in self._blocks(np.flatnonzero(y_hat == c)):
                dist_b, q_sq = self._distances(qc, rows, grouping.support, grouping.support_sq, ex_cols)
                bad_d, bad_i = self._first_bad(queries, rows, dist_b, q_sq, grouping, c, ex_l=ex_l)
                self.local._top_into(queries, rows, dist_b, q_sq, grouping.support_sq, grouping.perm, ex=ex_l,
                                     out=(top_d, top_i))
                both_d = np.concatenate([bad_d[:, None], top_d[rows]], axis=1)
                both_i = np.concatenate([bad_i[:, None], self._to_global(top_i[rows])], axis=1)
                packed_d, packed_i = self._merge_block(both_d, both_i)
                top_d[rows], top_i[rows] = packed_d[:, 1:], packed_i[:, 1:]
                count[rows] = self._count_before(queries, rows, dist_b, q_sq, grouping, c,
                                                 bound_d=packed_d[:, 0], bound_i=packed_i[:, 0])
        q = dist.all_sum(count, "summing q over the shards", self.timeout, self.group)
        k_eff = max(0, min(int(k), self.size) - (1 if ex is not None else 0))
        np.minimum(q, k_eff, out=q)
        top_i[~np.isfinite(top_d)] = -1
        d0 = top_d[:, 0].astype(np.float32)
        return q, d0, top_d[:, :n].astype(np.float32), top_i[:, :n].copy()

    def _merge_block(self, both_d, both_i):
        """Merge column 0 (first bad) and columns 1: (top-n) of a block separately, in one all_gather."""
        every = dist.all_gather_rows(np.stack([both_d.view(np.int64), both_i]), "merging a query block",
                                     self.timeout, self.group)  # [R, 2, b, 1 + n]
        d = every[:, 0].view(np.float64)
        i = every[:, 1]
        side = lambda a, cols: np.concatenate(list(a[:, :, cols]), axis=1)  # noqa: E731  [b, R·width]
        bad_d, bad_i = dist.smallest_pairs(side(d, slice(0, 1)), side(i, slice(0, 1)), 1)
        top_d, top_i = dist.smallest_pairs(side(d, slice(1, None)), side(i, slice(1, None)), both_d.shape[1] - 1)
        return np.concatenate([bad_d, top_d], 1), np.concatenate([bad_i, top_i], 1)

    def _first_bad(self, queries, rows, dist_b, q_sq, grouping, c, *, ex_l):
        """This shard's first bad neighbour per row (exact float64 distance, global index; (inf, −1): none).

        Bad = not good for c (the columns outside G_c); the float32 screen and float64 re-rank are
        ExactIndex's top-1 over those columns only.
        """
        a, b = int(grouping.bounds[c]), int(grouping.bounds[c + 1])
        out_d = np.full((queries.shape[0], 1), np.inf)
        out_i = np.full((queries.shape[0], 1), -1, dtype=np.int64)
        if a == 0 and b == self.local.size:
            return out_d[rows, 0], out_i[rows, 0]
        cols = np.concatenate([np.arange(a), np.arange(b, self.local.size)])
        cols_mx = mx.array(cols)
        bad = dist_b[:, cols_mx]
        finite = np.array(mx.isfinite(bad.min(axis=1)))
        if finite.any():
            keep = mx.array(np.flatnonzero(finite))
            self.local._top_into(queries, rows[finite], bad[keep], q_sq[keep], grouping.support_sq[cols_mx],
                                 grouping.perm[cols], ex=ex_l, out=(out_d, out_i))
        return out_d[rows, 0], self._to_global(out_i[rows, 0])

    def _count_before(self, queries, rows, dist_b, q_sq, grouping, c, *, bound_d, bound_i) -> np.ndarray:
        """Per row, this shard's good neighbours (G_c, self excluded) ordered before (bound_d, bound_i).

        Float32 decides where the gap to the bound exceeds the screening band (``screening_tolerance``
        plus the rounding of the bound to float32); the rest is compared exactly in float64.
        """
        a, b = int(grouping.bounds[c]), int(grouping.bounds[c + 1])
        if a == b:
            return np.zeros(rows.size, dtype=np.int64)
        local = self.local
        finite = np.isfinite(bound_d)
        bound32 = np.where(finite, bound_d, np.finfo(np.float32).max).astype(np.float32)
        slack = np.where(finite, np.abs(bound32) * 2.0**-21, 0.0).astype(np.float32) + 1e-30
        good = dist_b[:, a:b]
        band = local._tau * (2.0 * q_sq[:, None] + grouping.support_sq[a:b][None, :] + local._max_support_sq) + 1e-30
        bound_mx = mx.array(bound32)[:, None]
        near = mx.abs(good - bound_mx) <= band + mx.array(slack)[:, None]
        clear = ((good < bound_mx) & ~near).sum(axis=1)
        any_near = near.any(axis=1)
        mx.eval(clear, any_near)
        count = np.array(clear).astype(np.int64)
        hard = np.flatnonzero(np.array(any_near))
        if hard.size:
            rr, jj = np.nonzero(np.array(near[mx.array(hard)]))
            r = hard[rr]
            idx = grouping.perm[a + jj]
            d64 = self._pair_distances(queries[rows[r]], idx)
            gi = idx + self.offset
            before = (d64 < bound_d[r]) | ((d64 == bound_d[r]) & (gi < np.where(bound_i[r] < 0, np.inf, bound_i[r])))
            np.add.at(count, r, before.astype(np.int64))
        return count

    def _pair_distances(self, query_rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """float64 squared distances of pairs (query_rows[p], local support idx[p]), in bounded chunks."""
        out = np.empty(idx.shape[0], dtype=np.float64)
        step = max(1, self.local.RERANK_BYTES // (8 * self.dim))
        for s in range(0, idx.shape[0], step):
            out[s : s + step] = self.local._exact64(query_rows[s : s + step], idx[s : s + step])
        return out


def make_sharded_or_local(support, shard: bool = True, timeout: float | None = None, **kwargs):
    """The exact index for ``support``: sharded over the ranks under ``mlx.launch`` (``shard`` and more than
    one rank), else a local :class:`~sdm_mlx.index.ExactIndex`."""
    if shard and dist.is_distributed():
        return ShardedExactIndex.from_full(support, timeout=timeout, **kwargs)
    return ExactIndex(support, **kwargs)


__all__ = ["ShardedExactIndex", "make_sharded_or_local"]
