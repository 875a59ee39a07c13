"""Per-(ŷ, bin) medians and the Cauchy robust estimates over the J rounds: ``eq:cauchyMinValidQBin``,
``eq:cauchyIteratedLower`` (``eq:cauchyDistributionInverseCDF`` for the factor)."""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np

from ._checks import _labels, _vector
from ..errors import InputError


def magnitude_medians(o_hat: np.ndarray, y_hat: np.ndarray, hard_bin: np.ndarray, num_classes: int) -> np.ndarray:
    """Median o_ŷ per (predicted class, hard bin) over calibration (``eq:cauchyIteratedLower`` inputs), NaN if empty, [C, B]."""
    o_hat = _vector("o_hat", o_hat).astype(np.float64)
    n = o_hat.shape[0]
    y_hat = _labels("y_hat", y_hat, num_classes, n)
    hard_bin = np.asarray(hard_bin).reshape(-1).astype(np.int64)
    if hard_bin.shape[0] != n:
        raise InputError(f"hard_bin has {hard_bin.shape[0]} rows, expected {n}")
    if np.any(hard_bin < 0):
        raise InputError("hard bins must be ≥ 0")
    num_bins = int(hard_bin.max()) + 1 if n else 1
    out = np.full((num_classes, num_bins), np.nan)
    if n == 0:
        return out
    key = y_hat * num_bins + hard_bin
    order = np.lexsort((o_hat, key))
    key_s, val_s = key[order], o_hat[order]
    groups, starts, counts = np.unique(key_s, return_index=True, return_counts=True)
    med = 0.5 * (val_s[starts + (counts - 1) // 2] + val_s[starts + counts // 2])
    out.reshape(-1)[groups] = med
    return out


def mad(x: np.ndarray) -> float:
    """Median absolute deviation around the median, median(|x − median x|) (Cauchy scale of ``eq:cauchyMinValidQBin``)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    if x.size == 0:
        return math.nan
    with np.errstate(invalid="ignore"):
        return float(np.median(np.abs(x - np.median(x))))


def cauchy_factor(alpha: float) -> float:
    """tan(π(α − ½)), the standard Cauchy quantile at α (``eq:cauchyDistributionInverseCDF``)."""
    return math.tan(math.pi * (float(alpha) - 0.5))


def cauchy_robust_min(min_valids: Sequence[float], best_index: int, alpha: float) -> float:
    """Robust min valid q~ = min_valid_* + MAD(J values)·tan(π(α−½)) (``eq:cauchyMinValidQBin``; J = 1 ⇒ MAD 0).

    A non-finite MAD (e.g. +inf values reaching the median) gives +inf — every
    row is rejected — and a ``RuntimeWarning`` explaining why (DESIGN #15).
    """
    vals = np.asarray(min_valids, dtype=np.float64).reshape(-1)
    if vals.size == 0:
        raise InputError("need at least one round's min valid q~")
    if np.any(np.isnan(vals)):
        raise InputError("min valid q~ values must not be NaN (use +inf for 'no threshold found')")
    if not (0 <= int(best_index) < vals.size):
        raise InputError(f"best_index {best_index} out of range for {vals.size} rounds")
    location = float(vals[int(best_index)])
    scale = 0.0 if vals.size == 1 else mad(vals)
    if not math.isfinite(scale):
        missing = [j + 1 for j in np.flatnonzero(np.isinf(vals)).tolist()]
        warnings.warn(
            f"Cauchy scale MAD of the J = {vals.size} min valid q~ values is not finite: round(s) {missing} "
            f"({len(missing)} of {vals.size}) found no valid threshold at alpha = {alpha:g}, which reaches the "
            "median; the robust min valid q~ is +inf, so every instance will be rejected (DESIGN #15). "
            "See SDMEstimator.admission_ for the diagnosis per class.",
            RuntimeWarning,
            stacklevel=2,
        )
        return math.inf
    return location + scale * cauchy_factor(alpha)


def cauchy_offsets(medians: Sequence[np.ndarray], alpha: float) -> np.ndarray:
    """Offsets m[ŷ][b] = MAD over rounds of the per-bin medians · tan(π(α−½)), no data ⇒ 0 (``eq:cauchyIteratedLower``), [C, B]."""
    if len(medians) == 0:
        raise InputError("need at least one round's medians")
    meds = [np.asarray(m, dtype=np.float64) for m in medians]
    num_classes = meds[0].shape[0]
    if any(m.ndim != 2 or m.shape[0] != num_classes for m in meds):
        raise InputError("every round's medians must be [C, B] with the same C")
    num_bins = max(m.shape[1] for m in meds)
    stack = np.full((len(meds), num_classes, num_bins), np.nan)
    for j, m in enumerate(meds):
        stack[j, :, : m.shape[1]] = m
    present = ~np.isnan(stack)
    count = present.sum(axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN buckets
        center = np.nanmedian(stack, axis=0)
        scale = np.nanmedian(np.abs(stack - center[None]), axis=0)
    scale = np.where(count > 0, scale, 0.0)
    if not np.all(np.isfinite(scale)):
        raise InputError("per-bin medians must be finite (NaN marks an empty bucket)")
    return scale * cauchy_factor(alpha)


def lookup_offsets(offsets: np.ndarray, y_hat: np.ndarray, hard_bin: np.ndarray, level=None) -> np.ndarray:
    """m[ŷ][bin] per row, 0 for bins beyond the table (``eq:index-conditional-sdm-estimator``), float64 [N].

    ``offsets``: one level's ``[C, B]`` table, or ``[L, C, B]`` for levels stacked along the rows, with
    ``level`` [N] naming each row's level."""
    offsets = np.asarray(offsets, dtype=np.float64)
    y_hat = np.asarray(y_hat, dtype=np.int64).reshape(-1)
    hard_bin = np.asarray(hard_bin, dtype=np.int64).reshape(-1)
    if offsets.ndim not in (2, 3) or offsets.shape[-1] == 0:
        return np.zeros(y_hat.shape[0])
    inside = hard_bin < offsets.shape[-1]
    at = (y_hat, np.minimum(hard_bin, offsets.shape[-1] - 1))
    return np.where(inside, offsets[at] if offsets.ndim == 2 else offsets[(np.asarray(level),) + at], 0.0)
