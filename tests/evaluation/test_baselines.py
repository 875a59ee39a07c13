"""Known-answer tests for sdm_mlx.evaluation.baselines."""

import math

import numpy as np
import pytest
from scipy.special import softmax

from sdm_mlx.evaluation import baselines as B
from sdm_mlx.evaluation.metrics import REPORT_KEYS


def logits_of(p):
    """Logits whose softmax is exactly the (row-normalised) probabilities p."""
    return np.log(np.asarray(p, dtype=np.float64))


# --------------------------------------------------------------------------- no reject / softmax


def test_no_reject_admits_all_argmax_lowest_tie():
    z = np.array([[0.0, 1.0, 1.0], [2.0, 2.0, 0.0], [0.0, 0.0, 5.0]])
    est = B.NoReject().fit(z, [1, 0, 2], 0.95)
    y_pred, admitted, score = est.predict(z)
    assert y_pred.tolist() == [1, 0, 2]
    assert admitted.dtype == bool and admitted.all()
    np.testing.assert_allclose(score, softmax(z, axis=1).max(axis=1))


def test_softmax_threshold_fixed_logits():
    z = np.array([
        logits_of([0.96, 0.04]),
        logits_of([0.94, 0.06]),
        [0.0, 0.0],
        [3.0, 0.0],      # sigmoid(3) = 0.9526 >= 0.95
        [0.0, 2.9],      # sigmoid(2.9) = 0.9478 < 0.95
    ])
    est = B.SoftmaxThreshold().fit(z, [0, 0, 0, 0, 1], 0.95)
    y_pred, admitted, score = est.predict(z)
    assert y_pred.tolist() == [0, 0, 0, 0, 1]
    assert admitted.tolist() == [True, False, False, True, False]
    np.testing.assert_allclose(score, [0.96, 0.94, 0.5, 1 / (1 + math.exp(-3)), 1 / (1 + math.exp(-2.9))])


def test_predict_before_fit_and_bad_inputs():
    for cls in (B.NoReject, B.SoftmaxThreshold, B.TemperatureScaling, B.APS, B.RAPS):
        with pytest.raises(RuntimeError):
            cls().predict(np.zeros((2, 2)))
    est = B.SoftmaxThreshold()
    with pytest.raises(ValueError):
        est.fit(np.zeros((2, 2)), [0, 2], 0.9)         # label out of range
    with pytest.raises(ValueError):
        est.fit(np.zeros(4), [0, 1], 0.9)              # not 2-D
    with pytest.raises(ValueError):
        est.fit(np.zeros((2, 2)), [0, 1], 0.0)         # alpha out of (0, 1]
    with pytest.raises(ValueError):
        est.fit(np.array([[0.0, np.nan]]), [0], 0.9)   # non-finite
    est.fit(np.zeros((2, 2)), [0, 1], 0.9)
    with pytest.raises(ValueError):
        est.predict(np.zeros((2, 3)))                  # class count mismatch


# --------------------------------------------------------------------------- temperature


def _tempered_data(n, c, t_true, seed):
    rng = np.random.default_rng(seed)
    base = rng.normal(0.0, 2.0, size=(n, c))              # the "true" logits
    p = softmax(base, axis=1)
    y = (p.cumsum(axis=1) > rng.uniform(size=(n, 1))).argmax(axis=1)  # y ~ Categorical(p)
    return base * t_true, y                                 # z / t_true are the true logits


@pytest.mark.parametrize("t_true", [0.5, 1.0, 2.5])
def test_temperature_recovers_known_T(t_true):
    z, y = _tempered_data(20000, 3, t_true, seed=int(t_true * 10))
    t = B.fit_temperature(z, y)
    assert t == pytest.approx(t_true, rel=0.04)


def test_temperature_scaling_admission_uses_fitted_T():
    z, y = _tempered_data(5000, 3, 2.5, seed=1)
    est = B.TemperatureScaling().fit(z, y, 0.9)
    T = est.temperature
    z_test = np.array([[4.0, 0.0, 0.0], [9.0, 0.0, 0.0], [0.0, 12.0, 1.0]])
    y_pred, admitted, score = est.predict(z_test)
    expected = softmax(z_test / T, axis=1).max(axis=1)
    np.testing.assert_allclose(score, expected)
    assert y_pred.tolist() == [0, 0, 1]                     # T > 0 keeps the argmax
    assert admitted.tolist() == (expected >= 0.9).tolist()
    # with T ≈ 2.5: softmax([4,0,0]/2.5) max ≈ 0.71 (rejected); [9,0,0] ≈ 0.95 (admitted)
    assert admitted.tolist() == [False, True, True]
    params = est.get_params()
    assert params["temperature"] == T and params["name"] == "temperature"


