"""Evaluation of the SDM estimators against the baselines (paper: Experiments: Classification,
Table ``tab:experiments-classification-combined``; Def. ``defn:index-conditional-calibration``).

:func:`evaluate` takes a fitted :class:`~sdm_mlx.estimator.SDMEstimator`, labelled evaluation
sets and the calibration split's adaptor logits z' and labels, and reports, per evaluation set
and per estimator,

* the index-conditional report of :func:`sdm_mlx.evaluation.metrics.index_conditional_report`
  (class- and prediction-conditional accuracy over the admitted rows, admitted fractions, and
  whether index-conditional calibration holds at α');
* an α' sweep (the points of the admitted-fraction vs conditional-accuracy curves): the SDM
  estimators are re-thresholded with :meth:`SDMEstimator.recalibrate` (no retraining; the
  estimator's α' is restored afterwards), the baselines are refitted at every α';
* the hard q-bin distributions ⌊q~⌋ of the admitted vs the rejected rows (SDM p_lower), and
  the counts of the rejection reasons.

Estimators (names used as keys)::

    no_reject        every row admitted: the adaptor's raw accuracies (paper: NoReject)
    softmax          max softmax(z') >= α'
    temperature      max softmax(z'/T) >= α', T fitted on the calibration split (NLL)
    aps, raps        conformal prediction sets at coverage α'; admitted iff a singleton (by default
                     randomised over temperature-scaled softmax, as in the RAPS reference code
                     the paper compared against: :data:`CONFORMAL_MODES`)
    sdm_p_lower      the SDM estimator p̂_lower with ⊥ (the primary estimator)
    sdm_p_centroid   the same decision from the centroid quantities (reference)
    sdm_p_upper      the same decision from the upper quantities (reference)

All baselines run over the SAME adaptor logits z' as the SDM estimator (``Predictions.logits``)
and are fitted on the best round's calibration split (``SDMEstimator.calibration_logits_`` /
``calibration_labels_``); ``no_reject`` and ``softmax`` need no calibration data.

Report schema (JSON-serialisable; ``None`` = N/A or not finite)::

    {
      "schema_version": 1,
      "alpha": float,                     # the estimator's α' (the reports' α')
      "alphas": [float, ...],             # the sweep
      "num_classes": int, "class_names": [str, ...] | None,
      "primary_estimator": "sdm_p_lower",
      "estimators": [name, ...],          # display order
      "model": {"iterations", "best_round", "calibration_size", "support_size", "input_dim",
                "min_valid_qbin", "robust_min_valid_qbin", "psi"},
      "baselines": {"fitted_on": str | None, "n_calibration": int | None,
                    "skipped": {name: reason}, "options": {name: {...}},
                    "params": {name: {...}}},   # fitted state at the estimator's alpha
      "datasets": {
        NAME: {
          "source": str, "n": int, "label_counts": [int] * C, "prediction_counts": [int] * C,
          "reports": {estimator: REPORT},                 # metrics.index_conditional_report
          "calibrated": [estimator, ...],                 # index-conditional calibration holds
          "violated": [estimator, ...],
          "all_rejected": [estimator, ...],               # calibrated because nothing admitted
          "sweep": {estimator: [{"alpha", "n_admitted", "admitted_fraction",
                                 "min_conditional_accuracy", "marginal_accuracy",
                                 "index_conditional_calibrated"}, ...]},
          "hard_bins": {"bins": [0..B], "admitted": [counts], "rejected": [counts],
                        "admitted_lower": [counts], "rejected_lower": [counts]},
          "rejection_reasons": {reason: count},
          "label_errors": int,                            # admitted (p_lower) rows with y != ŷ
          "decisions": {"allow": int, "review": int, "reject": int},
          "ladder": [{"alpha", "n_admitted", "admitted_fraction", "min_conditional_accuracy",
                      "marginal_accuracy", "index_conditional_calibrated", "n_admitted_centroid",
                      "n_paper", "lifted", "dropped"}, ...],  # every grid level, α descending (DESIGN #25)
        }, ...
      },
      "grid": [float, ...], "decision_policy": {"allow": float, "review": float},
      "warnings": [str, ...],
    }

Why this module is over 400 lines: 70 of them are the report schema above, which stays beside the code that
writes it; the rest is one function's three steps (fit the baselines, sweep α', report per set) and the checks
of its inputs.  The work of each step is already elsewhere (:mod:`.baselines`, :mod:`.sweeps`, :mod:`.metrics`,
:mod:`.report`), so splitting what is left would make a reader cross files to follow one report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .baselines import BASELINES, make_baseline
from ..calibration import check_alpha
from ..storage.datasets import Dataset
from .report import format_evaluation, label_error_records, write_plots  # re-exported
from .metrics import index_conditional_report
from .sweeps import admission_ladder, sdm_admissions, sdm_sweep, sweep_point  # noqa: F401  (public here too)
from ..storage.files import finite_or_none, strict
from ..runtime.callbacks import SILENT, Callback
from ..validation import label_indices
from ..errors import InputError

__all__ = [
    "SDM_ESTIMATORS",
    "PRIMARY_ESTIMATOR",
    "DEFAULT_ALPHAS",
    "DEFAULT_BASELINES",
    "REPORT_SCHEMA_VERSION",
    "evaluate",
    "predict_datasets",
    "sdm_admissions",
    "admission_ladder",
    "format_evaluation",
    "label_error_records",
    "write_plots",
    "calibration_from_data",
    "baseline_options",
    "CONFORMAL_MODES",
]

REPORT_SCHEMA_VERSION = 1
PRIMARY_ESTIMATOR = "sdm_p_lower"
SDM_ESTIMATORS = ("sdm_p_lower", "sdm_p_centroid", "sdm_p_upper")
DEFAULT_BASELINES = ("no_reject", "softmax", "temperature", "aps", "raps")
#: Default α' sweep (values outside max(0.5, 1/C) < α' < 1 are dropped; the estimator's α' is added).
DEFAULT_ALPHAS = (0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99)
#: Baselines without fitted state (usable without calibration logits).
_CALIBRATION_FREE = ("no_reject", "softmax")
#: Conformal settings: "randomized" is the configuration of the RAPS reference code the paper used
#: (u ~ U(0, 1) in scores and sets, softmax of temperature-scaled logits); "deterministic" is the
#: non-randomised APS/RAPS of :mod:`sdm_mlx.evaluation.baselines` on plain softmax (it admits nothing whenever the
#: calibration error rate exceeds 1 - α', since every wrong row then scores 1).
CONFORMAL_MODES = {
    "randomized": {"randomized": True, "temperature_scale": True, "seed": 0},
    "deterministic": {"randomized": False, "temperature_scale": False},
}
DEFAULT_CONFORMAL = "randomized"


def baseline_options(conformal: str = DEFAULT_CONFORMAL) -> dict[str, dict]:
    """Constructor options per baseline for a conformal mode (see :data:`CONFORMAL_MODES`)."""
    if conformal not in CONFORMAL_MODES:
        raise InputError(f"conformal mode must be one of {sorted(CONFORMAL_MODES)}, got {conformal!r}")
    return {"aps": dict(CONFORMAL_MODES[conformal]), "raps": dict(CONFORMAL_MODES[conformal])}


# --------------------------------------------------------------------------- helpers


def _check_dataset(name: str, ds: Dataset, num_classes: int, input_dim: int) -> None:
    if ds.y is None:
        raise InputError(f"evaluation set {name!r} has no labels (every row needs a 'label' to be evaluated)")
    label_indices(ds.y, f"evaluation set {name!r}: labels", num_classes)
    if ds.X.ndim != 2 or ds.X.shape[1] != input_dim:
        raise InputError(
            f"evaluation set {name!r}: features have dimension {ds.X.shape[-1]}, the model expects {input_dim} "
            "(check --features)"
        )


def _alphas(alphas, estimator_alpha: float, num_classes: int) -> list[float]:
    if alphas is None:
        out = []
        for a in DEFAULT_ALPHAS:
            try:
                out.append(check_alpha(a, num_classes))
            except ValueError:
                pass
    else:
        out = [check_alpha(float(a), num_classes) for a in alphas]
    out.append(float(estimator_alpha))
    return sorted(set(out))


def predict_datasets(estimator, datasets: Mapping[str, Dataset], n_exemplars: int = 0) -> dict:
    """``{name: estimator.estimate(ds.X, ds.ids)}`` (no exemplars by default: evaluation does not need them)."""
    return {name: estimator.estimate(ds.X, ds.ids, n_exemplars=n_exemplars) for name, ds in datasets.items()}


def calibration_from_data(estimator, data: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """The best round's calibration logits z' and labels, recomputed from the pooled training data:
    the rows whose ids are ``estimator.calibration_ids_`` (in that order), forwarded through the adaptor."""
    import json

    if data.y is None:
        raise InputError(f"{data.source or 'calibration data'}: rows need labels")
    where = {json.dumps(i, sort_keys=True): k for k, i in enumerate(data.ids)}
    idx, missing = [], []
    for cid in estimator.calibration_ids_:
        k = where.get(json.dumps(cid, sort_keys=True))
        (missing.append(cid) if k is None else idx.append(k))
    if missing:
        raise InputError(
            f"{data.source or 'calibration data'}: {len(missing)} of the model's {len(estimator.calibration_ids_)} "
            f"calibration ids are not in the file (e.g. {missing[:3]}); pass the JSONL the model was trained on"
        )
    sub = data.subset(idx)
    z = estimator.logits(sub.X)
    return np.asarray(z, dtype=np.float32), np.asarray(sub.y, dtype=np.int64)


def _fit_baselines(names, z_cal, y_cal, alpha, num_classes, skipped, *, options) -> dict:
    fitted = {}
    for name in names:
        if name not in BASELINES:
            raise InputError(f"unknown baseline {name!r}; choose from {sorted(BASELINES)}")
        if name in skipped:
            continue
        b = make_baseline(name, **options.get(name, {}))
        if z_cal is None:
            if name not in _CALIBRATION_FREE:
                skipped[name] = "no calibration logits (artifact without them and no --calibration-data)"
                continue
            # no fitted state: fit() only records alpha and C
            b.alpha, b.num_classes = float(alpha), int(num_classes)
        else:
            b.fit(z_cal, y_cal, alpha)
        fitted[name] = b
    return fitted


def _counts(values: np.ndarray, length: int) -> list[int]:
    values = np.asarray(values, dtype=np.int64)
    return np.bincount(values, minlength=length).astype(int).tolist() if values.size else [0] * length


# --------------------------------------------------------------------------- evaluate


def _check_calibration_logits(z_cal, y_cal, C: int):
    if (z_cal is None) != (y_cal is None):
        raise InputError("pass both z_cal and y_cal, or neither")
    if z_cal is None:
        return None, None
    z_cal = np.asarray(z_cal, dtype=np.float64)
    y_cal = np.asarray(y_cal).reshape(-1).astype(np.int64)
    if z_cal.ndim != 2 or z_cal.shape[1] != C or z_cal.shape[0] != y_cal.shape[0] or z_cal.shape[0] == 0:
        raise InputError(f"calibration logits must be [n, {C}] with n labels, got {z_cal.shape} and {y_cal.shape}")
    return z_cal, y_cal


@dataclass(frozen=True)
class _BaselineRun:
    """What step 1 settled for the baselines: the ones that run (display order), their calibration logits and
    labels (None: none), their constructor options, those skipped (name -> why) and the fitted parameters at
    the estimator's α'."""

    run: list
    z_cal: np.ndarray | None
    y_cal: np.ndarray | None
    num_classes: int
    options: dict
    skipped: dict
    params: dict


@dataclass(frozen=True)
class _Sweep:
    """The α' sweep: the estimator's α', the swept values, the estimators in display order (baselines, then
    SDM) and the SDM admissions ``sdm_at[α'][set name][estimator]`` (step 2)."""

    alpha: float
    alphas: list
    order: list
    sdm_at: dict


def _baseline_admissions(baselines: _BaselineRun, a, *, z, y_hat) -> dict[str, np.ndarray]:
    """Baselines refitted at α' and applied to the set's logits z' (they never change argmax z')."""
    admitted = {}
    fitted = _fit_baselines(baselines.run, baselines.z_cal, baselines.y_cal, a, baselines.num_classes, {},
                            options=baselines.options)
    for b in baselines.run:
        b_pred, b_adm, _ = fitted[b].predict(z)
        if not np.array_equal(b_pred, y_hat):  # a baseline never changes argmax z'
            raise AssertionError(f"baseline {b} changed the prediction")
        admitted[b] = b_adm
    return admitted


def _set_report(name, ds, pred, sweep: _Sweep, baselines: _BaselineRun, callback: Callback) -> dict:
    """Step 3 for one evaluation set: reports at α', the α' sweep, hard bins, reasons, label errors."""
    alpha, sweep_alphas, order, C = sweep.alpha, sweep.alphas, sweep.order, baselines.num_classes
    y = np.asarray(ds.y, dtype=np.int64)
    y_hat = np.asarray(pred.prediction, dtype=np.int64)
    if y.shape[0] != y_hat.shape[0]:
        raise InputError(f"evaluation set {name!r}: {y.shape[0]} labels but {y_hat.shape[0]} predictions")
    z = np.asarray(pred.logits, dtype=np.float64)
    callback.message(f"evaluating {name} ({len(ds)} rows) over {len(sweep_alphas)} alpha values ...")
    curve: dict[str, list] = {e: [] for e in order}
    reports: dict[str, dict] = {}
    for a in sweep_alphas:
        admitted = _baseline_admissions(baselines, a, z=z, y_hat=y_hat)
        admitted.update(sweep.sdm_at[a][name])
        for e in order:
            rep = index_conditional_report(y, y_hat, admitted[e], C, a)
            curve[e].append(sweep_point(rep))
            if a == alpha:
                reports[e] = rep
    adm = np.asarray(pred.admitted, dtype=bool)
    bins, bins_lower = np.asarray(pred.estimate.centroid.hard_bin), np.asarray(pred.estimate.lower.hard_bin)
    top = int(max(np.max(bins, initial=0), np.max(bins_lower, initial=0))) + 1
    reasons = Counter(str(r) for r in np.asarray(pred.rejection_reason, dtype=object)[~adm])
    return {
        "source": ds.source,
        "n": len(ds),
        "label_counts": _counts(y, C),
        "prediction_counts": _counts(y_hat, C),
        "reports": reports,
        "calibrated": [e for e in order if reports[e]["index_conditional_calibrated"]],
        "violated": [e for e in order if not reports[e]["index_conditional_calibrated"]],
        "all_rejected": [e for e in order if reports[e]["all_rejected"]],
        "sweep": curve,
        "hard_bins": {
            "bins": list(range(top)),
            "admitted": _counts(bins[adm], top),
            "rejected": _counts(bins[~adm], top),
            "admitted_lower": _counts(bins_lower[adm], top),
            "rejected_lower": _counts(bins_lower[~adm], top),
        },
        "rejection_reasons": dict(sorted(reasons.items())),
        "label_errors": int((adm & (y != y_hat)).sum()),
        "decisions": {d: int((np.asarray(pred.estimate.decision) == d).sum()) for d in ("allow", "review", "reject")},
    }


def _model_summary(estimator) -> dict:
    cal = estimator.calibration_
    return {
        "iterations": len(estimator.rounds_),
        "best_round": int(estimator.best_round_),
        "calibration_size": len(estimator.calibration_ids_),
        "support_size": int(np.asarray(estimator.support_vectors_).shape[0]),
        "input_dim": int(estimator.input_dim_),
        "min_valid_qbin": finite_or_none(cal.min_valid),
        "robust_min_valid_qbin": finite_or_none(cal.robust_min_valid),
        "psi": [finite_or_none(p) for p in np.asarray(cal.psi).tolist()],
    }


def _assemble(estimator, sweep: _Sweep, baselines: _BaselineRun, out_sets: dict, notes: list) -> dict:
    """The report dict (schema: module docstring) from the three steps' results."""
    z_cal, options = baselines.z_cal, baselines.options
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "alpha": sweep.alpha,
        "alphas": sweep.alphas,
        "num_classes": int(estimator.num_classes_),
        "class_names": None if estimator.class_names is None else [str(c) for c in estimator.class_names],
        "primary_estimator": PRIMARY_ESTIMATOR,
        "estimators": sweep.order,
        "model": _model_summary(estimator),
        "baselines": {
            "fitted_on": None if z_cal is None else "the best round's calibration split, over the adaptor logits z'",
            "n_calibration": None if z_cal is None else int(z_cal.shape[0]),
            "skipped": baselines.skipped,
            "options": {b: options.get(b, {}) for b in baselines.run},
            "params": baselines.params,
        },
        "datasets": out_sets,
        "grid": list(estimator.nested_.grid),
        "decision_policy": {"allow": estimator.nested_.policy.allow, "review": estimator.nested_.policy.review},
        "warnings": notes,
    }


