"""SDM calibration: from SDM activation outputs to the index-conditional estimator p̂_lower.

Paper §"From SDM Activation Functions to SDM Calibration"; conventions fixed by
DESIGN.md #7, #10-16, #23, #24 (they win over the paper and over the research
code R where they differ).  Everything here is host-side, vectorised NumPy on
sorted arrays (the rescaler W'' itself is trained in :mod:`sdm_mlx.rescaler`).

Pipeline for one round (``calibrate_round``), calibration rows of the best epoch:

1. output eCDFs: per true class c, the sorted sdm(z')_c of calibration rows whose
   TRUE label is c (``equation:sdm-output-cdfs``);
2. v_c = eCDF_c(s_c): strict-left count / n, s_c ≥ max ⇒ 1, empty ⇒ 0 (DESIGN #11);
3. q~ = v_ŷ · ln(2+q) (``equation:softqbin``); a row whose SDM output has no
   unique argmax equal to ŷ gets q~ := 0 (DESIGN #7);
4. W'' by Alg. 2 on (v, q~, y);  o = softmax(W''v · ln(2+q~));
5. OOD iff floor(q~) ≤ 0 or o has no unique argmax equal to ŷ; OOD rows get
   q~ := 0 and hard bin 0 (DESIGN #7, #16; o itself is not recomputed);
6. sample-size arrays: per true class, the sorted processed q~ of ALL calibration
   rows (OOD rows included, with q~ = 0);
7. Alg. 3: min valid q~ and ψ (α-dependent);
8. per (ŷ, hard bin) median of o_ŷ (α-independent).

Across the J rounds (``aggregate_rounds``): the Cauchy robust min valid q~
(``eq:cauchyMinValidQBin``) and the per-(ŷ, bin) offsets (``eq:cauchyIteratedLower``).

At test time (``estimate``): q~ for centroid, n̂ and DKW ε from the centroid,
lower/upper v and q~, the rescaled outputs, offsets, and admission
(``eq:index-conditional-sdm-estimator``, all of R's conditions, DESIGN #14).

What depends on α: Alg. 3 (ψ, min valid q~), the Cauchy factor tan(π(α−½)) and
DKW ε.  What does not: output eCDFs, v, q~, W'', o, OOD flags, sample-size
arrays, the per-bin medians.  So a new α needs no retraining:
``RoundCalibration.with_alpha`` re-runs Alg. 3 on the stored arrays and
``aggregate_rounds`` recomputes the Cauchy quantities.

Rejection reasons of ``estimate`` (first failing condition wins; "" = admitted):

1. ``"no_valid_threshold"``    the model's own min valid q~ is +inf (Alg. 3 found none)
2. ``"no_robust_threshold"``   the Cauchy robust min valid q~ is +inf (non-finite MAD, DESIGN #15)
3. ``"ood_distance"``          d = 0: farther from the training support than every calibration row of
                               some class, so the SDM output is uniform (DESIGN #7, #24)
4. ``"argmax_flip"``           the SDM output has no unique argmax equal to ŷ (ties), or
                               the centroid's rescaled output o does not (with floor(q~) > 0); that
                               zeroes q~, hence n̂ = 0, ε = 1 and the lower variant is OOD too
5. ``"ood_similarity"``        floor(q~_lower) ≤ 0 (e.g. q = 0: q~ ≤ ln 2)
6. ``"argmax_flip"``           the rescaled lower output o_lower has no unique argmax equal to ŷ
7. ``"below_model_min_qbin"``  q~_lower < the model's own min valid q~
8. ``"below_robust_min_qbin"`` q~_lower < the robust (Cauchy) min valid q~
9. ``"below_threshold_psi"``   {c : o_lower,c ≥ ψ_c} ≠ {ŷ} after the offset at ŷ
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Sequence

import numpy as np

from . import validation
from .io import get_float, put_float
from .results import Estimate, Variant
from .rescaler import (
    DEFAULT_LEARNING_RATE,
    DEFAULT_MAX_EPOCHS,
    DEFAULT_PATIENCE,
    RescalerFit,
    rescaled_output,
    train_rescaler,
)

__all__ = [
    "REJECTION_REASONS",
    "Calibration",
    "RoundCalibration",
    "aggregate_rounds",
    "apply_ood",
    "calibrate_round",
    "cauchy_factor",
    "cauchy_offsets",
    "cauchy_robust_min",
    "check_alpha",
    "dkw_bounds",
    "dkw_epsilon",
    "effective_sample_size",
    "estimate",
    "hard_qbin",
    "lookup_offsets",
    "mad",
    "magnitude_medians",
    "min_valid_qbin",
    "ood_mask",
    "output_ecdfs",
    "rescaled_output",
    "sample_size_arrays",
    "soft_qbin",
    "unique_argmax_is",
    "v_vector",
]

#: Rejection reasons in precedence order (see the module docstring); "" means admitted.
REJECTION_REASONS = (
    "no_valid_threshold",
    "no_robust_threshold",
    "ood_distance",
    "argmax_flip",
    "ood_similarity",
    "below_model_min_qbin",
    "below_robust_min_qbin",
    "below_threshold_psi",
)

#: Decimals 1 − α is rounded to before the quantile index (DESIGN #13), exactly (:func:`exact_one_minus`).
_QUANTILE_ROUND = 10


# ---------------------------------------------------------------------------------------------
# validation helpers


def check_alpha(alpha: float, num_classes: int) -> float:
    """Validate α' for ``defn:index-conditional-calibration``: max(0.5, 1/C) < α < 1 (DESIGN #23)."""
    return validation.alpha(alpha, num_classes)