def test_temperature_separable_hits_lower_bound():
    z = np.array([[5.0, -5.0], [-5.0, 5.0]])
    t = B.fit_temperature(z, [0, 1], bounds=(1e-2, 1e2))
    # the NLL decreases as T -> 0 and underflows to 0 well before the bound: any small T is optimal
    assert t < 0.2


# --------------------------------------------------------------------------- conformal helpers


def test_conformal_quantile_rank():
    s = [0.7, 0.9, 0.8, 1.0]
    assert B.conformal_quantile(s, 0.6) == 0.9          # ceil(5*0.6) = 3rd smallest
    assert B.conformal_quantile(s, 0.8) == 1.0          # ceil(4.0)  = 4th
    assert B.conformal_quantile(s, 0.81) == math.inf    # ceil(4.05) = 5 > n
    assert B.conformal_quantile(np.arange(19), 0.95) == 18.0   # (19+1)*0.95 = 19 exactly
    assert B.conformal_quantile(np.arange(18), 0.95) == math.inf
    with pytest.raises(ValueError):
        B.conformal_quantile([], 0.9)


CAL_P = [[0.7, 0.2, 0.1],    # y=0: rank 1            -> E = 0.7
         [0.5, 0.3, 0.2],    # y=1: rank 2            -> E = 0.8
         [0.6, 0.3, 0.1],    # y=2: rank 3            -> E = 1.0
         [0.9, 0.05, 0.05]]  # y=0: rank 1            -> E = 0.9
CAL_Y = [0, 1, 2, 0]


def test_conformal_scores_by_hand():
    np.testing.assert_allclose(B.conformal_scores(CAL_P, CAL_Y), [0.7, 0.8, 1.0, 0.9])
    # RAPS penalty λ(o - k_reg)^+, λ = 0.1, k_reg = 1: ranks 1, 2, 3, 1
    np.testing.assert_allclose(B.conformal_scores(CAL_P, CAL_Y, lam=0.1, k_reg=1),
                               [0.7, 0.9, 1.2, 0.9])
    # k_reg = 0 penalises rank 1 as well
    np.testing.assert_allclose(B.conformal_scores(CAL_P, CAL_Y, lam=0.1, k_reg=0),
                               [0.8, 1.0, 1.3, 1.0])
    # randomised: ρ + u·π̂(y)
    np.testing.assert_allclose(B.conformal_scores(CAL_P, CAL_Y, u=[0.5, 0.5, 0.0, 1.0]),
                               [0.35, 0.5 + 0.15, 0.9, 0.9])


def test_prediction_set_sizes_by_hand():
    p = np.array([[0.95, 0.03, 0.02], [0.85, 0.1, 0.05], [0.4, 0.35, 0.25]])
    sizes, order = B.prediction_set_sizes(p, 0.9)
    # cumsums: .95 | .85, .95 | .40, .75, 1.0  -> |{E_j <= .9}| + 1
    assert sizes.tolist() == [1, 2, 3]
    assert order[:, 0].tolist() == [0, 0, 0]
    sizes, _ = B.prediction_set_sizes(p, math.inf)
    assert sizes.tolist() == [3, 3, 3]
    # k_reg = 0, λ = 0.1: E_1 = π̂_max + 0.1 -> row 0: 1.05 > .9 (size 1); row 1: .95 > .9 (size 1)
    sizes, _ = B.prediction_set_sizes(p, 0.9, lam=0.1, k_reg=0)
    assert sizes.tolist() == [1, 1, 2]
    # randomised: row 1 (L = 2, I_L = class 1): V = (0.9 - 0.85)/0.1 = 0.5
    sizes, _ = B.prediction_set_sizes(p, 0.9, u=[0.0, 0.4, 0.0])
    assert sizes.tolist()[1] == 2
    sizes, _ = B.prediction_set_sizes(p, 0.9, u=[0.0, 0.6, 0.0])
    assert sizes.tolist()[1] == 1
    # row 0 (L = 1): V = 0.9 / 0.95 -> u = 0.99 empties the set; kept empty only if allowed
    sizes, _ = B.prediction_set_sizes(p, 0.9, u=[0.99, 0.0, 0.0])
    assert sizes.tolist()[0] == 1
    sizes, _ = B.prediction_set_sizes(p, 0.9, u=[0.99, 0.0, 0.0], allow_zero_sets=True)
    assert sizes.tolist()[0] == 0


