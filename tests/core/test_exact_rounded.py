"""The float32 scoring forward's shortcuts give the exact product's values bit for bit.

* :func:`~sdm_mlx.core.exact_product.split_stacked` == :func:`~sdm_mlx.core.exact_product.split_rows` (stacked), and
  :func:`~sdm_mlx.core.exact_product.joined_rows` == hi + 2^−β lo, on rows with zeros, signed zeros, subnormals,
  outliers, huge and tiny maxima (the rows whose 2^(β−e) is not a float64), widths that are not powers of two;
* :meth:`ExactRowProduct.rounded` (one float64 GEMM of N rows, screened; the undecided entries exact) ==
  ``ExactRowProduct(x).astype(float32)`` (two integer slices, 2N rows), and each row's value does not depend on
  the batch around it;
* :class:`~sdm_mlx.core.adaptor.InvariantForward` == the exact products of (x − μ)/σ rounded to float32, for
  D ≥ M and D < M.
"""

from __future__ import annotations

import numpy as np
import pytest

from sdm_mlx.core import exact_product
from sdm_mlx.core.adaptor import ExemplarAdaptor, InvariantForward
from sdm_mlx.core.exact_product import ExactRowProduct, joined_rows, shared_products, slice_bits, split_rows, split_stacked
from sdm_mlx.errors import InputError

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # rows of 1e300 in float32: inf


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _awkward_rows(rng, n, d):
    x = rng.standard_normal((n, d))
    x[0] = 0.0
    x[1] = -0.0
    x[2] *= 1e-310  # subnormal entries
    x[3] *= 2.0**-1010  # max below 2^(β−1023): scaled by ldexp
    x[4] *= 1e300
    x[5, 0] = 1e308  # one outlier
    x[6] = -np.abs(x[6])
    x[7, ::2] *= 1e-200  # entries far below the row maximum
    x[8, 0] = 5e-324
    x[9] = np.float32(x[9])
    x[10] = 2.0**-1074 * rng.integers(-5, 5, d)
    x[11] *= 2.0**-1000
    x[12, 1:] = 0.0
    x[13] = np.round(x[13] * 8) / 8  # on a coarse grid (halves: ties of the rounding)
    x[14] = 0.5 + np.arange(d) % 3  # exact halves
    return x


@pytest.mark.parametrize("d", [1, 3, 7, 384, 1000, 3073])
def test_split_stacked_and_joined_rows_equal_split_rows(d):
    rng = np.random.default_rng(d)
    x = _awkward_rows(rng, 20, d)
    for beta in sorted(set(slice_bits(d))):
        hi, lo, e = split_rows(x, beta)
        stacked, scale = split_stacked(x, beta)
        assert np.array_equal(_bits(stacked), _bits(np.concatenate([hi, lo])))
        assert np.array_equal(_bits(scale), _bits(np.ldexp(1.0, e - beta)[:, None]))
        joined, scale_j = joined_rows(x, beta)
        assert np.array_equal(joined, hi + lo * 2.0**-beta)  # values (−0 and +0 alike)
        assert np.array_equal(_bits(scale_j), _bits(scale))
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[3, 0] = bad
        with pytest.raises(InputError):
            split_stacked(y, 16)
        with pytest.raises(InputError):
            joined_rows(y, 16)


@pytest.mark.parametrize("d, k, bias", [(3072, 700, True), (384, 384, False), (1000, 2, True), (1001, 513, True),
                                        (37, 3000, False)])