def _finite(name: str, arr) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or Inf")
    return arr


def _labels(name: str, y, num_classes: int, n: int | None = None) -> np.ndarray:
    return validation.label_indices(y, name, num_classes, n)


def _matrix(name: str, x, n: int | None = None, c: int | None = None) -> np.ndarray:
    x = _finite(name, x)
    if x.ndim != 2:
        raise ValueError(f"{name} must be [N, C], got shape {x.shape}")
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{name} has {x.shape[0]} rows, expected {n}")
    if c is not None and x.shape[1] != c:
        raise ValueError(f"{name} has {x.shape[1]} columns, expected {c}")
    return x


def _vector(name: str, x, n: int | None = None) -> np.ndarray:
    x = _finite(name, x).reshape(-1)
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{name} has {x.shape[0]} rows, expected {n}")
    return x


def _check_lists(name: str, lists, num_classes: int) -> list[np.ndarray]:
    if len(lists) != num_classes:
        raise ValueError(f"{name} must hold one array per class ({num_classes}), got {len(lists)}")
    out = []
    for c, a in enumerate(lists):
        a = _finite(f"{name}[{c}]", a).reshape(-1)
        if a.size > 1 and np.any(a[1:] < a[:-1]):
            raise ValueError(f"{name}[{c}] must be sorted ascending")
        out.append(a)
    return out


# ---------------------------------------------------------------------------------------------
# eCDFs, v, q~


def output_ecdfs(sdm_cal: np.ndarray, y_cal: np.ndarray, num_classes: int) -> list[np.ndarray]:
    """Per class c, sorted sdm(z')_c over calibration rows with TRUE label c (``equation:sdm-output-cdfs``)."""
    sdm_cal = _matrix("sdm_cal", sdm_cal, c=num_classes)
    y_cal = _labels("y_cal", y_cal, num_classes, sdm_cal.shape[0])
    return [np.sort(sdm_cal[y_cal == c, c]) for c in range(num_classes)]


def v_vector(sdm: np.ndarray, ecdfs: Sequence[np.ndarray]) -> np.ndarray:
    """v_c = eCDF_c(s_c), strict-left count / n, s_c ≥ max ⇒ 1, empty ⇒ 0 (``equation:sdm-output-cdfs``, DESIGN #11)."""
    num_classes = len(ecdfs)
    sdm = _matrix("sdm", sdm, c=num_classes)
    return _v_of(sdm, _check_lists("output_ecdfs", ecdfs, num_classes))


def _v_of(sdm: np.ndarray, ecdfs: list[np.ndarray]) -> np.ndarray:
    """:func:`v_vector` of validated inputs."""
    v = np.zeros(sdm.shape, dtype=np.float64)
    for c, sorted_c in enumerate(ecdfs):
        if sorted_c.size == 0:
            continue  # empty list ⇒ 0
        s = sdm[:, c]
        below = np.searchsorted(sorted_c, s, side="left")
        v[:, c] = np.where(s >= sorted_c[-1], 1.0, below / sorted_c.size)
    return v


def unique_argmax_is(x: np.ndarray, y_hat: np.ndarray) -> np.ndarray:
    """True where row x has a unique maximum at ŷ: the argmax test of ``equation:rescaled-prediction-conditional-estimate`` (DESIGN #7)."""
    x = np.asarray(x)
    top = x.max(axis=1, keepdims=True)
    is_top = x == top
    rows = np.arange(x.shape[0])
    return (is_top.sum(axis=1) == 1) & is_top[rows, np.asarray(y_hat, dtype=np.int64)]


def soft_qbin(v: np.ndarray, q: np.ndarray, y_hat: np.ndarray) -> np.ndarray:
    """q~ = ln((2+q)^{v_ŷ}) = v_ŷ · ln(2+q) (``equation:softqbin``), float64 [N]."""
    v = _matrix("v", v)
    n = v.shape[0]
    q = _vector("q", q, n).astype(np.float64)
    if np.any(q < 0):
        raise ValueError("q must be ≥ 0")
    y_hat = _labels("y_hat", y_hat, v.shape[1], n)
    return v[np.arange(n), y_hat].astype(np.float64) * np.log(2.0 + q)