# --------------------------------------------------------------------------- APS / RAPS


def test_aps_threshold_and_singletons_by_hand():
    est = B.APS().fit(logits_of(CAL_P), CAL_Y, 0.6)
    assert est.tau == pytest.approx(0.9)             # 3rd smallest of {.7, .8, 1.0, .9}
    z = logits_of([[0.95, 0.03, 0.02], [0.85, 0.1, 0.05], [0.4, 0.35, 0.25], [0.02, 0.97, 0.01]])
    y_pred, admitted, score = est.predict(z)
    assert y_pred.tolist() == [0, 0, 0, 1]
    assert admitted.tolist() == [True, False, False, True]
    np.testing.assert_allclose(score, [0.95, 0.85, 0.4, 0.97])
    assert est.set_sizes(z).tolist() == [1, 2, 3, 1]
    sets = est.predict_sets(z)
    assert sets.tolist() == [[True, False, False], [True, True, False],
                             [True, True, True], [False, True, False]]


def test_aps_too_few_calibration_points_rejects_all():
    est = B.APS().fit(logits_of(CAL_P), CAL_Y, 0.9)      # ceil(5*0.9) = 5 > 4
    assert est.tau == math.inf
    _, admitted, _ = est.predict(logits_of([[0.999, 0.0005, 0.0005]]))
    assert not admitted.any()
    assert est.get_params()["tau"] is None and est.get_params()["tau_is_infinite"] is True


CAL4_P = [[0.6, 0.2, 0.1, 0.1],   # y=0 rank 1: APS .6,  RAPS(λ=.5, k_reg=1) .6
          [0.5, 0.3, 0.1, 0.1],   # y=1 rank 2: APS .8,  RAPS .8 + .5 = 1.3
          [0.7, 0.1, 0.1, 0.1],   # y=0 rank 1: APS .7,  RAPS .7
          [0.4, 0.3, 0.2, 0.1]]   # y=3 rank 4: APS 1.0, RAPS 1.0 + 1.5 = 2.5
CAL4_Y = [0, 1, 0, 3]


def test_raps_penalty_effect_by_hand():
    aps = B.APS().fit(logits_of(CAL4_P), CAL4_Y, 0.6)
    raps = B.RAPS(lam=0.5, k_reg=1).fit(logits_of(CAL4_P), CAL4_Y, 0.6)
    assert aps.tau == pytest.approx(0.8)    # 3rd smallest of {.6, .8, .7, 1.0}
    assert raps.tau == pytest.approx(1.3)   # 3rd smallest of {.6, 1.3, .7, 2.5}
    flat = logits_of([[0.28, 0.26, 0.24, 0.22]])
    # APS: cumsum .28, .54, .78 <= .8 < 1.0 -> size 4.
    # RAPS: .28, .54+.5 = 1.04 <= 1.3 < .78+1.0 -> size 3 (the penalty shrinks flat sets)
    assert aps.set_sizes(flat).tolist() == [4]
    assert raps.set_sizes(flat).tolist() == [3]
    conf = logits_of([[0.9, 0.05, 0.03, 0.02]])
    # APS: π̂_max = .9 > .8 -> singleton, admitted
    assert aps.set_sizes(conf).tolist() == [1]
    assert aps.predict(conf)[1].tolist() == [True]
    # RAPS: E_1 = .9 <= 1.3, E_2 = .95 + .5 = 1.45 > 1.3 -> size 2, rejected
    assert raps.set_sizes(conf).tolist() == [2]
    assert raps.predict(conf)[1].tolist() == [False]


def test_raps_k_reg_zero_penalises_top_rank():
    # calibration scores with λ = .1, k_reg = 0: [.8, 1.0, 1.3, 1.0]; α' = .6 -> 3rd smallest ≈ 1.0
    raps = B.RAPS(lam=0.1, k_reg=0).fit(logits_of(CAL_P), CAL_Y, 0.6)
    assert raps.tau == pytest.approx(1.0)
    # π̂_max = .95: E_1 = 1.05 > 1.0 -> singleton; π̂_max = .85: E_1 = .95, E_2 = .95 + .2 -> size 2
    z = logits_of([[0.95, 0.03, 0.02], [0.85, 0.1, 0.05]])
    assert raps.predict(z)[1].tolist() == [True, False]


