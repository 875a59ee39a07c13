import mlx.core as mx
import numpy as np
import pytest

from sdm_mlx.core.activation import Q_SOFTMAX, log_sdm, sdm, sdm_nll_loss


def test_hand_computed_value():
    # (2+q)^(d z_i) / sum: q=1, d=0.5, z=[1, 2] -> 3^0.5, 3^1
    out = np.array(sdm(mx.array([[1.0, 2.0]]), mx.array([1.0]), mx.array([0.5])))
    a, b = 3**0.5, 3.0
    np.testing.assert_allclose(out[0], [a / (a + b), b / (a + b)], rtol=1e-6)
    lg = np.array(log_sdm(mx.array([[1.0, 2.0]]), mx.array([1.0]), mx.array([0.5])))
    np.testing.assert_allclose(lg[0], np.log([a / (a + b), b / (a + b)]) / np.log(3.0), rtol=1e-6)


def test_softmax_and_uniform_special_cases():
    z = mx.array([[0.3, -1.2, 2.5], [10.0, 0.0, -10.0]])
    soft = np.array(mx.softmax(z, axis=-1))
    np.testing.assert_allclose(np.array(sdm(z, mx.array([Q_SOFTMAX] * 2), mx.array([1.0, 1.0]))), soft, rtol=1e-6)
    np.testing.assert_allclose(np.array(sdm(z, mx.array([5.0, 0.0]), mx.array([0.0, 0.0]))), 1 / 3, rtol=1e-6)


def test_numerically_stable_for_large_logits():
    z = mx.array([[1000.0, -1000.0], [5e4, 5e4 - 1.0]])
    out = np.array(sdm(z, mx.array([100.0, 3.0]), mx.array([1.0, 1.0])))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out.sum(1), 1.0, rtol=1e-6)
    lg = np.array(log_sdm(z, mx.array([100.0, 3.0]), mx.array([1.0, 1.0])))
    assert np.isfinite(lg).all()
    # exact log-softmax: no eps floor, very wrong rows keep a large finite loss
    assert lg[0, 1] < -100


def test_loss_value_and_reductions():
    z = mx.array([[1.0, 2.0], [0.5, -0.5]])
    q = mx.array([1.0, 3.0])
    d = mx.array([0.5, 1.0])
    y = mx.array([0, 0])
    per_row = -np.array(log_sdm(z, q, d))[[0, 1], [0, 0]]
    np.testing.assert_allclose(np.array(sdm_nll_loss(z, y, q, d, "none")), per_row, rtol=1e-6)
    np.testing.assert_allclose(sdm_nll_loss(z, y, q, d).item(), per_row.mean(), rtol=1e-6)
    np.testing.assert_allclose(sdm_nll_loss(z, y, q, d, "sum").item(), per_row.sum(), rtol=1e-6)
    with pytest.raises(ValueError):
        sdm_nll_loss(z, y, q, d, "avg")


def test_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    z0 = rng.normal(size=(3, 4)).astype(np.float64)
    q = mx.array([0.0, 2.0, 7.0])
    d = mx.array([0.3, 1.0, 0.8])
    y = mx.array([1, 3, 0])
    grad = np.array(mx.grad(lambda z: sdm_nll_loss(z, y, q, d, "sum"))(mx.array(z0.astype(np.float32))))
    eps = 1e-3
    num = np.zeros_like(z0)
    for i in range(3):
        for j in range(4):
            zp, zm = z0.copy(), z0.copy()
            zp[i, j] += eps
            zm[i, j] -= eps
            fp = sdm_nll_loss(mx.array(zp.astype(np.float32)), y, q, d, "sum").item()
            fm = sdm_nll_loss(mx.array(zm.astype(np.float32)), y, q, d, "sum").item()
            num[i, j] = (fp - fm) / (2 * eps)
    np.testing.assert_allclose(grad, num, atol=2e-3)


def test_change_of_base_gradient_closed_form():
    # d/dz of -log_{2+q} softmax(z d ln(2+q))_y = d (p - onehot)
    z = mx.array([[0.2, 1.5]])
    q, d = mx.array([4.0]), mx.array([0.7])
    g = np.array(mx.grad(lambda z: sdm_nll_loss(z, mx.array([0]), q, d))(z))
    p = np.array(sdm(z, q, d))
    np.testing.assert_allclose(g, 0.7 * (p - np.array([[1.0, 0.0]])), rtol=1e-5)
