"""Approximate support index: hnswlib's HNSW graph behind the :class:`~sdm_mlx.index.ExactIndex` interface.

Opt-in (``make_index(..., backend="hnsw")``) for large support sets: its neighbours, and
therefore the Similarity q (``equation:q``) and d0, may differ from the exact index's.
hnswlib is imported only when an index is built.
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError
from ._arrays import _as_float32_matrix, _exclusion, _kept, similarity_from_neighbours


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
            raise InputError("support set is empty")
        self.size, self.dim = s.shape
        self.ef = int(ef)
        self._index = hnswlib.Index(space="l2", dim=self.dim)
        self._index.init_index(max_elements=self.size, ef_construction=ef_construction, M=m, random_seed=seed)
        self._index.add_items(s, np.arange(self.size), num_threads=num_threads)
        self._num_threads = num_threads
        self._label_of_pos = np.arange(self.size, dtype=np.int64)  # hnswlib label of each support index
        self._pos_of_label = np.arange(self.size, dtype=np.int64)  # support index of each label (−1: deleted)

    def append(self, vectors) -> None:
        """Append support rows with ``add_items`` (after ``resize_index`` when full): the graph is not rebuilt."""
        v = _as_float32_matrix(vectors, "appended support")
        if v.shape[1] != self.dim:
            raise InputError(f"appended support has dimension {v.shape[1]}, the support set has {self.dim}")
        n = v.shape[0]
        first = self._pos_of_label.shape[0]
        labels = np.arange(first, first + n, dtype=np.int64)
        needed = self._index.element_count + n
        if needed > self._index.get_max_elements():
            self._index.resize_index(max(needed, 2 * self._index.get_max_elements()))
        self._index.add_items(v, labels, num_threads=self._num_threads)
        self._label_of_pos = np.concatenate([self._label_of_pos, labels])
        self._pos_of_label = np.concatenate([self._pos_of_label, np.arange(self.size, self.size + n)])
        self.size += n

    def remove(self, positions) -> None:
        """Remove support rows by index with ``mark_deleted`` (later rows move up); no rebuild."""
        keep = _kept(positions, self.size)
        for label in self._label_of_pos[~keep]:
            self._index.mark_deleted(int(label))
        self._label_of_pos = self._label_of_pos[keep]
        self._pos_of_label[:] = -1
        self._pos_of_label[self._label_of_pos] = np.arange(self._label_of_pos.shape[0])
        self.size = int(self._label_of_pos.shape[0])

    def _check_queries(self, queries) -> np.ndarray:
        qn = _as_float32_matrix(queries, "queries")
        if qn.shape[1] != self.dim:
            raise InputError(f"queries have dimension {qn.shape[1]}, the support set has {self.dim}")
        return qn

    def _knn(self, qn: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """hnswlib's k-NN of checked queries (finite float32 [N, dim])."""
        n = min(n, self.size)
        self._index.set_ef(max(self.ef, n))
        labels, dist = self._index.knn_query(qn, k=n, num_threads=self._num_threads)
        labels = self._pos_of_label[labels.astype(np.int64)]
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
        qn = self._check_queries(queries)
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

    def similarity_and_neighbours(self, queries, y_hat, good_by_class, k: int, n: int, exclude=None, *,
                                  check_input: bool = True):
        """(q, d0, top-n distances, top-n indices) from one approximate k-NN query (``equation:q``).

        ``check_input=False``: ``queries`` finite float32 [N, dim], made by the caller (not checked again)."""
        qn = self._check_queries(queries) if check_input else queries
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