def test_raps_lambda_zero_equals_aps():
    rng = np.random.default_rng(3)
    z_cal, z_te = rng.normal(0, 2, (300, 5)), rng.normal(0, 2, (200, 5))
    y_cal = rng.integers(0, 5, 300)
    aps = B.APS().fit(z_cal, y_cal, 0.8)
    raps = B.RAPS(lam=0.0, k_reg=3).fit(z_cal, y_cal, 0.8)
    assert aps.tau == raps.tau
    np.testing.assert_array_equal(aps.set_sizes(z_te), raps.set_sizes(z_te))
    assert B.RAPS().lam == 0.01 and B.RAPS().k_reg == 1 and B.RAPS().randomized is False


def _synthetic(n, c, seed):
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 2.0, (n, c))
    p = softmax(z, axis=1)
    y = (p.cumsum(axis=1) > rng.uniform(size=(n, 1))).argmax(axis=1)
    return z, y


@pytest.mark.parametrize("cls,kw", [(B.APS, {}), (B.RAPS, {}), (B.APS, {"randomized": True}),
                                    (B.RAPS, {"randomized": True, "lam": 0.05, "k_reg": 2})])
def test_conformal_coverage(cls, kw):
    z_cal, y_cal = _synthetic(3000, 5, 11)
    z_te, y_te = _synthetic(6000, 5, 12)
    est = cls(**kw).fit(z_cal, y_cal, 0.9)
    sets = est.predict_sets(z_te)
    coverage = sets[np.arange(len(y_te)), y_te].mean()
    assert coverage >= 0.88
    if kw.get("randomized"):
        assert coverage <= 0.93            # randomised sets are (nearly) exact
    if not kw.get("randomized"):  # (randomised sets change with each U draw)
        # the admitted rows are exactly the singletons, and each singleton is {argmax}
        y_pred, admitted, _ = est.predict(z_te)
        np.testing.assert_array_equal(admitted, sets.sum(axis=1) == 1)
        assert (sets[admitted].argmax(axis=1) == y_pred[admitted]).all()
        assert 0 < admitted.mean() < 1


def test_randomized_is_seeded():
    z_cal, y_cal = _synthetic(500, 4, 5)
    z_te, _ = _synthetic(300, 4, 6)
    a = B.APS(randomized=True, seed=7).fit(z_cal, y_cal, 0.9)
    b = B.APS(randomized=True, seed=7).fit(z_cal, y_cal, 0.9)
    assert a.tau == b.tau
    np.testing.assert_array_equal(a.predict(z_te)[1], b.predict(z_te)[1])
    c = B.APS(randomized=True, seed=8).fit(z_cal, y_cal, 0.9)
    assert c.tau != a.tau or not np.array_equal(c.set_sizes(z_te), a.set_sizes(z_te))


def test_temperature_scaled_conformal():
    z, y = _tempered_data(4000, 3, 2.5, seed=2)
    est = B.APS(temperature_scale=True).fit(z, y, 0.9)
    assert est.temperature == pytest.approx(2.5, rel=0.08)
    _, _, score = est.predict(z[:5])
    np.testing.assert_allclose(score, softmax(z[:5] / est.temperature, axis=1).max(axis=1))


def test_mlx_arrays_accepted():
    mx = pytest.importorskip("mlx.core")
    z = mx.array([[3.0, 0.0], [0.0, 0.1]])
    y_pred, admitted, _ = B.SoftmaxThreshold().fit(z, mx.array([0, 1]), 0.95).predict(z)
    assert y_pred.tolist() == [0, 1] and admitted.tolist() == [True, False]


# --------------------------------------------------------------------------- registry / run


def test_registry_and_run_baselines():
    assert list(B.BASELINES) == ["no_reject", "softmax", "temperature", "aps", "raps"]
    assert isinstance(B.make_baseline("raps", lam=0.2), B.RAPS)
    with pytest.raises(ValueError):
        B.make_baseline("nope")
    z_cal, y_cal = _synthetic(400, 3, 21)
    z_te, y_te = _synthetic(300, 3, 22)
    out = B.run_baselines(z_cal, y_cal, z_te, y_te, 0.9, options={"raps": {"lam": 0.1}})
    assert list(out) == list(B.BASELINES)
    for rep in out.values():
        assert set(rep) == set(REPORT_KEYS)
    assert out["no_reject"]["marginal"]["admitted_fraction"] == 1.0
    assert out["softmax"]["marginal"]["n_admitted"] == int((softmax(z_te, axis=1).max(axis=1) >= 0.9).sum())
