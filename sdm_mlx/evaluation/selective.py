"""A selective score for model selection (scikit-learn ``make_scorer`` / ``GridSearchCV``).

``SDMEstimator.score`` is scikit-learn's plain accuracy of ``predict`` and ignores rejection, so a search over
``alpha`` (which changes only what is admitted) sees identical scores.  :func:`selective_score` scores what a
selective classifier is for: the **admitted fraction, provided the admitted rows are at least
``min_accuracy`` accurate**; below that accuracy the score is the (negative) shortfall, so a search prefers
any setting that reaches the accuracy and, among those, the one that admits most.  It reads
:meth:`SDMEstimator.predict_selective` (the class label where admitted, ``None`` where rejected)::

    from sklearn.metrics import make_scorer
    scorer = make_scorer(selective_score, response_method=("predict_selective",), min_accuracy=0.9)
    GridSearchCV(SDMEstimator(), {"alpha": [0.8, 0.9, 0.95]}, scoring=scorer)

(:func:`selective_scorer` builds the same scorer.)  A fold of which nothing is admitted scores 0.0 and warns
(:class:`~sdm_mlx.errors.NothingAdmittedWarning`): if every fold of every candidate does, the search compared
nothing and its ``best_params_`` is arbitrary, which the warning says (``compared_nothing(search)`` tells after
the fact).  The accuracy is marginal over the admitted rows of one
validation fold: with few admitted rows it is a noisy estimate, so a ``min_accuracy`` at or below the
``alpha`` values searched is the honest use; index-conditional calibration per class is what
``sdm-mlx evaluate`` checks.
"""

from __future__ import annotations

import warnings

import numpy as np

from ..errors import InputError, NothingAdmittedWarning


def selective_score(y_true, y_selective, *, min_accuracy: float = 0.95) -> float:
    """Admitted fraction if the admitted rows' accuracy is ≥ ``min_accuracy``, else accuracy − min_accuracy (< 0).

    ``y_selective``: the predicted label per row, ``None`` where the row is rejected (⊥), as
    :meth:`SDMEstimator.predict_selective` returns it.  Nothing admitted scores 0.0 (no error made, nothing
    gained).  Range [−1, 1]; greater is better."""
    if not 0.0 <= float(min_accuracy) <= 1.0:
        raise InputError(f"min_accuracy must be in [0, 1], got {min_accuracy!r}")
    y_true = np.asarray(y_true, dtype=object).reshape(-1)
    y_sel = np.asarray(y_selective, dtype=object).reshape(-1)
    if y_true.shape != y_sel.shape:
        raise InputError(f"selective_score: {y_true.shape[0]} labels for {y_sel.shape[0]} predictions")
    admitted = np.array([v is not None for v in y_sel], dtype=bool)
    if not admitted.any():
        warnings.warn(f"selective_score: nothing was admitted among the {y_sel.shape[0]} rows scored, so this score "
                      "(0.0) compares nothing; if every fold of every candidate scores 0.0, a search over alpha chose "
                      "its best_params_ arbitrarily: train longer (epochs, rescaler_max_epochs), use more rows, or "
                      "search lower alpha values", NothingAdmittedWarning, stacklevel=2)
        return 0.0
    accuracy = float(np.mean(y_sel[admitted] == y_true[admitted]))
    if accuracy < float(min_accuracy):
        return accuracy - float(min_accuracy)
    return float(admitted.mean())


def compared_nothing(search) -> bool:
    """True when a fitted ``GridSearchCV`` / ``RandomizedSearchCV`` scored 0.0 in every fold of every candidate
    with :func:`selective_score`: nothing was admitted anywhere, so its ``best_params_`` says nothing."""
    results = search.cv_results_
    folds = [np.asarray(v, dtype=float) for k, v in results.items() if k.startswith("split") and k.endswith("_test_score")]
    return bool(folds) and all(np.all(f == 0.0) for f in folds)


def selective_scorer(min_accuracy: float = 0.95):
    """``sklearn.metrics.make_scorer(selective_score, response_method=("predict_selective",), min_accuracy=...)``
    (needs scikit-learn ≥ 1.4)."""
    from sklearn.metrics import make_scorer

    return make_scorer(selective_score, response_method=("predict_selective",), min_accuracy=min_accuracy)