def hard_qbin(q_tilde: np.ndarray, ood: np.ndarray | None = None) -> np.ndarray:
    """Hard bin floor(q~), OOD rows → 0, no upper cap (``equation:softqbin``, DESIGN #16), int64 [N]."""
    q_tilde = _vector("q_tilde", q_tilde)
    bins = np.floor(np.maximum(q_tilde, 0.0)).astype(np.int64)
    if ood is not None:
        bins = np.where(np.asarray(ood, dtype=bool).reshape(-1), 0, bins)
    return bins


def ood_mask(o: np.ndarray, q_tilde: np.ndarray, y_hat: np.ndarray) -> np.ndarray:
    """OOD iff floor(q~) ≤ 0 or o has no unique argmax equal to ŷ (``equation:rescaled-prediction-conditional-estimate``, DESIGN #7)."""
    q_tilde = np.asarray(q_tilde, dtype=np.float64).reshape(-1)
    return (np.floor(q_tilde) <= 0) | ~unique_argmax_is(o, y_hat)


def apply_ood(q_tilde: np.ndarray, ood: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Processed (q~, hard bin): OOD rows get q~ := 0 and bin 0 (``equation:softqbin``, DESIGN #7/#16)."""
    q_tilde = np.asarray(q_tilde, dtype=np.float64).reshape(-1)
    ood = np.asarray(ood, dtype=bool).reshape(-1)
    q_proc = np.where(ood, 0.0, q_tilde)
    return q_proc, hard_qbin(q_proc, ood)


# ---------------------------------------------------------------------------------------------
# effective sample size and DKW


def sample_size_arrays(q_tilde_cal: np.ndarray, y_cal: np.ndarray, num_classes: int) -> list[np.ndarray]:
    """Per true class, sorted processed q~ of ALL calibration rows (OOD included) for ``equation:effective-sample-size``."""
    q_tilde_cal = _vector("q_tilde_cal", q_tilde_cal).astype(np.float64)
    y_cal = _labels("y_cal", y_cal, num_classes, q_tilde_cal.shape[0])
    return [np.sort(q_tilde_cal[y_cal == c]) for c in range(num_classes)]


def effective_sample_size(q_tilde: np.ndarray, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """n̂_c = min(#{x ∈ arrays_c : x < q~}, n_c − 1) in integers (``equation:effective-sample-size``, DESIGN #12).

    A class with no calibration rows gives n̂_c = min(0, −1) = −1 (reported as
    −1, as in R; :func:`dkw_epsilon` then gives ε_c = 1).
    """
    q_tilde = _vector("q_tilde", q_tilde).astype(np.float64)
    return _n_hat_of(q_tilde, _check_lists("sample_size_arrays", arrays, len(arrays)))


def _n_hat_of(q_tilde: np.ndarray, arrays: list[np.ndarray]) -> np.ndarray:
    """:func:`effective_sample_size` of validated inputs."""
    n_hat = np.empty((q_tilde.shape[0], len(arrays)), dtype=np.int64)
    for c, arr in enumerate(arrays):
        below = np.searchsorted(arr, q_tilde, side="left").astype(np.int64)
        n_hat[:, c] = np.minimum(below, arr.size - 1)
    return n_hat


def dkw_epsilon(n_hat: np.ndarray, alpha: float) -> np.ndarray:
    """ε = sqrt(ln(2/(1−α)) / (2 n̂)) where n̂ > 0, else 1 (``equation:dkw``), float64."""
    a = validation.level(alpha)
    n_hat = np.asarray(n_hat)
    safe = np.where(n_hat > 0, n_hat, 1).astype(np.float64)
    return np.where(n_hat > 0, np.sqrt(math.log(2.0 / (1.0 - a)) / (2.0 * safe)), 1.0)


def dkw_bounds(v: np.ndarray, epsilon: np.ndarray, y_hat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(v_lower, v_upper): v ∓ ε at ŷ, v ± ε elsewhere, clipped to [0, 1] (``equation:sdm-output-cdfs-lower``/``-upper``)."""
    v = np.asarray(v, dtype=np.float64)
    epsilon = np.asarray(epsilon, dtype=np.float64)
    sign = np.ones_like(v)
    sign[np.arange(v.shape[0]), np.asarray(y_hat, dtype=np.int64)] = -1.0
    return np.clip(v + sign * epsilon, 0.0, 1.0), np.clip(v - sign * epsilon, 0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# Alg. 3


def exact_one_minus(alpha: float) -> Fraction:
    """round(1 − α, 10) as an exact rational, α read as the decimal it prints as (``str(α)``).

    Float arithmetic puts 1 − 0.71 at 0.29000000000000004 and 0.29·100 at 28.999999999999996;
    the rational 29/100 has neither error.
    """
    return round(1 - Fraction(str(float(alpha))), _QUANTILE_ROUND)


def _quantile_index(n: np.ndarray, alpha: float) -> np.ndarray:
    """min(⌊round(1−α, 10)·n⌋, n−1) elementwise (DESIGN #13), in exact integer arithmetic.

    With r = a/b (:func:`exact_one_minus`) the index is (a·n) // b: α' = 0.71, n = 100 gives 29
    (float arithmetic gives 28).
    """
    r = exact_one_minus(alpha)
    n = np.asarray(n, dtype=np.int64)
    return np.minimum((r.numerator * n) // r.denominator, n - 1)


def min_valid_qbin(
    o_true: np.ndarray,
    q_tilde: np.ndarray,
    y: np.ndarray,
    non_ood: np.ndarray,
    num_classes: int,
    alpha: float,
) -> tuple[float, np.ndarray]:
    """Alg. 3 (``alg:estimate-soft-q-bin``): smallest candidate q~ where every class's ψ_c ≥ α; (inf, zeros) if none.

    Candidates are the sorted unique q~ of non-OOD rows (floor(q~) > 0 is also
    enforced).  At candidate t, class c keeps the o-values (at the TRUE label) of
    its non-OOD rows with q~ ≥ t; ψ_c = max(sorted[min(int(round(1−α,10)·n), n−1)], 0),
    empty ⇒ 0 (fails).  ψ_c ≥ α (compared in float64) iff at most k of the kept
    values are < α, so each class needs only its rows sorted by q~ and a suffix
    count of values below α: O(N log N) overall.
    """
    alpha = check_alpha(alpha, num_classes)
    o_true = _vector("o_true", o_true)
    n = o_true.shape[0]
    q_tilde = _vector("q_tilde", q_tilde, n).astype(np.float64)
    y = _labels("y", y, num_classes, n)
    keep = np.asarray(non_ood, dtype=bool).reshape(-1)
    if keep.shape[0] != n:
        raise ValueError(f"non_ood has {keep.shape[0]} rows, expected {n}")
    keep = keep & (np.floor(q_tilde) > 0)
    psi = np.zeros(num_classes, dtype=np.float64)
    candidates = np.unique(q_tilde[keep])
    if candidates.size == 0:
        return math.inf, psi
    ok = np.ones(candidates.size, dtype=bool)
    per_class = []
    for c in range(num_classes):
        sel = keep & (y == c)
        order = np.argsort(q_tilde[sel], kind="stable")
        q_c = q_tilde[sel][order]
        o_c = o_true[sel][order].astype(np.float64)
        per_class.append((q_c, o_c))
        below = (o_c < alpha).astype(np.int64)
        below_suffix = np.concatenate([np.cumsum(below[::-1])[::-1], [0]])  # #(o < α) among rows i..end
        start = np.searchsorted(q_c, candidates, side="left")
        kept = q_c.size - start
        ok &= (kept > 0) & (below_suffix[start] <= _quantile_index(kept, alpha))
    if not ok.any():
        return math.inf, psi
    t = float(candidates[int(np.argmax(ok))])
    for c, (q_c, o_c) in enumerate(per_class):
        vals = np.sort(o_c[q_c >= t])
        psi[c] = max(float(vals[int(_quantile_index(vals.size, alpha))]), 0.0)
    return t, psi


# ---------------------------------------------------------------------------------------------
# per-bin medians and Cauchy robust estimates


def magnitude_medians(o_hat: np.ndarray, y_hat: np.ndarray, hard_bin: np.ndarray, num_classes: int) -> np.ndarray:
    """Median o_ŷ per (predicted class, hard bin) over calibration (``eq:cauchyIteratedLower`` inputs), NaN if empty, [C, B]."""
    o_hat = _vector("o_hat", o_hat).astype(np.float64)
    n = o_hat.shape[0]
    y_hat = _labels("y_hat", y_hat, num_classes, n)
    hard_bin = np.asarray(hard_bin).reshape(-1).astype(np.int64)
    if hard_bin.shape[0] != n:
        raise ValueError(f"hard_bin has {hard_bin.shape[0]} rows, expected {n}")
    if np.any(hard_bin < 0):
        raise ValueError("hard bins must be ≥ 0")
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
        raise ValueError("need at least one round's min valid q~")
    if np.any(np.isnan(vals)):
        raise ValueError("min valid q~ values must not be NaN (use +inf for 'no threshold found')")
    if not (0 <= int(best_index) < vals.size):
        raise ValueError(f"best_index {best_index} out of range for {vals.size} rounds")
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
        raise ValueError("need at least one round's medians")
    meds = [np.asarray(m, dtype=np.float64) for m in medians]
    num_classes = meds[0].shape[0]
    if any(m.ndim != 2 or m.shape[0] != num_classes for m in meds):
        raise ValueError("every round's medians must be [C, B] with the same C")
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
        raise ValueError("per-bin medians must be finite (NaN marks an empty bucket)")
    return scale * cauchy_factor(alpha)


def lookup_offsets(offsets: np.ndarray, y_hat: np.ndarray, hard_bin: np.ndarray) -> np.ndarray:
    """m[ŷ][bin] per row, 0 for bins beyond the table (``eq:index-conditional-sdm-estimator``), float64 [N]."""
    offsets = np.asarray(offsets, dtype=np.float64)
    y_hat = np.asarray(y_hat, dtype=np.int64).reshape(-1)
    hard_bin = np.asarray(hard_bin, dtype=np.int64).reshape(-1)
    if offsets.ndim != 2 or offsets.shape[1] == 0:
        return np.zeros(y_hat.shape[0])
    inside = hard_bin < offsets.shape[1]
    return np.where(inside, offsets[y_hat, np.minimum(hard_bin, offsets.shape[1] - 1)], 0.0)


# ---------------------------------------------------------------------------------------------
# the index-conditional estimator


def _variant(W, v_var, log_base, y_hat, sdm_flip, offsets, psi, min_valid_own, robust_min):
    """Process one of centroid / lower / upper: q~, o, flip rule, offset, validity.

    Returns (:class:`~sdm_mlx.results.Variant`, floor(q~) > 0 before processing, o has no unique argmax ŷ):
    the last two feed the rejection reasons."""
    rows = np.arange(v_var.shape[0])
    q_raw = np.where(sdm_flip, 0.0, v_var[rows, y_hat] * log_base)
    o = rescaled_output(W, v_var, q_raw)
    floor_ok = np.floor(q_raw) > 0
    o_flip = ~unique_argmax_is(o, y_hat)
    ood = sdm_flip | ~floor_ok | o_flip
    q_proc, bins = apply_ood(q_raw, ood)
    offset = lookup_offsets(offsets, y_hat, bins)
    p = np.clip(o[rows, y_hat] - offset, 0.0, 1.0)
    o_adj = o.copy()
    o_adj[rows, y_hat] = p
    above = o_adj >= psi[None, :]
    singleton = (above.sum(axis=1) == 1) & above[rows, y_hat]
    valid = ~ood & (q_proc >= min_valid_own) & (q_proc >= robust_min) & singleton
    variant = Variant(v=v_var, q_tilde=q_proc, hard_bin=bins, ood=ood, o=o, offset=offset, p=p, valid=valid)
    return variant, floor_ok, o_flip, singleton


def _check_calibration(cal: "Calibration") -> tuple:
    """(W, ψ, min valid q~, robust min valid q~, offsets, output eCDFs, sample-size arrays) validated.

    Validated once per :class:`Calibration` (frozen) and kept on it: prediction calls it per batch,
    and re-checking the sorted eCDFs cost more than scoring a single row."""
    cached = cal.__dict__.get("_checked")
    if cached is not None:
        return cached
    checked = _validate_calibration(cal)
    object.__setattr__(cal, "_checked", checked)
    return checked


def _validate_calibration(cal: "Calibration") -> tuple:
    W = _finite("W", cal.W)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"W must be [C, C], got shape {W.shape}")
    C = W.shape[0]
    check_alpha(cal.alpha, C)
    psi = _vector("psi", cal.psi).astype(np.float64)
    if psi.shape[0] != C:
        raise ValueError(f"psi must have {C} entries, got {psi.shape[0]}")
    min_valid_own, robust_min = float(cal.min_valid), float(cal.robust_min_valid)
    if math.isnan(min_valid_own) or math.isnan(robust_min):
        raise ValueError("min valid q~ thresholds must not be NaN (+inf means 'none')")
    offsets = np.zeros((C, 0)) if cal.offsets is None else np.asarray(cal.offsets, dtype=np.float64)
    if offsets.size and (offsets.ndim != 2 or offsets.shape[0] != C or not np.all(np.isfinite(offsets))):
        raise ValueError(f"offsets must be a finite [C, B] array with C = {C}")
    ecdfs = _check_lists("output_ecdfs", cal.output_ecdfs, C)
    arrays = _check_lists("sample_size_arrays", cal.sample_size_arrays, C)
    return W, psi, min_valid_own, robust_min, offsets, ecdfs, arrays


def _rejection_reasons(n, min_valid_own, robust_min, sdm_flip, d, cen, low) -> np.ndarray:
    """First failing condition per row, in the order of :data:`REJECTION_REASONS` ("" = admitted)."""
    (_, cen_floor_ok, cen_o_flip, _), (low_v, low_floor_ok, low_o_flip, low_singleton) = cen, low
    conditions = [
        np.full(n, math.isinf(min_valid_own) and min_valid_own > 0),
        np.full(n, robust_min == math.inf),
        sdm_flip & (d <= 0),
        sdm_flip | (cen_floor_ok & cen_o_flip),
        ~low_floor_ok,
        low_o_flip,
        low_v.q_tilde < min_valid_own,
        low_v.q_tilde < robust_min,
        ~low_singleton,
    ]
    choices = ["no_valid_threshold", "no_robust_threshold", "ood_distance", "argmax_flip", "ood_similarity",
               "argmax_flip", "below_model_min_qbin", "below_robust_min_qbin", "below_threshold_psi"]
    return np.select(conditions, choices, default="").astype(object)


def estimate(calibration: "Calibration", z: np.ndarray, q: np.ndarray, d: np.ndarray, sdm: np.ndarray) -> Estimate:
    """Index-conditional SDM estimator p̂_lower with ⊥ (``eq:index-conditional-sdm-estimator``), vectorised over rows.

    Inputs per row: logits z' [N, C] (ŷ = argmax z'), Similarity q [N] (≥ 0), Distance quantile d [N]
    (validated only: d = 0 makes the SDM output uniform, which the flip rule catches), SDM output
    [N, C].  The model is a :class:`Calibration` (W'', ψ, min valid q~ at α', robust min valid q~,
    offsets, output eCDFs for v, sample-size arrays for n̂).

    Returns an :class:`~sdm_mlx.results.Estimate`: ŷ, the SDM flip, n̂ [N, C] (−1 for a class without
    calibration rows), DKW ε, admission and the rejection reason (order :data:`REJECTION_REASONS`), and
    for each variant (centroid / lower / upper) v, processed q~ (0 when OOD), hard bin, OOD, o (before
    the offset), offset m[ŷ][bin], p = clip(o_ŷ − offset, 0, 1) and validity (lower: ``admitted``).
    """
    W, psi, min_valid_own, robust_min, offsets, ecdfs, arrays = _check_calibration(calibration)
    C = W.shape[0]
    z = _matrix("z", z, c=C)
    n = z.shape[0]
    sdm = _matrix("sdm", sdm, n, C)
    q = _vector("q", q, n).astype(np.float64)
    d = _vector("d", d, n)
    if np.any(q < 0):
        raise ValueError("q must be ≥ 0")
    if np.any(d < 0):
        raise ValueError("d must be ≥ 0")
    v = _v_of(sdm, ecdfs).astype(np.float64)

    y_hat = z.argmax(axis=1).astype(np.int64)
    sdm_flip = ~unique_argmax_is(sdm, y_hat)
    common = dict(W=W, log_base=np.log(2.0 + q), y_hat=y_hat, sdm_flip=sdm_flip, offsets=offsets, psi=psi,
                  min_valid_own=min_valid_own, robust_min=robust_min)
    cen = _variant(v_var=v, **common)
    n_hat = _n_hat_of(cen[0].q_tilde, arrays)
    eps = dkw_epsilon(n_hat, calibration.alpha)
    v_lower, v_upper = dkw_bounds(v, eps, y_hat)
    low = _variant(v_var=v_lower, **common)
    up = _variant(v_var=v_upper, **common)
    reason = _rejection_reasons(n, min_valid_own, robust_min, sdm_flip, d, cen, low)
    admitted = low[0].valid
    # the reasons are exhaustive for the conditions of `valid`
    assert np.array_equal(admitted, reason == ""), "rejection reasons out of sync with admission"
    return Estimate(prediction=y_hat, admitted=admitted, rejection_reason=reason, sdm_flip=sdm_flip, n_hat=n_hat,
                    epsilon=eps, centroid=cen[0], lower=low[0], upper=up[0])


# ---------------------------------------------------------------------------------------------
# one round, and aggregation over rounds


@dataclass
class RoundCalibration:
    """Everything one round (of J) contributes: what prediction needs and what aggregation over J needs."""

    num_classes: int
    alpha: float  #: α' the α-dependent fields (min_valid, psi) were computed at
    output_ecdfs: list  #: per class c, sorted calibration sdm_c of true class c (``equation:sdm-output-cdfs``)
    W: np.ndarray  #: rescaler W'' float32 [C, C] (``[out, in]``: v' = W v)
    y: np.ndarray  #: calibration true labels [N]
    y_hat: np.ndarray  #: calibration predictions argmax z' [N]
    sdm_flip: np.ndarray  #: SDM output without a unique argmax equal to ŷ [N]
    v: np.ndarray  #: [N, C]
    q_tilde_pre: np.ndarray  #: q~ before the rescaler (sdm flips → 0): W'' was trained on it [N]
    o: np.ndarray  #: rescaled output [N, C] (from q~_pre)
    non_ood: np.ndarray  #: bool [N]
    q_tilde: np.ndarray  #: processed q~ (OOD → 0) [N]
    hard_bin: np.ndarray  #: int [N] (OOD → 0)
    o_true: np.ndarray  #: o at the TRUE label [N] (Alg. 3 input)
    o_hat: np.ndarray  #: o at ŷ [N] (median input)
    sample_size_arrays: list  #: per class, sorted processed q~ of all rows of that true class
    min_valid: float  #: Alg. 3 min valid q~ (+inf if none) at ``alpha``
    psi: np.ndarray  #: Alg. 3 thresholds [C] at ``alpha``
    medians: np.ndarray  #: median o_ŷ per (ŷ, bin) [C, B], NaN where empty
    rescaler: RescalerFit | None = field(default=None, repr=False)

    def with_alpha(self, alpha: float) -> "RoundCalibration":
        """This round re-thresholded at a new α' by Alg. 3 (``alg:estimate-soft-q-bin``), no retraining."""
        mv, psi = min_valid_qbin(self.o_true, self.q_tilde, self.y, self.non_ood, self.num_classes, alpha)
        return replace(self, alpha=float(alpha), min_valid=mv, psi=psi)

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, meta) for a safetensors + JSON artifact; ragged per-class lists are concatenated + counts."""
        arrays = {
            name: np.asarray(getattr(self, name))
            for name in ("W", "y", "y_hat", "sdm_flip", "v", "q_tilde_pre", "o", "non_ood", "q_tilde",
                         "hard_bin", "o_true", "o_hat", "psi", "medians")
        }
        for name in ("sdm_flip", "non_ood"):
            arrays[name] = arrays[name].astype(np.uint8)
        for name in ("output_ecdfs", "sample_size_arrays"):
            lists = getattr(self, name)
            arrays[name + "_values"] = np.concatenate([np.asarray(a) for a in lists]) if lists else np.zeros(0)
            arrays[name + "_counts"] = np.array([len(a) for a in lists], dtype=np.int64)
        meta = {"num_classes": int(self.num_classes), "alpha": float(self.alpha)}
        put_float(meta, "min_valid", self.min_valid, "no valid threshold: Alg. 3 found no q~ where psi_c >= alpha "
                                                     "for every class, so this round rejects every prediction")
        if self.rescaler is not None:
            meta["rescaler"] = {
                "epoch_losses": self.rescaler.epoch_losses.tolist(),
                "best_epoch": int(self.rescaler.best_epoch),
                "best_loss": float(self.rescaler.best_loss),
                "epochs_run": int(self.rescaler.epochs_run),
                "stopped_early": bool(self.rescaler.stopped_early),
                "seconds": float(self.rescaler.seconds),
            }
        return arrays, meta

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], meta: dict) -> "RoundCalibration":
        """Inverse of :meth:`to_arrays` (the rescaler history is not restored)."""
        def split(name):
            vals, counts = np.asarray(arrays[name + "_values"]), np.asarray(arrays[name + "_counts"])
            return [a.copy() for a in np.split(vals, np.cumsum(counts)[:-1])]

        a = {k: np.asarray(v) for k, v in arrays.items()}
        return cls(
            num_classes=int(meta["num_classes"]), alpha=float(meta["alpha"]),
            output_ecdfs=split("output_ecdfs"), W=a["W"].astype(np.float32), y=a["y"].astype(np.int64),
            y_hat=a["y_hat"].astype(np.int64), sdm_flip=a["sdm_flip"].astype(bool), v=a["v"],
            q_tilde_pre=a["q_tilde_pre"], o=a["o"], non_ood=a["non_ood"].astype(bool), q_tilde=a["q_tilde"],
            hard_bin=a["hard_bin"].astype(np.int64), o_true=a["o_true"], o_hat=a["o_hat"],
            sample_size_arrays=split("sample_size_arrays"), min_valid=_stored_min_valid(meta),
            psi=a["psi"], medians=a["medians"],
        )


def _stored_min_valid(meta: dict) -> float:
    value = get_float(meta, "min_valid")
    if value is None:
        raise ValueError("round metadata has min_valid null without a min_valid_reason")
    return value


def calibrate_round(
    sdm_cal: np.ndarray,
    q_cal: np.ndarray,
    y_cal: np.ndarray,
    y_hat_cal: np.ndarray,
    *,
    alpha: float = 0.95,
    seed: int = 0,
    num_classes: int | None = None,
    max_epochs: int = DEFAULT_MAX_EPOCHS,
    patience: int = DEFAULT_PATIENCE,
    learning_rate: float = DEFAULT_LEARNING_RATE,
    engine: str = "numpy",
    W: np.ndarray | None = None,
    on_epoch=None,
) -> RoundCalibration:
    """One round after Alg. 1's best epoch: eCDFs → v → q~ → W'' (``alg:train-rescaler``) → o → OOD → ``alg:estimate-soft-q-bin`` → medians.

    ``sdm_cal``/``q_cal`` are the calibration SDM outputs and (flip-reset) q of the
    best epoch, ``y_hat_cal`` = argmax z'.  Pass ``W`` to skip training (e.g. a
    stored W''); otherwise W'' is trained with ``seed`` (init and shuffles);
    ``on_epoch(epoch, loss)`` is called after every rescaler epoch.
    """
    sdm_cal = _matrix("sdm_cal", sdm_cal)
    C = sdm_cal.shape[1] if num_classes is None else int(num_classes)
    alpha = check_alpha(alpha, C)
    sdm_cal = _matrix("sdm_cal", sdm_cal, c=C)
    n = sdm_cal.shape[0]
    if n == 0:
        raise ValueError("calibration split is empty")
    q_cal = _vector("q_cal", q_cal, n)
    y = _labels("y_cal", y_cal, C, n)
    y_hat = _labels("y_hat_cal", y_hat_cal, C, n)

    ecdfs = output_ecdfs(sdm_cal, y, C)
    v = v_vector(sdm_cal, ecdfs)
    sdm_flip = ~unique_argmax_is(sdm_cal, y_hat)
    q_pre = np.where(sdm_flip, 0.0, soft_qbin(v, q_cal, y_hat))
    fit = None
    if W is None:
        fit = train_rescaler(v, q_pre, y, seed=seed, max_epochs=max_epochs, patience=patience,
                             learning_rate=learning_rate, engine=engine, on_epoch=on_epoch)
        W = fit.W
    W = np.asarray(W, dtype=np.float32)
    if W.shape != (C, C):
        raise ValueError(f"W must be [{C}, {C}], got {W.shape}")
    o = rescaled_output(W, v, q_pre)
    ood = sdm_flip | ood_mask(o, q_pre, y_hat)
    q_proc, bins = apply_ood(q_pre, ood)
    rows = np.arange(n)
    o_true, o_hat = o[rows, y], o[rows, y_hat]
    min_valid, psi = min_valid_qbin(o_true, q_proc, y, ~ood, C, alpha)
    return RoundCalibration(
        num_classes=C, alpha=alpha, output_ecdfs=ecdfs, W=W, y=y, y_hat=y_hat, sdm_flip=sdm_flip, v=v,
        q_tilde_pre=q_pre, o=o, non_ood=~ood, q_tilde=q_proc, hard_bin=bins, o_true=o_true, o_hat=o_hat,
        sample_size_arrays=sample_size_arrays(q_proc, y, C), min_valid=min_valid, psi=psi,
        medians=magnitude_medians(o_hat, y_hat, bins, C), rescaler=fit,
    )


def aggregate_rounds(rounds: Sequence[RoundCalibration], best_index: int, alpha: float) -> tuple[float, np.ndarray]:
    """(robust min valid q~, offsets [C, B]) over the J rounds (``eq:cauchyMinValidQBin``, ``eq:cauchyIteratedLower``).

    Rounds calibrated at another α are re-thresholded (Alg. 3) at ``alpha`` first.
    """
    if len(rounds) == 0:
        raise ValueError("need at least one round")
    C = rounds[0].num_classes
    alpha = check_alpha(alpha, C)
    if any(r.num_classes != C for r in rounds):
        raise ValueError("all rounds must have the same number of classes")
    rounds = [r if r.alpha == alpha else r.with_alpha(alpha) for r in rounds]
    robust = cauchy_robust_min([r.min_valid for r in rounds], best_index, alpha)
    return robust, cauchy_offsets([r.medians for r in rounds], alpha)


@dataclass(frozen=True)
class Calibration:
    """The test-time model of ``eq:index-conditional-sdm-estimator`` at one α'.

    The best round's output eCDFs, W'', ψ, min valid q~ and sample-size arrays (Alg. 3 at ``alpha``),
    plus the Cauchy robust min valid q~ (``eq:cauchyMinValidQBin``) and offsets (``eq:cauchyIteratedLower``)
    over all J rounds at the same α'.
    """

    alpha: float
    W: np.ndarray  #: rescaler W'' [C, C]
    psi: np.ndarray  #: Alg. 3 thresholds ψ [C]
    min_valid: float  #: the model's own min valid q~ (+inf: none)
    robust_min_valid: float  #: Cauchy robust min valid q~ (+inf: none)
    offsets: np.ndarray | None  #: [C, B] (None: no offsets)
    output_ecdfs: list  #: per class, sorted calibration sdm_c of true class c (for v)
    sample_size_arrays: list  #: per class, sorted processed calibration q~ (for n̂)

    @classmethod
    def from_round(cls, best: RoundCalibration, robust_min_valid: float, offsets) -> "Calibration":
        """The best round (at its α') with given robust min valid q~ and offsets."""
        return cls(alpha=best.alpha, W=best.W, psi=best.psi, min_valid=best.min_valid,
                   robust_min_valid=float(robust_min_valid), offsets=offsets, output_ecdfs=best.output_ecdfs,
                   sample_size_arrays=best.sample_size_arrays)

    @classmethod
    def from_rounds(cls, rounds: Sequence[RoundCalibration], best_index: int, alpha: float) -> "Calibration":
        """Alg. 3 re-run at ``alpha`` on the best round and Cauchy aggregation over all rounds (no retraining)."""
        best = rounds[best_index]
        best = best if best.alpha == alpha else best.with_alpha(alpha)
        robust, offsets = aggregate_rounds(rounds, best_index, alpha)
        return cls.from_round(best, robust, offsets)
