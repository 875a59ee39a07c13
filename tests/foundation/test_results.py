"""The typed results: immutable, and the JSON row schema and the verifier's verdict derive from the fields."""

import dataclasses

import numpy as np
import pytest

from sdm_mlx import calibration as cal
from sdm_mlx.errors import InputError
from sdm_mlx.results import ROW_COLUMNS, VERDICT_FLOAT_KEYS, VERDICT_KEYS, Estimate, Predictions, Variant
from sdm_mlx.verified.verification import VERIFIER_FIELDS

#: the JSON keys of a row as published before the typed results (users and tests depend on them)
PUBLISHED_KEYS = {"id", "prediction", "admitted", "rejection_reason", "p_lower", "p_centroid", "p_upper", "q", "d0",
                  "d", "logits", "sdm", "q_tilde", "hard_bin", "q_tilde_lower", "hard_bin_lower", "q_tilde_upper",
                  "hard_bin_upper", "n_hat", "offset"}
#: the nested calibration's per-row keys (DESIGN #25)
NESTED_KEYS = {"alpha_region_lower", "alpha_region_centroid", "decision"}


def _estimate(n=3, C=2):
    rng = np.random.default_rng(0)
    sdm = rng.dirichlet(np.ones(C), n).astype(np.float32)
    ecdfs = [np.linspace(0.05, 0.95, 19) for _ in range(C)]
    calibration = cal.Calibration(alpha=0.9, W=np.eye(C, dtype=np.float32) * 8, psi=np.full(C, 0.9), min_valid=1.0,
                                  robust_min_valid=1.2, offsets=None, output_ecdfs=ecdfs,
                                  sample_size_arrays=[np.linspace(0, 3, 200)] * C)
    return cal.estimate(calibration, np.log(sdm), np.full(n, 30.0), np.ones(n), sdm), sdm


def test_schema_is_derived_from_the_fields():
    keys = [c.key for c in ROW_COLUMNS]
    assert len(keys) == len(set(keys)) and set(keys) == PUBLISHED_KEYS | NESTED_KEYS
    # every exported field of Variant appears once per exporting variant, with the variant's key
    exported = [f for f in dataclasses.fields(Variant) if "json" in f.metadata]
    assert {"p", "q_tilde", "hard_bin", "offset"} == {f.name for f in exported}
    assert {c.path for c in ROW_COLUMNS if c.key == "q_tilde_upper"} == {("estimate", "upper", "q_tilde")}
    assert VERIFIER_FIELDS == VERDICT_KEYS
    assert set(VERDICT_KEYS) == {"prediction", "admitted", "rejection_reason", "p_lower", "p_centroid", "p_upper",
                                 "q", "d0", "d", "q_tilde_lower", "hard_bin_lower"} | NESTED_KEYS
    assert set(VERDICT_FLOAT_KEYS) == {"p_lower", "p_centroid", "p_upper", "d0", "d", "q_tilde_lower"}


def test_estimate_is_immutable_and_rows_follow_it():
    est, sdm = _estimate()
    assert isinstance(est, Estimate) and len(est) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        est.admitted = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        est.lower.p = None
    pred = Predictions(ids=["a", "b", "c"], estimate=est, q=np.full(3, 30), d0=np.zeros(3), d=np.ones(3),
                       logits=np.log(sdm), sdm=sdm, exemplar_index=np.full((3, 0), -1),
                       exemplar_distance=np.zeros((3, 0)), class_names=["neg", "pos"])
    rows = pred.to_dicts()
    assert [r["id"] for r in rows] == ["a", "b", "c"]
    for i, r in enumerate(rows):
        assert r["p_lower"] == float(est.lower.p[i]) and r["q_tilde"] == float(est.centroid.q_tilde[i])
        assert r["offset"] == float(est.lower.offset[i]) and r["hard_bin_upper"] == int(est.upper.hard_bin[i])
        assert r["rejection_reason"] == (est.rejection_reason[i] or None)
        assert r["prediction_name"] == ["neg", "pos"][r["prediction"]] and r["exemplars"] == []
    np.testing.assert_array_equal(pred.q_tilde_lower, est.lower.q_tilde)  # each JSON key is also an attribute
    with pytest.raises(AttributeError):
        pred.no_such_column
    np.testing.assert_array_equal(est.p_hat, np.where(est.admitted, est.lower.p, np.nan))


def test_alpha_levels_are_checked_by_one_validator():
    with pytest.raises(InputError, match=r"alpha must lie in \(0, 1\)"):
        cal.dkw_epsilon(np.ones(2), 1.0)
    with pytest.raises(InputError, match="alpha must be a number"):
        cal.check_alpha(True, 2)
