"""Effective sample size and the DKW band: ``equation:effective-sample-size``, ``equation:dkw``,
``equation:sdm-output-cdfs-lower``."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .. import validation
from ._checks import _SortedTable, _check_lists, _labels, _vector


def sample_size_arrays(q_tilde_cal: np.ndarray, y_cal: np.ndarray, num_classes: int) -> list[np.ndarray]:
    """Per true class, sorted processed q~ of ALL calibration rows (OOD included) for ``equation:effective-sample-size``."""
    q_tilde_cal = _vector("q_tilde_cal", q_tilde_cal).astype(np.float64)
    y_cal = _labels("y_cal", y_cal, num_classes, q_tilde_cal.shape[0])
    return [np.sort(q_tilde_cal[y_cal == c]) for c in range(num_classes)]


def effective_sample_size(q_tilde: np.ndarray, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """n̂_c = min(#{x ∈ arrays_c : x < q~}, n_c − 1) in integers (``equation:effective-sample-size``, DESIGN #12).

    A class with no calibration rows gives n̂_c = min(0, −1) = −1 (reported as
    −1, as in the research code; :func:`dkw_epsilon` then gives ε_c = 1).
    """
    q_tilde = _vector("q_tilde", q_tilde).astype(np.float64)
    return _n_hat_of(q_tilde, _check_lists("sample_size_arrays", arrays, len(arrays)))


def _n_hat_of(q_tilde: np.ndarray, arrays: list[np.ndarray], table: _SortedTable | None = None) -> np.ndarray:
    """:func:`effective_sample_size` of validated inputs (``table``: the same arrays as one table, for a small
    batch)."""
    below = None if table is None else table.below(q_tilde)
    if below is not None:  # every class at once
        return np.minimum(below, table.sizes - 1)
    n_hat = np.empty((q_tilde.shape[0], len(arrays)), dtype=np.int64)
    for c, arr in enumerate(arrays):
        below = arr.searchsorted(q_tilde, side="left").astype(np.int64, copy=False)
        np.minimum(below, arr.size - 1, out=n_hat[:, c])
    return n_hat


def dkw_epsilon(n_hat: np.ndarray, alpha) -> np.ndarray:
    """ε = sqrt(ln(2/(1−α)) / (2 n̂)) where n̂ > 0, else 1 (``equation:dkw``), float64.

    ``alpha``: one level, or one per row of ``n_hat`` (the nested ladder's levels stacked along the rows)."""
    n_hat = np.asarray(n_hat)
    if np.ndim(alpha) == 0:
        log_term = _dkw_log(validation.level(alpha))
    else:  # one log per distinct level (the ladder's), not per row
        levels, which = np.unique(np.asarray(alpha, dtype=np.float64), return_inverse=True)
        logs = np.array([_dkw_log(validation.level(float(a))) for a in levels])
        log_term = logs[which.reshape(-1)].reshape((-1,) + (1,) * (n_hat.ndim - 1))
    return _epsilon_of(n_hat, log_term)


def _dkw_log(alpha: float) -> float:
    """ln(2/(1−α)), the level's factor of ``equation:dkw``; ``alpha`` a validated level in (0, 1)."""
    return math.log(2.0 / (1.0 - float(alpha)))


def _epsilon_of(n_hat: np.ndarray, log_term) -> np.ndarray:
    """:func:`dkw_epsilon` of an integer n̂ array with ln(2/(1−α)) given (:func:`_dkw_log`): a float, or an
    array broadcast against n̂ (levels along a leading axis: the nested ladder's, computed once per model)."""
    positive = n_hat > 0
    safe = np.where(positive, n_hat, 1).astype(np.float64)
    return np.where(positive, np.sqrt(log_term / (2.0 * safe)), 1.0)


def dkw_bounds(v: np.ndarray, epsilon: np.ndarray, y_hat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(v_lower, v_upper): v ∓ ε at ŷ, v ± ε elsewhere, clipped to [0, 1] (``equation:sdm-output-cdfs-lower``/``-upper``)."""
    v = np.asarray(v, dtype=np.float64)
    epsilon = np.asarray(epsilon, dtype=np.float64)
    sign = np.ones_like(v)
    sign[np.arange(v.shape[0]), np.asarray(y_hat, dtype=np.int64)] = -1.0
    return np.clip(v + sign * epsilon, 0.0, 1.0), np.clip(v - sign * epsilon, 0.0, 1.0)
