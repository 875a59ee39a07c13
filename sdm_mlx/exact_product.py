"""Batch-invariant dense products: each row's result depends on that row alone, bit for bit.

A float32 GEMM gives a row different low bits depending on the batch around it: BLAS
kernels accumulate rows at different positions of a micro-tile in different orders, and
one row takes the GEMV path (measured with OpenBLAS on this machine: a row's output depends
on its position within a 6-row panel and on the thread count).  For predictions that must
not depend on the batch (issue 10 §4), ``Y = X Wᵀ`` is instead computed as an
*error-free* float64 product:

* every row of X (and of W) is scaled by a power of two so that its largest entry is below
  2^β, and split into two integer slices, ``x ≈ 2^(e−β) (x_hi + 2^−β x_lo)`` with
  ``|x_hi| ≤ 2^β``, ``|x_lo| ≤ 2^(β−1)`` (the split keeps 2β bits relative to the row's
  largest entry; what is dropped depends on the row alone);
* β = ⌊(53 − ⌈log2 D⌉) / 2⌋, so every product and every partial sum of the integer slice
  products ``x_hi·w_hi`` and ``x_hi·w_lo + x_lo·w_hi`` is an integer below 2^53: the float64
  GEMMs are *exact*, whatever order or blocking the BLAS uses;
* ``Y = 2^(e_x + e_w − 2β) (P + 2^−β Q)`` is then assembled with one rounding, in a fixed
  order, elementwise.

The result is a deterministic function of one row of X and of W (independent of the batch,
of the BLAS library and of its thread count), accurate to ≈ D·2^−2β relative to
‖x‖∞‖w‖∞ — far below float32 rounding.  Cost: three float64 GEMM widths, run by MLX on
the CPU stream (the BLAS MLX uses; NumPy's own multithreaded OpenBLAS next to MLX's was
measured to stall other NumPy LAPACK calls by ~0.8 s each on a shared 2-core machine).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

#: Rows per float64 GEMM chunk (bounds memory; the result does not depend on it).
CHUNK_ROWS = 4096


def _f64(a: np.ndarray) -> mx.array:
    return mx.array(np.ascontiguousarray(a, dtype=np.float64), dtype=mx.float64)


def slice_bits(width: int) -> int:
    """β: bits per integer slice so that sums of ``2·width`` slice products stay below 2^53."""
    return (53 - math.ceil(math.log2(2 * max(int(width), 1)))) // 2


def split_rows(a: np.ndarray, beta: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hi, lo, e): ``a[i] ≈ 2^(e_i − β) (hi[i] + 2^−β lo[i])``, integer-valued float64 slices."""
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"expected a 2-D array, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("exact product: input contains NaN or Inf values")
    _, e = np.frexp(np.abs(a).max(axis=1, initial=0.0))  # max|a_i| < 2^e_i
    e = e.astype(np.int64)
    scaled = np.ldexp(a, (beta - e)[:, None])  # exact: a power-of-two scaling, |scaled| < 2^β
    hi = np.rint(scaled)
    lo = np.rint(np.ldexp(scaled - hi, beta))  # scaled − hi is exact (|.| ≤ 1/2, same ulp grid)
    return hi, lo, e


class ExactRowProduct:
    """``x ↦ x Wᵀ + b`` (W: [K, D], float64 result), batch-invariant and exact to ≈ 2^−2β (module doc)."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None):
        w = np.asarray(weight, dtype=np.float64)
        self.out_dim, self.in_dim = w.shape
        self.beta = slice_bits(self.in_dim)
        w_hi, w_lo, self._w_exp = split_rows(w, self.beta)
        self._w_hi_t = _f64(w_hi.T)  # [D, K]
        self._w_cross_t = _f64(np.concatenate([w_lo, w_hi], axis=1).T)  # [2D, K]
        self._bias = None if bias is None else np.asarray(bias, dtype=np.float64).reshape(1, -1)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """[N, K] float64 for x [N, D]; row i depends on x[i] alone."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.in_dim:
            raise ValueError(f"exact product: expected rows of width {self.in_dim}, got shape {x.shape}")
        out = np.empty((x.shape[0], self.out_dim), dtype=np.float64)
        for start in range(0, x.shape[0], CHUNK_ROWS):
            out[start : start + CHUNK_ROWS] = self._chunk(x[start : start + CHUNK_ROWS])
        return out

    def _chunk(self, x: np.ndarray) -> np.ndarray:
        b = self.beta
        x_hi, x_lo, x_exp = split_rows(x, b)
        p = mx.matmul(_f64(x_hi), self._w_hi_t, stream=mx.cpu)  # exact integers
        q = mx.matmul(_f64(np.concatenate([x_hi, x_lo], axis=1)), self._w_cross_t, stream=mx.cpu)  # exact
        mx.eval(p, q)
        p, q = np.array(p), np.array(q)
        y = p + np.ldexp(q, -b)  # one rounding
        y = np.ldexp(y, x_exp[:, None] + self._w_exp[None, :] - 2 * b)
        return y if self._bias is None else y + self._bias
