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

Scoring needs the float32 rounding of Y only (:class:`~sdm_mlx.core.adaptor.InvariantForward`), and
:meth:`ExactRowProduct.rounded` gives it, bit for bit, from one float64 GEMM of N rows: the unsplit
rows x̃ = x_hi + 2^−β_x x_lo (2β_x + 1 bits, exact in float64) times W̃ is off from the exact sum by at
most γ_D ‖x̃‖ ‖w̃‖ whatever the BLAS does; every entry whose band rounds to one float32 is that float32
(the output is monotone in the sum), and the few others (0.28 % at D = 3,072) take the exact sum from
two integer dot products.  Which entries are settled exactly may depend on the batch; their values
do not.  Measured at D = 3,072, M = 1,000: 0.48 against 0.85 CPU s for 2,000 rows (docs/performance.md).
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
#: Bytes of one gathered operand of the exact dot products that settle the entries the screening leaves open
#: (cache-sized: 2,761 entries at D = 3,072 took 41 ms in chunks of 64 against 101 ms in chunks of 1,024).
EXACT_BYTES = 1 << 19
#: Factor on δ = γ_D ‖x̃‖ ‖w̃‖ (times 1 + 4/D, :func:`_bound_factor`) covering the float64 roundings of the
#: two norms and of their product (each below (D/2 + 3)·2^−53 relative for D < 2^30).
ROUNDED_BOUND_MARGIN = 1.0 + 2.0**-20


def _bound_factor(width: int) -> float:
    """The factor on ‖x̃‖₂ ‖w̃‖₂ of the screening band of :meth:`ExactRowProduct.rounded`: γ_D (1 + 4/D) with margin.

    γ_D = D·u / (1 − D·u), u = 2^−53, bounds |fl(Σ a_i b_i) − Σ a_i b_i| ≤ γ_D Σ |a_i b_i| ≤ γ_D ‖a‖ ‖b‖
    (any summation order, with or without FMA).  The factor 1 + 4/D covers the rounding of S̃ ∓ δ
    itself: it is at most 2^−53 (|S| + 3δ), and |S| ≤ ‖a‖ ‖b‖ ≤ 2^53 δ / D.
    """
    d = max(int(width), 1)
    du = d * 2.0**-53
    return du / (1.0 - du) * (1.0 + 4.0 / d) * ROUNDED_BOUND_MARGIN


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