def test_rounded_equals_the_exact_product_in_float32(d, k, bias, monkeypatch):
    rng = np.random.default_rng(d + k)
    w = rng.standard_normal((k, d)).astype(np.float32)
    if k > 5:
        w[3] = 0.0
        w[5, : d // 2] *= 1e-6
    b = rng.standard_normal(k) if bias else None
    product = ExactRowProduct(w, b)
    x = _awkward_rows(rng, 300, d)
    x[20:40] = rng.standard_normal((20, d)) * 1e-3 + 2.0  # large offset, values near zero after the bias
    want = product(x).astype(np.float32)
    got = product.rounded(x)
    assert got.dtype == np.float32 and np.array_equal(_bits(got), _bits(want))
    perm = rng.permutation(x.shape[0])
    assert np.array_equal(_bits(product.rounded(x[perm])), _bits(want[perm]))
    assert np.array_equal(_bits(product.rounded(x[21:22])), _bits(want[21:22]))  # one row: the host path
    monkeypatch.setattr(exact_product, "HOST_MULTIPLY_ADDS", 0)  # the screened GEMM for one row too
    assert np.array_equal(_bits(product.rounded(x[21:22])), _bits(want[21:22]))


def test_rounded_settles_every_entry_exactly_when_the_band_is_wide(monkeypatch):
    # a band wider than any value: no entry is decided by the screening, every one takes the exact dot products
    rng = np.random.default_rng(3)
    w = rng.standard_normal((50, 333)).astype(np.float32)
    product = ExactRowProduct(w, rng.standard_normal(50))
    x = _awkward_rows(rng, 400, 333)
    want = product(x).astype(np.float32)
    product._w_bound = product._w_bound * 2.0**40
    monkeypatch.setattr(exact_product, "HOST_MULTIPLY_ADDS", 0)
    assert np.array_equal(_bits(product.rounded(x)), _bits(want))


def test_shared_products_rounded_equal_each_product(monkeypatch):
    rng = np.random.default_rng(4)
    x = _awkward_rows(rng, 90, 200)
    a = ExactRowProduct(rng.standard_normal((3, 200)), rng.standard_normal(3))
    b = ExactRowProduct(rng.standard_normal((200, 200)))
    monkeypatch.setattr(exact_product, "CHUNK_ROWS", 32)  # several chunks
    for got, p in zip(shared_products(x, (a, b), rounded=True), (a, b)):
        assert np.array_equal(_bits(got), _bits(p(x).astype(np.float32)))


@pytest.mark.parametrize("d, m, normalization", [(96, 40, "scalar"), (24, 60, "per-dimension"), (50, 50, None)])
def test_invariant_forward_equals_the_exact_products_rounded(d, m, normalization):
    rng = np.random.default_rng(d * m)
    model = ExemplarAdaptor(d, m, 3, seed=1)
    if normalization == "scalar":
        model.set_normalization(0.3, 1.7)
    elif normalization == "per-dimension":
        model.set_normalization(rng.standard_normal(d), rng.random(d) + 0.5)
    x = (rng.standard_normal((2500, d)) * 3 + 1).astype(np.float32)  # above HOST_MULTIPLY_ADDS: the screened GEMM
    forward = InvariantForward(model)
    logits, coordinates = forward(x)
    x_norm = (x.astype(np.float64) - np.array(model.input_mean, dtype=np.float64)) / np.array(model.input_std,
                                                                                             dtype=np.float64)
    if forward.basis is None:
        w_g = np.array(model.projection.weight, dtype=np.float64)
        b_g = np.array(model.projection.bias, dtype=np.float64)
        h = ExactRowProduct(w_g, b_g)(x_norm).astype(np.float32)
        z = ExactRowProduct(np.array(model.classifier.weight, np.float64), np.array(model.classifier.bias, np.float64))
        want = (z(h).astype(np.float32), h)
    else:
        want = (forward._logits(x_norm).astype(np.float32), forward._coordinates(x_norm).astype(np.float32))
    assert np.array_equal(_bits(logits), _bits(want[0]))
    assert np.array_equal(_bits(coordinates), _bits(want[1]))
    alone = forward(x[7:8])
    assert np.array_equal(_bits(alone[0]), _bits(logits[7:8])) and np.array_equal(_bits(alone[1]), _bits(coordinates[7:8]))
