"""Float32 screening of the exact index's candidates, with provable error bands (``equation:q``).

The exact index (:mod:`.exact`, and :mod:`.sharded` over the ranks of ``mlx.launch``) takes q, d0 and the
neighbours from float64 distances computed per pair on the host; the float32 distances of tiled matmuls only
*screen* which support rows can be among them.  This module holds that screening: the float32 squared
distances of a query block (:func:`_squared_distances`, in MLX or on the host), the error bound every band is
built from (:func:`screening_tolerance`), the top-n and first-bad-neighbour screens (:func:`_screen_top`,
:func:`_count_before_first_bad`, :func:`_hard_positions`) and self-exclusion (:func:`_excluded_inf`).  The
functions work on MLX or NumPy blocks alike (:data:`HOST_SCREEN_ELEMENTS`); the answers do not depend on which.
The underscored names are the backends' internals, imported by :mod:`.exact` and :mod:`.sharded` only.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

#: Screening on the host: when MLX runs on the CPU (or for small blocks on any device), a distance
#: block's elementwise screening (row minima, counts, partitions) runs in NumPy, measured 3–5x
#: faster than MLX's CPU elementwise kernels and free of per-op dispatch; the block's matmul stays
#: in MLX (one BLAS thread pool) unless it has at most :data:`HOST_MATMUL_MULTIPLY_ADDS` terms,
#: where NumPy's BLAS runs it single-threaded on the calling thread (single-row prediction), or
#: fits in :data:`HOST_MATMUL_PRODUCTS` such single-threaded products of consecutive rows (a few
#: rows: MLX's dispatch and stream synchronisation cost more, e.g. the distances of 8 rows to 500 support
#: rows of 128 dims took ~0.1 ms with two NumPy products against ~0.2 ms with MLX's on the 2-core test
#: machine).
#: Answers do not depend on the path: float32 distances only screen candidates for the exact
#: float64 results (:func:`screening_tolerance`), whatever computed them.
HOST_SCREEN_ELEMENTS = 1 << 21
HOST_MATMUL_MULTIPLY_ADDS = 1 << 18
HOST_MATMUL_PRODUCTS = 2


def _xp(a):
    """The array module of ``a``: NumPy for host (NumPy) blocks, else MLX."""
    return np if isinstance(a, np.ndarray) else mx


def _evaluate(*arrays) -> None:
    """``mx.eval`` for MLX arrays; NumPy arrays are already computed."""
    lazy = [a for a in arrays if not isinstance(a, np.ndarray)]
    if lazy:
        mx.eval(*lazy)


# Not mx.compile'd: the group sizes change every epoch, and on the CPU backend each new shape
# costs a ~2 s recompilation against a ~25% steady-state gain (shapeless compilation crashed).
def _squared_distances(qc, support, support_sq, support_host=None):
    """Squared L2 [b, N_s] between centred queries and centred support, clamped at 0; and ‖q‖².

    MLX arrays, or (host screening) NumPy ``qc`` and ``support_sq`` with the MLX ``support`` and its
    NumPy view ``support_host``: the result is then NumPy.  float32 either way, only for screening."""
    q_sq = (qc * qc).sum(axis=1)
    if isinstance(qc, np.ndarray):
        per_row = support.shape[0] * support.shape[1]
        rows = HOST_MATMUL_MULTIPLY_ADDS // max(per_row, 1)  # rows per single-threaded host product
        if qc.shape[0] <= rows:
            dist = qc @ support_host.T
        elif rows and qc.shape[0] <= HOST_MATMUL_PRODUCTS * rows:
            dist = np.concatenate([qc[i : i + rows] @ support_host.T for i in range(0, qc.shape[0], rows)])
        else:
            dist = np.array(mx.array(qc) @ support.T)
        dist *= np.float32(-2.0)
        dist += q_sq[:, None]
        dist += support_sq[None, :]
        return np.maximum(dist, np.float32(0.0), out=dist), q_sq
    return mx.maximum(q_sq[:, None] + support_sq[None, :] - 2.0 * (qc @ support.T), 0.0), q_sq


def screening_tolerance(dim: int) -> float:
    """τ with |float32 distance − float64 distance| ≤ τ·(‖q_c‖² + ‖s_c‖²) for centred vectors of width ``dim``.

    The float32 distance ``‖q_c‖² + ‖s_c‖² − 2 q_c·s_c`` of float32-centred vectors is off from the
    float64 distance of the uncentred vectors by at most (2γ_dim + 8u)(‖q_c‖² + ‖s_c‖²), u = 2⁻²⁴
    (γ_dim ≈ dim·u for each of the two norms and the dot product, whatever the summation order;
    4u for the centring, 4u for the final additions).  τ = (2·dim + 16)·u adds a margin for the
    rounding of the bands themselves.  Every float32 screening band below is built from τ, so
    the exact float64 result does not depend on the float32 values (i.e. on the batch).
    """
    return (2 * int(dim) + 16) * 2.0**-24


def _count_before_first_bad(good_dist, first_bad, q_sq, good_sq, tau, max_sq):
    """(#good closer than the first bad, any good within the float32 error band of the first bad)."""
    fb = first_bad[:, None]
    count = (good_dist < fb).sum(axis=1)
    band = tau * (2.0 * q_sq[:, None] + good_sq[None, :] + max_sq) + 1e-30
    near = (_xp(good_dist).abs(good_dist - fb) <= band).any(axis=1)
    return count, near


def _screen_top(dist, q_sq, col_sq, max_sq, n: int, tau):
    """(key, first [b, w], count [b]) for screening every row's exact float64 top-n (n < columns).

    With key_j = dist_j − τ‖s_j‖² and v the row's n-th smallest key, every column of the exact
    top-n has key_j ≤ v + 2τ(‖q‖² + max‖s‖²) (:func:`screening_tolerance`); ``count`` is the
    number of such columns and ``first`` the w smallest keys (w = 1 for n = 1: an argmin, else
    n + 8), which hold them all wherever count ≤ w.
    """
    xp = _xp(dist)
    key = dist - tau * col_sq[None, :]
    along = _along(key)
    if n == 1:
        first = xp.argmin(key, axis=1)[:, None]
        v = along(key, first)[:, 0]
    else:
        first = xp.argpartition(key, n + 7, axis=1)[:, : n + 8]
        v = xp.sort(along(key, first), axis=1)[:, n - 1]
    limit = v + 2.0 * tau * (q_sq + max_sq) + 1e-30
    count = (key <= limit[:, None]).sum(axis=1)
    _evaluate(first, count)
    return key, np.asarray(first), np.asarray(count)


def _along(a):
    """``take_along_axis(·, ·, axis=1)`` for 2-D arrays of ``a``'s module: for NumPy, the same elements by
    plain indexing (``np.take_along_axis`` builds its index arrays in Python, most of a small block's cost)."""
    if isinstance(a, np.ndarray):
        return lambda x, idx: x[np.arange(idx.shape[0])[:, None], idx]
    return lambda x, idx: mx.take_along_axis(x, idx, axis=1)


def _host_view(a: mx.array) -> np.ndarray:
    """A NumPy view of an evaluated MLX array's buffer (no copy; MLX arrays are immutable)."""
    mx.eval(a)
    return np.asarray(memoryview(a))


def _hard_positions(key, hard: np.ndarray, c: int) -> np.ndarray:
    """Column positions of the c smallest keys of rows ``hard`` (MLX or NumPy ``key``)."""
    if isinstance(key, np.ndarray):
        return np.argpartition(key[hard], c - 1, axis=1)[:, :c]
    return np.array(mx.argpartition(key[mx.array(hard)], kth=c - 1, axis=1)[:, :c])


def _excluded_inf(dist, rows_ex: np.ndarray, columns):
    """``dist`` with entry (i, rows_ex[i]) set to +inf (rows_ex[i] < 0: none); ``columns`` = mx.arange(N_s)."""
    if isinstance(dist, np.ndarray):
        hit = np.flatnonzero(rows_ex >= 0)
        dist[hit, rows_ex[hit]] = np.inf
        return dist
    return mx.where(columns[None, :] == mx.array(rows_ex)[:, None], mx.inf, dist)


__all__ = ["HOST_SCREEN_ELEMENTS", "HOST_MATMUL_MULTIPLY_ADDS", "HOST_MATMUL_PRODUCTS", "screening_tolerance"]
