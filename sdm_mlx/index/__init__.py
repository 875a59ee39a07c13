"""Support index over training exemplar vectors h', and the Similarity q.

Two interchangeable backends share one small interface:

* :class:`ExactIndex` (default, :mod:`.exact`) — float32 squared L2 by tiled MLX matmuls,
  ``‖a‖² + ‖b‖² − 2a·bᵀ`` after centring every vector on support row 0, used
  only to screen candidates with provable error bands; q, d0 and the neighbours
  come from float64 distances re-computed per pair on the host, ordered by
  (distance, support index), so they do not depend on the batch.
* :class:`HnswIndex` (:mod:`.hnsw`) — hnswlib HNSW graph (approximate, opt-in, for large
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

Modules: :mod:`._arrays` (array checks, q from neighbour lists; the leaf every backend imports),
:mod:`.screening` (the exact index's float32 screening and its error bands), :mod:`.exact`, :mod:`.hnsw`,
:mod:`.dense` (the float32 index of the training epochs),
:mod:`.sharded` (the exact index split over the ranks of ``mlx.launch``).
Only this ``__init__`` (:func:`make_index`) imports the backends.

May import: layers 0-1 (:mod:`sdm_mlx.errors`, :mod:`sdm_mlx.runtime`, :mod:`sdm_mlx.storage`).  The backends
are imported on first use (PEP 562).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .._lazy import lazy_exports
from ..errors import InputError

_EXPORTS = {"ExactIndex": "exact", "HnswIndex": "hnsw", "ShardedExactIndex": "sharded", "DenseIndex": "dense",
            "good_neighbours_by_class": "_arrays", "similarity_from_neighbours": "_arrays"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


class SupportIndex(Protocol):
    """What the estimator needs of a support index (every backend has it)."""

    def search(self, queries, n: int, exclude=None) -> tuple[np.ndarray, np.ndarray]:
        """(squared distances [N, n], support indices [N, n]) of the top-n neighbours, nearest first."""

    def similarity(self, queries, y_hat, good_by_class, k: int, exclude=None) -> tuple[np.ndarray, np.ndarray]:
        """(q [N], d0 [N]): the Similarity (``equation:q``) and the squared distance to the nearest support."""

    def similarity_and_neighbours(self, queries, y_hat, good_by_class, k: int, n: int, exclude=None, *,
                                  check_input: bool = True) -> tuple:
        """(q, d0, top-n squared distances, top-n indices) in one query.  Checked at this boundary unless
        ``check_input=False``: then ``queries`` are finite float32 [N, dim], ``y_hat`` int64 [N] in 0..C−1 and
        ``good_by_class`` bool [C, size], as the estimator makes them."""


def make_index(support, backend: str = "exact", shard: bool = False, shard_timeout: float | None = None, **kwargs):
    """Build a support index: ``backend`` is ``"exact"`` (MLX) or ``"hnsw"`` (hnswlib); ``"dense"`` is the float32
    index of Alg. 1's epochs (:mod:`.dense`: not batch-invariant, never stored).

    ``shard``: under ``mlx.launch`` with more than one rank, the exact index is split over the ranks
    (:class:`sdm_mlx.index.sharded.ShardedExactIndex`, same results); ignored in a single process.
    """
    if backend == "exact":
        if shard:
            from .sharded import make_sharded_or_local

            return make_sharded_or_local(support, timeout=shard_timeout, **kwargs)
        from .exact import ExactIndex

        return ExactIndex(support, **kwargs)
    if backend == "hnsw":
        from .hnsw import HnswIndex

        return HnswIndex(support, **kwargs)
    if backend == "dense":
        from .dense import DenseIndex

        return DenseIndex(support, **kwargs)
    raise InputError(f"unknown index backend {backend!r}; choose 'exact' or 'hnsw'")


def default_k(train_labels: np.ndarray, num_classes: int) -> int:
    """The paper's k: the largest per-class count in the training split."""
    counts = np.bincount(np.asarray(train_labels, dtype=np.int64), minlength=num_classes)
    return int(counts.max()) if counts.size else 0


__all__ = ["ExactIndex", "HnswIndex", "ShardedExactIndex", "DenseIndex", "SupportIndex", "make_index", "default_k",
           "good_neighbours_by_class", "similarity_from_neighbours"]
