"""The SDM estimators' admissions across α levels (:mod:`.evaluate`'s steps 2 and the nested ladder): the α' sweep
re-thresholded from cached predictions (Alg. 3 + Cauchy, no retraining) and the admission report at every grid
level of the nested calibration (DESIGN #25)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import numpy as np

from ..calibration import estimate, nested_admissions
from ..calibration.nested import level_admissions
from ..errors import InputError
from .metrics import index_conditional_report


def sweep_point(report: Mapping[str, Any]) -> dict:
    m = report["marginal"]
    return {
        "alpha": report["alpha"],
        "n_admitted": m["n_admitted"],
        "admitted_fraction": m["admitted_fraction"],
        "min_conditional_accuracy": report["min_conditional_accuracy"],
        "marginal_accuracy": m["accuracy"],
        "index_conditional_calibrated": report["index_conditional_calibrated"],
    }


def sdm_admissions(pred) -> dict[str, np.ndarray]:
    """The three SDM estimators' admission decisions from :class:`~sdm_mlx.results.Predictions`."""
    est = getattr(pred, "estimate", None)
    if est is None:
        raise InputError(f"{type(pred).__name__} has no estimate: predictions must come from SDMEstimator.estimate")
    return {"sdm_p_lower": np.asarray(est.lower.valid, dtype=bool),
            "sdm_p_centroid": np.asarray(est.centroid.valid, dtype=bool),
            "sdm_p_upper": np.asarray(est.upper.valid, dtype=bool)}


def _calibration_quietly(estimator, alpha: float, notes: list):
    """``estimator.calibration_at(alpha)`` with its warnings collected into ``notes`` (no stderr noise)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal = estimator.calibration_at(alpha)
    for w in caught:
        msg = f"alpha {alpha:g}: {w.message}"
        if msg not in notes:
            notes.append(msg)
    return cal


def sdm_sweep(estimator, predictions: Mapping[str, Any], alphas: Sequence[float],
              notes: list) -> dict[float, dict[str, dict[str, np.ndarray]]]:
    """Step 2: ``{α': {set: SDM admissions}}``, re-thresholded (Alg. 3 + Cauchy) from the cached z', q, d and
    SDM output of each set's predictions; the estimator is not modified.  Predictions made at the
    estimator's α' are used as they are."""
    out = {}
    for a in alphas:
        if a == float(estimator.alpha):
            out[a] = {n: sdm_admissions(p) for n, p in predictions.items()}
            continue
        cal = _calibration_quietly(estimator, a, notes)
        out[a] = {n: sdm_admissions(SimpleNamespace(estimate=estimate(cal, p.logits, p.q, p.d, p.sdm)))
                  for n, p in predictions.items()}
    return out


def admission_ladder(nested, pred, y: np.ndarray, C: int) -> list[dict]:
    """The admission report at every grid level (DESIGN #25): the nested ladder (admitted at α iff the row's
    lower region ≥ α) with its index-conditional accuracy, the paper's per-level rule (``n_paper``) and how
    many rows nesting adds (``lifted``) or removes (``dropped``) at that level."""
    est = pred.estimate
    y_hat = np.asarray(pred.prediction, dtype=np.int64)
    _, paper, _ = level_admissions(nested, pred.logits, pred.q, pred.d, pred.sdm)
    ladder = nested_admissions(est.alpha_region_lower, nested.grid)
    centroid = nested_admissions(est.alpha_region_centroid, nested.grid)
    out = []
    for j, a in enumerate(nested.grid):
        point = sweep_point(index_conditional_report(y, y_hat, ladder[:, j], C, a))
        point.update(n_admitted_centroid=int(centroid[:, j].sum()), n_paper=int(paper[:, j].sum()),
                     lifted=int((ladder[:, j] & ~paper[:, j]).sum()), dropped=int((paper[:, j] & ~ladder[:, j]).sum()))
        out.append(point)
    return out