def _row_exponents(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a as float64 [N, D], e [N]) with max|a_i| < 2^e_i (e = 0 for a row of zeros); NaN and Inf refused
    (found from the row maxima: one makes its row's max|a| NaN or Inf)."""
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2:
        raise InputError(f"expected a 2-D array, got shape {a.shape}")
    top = np.maximum(a.max(axis=1, initial=0.0), -a.min(axis=1, initial=0.0))  # max|a_i|
    if not np.isfinite(top).all():
        raise InputError("exact product: input contains NaN or Inf values")
    return a, np.frexp(top)[1].astype(np.int64)


def _scale_into(out: np.ndarray, a: np.ndarray, shift: np.ndarray) -> None:
    """``out[i] = a[i]·2^shift_i``: a product by 2^shift_i (rounds as ``ldexp`` does); ``ldexp`` for the rows whose
    2^shift_i is not a float64 (a maximum below 2^(shift − 1023): those rows are scaled as before)."""
    normal = shift <= 1023
    np.multiply(a, np.ldexp(1.0, np.minimum(shift, 1023))[:, None], out=out)
    if not normal.all():
        out[~normal] = np.ldexp(a[~normal], shift[~normal, None])


def split_stacked(a: np.ndarray, beta: int) -> tuple[np.ndarray, np.ndarray]:
    """([hi; lo] [2N, D], 2^(e − β) [N, 1]): :func:`split_rows` bit for bit, the slices stacked in one buffer
    (five in-place passes over ``a`` instead of eleven, written where the GEMM reads them)."""
    a, e = _row_exponents(a)
    n = a.shape[0]
    out = np.empty((2 * n, a.shape[1]), dtype=np.float64)
    hi, lo = out[:n], out[n:]
    _scale_into(lo, a, beta - e)  # the scaled rows (exact)
    np.rint(lo, out=hi)
    lo -= hi  # exact (|.| ≤ 1/2, on the scaled row's ulp grid)
    lo *= 2.0**beta  # exact
    np.rint(lo, out=lo)
    return out, np.ldexp(1.0, e - beta)[:, None]


def joined_rows(a: np.ndarray, beta: int) -> tuple[np.ndarray, np.ndarray]:
    """(x̃ = hi + 2^−β lo [N, D], 2^(e − β) [N, 1]) for :func:`split_rows`' slices, in two passes over ``a``.

    x̃ = rint(a·2^(2β−e))·2^−β: the integer shift hi·2^β is even, so rounding half to even commutes with it,
    and x̃ has at most 2β + 1 significant bits (exact in float64).  Any integer split of x̃ gives the products
    of :func:`split_rows`' slices (P + 2^−β Q = Σ x̃ w̃ exactly)."""
    a, e = _row_exponents(a)
    out = np.empty(a.shape, dtype=np.float64)
    _scale_into(out, a, 2 * beta - e)
    np.rint(out, out=out)
    out *= 2.0**-beta  # exact
    return out, np.ldexp(1.0, e - beta)[:, None]


class ExactRowProduct:
    """``x ↦ x Wᵀ + b`` (W: [K, D], float64 result), batch-invariant and error-free (module doc)."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None):
        w = np.asarray(weight, dtype=np.float64)
        self.out_dim, self.in_dim = w.shape
        self.beta_x, self.beta_w = slice_bits(self.in_dim)
        scaled, self._w_exp = scale_rows(w, self.beta_w)
        self._w_rows = np.rint(scaled)  # [K, D] integers, |.| ≤ 2^β_w
        self._w_t_host = self._w_rows.T  # [D, K], a view: the sums are exact in any layout
        self._w_t = _f64(self._w_t_host)
        # ‖w̃_k‖₂ times the band's factor (rounded, _bound_factor)
        self._w_bound = np.sqrt(np.einsum("ij,ij->i", self._w_rows, self._w_rows))[None, :] * _bound_factor(self.in_dim)
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
        return split_stacked(x, self.beta_x)

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
        return self._finish(y, row_scale)

    def _finish(self, y: np.ndarray, row_scale: np.ndarray) -> np.ndarray:
        """Σ x̃ w̃ (float64, scaled units) ↦ the output: the rows' and columns' power-of-two scalings, the bias."""
        y *= row_scale  # exact power-of-two scalings, rows then columns
        y *= self._w_scale
        if self._bias is not None:
            y += self._bias
        return y

    def rounded(self, x: np.ndarray) -> np.ndarray:
        """``self(x).astype(float32)`` bit for bit, screened from one float64 GEMM of N rows (:meth:`_rounded`)."""
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.in_dim:
            raise InputError(f"exact product: expected rows of width {self.in_dim}, got shape {x.shape}")
        out = np.empty((x.shape[0], self.out_dim), dtype=np.float32)
        for start in range(0, x.shape[0], CHUNK_ROWS):
            out[start : start + CHUNK_ROWS] = self._rounded(joined_rows(x[start : start + CHUNK_ROWS], self.beta_x))
        return out

    def _rounded(self, joined: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """float32 of :meth:`_product` bit for bit, for the rows x̃ of :func:`joined_rows` (at this β_x).

        S̃ = x̃ W̃ᵀ by one float64 GEMM of N rows (not 2N) is within δ = γ_D ‖x̃‖₂ ‖w̃_k‖₂ of the exact
        S = P + 2^−β_x Q (any summation order; Cauchy–Schwarz; :func:`_bound_factor`).  The output is a
        monotone function f of S (the one rounding, positive power-of-two scalings, the bias, float32), so where
        f(S̃ − δ) and f(S̃ + δ) have the same float32 bits, that is f(S); the other entries (and those with
        δ = 0) take S from two exact dot products of integers, as :meth:`_product` does."""
        x, row_scale = joined
        n = row_scale.shape[0]
        if n * self.in_dim * self.out_dim <= HOST_MULTIPLY_ADDS:
            hi = np.rint(x)
            return self._product((np.concatenate([hi, (x - hi) * 2.0**self.beta_x]), row_scale)).astype(np.float32)
        approx = np.array(mx.matmul(_f64(x), self._w_t, stream=mx.cpu))
        delta = np.sqrt(np.einsum("ij,ij->i", x, x))[:, None] * self._w_bound
        low = approx - delta  # ≤ S, with the rounding of this subtraction (_bound_factor)
        approx += delta  # ≥ S
        result = self._finish(low, row_scale).astype(np.float32)
        upper = self._finish(approx, row_scale).astype(np.float32)
        rows, cols = np.nonzero((result.view(np.uint32) != upper.view(np.uint32)) | (delta == 0.0))
        step = max(8, EXACT_BYTES // (8 * self.in_dim))
        for start in range(0, rows.size, step):
            r, c = rows[start : start + step], cols[start : start + step]
            w = self._w_rows[c]
            x_r = x[r]
            hi = np.rint(x_r)
            x_r -= hi
            x_r *= 2.0**self.beta_x  # lo: exact integers, |lo| ≤ 2^(β_x − 1)
            y = np.einsum("ij,ij->i", x_r, w)  # Q, exact
            y *= 2.0**-self.beta_x
            y += np.einsum("ij,ij->i", hi, w)  # + P: the one rounding, as in _product
            y *= row_scale[r, 0]
            y *= self._w_scale[0, c]
            if self._bias is not None:
                y += self._bias[0, c]
            result[r, c] = y.astype(np.float32)
        return result


def shared_products(x: np.ndarray, products, rounded: bool = False) -> list[np.ndarray]:
    """``[p(x) for p in products]`` (``rounded``: ``[p.rounded(x) …]``, float32), ``x`` [N, D] split into its
    integer slices once when the products share the input width (hence β_x): the same values bit for bit
    (each row's slices depend on that row alone)."""
    first = products[0]
    if any(p.in_dim != first.in_dim or p.beta_x != first.beta_x for p in products):
        return [p.rounded(x) if rounded else p(x) for p in products]
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != first.in_dim:
        raise InputError(f"exact product: expected rows of width {first.in_dim}, got shape {x.shape}")
    prepare, apply = ((lambda rows: joined_rows(rows, first.beta_x)), ExactRowProduct._rounded) if rounded else (
        first._slices, ExactRowProduct._product)
    if x.shape[0] <= CHUNK_ROWS:
        prepared = prepare(x)
        return [apply(p, prepared) for p in products]
    outs = [np.empty((x.shape[0], p.out_dim), dtype=np.float32 if rounded else np.float64) for p in products]
    for start in range(0, x.shape[0], CHUNK_ROWS):
        prepared = prepare(x[start : start + CHUNK_ROWS])
        for p, out in zip(products, outs):
            out[start : start + CHUNK_ROWS] = apply(p, prepared)
    return outs
