"""Batch-invariant dense products: each row's result depends on that row alone, bit for bit.

A float32 GEMM gives a row different low bits depending on the batch around it: BLAS
kernels accumulate rows at different positions of a micro-tile in different orders, and
one row takes the GEMV path (measured with OpenBLAS on this machine: a row's output depends
on its position within a 6-row panel and on the thread count; MLX's bundled BLAS happened
to be invariant).  For predictions that must not depend on the batch,
``Y = X Wᵀ`` is instead computed as an *error-free* float64 product:

* every row of W is scaled by a power of two so that its largest entry is below 2^β_w and
  rounded to an integer (β_w = 24 keeps float32 weights near the row maximum exactly);
* every row of X is scaled likewise to below 2^β_x and split into two integer slices,
  ``x ≈ 2^(e−β_x) (x_hi + 2^−β_x x_lo)``, ``|x_hi| ≤ 2^β_x``, ``|x_lo| ≤ 2^(β_x−1)``
  (2β_x bits relative to the row's largest entry, enough for outlier features);
* β_x + β_w ≤ 52 − ⌈log2 D⌉, so every product and partial sum of ``x_hi·w`` and ``x_lo·w`` is an
  integer below 2^53: the float64 GEMM is *exact*, whatever order or blocking the BLAS uses;
* ``Y = 2^(e_x + e_w − β_x − β_w) (P + 2^−β_x Q)`` is assembled elementwise with one rounding.

What the scalings drop depends on the row (and W) alone, so the result is a deterministic
function of one row of X and of W — independent of the batch, of the BLAS library and of
its thread count — and as accurate as float32 rounding of the weights.  Cost: one float64
GEMM with 2N rows, run by MLX on the CPU stream (the BLAS MLX uses; NumPy's own
multithreaded OpenBLAS next to MLX's was measured to stall NumPy LAPACK calls on a shared
2-core machine).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from ..errors import InputError

#: Rows per float64 GEMM chunk (bounds memory; the result does not depend on it).
CHUNK_ROWS = 4096
#: Bits kept per weight row, relative to its largest entry (a float32 mantissa).
WEIGHT_BITS = 24
#: Products of at most this many multiply-adds run in NumPy on the calling thread (single-row
#: prediction: MLX's dispatch and stream synchronisation cost more than the arithmetic).  The
#: result is the same bit for bit: the float64 GEMM is exact whatever computes it.
HOST_MULTIPLY_ADDS = 1 << 18


def slice_bits(width: int) -> tuple[int, int]:
    """(β_x, β_w) for rows of ``width`` terms: width·2^(β_x+β_w) stays below 2^53 with a bit to spare."""
    total = 52 - math.ceil(math.log2(max(int(width), 2)))
    beta_w = min(WEIGHT_BITS, total // 2 + 6)
    return total - beta_w, beta_w


def _f64(a: np.ndarray) -> mx.array:
    return mx.array(np.ascontiguousarray(a, dtype=np.float64), dtype=mx.float64)


def scale_rows(a: np.ndarray, beta: int) -> tuple[np.ndarray, np.ndarray]:
    """(scaled, e): ``scaled[i] = a[i]·2^(β−e_i)`` with max|scaled[i]| < 2^β (an exact power-of-two scaling)."""
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2:
        raise InputError(f"expected a 2-D array, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise InputError("exact product: input contains NaN or Inf values")
    _, e = np.frexp(np.maximum.reduce(np.abs(a), axis=1, initial=0.0))  # max|a_i| < 2^e_i
    e = e.astype(np.int64)
    return np.ldexp(a, (beta - e)[:, None]), e


def split_rows(a: np.ndarray, beta: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hi, lo, e): ``a[i] ≈ 2^(e_i − β) (hi[i] + 2^−β lo[i])``, integer-valued float64 slices."""
    scaled, e = scale_rows(a, beta)
    hi = np.rint(scaled)
    lo = np.rint(np.ldexp(scaled - hi, beta))  # scaled − hi is exact (|.| ≤ 1/2, on scaled's ulp grid)
    return hi, lo, e


class ExactRowProduct:
    """``x ↦ x Wᵀ + b`` (W: [K, D], float64 result), batch-invariant and error-free (module doc)."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None):
        w = np.asarray(weight, dtype=np.float64)
        self.out_dim, self.in_dim = w.shape
        self.beta_x, self.beta_w = slice_bits(self.in_dim)
        scaled, self._w_exp = scale_rows(w, self.beta_w)
        self._w_t_host = np.ascontiguousarray(np.rint(scaled).T)  # [D, K] integers, |.| ≤ 2^β_w
        self._w_t = _f64(self._w_t_host)
        self._w_scale = np.ldexp(1.0, self._w_exp - self.beta_w)[None, :]
        self._bias = None if bias is None else np.asarray(bias, dtype=np.float64).reshape(1, -1)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """[N, K] float64 for x [N, D]; row i depends on x[i] alone."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.in_dim:
            raise InputError(f"exact product: expected rows of width {self.in_dim}, got shape {x.shape}")
        out = np.empty((x.shape[0], self.out_dim), dtype=np.float64)
        for start in range(0, x.shape[0], CHUNK_ROWS):
            out[start : start + CHUNK_ROWS] = self._chunk(x[start : start + CHUNK_ROWS])
        return out

    def _chunk(self, x: np.ndarray) -> np.ndarray:
        return self._product(self._slices(x))

    def _slices(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the integer slices [x_hi; x_lo] [2N, D], the rows' power-of-two scalings [N, 1]) of x at β_x."""
        bx = self.beta_x
        x_hi, x_lo, x_exp = split_rows(x, bx)
        return np.concatenate([x_hi, x_lo]), np.ldexp(1.0, x_exp - bx)[:, None]

    def _product(self, sliced: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """The rows' x Wᵀ + b from :meth:`_slices` (of this product, or of another with the same β_x)."""
        slices, row_scale = sliced
        if slices.shape[0] * self.in_dim * self.out_dim <= HOST_MULTIPLY_ADDS:
            pq = slices @ self._w_t_host  # exact integers
        else:
            pq = np.array(mx.matmul(_f64(slices), self._w_t, stream=mx.cpu))  # exact integers
        n = row_scale.shape[0]
        y = pq[n:]
        y *= 2.0**-self.beta_x  # exact (a power of two)
        y += pq[:n]  # the one rounding
        y *= row_scale  # exact power-of-two scalings, rows then columns
        y *= self._w_scale
        return y if self._bias is None else y + self._bias


def shared_products(x: np.ndarray, products) -> list[np.ndarray]:
    """``[p(x) for p in products]``, ``x`` [N, D] split into its integer slices once when the products share
    the input width (hence β_x): the same values bit for bit (each row's slices depend on that row alone)."""
    first = products[0]
    if any(p.in_dim != first.in_dim or p.beta_x != first.beta_x for p in products):
        return [p(x) for p in products]
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != first.in_dim:
        raise InputError(f"exact product: expected rows of width {first.in_dim}, got shape {x.shape}")
    if x.shape[0] <= CHUNK_ROWS:
        sliced = first._slices(x)
        return [p._product(sliced) for p in products]
    outs = [np.empty((x.shape[0], p.out_dim), dtype=np.float64) for p in products]
    for start in range(0, x.shape[0], CHUNK_ROWS):
        sliced = first._slices(x[start : start + CHUNK_ROWS])
        for p, out in zip(products, outs):
            out[start : start + CHUNK_ROWS] = p._product(sliced)
    return outs
