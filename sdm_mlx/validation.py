"""The one validator for what users hand the API: labels, feature matrices and α'.

Applied once at the boundary (``SDMEstimator.fit`` / ``estimate``, the calibration math's public
functions, metrics and baselines); every problem raises :class:`~sdm_mlx.errors.InputError` naming
the argument.  Rules for class-index labels, everywhere: a 1-D array of integers (integral floats are
accepted and converted), no booleans, no NaN, each in 0..C−1.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from .errors import DataConversionWarning, InputError, InputTypeError


def one_d(y, name: str) -> np.ndarray:
    """``y`` as a 1-D array; a column vector [N, 1] is flattened with a :class:`DataConversionWarning`."""
    if y is None:
        raise InputError(f"{name}: this estimator requires y to be passed, but the target y is None")
    arr = np.asarray(y)
    if arr.ndim == 2 and arr.shape[1] == 1:
        warnings.warn(DataConversionWarning(
            f"A column-vector y was passed when a 1d array was expected ({name}, shape {arr.shape}); it is "
            "flattened to (n_samples,)"), stacklevel=3)
        arr = arr.reshape(-1)
    if arr.ndim != 1:
        raise InputError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def label_indices(y, name: str, num_classes: int | None = None, n: int | None = None) -> np.ndarray:
    """Class-index labels as int64 [N]: integers (or integral floats), not bool, in 0..C−1 (``num_classes``)."""
    arr = np.asarray(y)
    if arr.ndim != 1:
        raise InputError(f"{name} must be 1-D, got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise InputError(f"{name} has {arr.shape[0]} labels, expected {n} (one per row)")
    if arr.dtype.kind == "b" or (arr.size and arr.dtype.kind not in "iuf"):
        raise InputError(f"{name} must hold integer class labels 0..C-1, got dtype {arr.dtype}")
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InputError(f"Unknown label type: {name} must hold integer class labels, row {i} has {arr[i]!r} "
                             "(a continuous target?)")
    arr = arr.astype(np.int64)
    if num_classes is not None and arr.size and (arr.min() < 0 or arr.max() >= num_classes):
        found = sorted(set(arr[(arr < 0) | (arr >= num_classes)].tolist()))[:5]
        raise InputError(f"{name} must lie in 0..{num_classes - 1}, found {found}")
    return arr


def encode_labels(y, name: str, num_classes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(classes_, indices) for labels of any sortable hashable type (scikit-learn's convention).

    With ``num_classes`` the labels are class indices (:func:`label_indices`) and ``classes_`` is
    0..C−1 (a class may then have no rows).  Otherwise ``classes_`` is the sorted distinct labels and
    each label becomes its position there.  Booleans, NaN and non-integral numbers (a regression
    target) are refused.
    """
    arr = one_d(y, name)
    if num_classes is not None:
        return np.arange(int(num_classes)), label_indices(arr, name, int(num_classes))
    if arr.dtype.kind in "biuf":
        arr = label_indices(arr, name)
    elif arr.dtype.kind == "O" and any(isinstance(v, (bool, np.bool_, float, np.floating)) for v in arr):
        raise InputError(f"Unknown label type: {name} mixes booleans / floats into object labels")
    try:
        classes, indices = np.unique(arr, return_inverse=True)
    except TypeError as e:
        raise InputError(f"{name}: labels must be mutually sortable ({e})") from None
    return classes, indices.reshape(-1).astype(np.int64)


def _is_sparse(X) -> bool:
    return type(X).__module__.startswith("scipy.sparse")


def features(X, name: str, dim: int | None = None, model: str = "the model") -> np.ndarray:
    """Features as a finite, dense, real 2-D float32 array [rows, dim] with ≥ 1 row and ≥ 1 column (width
    ``dim``, expected by ``model``)."""
    if _is_sparse(X):
        raise InputError(f"{name}: sparse input is not supported; pass a dense array (X.toarray())")
    try:
        X = np.asarray(X)
        if X.dtype.kind == "c":
            raise InputError(f"{name}: Complex data not supported; features must be real numbers")
        X = X.astype(np.float32, copy=False)
    except TypeError as e:
        raise InputTypeError(f"{name}: features must be numbers ({e})") from None
    except ValueError as e:
        raise InputError(f"{name}: features must be numbers ({e})") from None
    if X.ndim != 2:
        raise InputError(f"{name}: features must be 2-D [rows, dim], got shape {X.shape}; Reshape your data "
                         "(X.reshape(1, -1) for a single row, X.reshape(-1, 1) for a single feature)")
    if X.shape[0] == 0:
        raise InputError(f"{name}: no rows (0 sample(s), shape={X.shape})")
    if X.shape[1] == 0:
        raise InputError(f"{name}: 0 feature(s) (shape={X.shape}) while a minimum of 1 is required.")
    if dim is not None and X.shape[1] != dim:
        raise InputError(f"{name}: X has {X.shape[1]} features, but {model} is expecting {dim} features as input "
                         f"(feature dimension {X.shape[1]} ≠ {dim})")
    if not np.isfinite(X).all():
        rows = np.flatnonzero(~np.isfinite(X).all(axis=1))[:5].tolist()
        raise InputError(f"{name}: features contain NaN or Inf (rows {rows})")
    return X


def _number(value, name: str) -> float:
    if isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name} must be a number, got {value!r}")
    try:
        a = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(a):
        raise InputError(f"{name} must be finite, got {value!r}")
    return a


def level(value, name: str = "alpha", *, zero: bool = False, one: bool = False) -> float:
    """A probability level in (0, 1), with 0 and / or 1 allowed when ``zero`` / ``one`` (e.g. a baseline's
    target coverage α ∈ (0, 1], a report's target α ∈ [0, 1], DKW's α ∈ (0, 1))."""
    a = _number(value, name)
    if not ((0.0 <= a if zero else 0.0 < a) and (a <= 1.0 if one else a < 1.0)):
        interval = f"{'[' if zero else '('}0, 1{']' if one else ')'}"
        raise InputError(f"{name} must lie in {interval}, got {value!r}")
    return a


def alpha(value, num_classes: int) -> float:
    """α' for ``defn:index-conditional-calibration``: a finite number with max(0.5, 1/C) < α' < 1."""
    a = _number(value, "alpha")
    if num_classes < 2:
        raise InputError(f"calibration needs at least 2 classes, got {num_classes}")
    lower = max(0.5, 1.0 / num_classes)
    if not (lower < a < 1.0):
        raise InputError(f"alpha must satisfy max(0.5, 1/C) = {lower:g} < alpha < 1 (C = {num_classes}), got {a!r}")
    return a