def _check_inputs(estimator, datasets: Mapping[str, Dataset]) -> tuple[int, float]:
    """``(C, α')`` of a fitted estimator, after checking every evaluation set against it."""
    if not getattr(estimator, "is_fitted", False):
        raise InputError("evaluate needs a fitted SDMEstimator (call fit() or SDMEstimator.load())")
    C = int(estimator.num_classes_)
    if not datasets:
        raise InputError("no evaluation sets")
    for name, ds in datasets.items():
        _check_dataset(name, ds, C, int(estimator.input_dim_))
    return C, float(estimator.alpha)


def _predictions(estimator, datasets, predictions, callback: Callback) -> Mapping[str, Any]:
    """The given predictions (checked to cover every set), else the estimator's at its α'."""
    if predictions is None:
        callback.message("predicting the evaluation sets ...")
        predictions = predict_datasets(estimator, datasets)
    missing = [n for n in datasets if n not in predictions]
    if missing:
        raise InputError(f"no predictions for evaluation set(s) {missing}")
    return predictions


def evaluate(
    estimator,
    datasets: Mapping[str, Dataset],
    z_cal=None,
    y_cal=None,
    alphas: Sequence[float] | None = None,
    baselines: Sequence[str] = DEFAULT_BASELINES,
    *, predictions: Mapping[str, Any] | None = None,
    callback: Callback = SILENT,
    options: Mapping[str, dict] | None = None,
) -> dict[str, Any]:
    """Evaluate the SDM estimators and the baselines on labelled evaluation sets (schema: module docstring).

    Nine parameters: this is the public entry point of ``sdm-mlx evaluate`` and of notebooks; its inputs
    (sets, calibration logits, α' sweep, baselines, precomputed predictions, progress, baseline options) are
    independent of each other, and the keyword API is kept as users call it.

    Three steps: fit the baselines (:func:`_fit_baselines`) → the α' sweep of the SDM estimators
    (:func:`sdm_sweep`) → the per-set report (:func:`_set_report`).  The estimator is only read (public
    methods ``estimate`` and ``calibration_at``); it is never modified.

    Args:
        estimator: a fitted :class:`~sdm_mlx.estimator.SDMEstimator`; the reports use its α'.
        datasets: ``{name: Dataset}`` with labels (insertion order kept).
        z_cal, y_cal: calibration logits z' [n, C] and labels [n] for the baselines (the best round's
            calibration split: ``estimator.calibration_logits_`` / ``calibration_labels_``).  ``None``:
            only ``no_reject`` and ``softmax`` are run; the others are listed under
            ``report["baselines"]["skipped"]``.
        alphas: the α' sweep (default :data:`DEFAULT_ALPHAS` within the valid range); the
            estimator's α' is always included.
        baselines: baseline names (:data:`sdm_mlx.evaluation.baselines.BASELINES`), in display order.
        predictions: optional precomputed ``{name: estimator.estimate(...)}`` at the estimator's α'
            (e.g. from :func:`predict_datasets`, to reuse them for label errors).
        callback: a :class:`sdm_mlx.runtime.callbacks.Callback` receiving progress lines (default: silent).
        options: constructor keyword arguments per baseline name (default
            :func:`baseline_options` ``("randomized")``: APS/RAPS as in the paper's reference code).
            Baselines are refitted for every α' and every evaluation set, so the randomised draws
            of one set do not depend on the others.
    """
    C, alpha = _check_inputs(estimator, datasets)
    sweep_alphas = _alphas(alphas, alpha, C)
    baselines = list(baselines or ())
    notes: list[str] = []
    z_cal, y_cal = _check_calibration_logits(z_cal, y_cal, C)
    predictions = _predictions(estimator, datasets, predictions, callback)

    # step 1: baselines (fitted state at the estimator's α' for the report; refitted per α' in step 3)
    options = baseline_options() if options is None else {k: dict(v) for k, v in options.items()}
    skipped: dict[str, str] = {}
    params = {n: b.get_params()
              for n, b in _fit_baselines(baselines, z_cal, y_cal, alpha, C, skipped, options=options).items()}
    run = _BaselineRun([b for b in baselines if b not in skipped], z_cal, y_cal, C, options, skipped, params)
    # step 2: SDM admissions at every α' (no change to the estimator)
    sweep = _Sweep(alpha, sweep_alphas, run.run + list(SDM_ESTIMATORS),
                   sdm_sweep(estimator, {n: predictions[n] for n in datasets}, sweep_alphas, notes))
    # step 3: reports
    out_sets = {name: _set_report(name, ds, predictions[name], sweep, run, callback)
                for name, ds in datasets.items()}
    nested = estimator.nested_
    for name, ds in datasets.items():
        out_sets[name]["ladder"] = admission_ladder(nested, predictions[name], np.asarray(ds.y, dtype=np.int64), C)
    report = _assemble(estimator, sweep, run, out_sets, notes)
    return strict(report)
