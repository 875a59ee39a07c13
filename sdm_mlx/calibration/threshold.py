"""Alg. 3 (``alg:estimate-soft-q-bin``): the min valid q~ and the thresholds ψ at α′, with the exact
quantile index of DESIGN #13."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from ._checks import _labels, _vector, check_alpha
from ..errors import InputError


#: Decimals 1 − α is rounded to before the quantile index (DESIGN #13), exactly (:func:`exact_one_minus`).
_QUANTILE_ROUND = 10


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

    Checks its inputs (the public entry); the package's own callers, whose arrays it made, call
    :func:`_min_valid_qbin` directly.
    """
    alpha = check_alpha(alpha, num_classes)
    o_true = _vector("o_true", o_true)
    n = o_true.shape[0]
    q_tilde = _vector("q_tilde", q_tilde, n)
    y = _labels("y", y, num_classes, n)
    keep = np.asarray(non_ood, dtype=bool).reshape(-1)
    if keep.shape[0] != n:
        raise InputError(f"non_ood has {keep.shape[0]} rows, expected {n}")
    return _min_valid_qbin(o_true, q_tilde, y, keep, num_classes, alpha)


def _min_valid_qbin(o_true: np.ndarray, q_tilde: np.ndarray, y: np.ndarray, non_ood: np.ndarray, num_classes: int,
         alpha: float) -> tuple[float, np.ndarray]:
    """:func:`min_valid_qbin` of arrays the package made, unchecked.

    Preconditions: ``o_true`` and ``q_tilde`` finite [N], ``y`` int64 labels in 0..C−1 [N], ``non_ood`` bool
    [N], ``alpha`` a validated α′ (:func:`sdm_mlx.validation.alpha`)."""
    q_tilde = np.asarray(q_tilde, dtype=np.float64)
    keep = non_ood & (np.floor(q_tilde) > 0)
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
