"""Calibration layer: micro-examples, hand-worked cases and edge cases."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from fractions import Fraction

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

from sdm_mlx import calibration as cal
from sdm_mlx.calibration.rescaler import (
    RescalerSettings,
    _row_loss_mlx,
    init_rescaler_weights,
    rescaled_output,
    rescaler_loss,
    train_rescaler,
)

LN5 = math.log(5.0)
TAN95 = math.tan(0.45 * math.pi)


# ------------------------------------------------------------------ spec §15 micro-examples


def test_v_ecdf_spec_example():
    lists = [np.array([0.2, 0.5, 0.5, 0.9]), np.array([])]
    s = np.array([[0.1, 0.3], [0.5, 0.3], [0.7, 0.3], [0.9, 0.3], [0.95, 0.3]])
    v = cal.v_vector(s, lists)
    np.testing.assert_allclose(v[:, 0], [0.0, 0.25, 0.75, 1.0, 1.0])
    np.testing.assert_array_equal(v[:, 1], 0.0)  # empty list ⇒ 0


def test_output_ecdfs_use_true_label_rows_only():
    s = np.array([[0.9, 0.1], [0.4, 0.6], [0.7, 0.3], [0.2, 0.8]], dtype=np.float32)
    y = np.array([0, 0, 1, 1])
    lists = cal.output_ecdfs(s, y, 2)
    np.testing.assert_array_equal(lists[0], np.array([0.4, 0.9], dtype=np.float32))
    np.testing.assert_array_equal(lists[1], np.array([0.3, 0.8], dtype=np.float32))
    # calibration rows are evaluated in-sample: the class maximum saturates to 1
    v = cal.v_vector(s, lists)
    np.testing.assert_allclose(v, [[1.0, 0.0], [0.0, 0.5], [0.5, 0.0], [0.0, 1.0]])


def test_soft_and_hard_qbin_spec_example():
    v = np.array([[0.1, 0.75], [0.0, 1.0], [0.9, 0.1]])
    q = np.array([3.0, 0.0, 3.0])
    qt = cal.soft_qbin(v, q, np.array([1, 1, 0]))
    np.testing.assert_allclose(qt, [0.75 * LN5, math.log(2.0), 0.9 * LN5])
    assert qt[0] == pytest.approx(1.2070784, abs=1e-7)
    np.testing.assert_array_equal(cal.hard_qbin(qt), [1, 0, 1])
    np.testing.assert_array_equal(cal.hard_qbin(qt, ood=np.array([False, False, True])), [1, 0, 0])
    assert qt[1] <= math.log(2.0)


def test_effective_sample_size_spec_example():
    arrays = [np.array([0.0, 0.5, 1.2, 1.2, 2.0]), np.array([])]
    n_hat = cal.effective_sample_size(np.array([0.0, 1.2, 1.5, 3.0]), arrays)
    np.testing.assert_array_equal(n_hat[:, 0], [0, 2, 4, 4])
    assert n_hat.dtype.kind == "i"
    np.testing.assert_array_equal(n_hat[:, 1], -1)  # class without calibration rows
    np.testing.assert_array_equal(cal.dkw_epsilon(n_hat[:, 1], 0.95), 1.0)


def test_dkw_epsilon_spec_example():
    eps = cal.dkw_epsilon(np.array([4, 0, -1, 1]), 0.95)
    assert eps[0] == pytest.approx(math.sqrt(math.log(40.0) / 8.0), rel=1e-12)
    assert eps[0] == pytest.approx(0.6790508, abs=1e-7)
    np.testing.assert_array_equal(eps[1:3], 1.0)
    assert eps[3] == pytest.approx(math.sqrt(math.log(40.0) / 2.0))


def test_lower_upper_spec_example():
    v = np.array([[0.2, 0.9]])
    lower, upper = cal.dkw_bounds(v, np.array([[0.1, 0.3]]), np.array([1]))
    np.testing.assert_allclose(lower, [[0.3, 0.6]])
    np.testing.assert_allclose(upper, [[0.1, 1.0]])  # clipped at 1
    q = np.array([3.0])
    assert cal.soft_qbin(lower, q, [1])[0] == pytest.approx(0.9656627, abs=1e-7)
    assert cal.soft_qbin(v, q, [1])[0] == pytest.approx(1.4484941, abs=1e-7)
    assert cal.hard_qbin(cal.soft_qbin(lower, q, [1]))[0] == 0  # ⇒ OOD
    # clipping at 0 too
    lo, up = cal.dkw_bounds(np.array([[0.05, 0.95]]), np.array([[1.0, 1.0]]), np.array([0]))
    np.testing.assert_allclose(lo, [[0.0, 1.0]])
    np.testing.assert_allclose(up, [[1.0, 0.0]])


def test_rescaled_output_identity_spec_example():
    o = rescaled_output(np.eye(2, dtype=np.float32), np.array([[0.2, 0.9]]), np.array([1.5]))
    np.testing.assert_allclose(o, [[0.2938135, 0.7061865]], atol=1e-7)


def test_rescaled_output_weight_orientation():
    # W is [out, in]: v' = W v
    W = np.array([[1.0, 2.0], [0.0, 0.0]], dtype=np.float32)
    o = rescaled_output(W, np.array([[0.5, 0.25]]), np.array([math.e - 2.0]))  # ln(2+q~) = 1
    expected = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()
    np.testing.assert_allclose(o, [expected], rtol=1e-12)


ALG3_TOY = dict(
    o=np.array([0.99, 0.97, 0.80, 0.60, 0.98, 0.96, 0.90, 0.55]),
    q=np.array([2.0, 1.5, 1.1, 1.0, 2.2, 1.4, 1.2, 1.05]),
    y=np.array([0, 0, 0, 0, 1, 1, 1, 1]),
)


def test_alg3_spec_toy():
    t = ALG3_TOY
    mv, psi = cal.min_valid_qbin(t["o"], t["q"], t["y"], np.ones(8, bool), 2, 0.9)
    assert mv == 1.2
    np.testing.assert_allclose(psi, [0.97, 0.9])


def test_alg3_intermediate_psi_match_spec():
    # ψ at each candidate (spec): 1.0 → [0.6, 0.55], 1.05 → [0.8, 0.55], 1.1 → [0.8, 0.9], 1.2 → [0.97, 0.9]
    t = ALG3_TOY
    for cand, expected in ((1.0, [0.6, 0.55]), (1.05, [0.8, 0.55]), (1.1, [0.8, 0.9]), (1.2, [0.97, 0.9])):
        got = _naive_psi(t["o"], t["q"], t["y"], np.ones(8, bool), 2, 0.9, cand)
        np.testing.assert_allclose(got, expected)


def test_cauchy_spec_numbers():
    robust = cal.cauchy_robust_min([1.0, 1.2, 1.1, 1.5, 1.05], best_index=2, alpha=0.95)
    assert robust == pytest.approx(1.7313752, abs=1e-6)
    assert cal.mad([1.0, 1.2, 1.1, 1.5, 1.05]) == pytest.approx(0.1)
    assert cal.cauchy_factor(0.95) == pytest.approx(6.3137515, abs=1e-6)
    # offsets: MAD 0.007 → 0.0441963 (paper Table 2: 0.044)
    meds = [np.array([[0.9, np.nan]]), np.array([[0.907, np.nan]]), np.array([[0.893, 0.5]])]
    off = cal.cauchy_offsets(meds, 0.95)
    assert off[0, 0] == pytest.approx(0.0441963, abs=1e-6)
    assert off[0, 1] == 0.0  # one value ⇒ MAD 0


# ------------------------------------------------------------------ Alg. 3: reference and speed


def _naive_psi(o, q, y, non_ood, C, alpha, t):
    r = round(1 - Fraction(str(alpha)), 10)  # exact rational: 1 − 0.71 is 29/100, not 0.29000000000000004
    psi = np.zeros(C)
    for c in range(C):
        vals = sorted(o[(y == c) & non_ood & (q >= t)])
        if vals:
            psi[c] = max(vals[min(math.floor(r * len(vals)), len(vals) - 1)], 0.0)
    return psi


def _naive_alg3(o, q, y, non_ood, C, alpha):
    keep = non_ood & (np.floor(q) > 0)
    for t in sorted(set(q[keep].tolist())):
        psi = _naive_psi(o, q, y, keep, C, alpha, t)
        if np.all(psi >= alpha):
            return t, psi
    return math.inf, np.zeros(C)


@pytest.mark.parametrize("alpha", [0.9, 0.95, 0.8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_alg3_matches_naive_search(alpha, seed):
    rng = np.random.default_rng(seed)
    n, C = 300, 3
    y = rng.integers(0, C, n)
    q = np.round(rng.uniform(0.0, 4.0, n), 1)  # many ties in q~
    # accuracy rises with q~
    o = np.clip(rng.beta(2 + 6 * q, 1.5), 0, 1)
    non_ood = rng.random(n) > 0.1
    got = cal.min_valid_qbin(o, q, y, non_ood, C, alpha)
    want = _naive_alg3(o, q, y, non_ood, C, alpha)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])


def test_alg3_quantile_index_uses_rounded_one_minus_alpha():
    # n = 10, α = 0.9: round(1 − 0.9, 10)·10 = 1 ⇒ the second smallest (unrounded Python would give index 0)
    o = np.array([0.5] + [0.95] * 9 + [0.99] * 10)
    q = np.array([1.5] * 10 + [1.5] * 10)
    y = np.array([0] * 10 + [1] * 10)
    mv, psi = cal.min_valid_qbin(o, q, y, np.ones(20, bool), 2, 0.9)
    assert mv == 1.5
    np.testing.assert_allclose(psi, [0.95, 0.99])


def test_alg3_float64_gate_and_float32_values():
    # ψ is compared with α in float64: float32(0.9) = 0.89999998 < 0.9 fails, float64 0.9 passes
    o = np.array([0.9, 0.99])
    args = (np.array([1.5, 1.5]), np.array([0, 1]), np.ones(2, bool), 2, 0.9)
    assert cal.min_valid_qbin(o, *args)[0] == 1.5
    assert cal.min_valid_qbin(o.astype(np.float32), *args)[0] == math.inf


def test_alg3_empty_class_and_all_ood_give_no_threshold():
    o, q = np.array([0.99, 0.99]), np.array([2.0, 2.5])
    mv, psi = cal.min_valid_qbin(o, q, np.array([0, 0]), np.ones(2, bool), 2, 0.9)
    assert mv == math.inf and np.all(psi == 0)
    mv, psi = cal.min_valid_qbin(o, q, np.array([0, 1]), np.zeros(2, bool), 2, 0.9)
    assert mv == math.inf and np.all(psi == 0)
    # floor(q~) ≤ 0 rows are never candidates even if flagged non-OOD
    mv, _ = cal.min_valid_qbin(np.array([0.99, 0.99]), np.array([0.5, 0.9]), np.array([0, 1]),
                               np.ones(2, bool), 2, 0.9)
    assert mv == math.inf


def test_alg3_speed_10k():
    rng = np.random.default_rng(0)
    n, C = 10_000, 4
    y = rng.integers(0, C, n)
    q = rng.uniform(0.0, 8.0, n)
    o = np.clip(rng.beta(1 + 30 * q, 1.0), 0, 1)
    t0 = time.perf_counter()
    mv, psi = cal.min_valid_qbin(o, q, y, np.floor(q) > 0, C, 0.95)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, elapsed
    assert math.isfinite(mv) and np.all(psi >= 0.95)


# ------------------------------------------------------------------ medians and Cauchy


def test_magnitude_medians_hand_example():
    o_hat = np.array([0.6, 0.8, 0.7, 0.9, 0.55, 0.95, 0.65])
    y_hat = np.array([0, 0, 0, 1, 1, 1, 0])
    bins = np.array([1, 1, 1, 2, 0, 2, 3])
    med = cal.magnitude_medians(o_hat, y_hat, bins, 2)
    assert med.shape == (2, 4)
    assert med[0, 1] == pytest.approx(0.7)
    assert med[1, 2] == pytest.approx(0.925)  # even count ⇒ mean of the middle two
    assert med[1, 0] == pytest.approx(0.55)
    assert med[0, 3] == pytest.approx(0.65)
    assert np.isnan(med[0, 0]) and np.isnan(med[1, 1]) and np.isnan(med[1, 3]) and np.isnan(med[0, 2])


def test_j1_gives_zero_offsets_and_own_min():
    assert cal.cauchy_robust_min([1.3], 0, 0.95) == 1.3
    off = cal.cauchy_offsets([np.array([[0.9, 0.8], [np.nan, 0.99]])], 0.95)
    np.testing.assert_array_equal(off, 0.0)


def test_non_finite_mad_rejects_everything_with_warning():
    with pytest.warns(RuntimeWarning, match="not finite"):
        robust = cal.cauchy_robust_min([1.0, math.inf], 0, 0.95)
    assert robust == math.inf
    # infinities that do not reach the median keep the MAD finite
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isfinite(cal.cauchy_robust_min([1.0, 1.2, math.inf], 0, 0.95))
    # J = 1 without a threshold stays +inf without a Cauchy warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cal.cauchy_robust_min([math.inf], 0, 0.95) == math.inf


def test_offsets_pad_to_longest_round():
    off = cal.cauchy_offsets([np.array([[0.9]]), np.array([[0.92, 0.97]]), np.array([[0.95, 0.99, 0.999]])], 0.9)
    assert off.shape == (1, 3)
    assert off[0, 0] == pytest.approx(0.02 * math.tan(0.4 * math.pi))
    assert off[0, 1] == pytest.approx(0.01 * math.tan(0.4 * math.pi))
    assert off[0, 2] == 0.0
    np.testing.assert_array_equal(cal.lookup_offsets(off, np.array([0, 0]), np.array([1, 7])), [off[0, 1], 0.0])


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("alpha", [0.5, 1.0, 0.3, 1.5, float("nan"), float("inf")])
def test_alpha_out_of_range_raises(alpha):
    with pytest.raises(ValueError, match="alpha"):
        cal.check_alpha(alpha, 2)
    with pytest.raises(ValueError, match="alpha"):
        cal.min_valid_qbin(ALG3_TOY["o"], ALG3_TOY["q"], ALG3_TOY["y"], np.ones(8, bool), 2, alpha)


def test_alpha_inside_range_ok():
    assert cal.check_alpha(0.51, 2) == 0.51
    assert cal.check_alpha(0.95, 10) == 0.95


def test_nan_inputs_raise():
    with pytest.raises(ValueError, match="NaN"):
        cal.v_vector(np.array([[np.nan, 0.5]]), [np.array([0.1]), np.array([0.2])])
    with pytest.raises(ValueError, match="NaN"):
        cal.soft_qbin(np.array([[0.5, 0.5]]), np.array([np.inf]), np.array([0]))
    with pytest.raises(ValueError, match="NaN"):
        cal.min_valid_qbin(np.array([np.nan]), np.array([1.5]), np.array([0]), np.array([True]), 2, 0.9)
    with pytest.raises(ValueError, match="NaN"):
        train_rescaler(np.array([[np.nan, 1.0]]), np.array([1.0]), np.array([0]), RescalerSettings(max_epochs=1))
    with pytest.raises(ValueError, match="lie in"):
        cal.output_ecdfs(np.array([[0.4, 0.6]]), np.array([2]), 2)


# ------------------------------------------------------------------ rescaler training


def _toy_calibration(n=240, C=2, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, C, n)
    v = np.clip(0.35 * rng.random((n, C)) + 0.6 * np.eye(C)[y] * rng.random((n, 1)), 0, 1)
    qt = rng.uniform(0.0, 3.0, n)
    return v, qt, y


def test_rescaler_init_bounds_and_seed():
    W = init_rescaler_weights(3, 7)
    assert W.dtype == np.float32 and W.shape == (3, 3)
    assert np.all(np.abs(W) <= 1 / math.sqrt(3))
    np.testing.assert_array_equal(W, init_rescaler_weights(3, 7))
    assert not np.array_equal(W, init_rescaler_weights(3, 8))


def test_rescaler_training_reduces_loss_and_is_reproducible():
    v, qt, y = _toy_calibration()
    fit = train_rescaler(v, qt, y, RescalerSettings(seed=3, max_epochs=15))
    before = rescaler_loss(fit.W_init, v, qt, y).mean()
    after = rescaler_loss(fit.W, v, qt, y).mean()
    assert after < before
    assert fit.epoch_losses[-1] < fit.epoch_losses[0]
    assert fit.best_loss == fit.epoch_losses.min()
    again = train_rescaler(v, qt, y, RescalerSettings(seed=3, max_epochs=15))
    np.testing.assert_array_equal(fit.W, again.W)
    np.testing.assert_array_equal(fit.epoch_losses, again.epoch_losses)
    other = train_rescaler(v, qt, y, RescalerSettings(seed=4, max_epochs=15))
    assert not np.array_equal(fit.W, other.W)


def _naive_mlx_epochs(W0, v, qt, y, perms, lr=1e-4):
    """Reference: plain per-row Python loop, mx.value_and_grad + mlx.optimizers.Adam(bias_correction=True)."""
    params = {"W": mx.array(W0)}
    opt = optim.Adam(learning_rate=lr, betas=[0.9, 0.999], eps=1e-8, bias_correction=True)
    vg = mx.value_and_grad(_row_loss_mlx)
    Vm = mx.array(v.astype(np.float32))
    Bm = mx.array(np.log(2.0 + qt).astype(np.float32))
    epoch_losses = []
    for perm in perms:
        losses = []
        for i in perm:
            loss, grads = vg(params, Vm[int(i)], Bm[int(i)], mx.array(int(y[i])))
            params.update(opt.apply_gradients(grads, params))
            mx.eval(params, opt.state)
            losses.append(loss.item())
        epoch_losses.append(np.mean(losses))
    return np.array(params["W"]), epoch_losses


def _naive_float64_epochs(W0, v, qt, y, perms, lr, betas=(0.9, 0.999), eps=1e-8):
    """Reference in float64: the textbook per-row loop of MLX's Adam(bias_correction=True) with
    g = (o − e_y) vᵀ, o = softmax(W v ln(2+q~)), from the float32 v and ln(2+q~) that train_rescaler hands on."""
    W = np.asarray(W0, dtype=np.float64).copy()
    v = v.astype(np.float32).astype(np.float64)
    m, s = np.zeros_like(W), np.zeros_like(W)
    b1, b2 = betas
    t, epoch_losses = 0, []
    for perm in perms:
        losses = []
        for i in perm:
            t += 1
            lb = float(np.float32(math.log(2.0 + float(qt[i]))))
            logits = W @ v[i] * lb
            top = logits.max()
            lse = top + math.log(np.exp(logits - top).sum())
            losses.append((lse - logits[y[i]]) / lb)
            g = np.outer(np.exp(logits - lse) - np.eye(len(W))[y[i]], v[i])
            m = b1 * m + (1 - b1) * g
            s = b2 * s + (1 - b2) * g * g
            W = W - (lr / (1 - b1**t)) * m / (np.sqrt(s) / math.sqrt(1 - b2**t) + eps)
        epoch_losses.append(np.mean(losses))
    return W, epoch_losses


@pytest.mark.parametrize("engine", ["numpy", "array", "mlx"])
def test_rescaler_sequential_batch1_semantics(engine, monkeypatch):
    """Every engine runs MLX's Adam per row: the float32 ones ("array": the NumPy array loop, "mlx") agree with a
    naive float32 MLX loop, the float64 scalar loop (what "numpy" runs for C <= 8) with a naive float64 loop."""
    from sdm_mlx.calibration import rescaler

    if engine == "array":
        monkeypatch.setitem(rescaler._ENGINES, "numpy", rescaler._NumpyEngine)
    v, qt, y = _toy_calibration(n=24, C=3, seed=5)
    seed, epochs, lr = 11, 2, 1e-2  # a large lr makes every step visible
    fit = train_rescaler(v, qt, y, RescalerSettings(seed=seed, max_epochs=epochs, learning_rate=lr,
                                                    engine="mlx" if engine == "mlx" else "numpy", patience=100))
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(len(y)) for _ in range(epochs)]
    assert fit.best_epoch == epochs - 1
    if engine == "numpy":
        W_ref, losses_ref = _naive_float64_epochs(init_rescaler_weights(3, seed), v, qt, y, perms, lr=lr)
        np.testing.assert_allclose(fit.epoch_losses, losses_ref, rtol=1e-12)
        np.testing.assert_allclose(fit.W, W_ref.astype(np.float32), rtol=1e-6, atol=1e-7)  # W rounded to float32
        return
    W_ref, losses_ref = _naive_mlx_epochs(init_rescaler_weights(3, seed), v, qt, y, perms, lr=lr)
    np.testing.assert_allclose(fit.epoch_losses, losses_ref, rtol=1e-5)
    np.testing.assert_allclose(fit.W, W_ref, rtol=1e-5, atol=1e-6)


def test_rescaler_early_stopping_and_best_weights():
    v, qt, y = _toy_calibration(n=60, seed=2)
    # a huge learning rate makes the epoch loss bounce so the patience rule fires
    fit = train_rescaler(v, qt, y, RescalerSettings(seed=1, max_epochs=300, learning_rate=0.5, patience=2))
    h = fit.epoch_losses
    assert fit.best_loss == h.min() and h[fit.best_epoch] == fit.best_loss
    if fit.stopped_early:
        assert fit.epochs_run < 300
        # the stopping epochs: the last patience+1 = 3 epochs are all strictly worse than the best
        assert np.all(h[-3:] > fit.best_loss)
    # the kept weights are those at the end of the best epoch
    rerun = train_rescaler(v, qt, y, RescalerSettings(seed=1, max_epochs=fit.best_epoch + 1, learning_rate=0.5,
                                                      patience=2))
    np.testing.assert_array_equal(rerun.epoch_losses, h[: fit.best_epoch + 1])
    assert rerun.best_epoch == fit.best_epoch
    np.testing.assert_array_equal(fit.W, rerun.W)


def test_rescaler_patience_counter_semantics():
    # patience 0: stop at the first epoch strictly worse than the best
    v, qt, y = _toy_calibration(n=40, seed=4)
    fit = train_rescaler(v, qt, y, RescalerSettings(seed=0, max_epochs=200, learning_rate=0.5, patience=0))
    h = fit.epoch_losses
    if fit.stopped_early:
        assert h[-1] > np.min(h[:-1])
        running_best = np.minimum.accumulate(h[:-1])
        assert np.all(h[1:-1] <= running_best[:-1])  # no earlier epoch was worse than its best


def test_rescaler_loss_matches_mlx_definition():
    v, qt, y = _toy_calibration(n=5, C=3, seed=9)
    W = init_rescaler_weights(3, 0)
    ours = rescaler_loss(W, v, qt, y)
    for i in range(5):
        ref = _row_loss_mlx({"W": mx.array(W)}, mx.array(v[i].astype(np.float32)),
                            mx.array(np.float32(math.log(2 + qt[i]))), mx.array(int(y[i]))).item()
        assert ours[i] == pytest.approx(ref, rel=1e-5)
    # no eps floor: an extremely wrong row still has a large finite loss
    big = rescaler_loss(np.array([[500.0, 0.0], [0.0, 0.0]]), np.array([[1.0, 0.0]]), np.array([1.0]), np.array([1]))
    assert big[0] == pytest.approx(500.0, rel=1e-6)


# ------------------------------------------------------------------ rounds and the estimator


def _synthetic_round_inputs(n=400, C=2, seed=0, acc=0.97):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, C, n)
    correct = rng.random(n) < acc
    y_hat = np.where(correct, y, (y + 1) % C)
    conf = np.where(correct, rng.uniform(0.7, 0.999, n), rng.uniform(0.5, 0.7, n))
    sdm = np.full((n, C), 0.0)
    sdm[:] = ((1 - conf) / (C - 1))[:, None]
    sdm[np.arange(n), y_hat] = conf
    q = np.where(correct, rng.integers(5, 60, n), rng.integers(0, 3, n)).astype(np.float32)
    return sdm.astype(np.float32), q, y, y_hat


W4 = np.eye(2, dtype=np.float32) * 4  # a fixed W'' that finds thresholds on the synthetic rounds


def test_calibrate_round_end_to_end_and_alpha_split():
    sdm, q, y, y_hat = _synthetic_round_inputs()
    rnd = cal.calibrate_round(sdm, q, y, y_hat, alpha=0.9,
                              rescaler=RescalerSettings(seed=0, max_epochs=15, learning_rate=1e-3))
    assert rnd.rescaler is not None and rnd.rescaler.epoch_losses[-1] < rnd.rescaler.epoch_losses[0]
    C = 2
    assert rnd.W.dtype == np.float32 and rnd.W.shape == (C, C)
    assert math.isfinite(rnd.min_valid) and np.all(rnd.psi >= 0.9)
    # OOD rows carry q~ = 0 and bin 0; non-OOD rows have floor(q~) ≥ 1 and a unique argmax at ŷ
    assert np.all(rnd.q_tilde[~rnd.non_ood] == 0) and np.all(rnd.hard_bin[~rnd.non_ood] == 0)
    assert np.all(np.floor(rnd.q_tilde[rnd.non_ood]) >= 1)
    np.testing.assert_array_equal(rnd.hard_bin[rnd.non_ood], np.floor(rnd.q_tilde[rnd.non_ood]))
    assert sum(a.size for a in rnd.sample_size_arrays) == len(y)
    # Alg. 3 re-run from the stored arrays agrees, and a new α needs no retraining
    mv, psi = cal.min_valid_qbin(rnd.o_true, rnd.q_tilde, rnd.y, rnd.non_ood, C, 0.9)
    assert mv == rnd.min_valid and np.array_equal(psi, rnd.psi)
    r95 = rnd.with_alpha(0.95)
    assert r95.min_valid >= rnd.min_valid and np.array_equal(r95.W, rnd.W)
    # serialisation round trip
    arrays, meta = rnd.to_arrays()
    back = cal.RoundCalibration.from_arrays(arrays, meta)
    for name in ("W", "v", "q_tilde", "o_true", "psi", "hard_bin", "non_ood"):
        np.testing.assert_array_equal(getattr(back, name), getattr(rnd, name))
    np.testing.assert_array_equal(back.medians, rnd.medians)
    for a, b in zip(back.output_ecdfs, rnd.output_ecdfs):
        np.testing.assert_array_equal(a, b)
    # calibration rows re-estimated: the estimator's centroid reproduces the round's processed q~ and o
    out = cal.estimate(cal.Calibration.from_round(rnd, rnd.min_valid, np.zeros((C, 0))), np.log(sdm), q, np.ones(len(q)), sdm)
    np.testing.assert_allclose(out.centroid.q_tilde, rnd.q_tilde)
    np.testing.assert_allclose(out.centroid.o, rnd.o)


def test_aggregate_and_estimate_hand_checked_row():
    sdm, q, y, y_hat = _synthetic_round_inputs(seed=1)
    rounds = [cal.calibrate_round(*_synthetic_round_inputs(seed=s), alpha=0.9, W=W4) for s in range(3)]
    robust, offsets = cal.aggregate_rounds(rounds, best_index=1, alpha=0.9)
    mvs = [r.min_valid for r in rounds]
    assert robust == pytest.approx(mvs[1] + cal.mad(mvs) * math.tan(0.4 * math.pi))
    best = rounds[1]
    z = np.log(sdm)
    d = np.ones(len(q))
    out = cal.estimate(cal.Calibration.from_round(best, robust, offsets), z, q, d, sdm)
    assert set(np.unique(out.rejection_reason)) <= set(cal.REJECTION_REASONS) | {""}
    np.testing.assert_array_equal(out.admitted, out.rejection_reason == "")
    adm = out.admitted
    assert adm.any() and (~adm).any()
    assert np.all(out.lower.q_tilde[adm] >= robust)
    assert np.all(out.p_hat[adm] >= best.psi[out.prediction[adm]])
    assert np.all(np.isnan(out.p_hat[~adm]))
    # recompute one admitted row by hand
    i = int(np.flatnonzero(adm)[0])
    yh = int(out.prediction[i])
    v = cal.v_vector(sdm[i:i + 1], best.output_ecdfs)[0]
    qt = v[yh] * math.log(2 + q[i])
    assert out.centroid.q_tilde[i] == pytest.approx(qt)
    n_hat = [min(int(np.searchsorted(a, qt, side="left")), a.size - 1) for a in best.sample_size_arrays]
    np.testing.assert_array_equal(out.n_hat[i], n_hat)
    eps = [math.sqrt(math.log(2 / 0.1) / (2 * n)) if n > 0 else 1.0 for n in n_hat]
    v_low = np.array([min(max(v[c] + (-eps[c] if c == yh else eps[c]), 0), 1) for c in range(2)])
    qt_low = v_low[yh] * math.log(2 + q[i])
    assert out.lower.q_tilde[i] == pytest.approx(qt_low)
    logits = (best.W.astype(np.float64) @ v_low) * math.log(2 + qt_low)
    o_low = np.exp(logits - logits.max())
    o_low /= o_low.sum()
    m = offsets[yh, int(math.floor(qt_low))] if int(math.floor(qt_low)) < offsets.shape[1] else 0.0
    assert out.lower.p[i] == pytest.approx(min(max(o_low[yh] - m, 0.0), 1.0))
    assert out.lower.offset[i] == pytest.approx(m)


def _estimate_inputs(sdm_rows, q, W=None, psi=(0.9, 0.9), min_valid=1.0, robust=1.2, offsets=None, arrays=None):
    sdm_rows = np.asarray(sdm_rows, dtype=np.float32)
    C = sdm_rows.shape[1]
    ecdfs = [np.linspace(0.05, 0.95, 19).astype(np.float32) for _ in range(C)]
    if arrays is None:
        arrays = [np.linspace(0.0, 3.0, 200) for _ in range(C)]
    calibration = cal.Calibration(
        alpha=0.9, W=np.eye(C, dtype=np.float32) * 8 if W is None else W, psi=np.array(psi), min_valid=min_valid,
        robust_min_valid=robust, offsets=np.zeros((C, 0)) if offsets is None else offsets, output_ecdfs=ecdfs,
        sample_size_arrays=arrays,
    )
    return dict(calibration=calibration, z=np.log(np.maximum(sdm_rows, 1e-6)), q=np.asarray(q, dtype=np.float32),
                d=np.ones(len(q)), sdm=sdm_rows)


def test_estimate_reasons_and_precedence():
    # v_ŷ = 1 (saturated) for the [0.99, 0.01] rows, so q~ = ln(2+q); sample sizes ⇒ ε_ŷ ≈ 0.09-0.12
    rows = [
        [0.99, 0.01],  # 0: q = 60: q~_lower ≈ 3.8 ⇒ admitted
        [0.5, 0.5],    # 1: SDM tie (d = 0) ⇒ argmax_flip
        [0.99, 0.01],  # 2: q = 0 ⇒ q~ ≤ ln 2 ⇒ ood_similarity
        [0.99, 0.01],  # 3: q = 3: q~_lower ≈ 1.4 < model min 2.0 ⇒ below_model_min_qbin
        [0.99, 0.01],  # 4: q = 20: q~_lower ≈ 2.8 ∈ [2.0, 2.9) ⇒ below_robust_min_qbin
    ]
    q = [60, 60, 0, 3, 20]
    args = _estimate_inputs(rows, q, min_valid=2.0, robust=2.9)
    out = cal.estimate(**args)
    reasons = list(out.rejection_reason)
    assert reasons[0] == ""
    assert reasons[1] == "argmax_flip" and out.sdm_flip[1] and out.centroid.q_tilde[1] == 0
    assert reasons[2] == "ood_similarity" and out.lower.q_tilde[2] == 0
    assert out.lower.hard_bin[2] == 0 and out.lower.ood[2]
    assert reasons[3] == "below_model_min_qbin" and 1.0 <= out.lower.q_tilde[3] < 2.0
    assert reasons[4] == "below_robust_min_qbin" and 2.0 <= out.lower.q_tilde[4] < 2.9
    assert np.array_equal(out.admitted, np.array([r == "" for r in reasons]))

    # model-level reasons come first
    out = cal.estimate(**_estimate_inputs(rows, q, min_valid=math.inf, robust=math.inf))
    assert set(out.rejection_reason) == {"no_valid_threshold"} and not out.admitted.any()
    out = cal.estimate(**_estimate_inputs(rows, q, min_valid=1.0, robust=math.inf))
    assert set(out.rejection_reason) == {"no_robust_threshold"} and not out.admitted.any()


def test_estimate_below_robust_min_and_psi():
    rows = [[0.99, 0.01], [0.99, 0.01]]
    args = _estimate_inputs(rows, [60, 60], min_valid=1.0, robust=10.0)
    assert list(cal.estimate(**args).rejection_reason) == ["below_robust_min_qbin"] * 2
    args = _estimate_inputs(rows, [60, 60], psi=(0.9999999, 0.9), min_valid=1.0, robust=1.0)
    out = cal.estimate(**args)
    assert list(out.rejection_reason) == ["below_threshold_psi"] * 2
    assert np.all(np.isnan(out.p_hat))


def test_estimate_rescaled_argmax_flip():
    # W'' swaps the classes: o's argmax ≠ ŷ ⇒ OOD with q~ := 0 for every variant, reason argmax_flip
    W = np.array([[0.0, 8.0], [8.0, 0.0]], dtype=np.float32)
    out = cal.estimate(**_estimate_inputs([[0.99, 0.01], [0.02, 0.98]], [60, 60], W=W, robust=1.0))
    assert list(out.rejection_reason) == ["argmax_flip", "argmax_flip"]
    for variant in (out.centroid, out.lower, out.upper):
        np.testing.assert_array_equal(variant.q_tilde, 0.0)
        np.testing.assert_array_equal(variant.hard_bin, 0)
    # n̂ from the processed centroid q~ = 0 ⇒ 0 ⇒ ε = 1
    np.testing.assert_array_equal(out.n_hat, 0)
    np.testing.assert_array_equal(out.epsilon, 1.0)
    # o is reported (not recomputed with q~ = 0) and its argmax is the other class
    assert out.centroid.o[0].argmax() == 1


def test_estimate_offsets_use_each_variants_own_bin():
    offsets = np.array([[0.0, 0.01, 0.02, 0.03, 0.04], [0.0, 0.0, 0.0, 0.0, 0.0]])
    args = _estimate_inputs([[0.97, 0.03]], [60], offsets=offsets, min_valid=1.0, robust=1.0, psi=(0.5, 0.5))
    out = cal.estimate(**args)
    for variant in (out.centroid, out.lower, out.upper):
        b = int(variant.hard_bin[0])
        assert variant.offset[0] == offsets[0, b]
        assert variant.p[0] == pytest.approx(min(max(variant.o[0, 0] - offsets[0, b], 0), 1))
    assert out.lower.hard_bin[0] < out.upper.hard_bin[0]  # the bins differ between variants


def test_estimate_class_without_calibration_rows():
    # class 1 never occurs in calibration: its output eCDF and sample-size array are empty
    sdm, q, y, y_hat = _synthetic_round_inputs(n=200, seed=3)
    y = np.zeros_like(y)
    rnd = cal.calibrate_round(sdm, q, y, y_hat, alpha=0.9, rescaler=RescalerSettings(seed=0, max_epochs=5))
    assert rnd.output_ecdfs[1].size == 0 and rnd.sample_size_arrays[1].size == 0
    np.testing.assert_array_equal(rnd.v[:, 1], 0.0)
    assert rnd.min_valid == math.inf and np.all(rnd.psi == 0)  # empty class ⇒ ψ = 0 ⇒ no threshold
    robust, offsets = cal.aggregate_rounds([rnd], 0, 0.9)
    assert robust == math.inf
    out = cal.estimate(cal.Calibration.from_round(rnd, robust, offsets), np.log(sdm), q, np.ones(len(q)), sdm)
    np.testing.assert_array_equal(out.n_hat[:, 1], -1)
    np.testing.assert_array_equal(out.epsilon[:, 1], 1.0)
    assert not out.admitted.any()
    assert set(out.rejection_reason) == {"no_valid_threshold"}


def test_non_finite_mad_round_aggregation_rejects_all():
    rounds = [cal.calibrate_round(*_synthetic_round_inputs(seed=s), alpha=0.9, W=W4) for s in range(2)]
    rounds[1] = cal.RoundCalibration(**{**rounds[1].__dict__, "min_valid": math.inf})
    with pytest.warns(RuntimeWarning, match="rejected"):
        robust, _ = cal.aggregate_rounds(rounds, 0, 0.9)
    assert robust == math.inf
    sdm, q, _, _ = _synthetic_round_inputs(seed=7)
    out = cal.estimate(cal.Calibration.from_round(rounds[0], robust, np.zeros((2, 0))), np.log(sdm), q, np.ones(len(q)), sdm)
    assert not out.admitted.any() and set(out.rejection_reason) == {"no_robust_threshold"}


def test_j1_round_aggregation():
    rnd = cal.calibrate_round(*_synthetic_round_inputs(seed=2), alpha=0.9, W=W4)
    assert math.isfinite(rnd.min_valid)
    robust, offsets = cal.aggregate_rounds([rnd], 0, 0.9)
    assert robust == rnd.min_valid
    np.testing.assert_array_equal(offsets, 0.0)
    # aggregation at another α re-thresholds from the stored arrays
    robust95, _ = cal.aggregate_rounds([rnd], 0, 0.95)
    assert robust95 == rnd.with_alpha(0.95).min_valid


def test_estimate_empty_batch_and_no_offsets():
    args = _estimate_inputs(np.zeros((0, 2)), np.zeros(0), offsets=None)
    args["calibration"] = dataclasses.replace(args["calibration"], offsets=None)
    out = cal.estimate(**args)
    assert out.admitted.shape == (0,) and out.n_hat.shape == (0, 2)
    args = _estimate_inputs([[0.99, 0.01]], [60], min_valid=1.0, robust=1.0, psi=(0.5, 0.5))
    args["calibration"] = dataclasses.replace(args["calibration"], offsets=None)
    out = cal.estimate(**args)
    assert out.admitted[0] and out.lower.offset[0] == 0.0
    assert out.p_hat[0] == out.lower.p[0] == pytest.approx(out.lower.o[0, 0])
    assert out.lower.p[0] <= out.centroid.p[0] <= out.upper.p[0]
