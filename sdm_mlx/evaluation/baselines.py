"""Baseline selective classifiers over the same adaptor logits ``z [N, C]`` as the SDM
estimator (paper: Experiments: Classification, "Estimators").

Every baseline exposes ``fit(z_cal, y_cal, alpha) -> self`` (fitted on calibration
logits + labels) and ``predict(z) -> (y_pred, admitted, score)``:

* ``y_pred [N] int64`` -- ``argmax z`` (ties -> lowest index); no baseline changes the
  argmax (a temperature T > 0 preserves it and a conformal singleton is {argmax});
* ``admitted [N] bool`` -- the baseline's admission (non-rejection) decision at α';
* ``score [N] float64`` -- the baseline's probability for ŷ: ``max softmax(z)`` for
  :class:`NoReject`, :class:`SoftmaxThreshold`, :class:`APS` and :class:`RAPS` (unless
  they were built with ``temperature_scale=True``), ``max softmax(z / T)`` for
  :class:`TemperatureScaling`.  For the conformal baselines the admission decision is
  the prediction-set size, available from ``predict_sets``.

===================  ==================================================================
``no_reject``        admit every row (the raw accuracies; paper's NoReject)
``softmax``          admit iff max softmax(z) >= α'  (τ = 1)
``temperature``      Guo et al. 2017: T > 0 minimising the calibration NLL of softmax(z/T);
                     admit iff max softmax(z/T) >= α'
``aps``              Romano, Sesia & Candès 2020 (APS), target coverage α' (miscoverage
                     ε = 1 - α'); admit iff the prediction set is a singleton
``raps``             Angelopoulos, Bates, Malik & Jordan 2021 (RAPS), APS plus the rank
                     penalty λ·(o - k_reg)^+; admit iff the prediction set is a singleton
===================  ==================================================================

The conformal notation and algorithms of APS and RAPS are in :mod:`sdm_mlx.evaluation.conformal`.

Defaults (documented choices; the paper's experiment used the RAPS reference code, which
randomises, Platt-scales the probabilities first and tunes k_reg / λ on a 30% split):
``randomized=False`` (a ``seed`` drives the U draws when ``randomized=True``),
``temperature_scale=False`` (plain softmax of the given logits), RAPS ``lam=0.01`` and
``k_reg=1`` (penalise every rank after the first).

All computation is host-side float64 NumPy (these are O(N·C log C) post-processing steps).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import softmax

from .metrics import index_conditional_report
from .baseline_core import Baseline, _label_array, _logits, fit_temperature
from .conformal import APS, RAPS, conformal_quantile, conformal_scores, prediction_set_sizes
from ..errors import InputError

__all__ = [
    "Baseline",
    "NoReject",
    "SoftmaxThreshold",
    "TemperatureScaling",
    "APS",
    "RAPS",
    "BASELINES",
    "make_baseline",
    "fit_temperature",
    "conformal_quantile",
    "conformal_scores",
    "prediction_set_sizes",
    "run_baselines",
]


class NoReject(Baseline):
    """No selective filtering: predict argmax z and admit every row (paper: NoReject)."""

    name = "no_reject"

    def _admit(self, z, probs, score):
        return np.ones(z.shape[0], dtype=bool)


class SoftmaxThreshold(Baseline):
    """Admit iff ``max softmax(z) >= alpha`` (temperature τ = 1; paper: Softmax)."""

    name = "softmax"

    def _admit(self, z, probs, score):
        return score >= self.alpha




class TemperatureScaling(Baseline):
    """Temperature scaling (Guo et al. 2017): one parameter T > 0 fitted by NLL on the
    calibration set (:func:`fit_temperature`); admit iff ``max softmax(z / T) >= alpha``."""

    name = "temperature"

    def __init__(self, bounds: tuple[float, float] = (1e-3, 1e3)) -> None:
        super().__init__()
        self.bounds = (float(bounds[0]), float(bounds[1]))
        self.temperature: float | None = None

    def _fit(self, z, y):
        self.temperature = fit_temperature(z, y, bounds=self.bounds)

    def probabilities(self, z) -> np.ndarray:
        if self.temperature is None:
            raise RuntimeError("TemperatureScaling must be fit before use")
        return softmax(_logits(z) / self.temperature, axis=1)

    def _admit(self, z, probs, score):
        return score >= self.alpha

    def get_params(self):
        return {**super().get_params(), "temperature": self.temperature, "bounds": list(self.bounds)}


# --------------------------------------------------------------------------- registry

#: name -> class, in the paper's table order.
BASELINES: dict[str, type[Baseline]] = {
    cls.name: cls for cls in (NoReject, SoftmaxThreshold, TemperatureScaling, APS, RAPS)
}


def make_baseline(name: str, **kwargs) -> Baseline:
    """Instantiate a baseline by registry name (``no_reject``, ``softmax``, ``temperature``,
    ``aps``, ``raps``) with constructor keyword arguments."""
    try:
        cls = BASELINES[name]
    except KeyError:
        raise InputError(f"unknown baseline {name!r}; choose from {sorted(BASELINES)}") from None
    return cls(**kwargs)


def run_baselines(z_cal, y_cal, z_eval, y_eval, alpha: float, *, names=None,
                  options: dict[str, dict] | None = None) -> dict[str, dict[str, Any]]:
    """Fit each baseline on the calibration logits and evaluate it on the evaluation split.

    Returns ``{name: index_conditional_report(...)}`` (see :mod:`sdm_mlx.evaluation.metrics`), in
    ``names`` order (default: all of :data:`BASELINES`).  ``options`` maps a name to its
    constructor keyword arguments.
    """
    z_eval = _logits(z_eval, "z_eval")
    y_eval = _label_array(y_eval, z_eval.shape[0], z_eval.shape[1])
    options = options or {}
    out = {}
    for name in (names or list(BASELINES)):
        est = make_baseline(name, **options.get(name, {})).fit(z_cal, y_cal, alpha)
        y_pred, admitted, _ = est.predict(z_eval)
        out[name] = index_conditional_report(y_eval, y_pred, admitted, z_eval.shape[1], alpha)
    return out
