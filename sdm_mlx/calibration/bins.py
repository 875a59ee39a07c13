"""Output eCDFs, v and the q bins: ``equation:sdm-output-cdfs``, ``equation:softqbin``, the hard bin and
the OOD rule (DESIGN #7, #11, #16)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ._checks import _SortedTable, _check_lists, _labels, _matrix, _vector
from ..errors import InputError


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


def _v_of(sdm: np.ndarray, ecdfs: list[np.ndarray], table: _SortedTable | None = None) -> np.ndarray:
    """:func:`v_vector` of validated inputs (``table``: the same eCDFs as one table, for a small batch)."""
    below = None if table is None else table.below(sdm)
    if below is not None:  # every class at once; a class without entries gives 0 (0 below, 0 / 1)
        return np.where(sdm >= table.last, 1.0, below / table.divisor)
    v = np.zeros(sdm.shape, dtype=np.float64)
    for c, sorted_c in enumerate(ecdfs):
        if sorted_c.size == 0:
            continue  # empty list ⇒ 0
        s = sdm[:, c]
        below = sorted_c.searchsorted(s, side="left")
        v[:, c] = np.where(s >= sorted_c[-1], 1.0, below / sorted_c.size)
    return v


def unique_argmax_is(x: np.ndarray, y_hat: np.ndarray) -> np.ndarray:
    """True where row x has a unique maximum at ŷ: the argmax test of ``equation:rescaled-prediction-conditional-estimate`` (DESIGN #7)."""
    x = np.asarray(x)
    top = x.max(axis=1, keepdims=True)
    is_top = x == top
    rows = np.arange(x.shape[0])
    return (is_top.sum(axis=1) == 1) & is_top[rows, np.asarray(y_hat, dtype=np.int64)]


def _unique_argmax_at(x: np.ndarray, y_hat: np.ndarray, index: np.ndarray) -> np.ndarray:
    """:func:`unique_argmax_is` of a float array ``x`` [N, C], int64 ŷ [N] and ``index`` = 0..N−1."""
    is_top = x == np.maximum.reduce(x, axis=1, keepdims=True)
    return (np.add.reduce(is_top, axis=1) == 1) & is_top[index, y_hat]


def soft_qbin(v: np.ndarray, q: np.ndarray, y_hat: np.ndarray) -> np.ndarray:
    """q~ = ln((2+q)^{v_ŷ}) = v_ŷ · ln(2+q) (``equation:softqbin``), float64 [N]."""
    v = _matrix("v", v)
    n = v.shape[0]
    q = _vector("q", q, n).astype(np.float64)
    if np.any(q < 0):
        raise InputError("q must be ≥ 0")
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


def _apply_ood_of(q_tilde: np.ndarray, ood: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`apply_ood` of a finite float64 q~ [N] and a bool ``ood`` [N] (the estimator's own arrays); the
    hard bin of an OOD row is floor(0) = 0 already."""
    q_proc = np.where(ood, 0.0, q_tilde)
    return q_proc, np.floor(np.maximum(q_proc, 0.0)).astype(np.int64)
