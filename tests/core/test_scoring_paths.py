"""The scoring shortcuts of single-row prediction give the general path's values bit for bit.

* :func:`~sdm_mlx.core.activation.sdm_numpy` (q and d handed to MLX as columns) == :func:`sdm` of MLX arrays;
* :func:`~sdm_mlx.core.exact_product.shared_products` (one integer split of x for several products) == each
  :class:`~sdm_mlx.core.exact_product.ExactRowProduct` called on its own, on the host and in MLX, in one
  chunk and in several.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from sdm_mlx.core import exact_product
from sdm_mlx.core.activation import sdm, sdm_numpy
from sdm_mlx.core.exact_product import ExactRowProduct, shared_products
from sdm_mlx.errors import InputError


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
@pytest.mark.parametrize("C", [2, 3, 9])
def test_sdm_numpy_equals_sdm(n, C):
    rng = np.random.default_rng(n * 10 + C)
    z = (rng.normal(size=(n, C)) * rng.choice([0.1, 3, 40], size=(n, 1))).astype(np.float32)
    q = rng.integers(0, 500, n)
    d = rng.random(n).astype(np.float32)
    d[::5] = 0.0
    want = np.array(sdm(mx.array(z), mx.array(q.astype(np.float32)), mx.array(d)))
    got = sdm_numpy(z, q, d)
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(_bits(got), _bits(want))
    got_float_q = sdm_numpy(z, q.astype(np.float64) + 0.5, d)  # any q, not only counts
    want_float_q = np.array(sdm(mx.array(z), mx.array((q + 0.5).astype(np.float32)), mx.array(d)))
    assert np.array_equal(_bits(got_float_q), _bits(want_float_q))


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("n", [1, 3, 50])
def test_shared_products_equal_separate_products(monkeypatch, host, n):
    monkeypatch.setattr(exact_product, "HOST_MULTIPLY_ADDS", 1 << 40 if host else 0)
    rng = np.random.default_rng(n)
    D = 40
    first = ExactRowProduct(rng.normal(size=(3, D)), rng.normal(size=3))
    second = ExactRowProduct(rng.normal(size=(D, D)) * 1e3)
    x = rng.normal(size=(n, D)) * rng.uniform(0.1, 50, (n, 1))
    x[:, 3] *= 1e4  # an outlier feature
    got = shared_products(x, (first, second))
    for product, out in zip((first, second), got):
        want = product(x)
        assert out.dtype == want.dtype == np.float64 and out.shape == want.shape
        assert np.array_equal(_bits(out), _bits(want))


def test_shared_products_over_several_chunks_and_other_widths(monkeypatch):
    monkeypatch.setattr(exact_product, "CHUNK_ROWS", 4)
    rng = np.random.default_rng(0)
    a, b = ExactRowProduct(rng.normal(size=(5, 30))), ExactRowProduct(rng.normal(size=(2, 30)), rng.normal(size=2))
    x = rng.normal(size=(11, 30))
    for out, product in zip(shared_products(x, (a, b)), (a, b)):
        assert np.array_equal(_bits(out), _bits(product(x)))
    other = ExactRowProduct(rng.normal(size=(2, 31)))  # another input width: each product splits x itself
    y = rng.normal(size=(3, 31))
    with pytest.raises(InputError):
        shared_products(y, (a, other))
    out_other, = shared_products(y, (other,))
    assert np.array_equal(_bits(out_other), _bits(other(y)))
