"""The index-conditional estimator at test time (``eq:index-conditional-sdm-estimator``): centroid, lower
and upper variants, admission and the rejection reasons (precedence: :data:`REJECTION_REASONS`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ..results import Estimate, Variant
from .rescaler import rescaled_output
from ._checks import _check_lists, _finite, _matrix, _vector, check_alpha
from .bins import _v_of, apply_ood, unique_argmax_is
from .bounds import _n_hat_of, dkw_bounds, dkw_epsilon
from .cauchy import lookup_offsets
from ..errors import InputError

if TYPE_CHECKING:  # a type only: rounds imports this module
    from .rounds import Calibration


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


def _geometry(W, v_var, log_base, y_hat, sdm_flip) -> tuple:
    """The thresholds-free part of one variant: (v, q~ processed, hard bin, OOD, o, floor(q~) > 0 before
    processing, o has no unique argmax ŷ)."""
    rows = np.arange(v_var.shape[0])
    q_raw = np.where(sdm_flip, 0.0, v_var[rows, y_hat] * log_base)
    o = rescaled_output(W, v_var, q_raw)
    floor_ok = np.floor(q_raw) > 0
    o_flip = ~unique_argmax_is(o, y_hat)
    ood = sdm_flip | ~floor_ok | o_flip
    q_proc, bins = apply_ood(q_raw, ood)
    return v_var, q_proc, bins, ood, o, floor_ok, o_flip


def _variant(geometry: tuple, y_hat, offsets, psi, min_valid_own, robust_min, *, offset=None):
    """Process one of centroid / lower / upper at one level: offset, p, validity.

    ``psi`` [C] (or one row per input row, [N, C]), the two minima scalars (or [N]); ``offset``: the rows'
    offsets already looked up (else from ``offsets``).  Returns (:class:`~sdm_mlx.results.Variant`,
    floor(q~) > 0 before processing, o has no unique argmax ŷ, singleton): the last three feed the
    rejection reasons."""
    v_var, q_proc, bins, ood, o, floor_ok, o_flip = geometry
    rows = np.arange(v_var.shape[0])
    offset = lookup_offsets(offsets, y_hat, bins) if offset is None else offset
    p = np.clip(o[rows, y_hat] - offset, 0.0, 1.0)
    o_adj = o.copy()
    o_adj[rows, y_hat] = p
    above = o_adj >= psi
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
        raise InputError(f"W must be [C, C], got shape {W.shape}")
    C = W.shape[0]
    check_alpha(cal.alpha, C)
    psi = _vector("psi", cal.psi).astype(np.float64)
    if psi.shape[0] != C:
        raise InputError(f"psi must have {C} entries, got {psi.shape[0]}")
    min_valid_own, robust_min = float(cal.min_valid), float(cal.robust_min_valid)
    if math.isnan(min_valid_own) or math.isnan(robust_min):
        raise InputError("min valid q~ thresholds must not be NaN (+inf means 'none')")
    offsets = np.zeros((C, 0)) if cal.offsets is None else np.asarray(cal.offsets, dtype=np.float64)
    if offsets.size and (offsets.ndim != 2 or offsets.shape[0] != C or not np.all(np.isfinite(offsets))):
        raise InputError(f"offsets must be a finite [C, B] array with C = {C}")
    ecdfs = _check_lists("output_ecdfs", cal.output_ecdfs, C)
    arrays = _check_lists("sample_size_arrays", cal.sample_size_arrays, C)
    return W, psi, min_valid_own, robust_min, offsets, ecdfs, arrays


def _rejection_reasons(n, min_valid_own, robust_min, sdm_flip, d, cen, *, low) -> np.ndarray:
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


def _rows(calibration: "Calibration", z, q, d, sdm) -> dict:
    """The per-row quantities no threshold changes: validated inputs, v, ŷ, the SDM flip, log(2+q), the
    centroid's geometry and n̂ (valid for every level of one model: the same W'', eCDFs and sample sizes)."""
    W, _, _, _, _, ecdfs, arrays = _check_calibration(calibration)
    C = W.shape[0]
    z = _matrix("z", z, c=C)
    n = z.shape[0]
    sdm = _matrix("sdm", sdm, n, C)
    q = _vector("q", q, n).astype(np.float64)
    d = _vector("d", d, n)
    if np.any(q < 0):
        raise InputError("q must be ≥ 0")
    if np.any(d < 0):
        raise InputError("d must be ≥ 0")
    v = _v_of(sdm, ecdfs).astype(np.float64)
    y_hat = z.argmax(axis=1).astype(np.int64)
    sdm_flip = ~unique_argmax_is(sdm, y_hat)
    log_base = np.log(2.0 + q)
    centroid = _geometry(W, v, log_base, y_hat, sdm_flip)
    return dict(n=n, d=d, v=v, y_hat=y_hat, sdm_flip=sdm_flip, log_base=log_base, centroid=centroid,
                n_hat=_n_hat_of(centroid[1], arrays))


def level_validity(calibration: "Calibration", rows: dict) -> tuple[np.ndarray, np.ndarray]:
    """(lower valid = admitted, centroid valid) at one level from :func:`_rows` of the same model: the
    lower variant's geometry at this level's ε and the thresholds of this level (no upper variant, no
    reasons: what the nested ladder needs, DESIGN #25)."""
    W, psi, min_valid_own, robust_min, offsets, _, _ = _check_calibration(calibration)
    y_hat = rows["y_hat"]
    eps = dkw_epsilon(rows["n_hat"], calibration.alpha)
    v_lower, _ = dkw_bounds(rows["v"], eps, y_hat)
    lower = _geometry(W, v_lower, rows["log_base"], y_hat, rows["sdm_flip"])
    thresholds = (offsets, psi, min_valid_own, robust_min)
    return _variant(lower, y_hat, *thresholds)[0].valid, _variant(rows["centroid"], y_hat, *thresholds)[0].valid


#: most stacked rows (levels x rows) :func:`levels_validity` processes at once: small batches (a server's
#: verdicts) gain from few array operations, large ones keep the working memory of one level
STACKED_ROWS = 4096


def levels_validity(calibrations, rows: dict) -> tuple[np.ndarray, np.ndarray]:
    """:func:`level_validity` at every level of ``calibrations`` (one model's, as the nested ladder's), bool
    ``[N, L]`` each.  Levels are stacked along the rows (row ``l N + i`` is row ``i`` at level ``l``, each
    with its own ε, offsets, ψ and minima), up to :data:`STACKED_ROWS` rows at a time: one row's ladder of
    19 levels takes 1.2 ms instead of 2.1 ms.  The same values as the per-level calls (the nested tests
    compare them with the full estimator at every level)."""
    n, L = rows["n"], len(calibrations)
    checked = [_check_calibration(c) for c in calibrations]
    lower, centroid = np.empty((n, L), dtype=bool), np.empty((n, L), dtype=bool)
    group = max(1, STACKED_ROWS // max(n, 1))
    one_model = all(c[0] is checked[0][0] or np.array_equal(c[0], checked[0][0]) for c in checked)
    for j0 in range(0, L, group):
        part = slice(j0, min(L, j0 + group))
        if one_model and part.stop - part.start > 1:
            lower[:, part], centroid[:, part] = _stacked_validity(calibrations[part], checked[part], rows)
        else:
            for j in range(part.start, part.stop):
                lower[:, j], centroid[:, j] = level_validity(calibrations[j], rows)
    return lower, centroid


def _stacked_validity(calibrations, checked, rows: dict) -> tuple[np.ndarray, np.ndarray]:
    """:func:`levels_validity` of levels sharing W'' in one stacked pass (see there)."""
    n, L = rows["n"], len(calibrations)

    def tiled(a):
        return np.concatenate([a] * L, axis=0)

    def per_level(values):  # one value per level -> one per stacked row
        return np.repeat(np.asarray(values), n, axis=0)

    y_hat = tiled(rows["y_hat"])
    eps = dkw_epsilon(tiled(rows["n_hat"]), per_level([c.alpha for c in calibrations]))
    v_lower, _ = dkw_bounds(tiled(rows["v"]), eps, y_hat)
    lower = _geometry(checked[0][0], v_lower, tiled(rows["log_base"]), y_hat, tiled(rows["sdm_flip"]))
    centroid = tuple(tiled(a) for a in rows["centroid"])
    psi = per_level(np.stack([c[1] for c in checked]))
    minima = per_level([float(c[2]) for c in checked]), per_level([float(c[3]) for c in checked])
    tables = [np.asarray(c[4], dtype=np.float64) for c in checked]
    same_shape = all(t.shape == tables[0].shape for t in tables)
    level = per_level(np.arange(L))
    out = []
    for geometry in (lower, centroid):
        bins = geometry[2]
        if same_shape:  # every level's offsets m[ŷ][bin] as one [L, C, B] table
            offset = lookup_offsets(np.stack(tables), y_hat, bins, level=level)
        else:
            offset = np.concatenate([lookup_offsets(t, rows["y_hat"], bins[j * n:(j + 1) * n])
                                     for j, t in enumerate(tables)])
        valid = _variant(geometry, y_hat, None, psi, *minima, offset=offset)[0].valid
        out.append(valid.reshape(L, n).T)
    return out[0], out[1]


def estimate(calibration: "Calibration", z: np.ndarray, q: np.ndarray, d: np.ndarray, sdm: np.ndarray,
             rows: dict | None = None) -> Estimate:
    """Index-conditional SDM estimator p̂_lower with ⊥ (``eq:index-conditional-sdm-estimator``), vectorised over rows.

    Inputs per row: logits z' [N, C] (ŷ = argmax z'), Similarity q [N] (≥ 0), Distance quantile d [N]
    (validated only: d = 0 makes the SDM output uniform, which the flip rule catches), SDM output
    [N, C].  The model is a :class:`Calibration` (W'', ψ, min valid q~ at α', robust min valid q~,
    offsets, output eCDFs for v, sample-size arrays for n̂).

    Returns an :class:`~sdm_mlx.results.Estimate`: ŷ, the SDM flip, n̂ [N, C] (−1 for a class without
    calibration rows), DKW ε, admission and the rejection reason (order :data:`REJECTION_REASONS`), and
    for each variant (centroid / lower / upper) v, processed q~ (0 when OOD), hard bin, OOD, o (before
    the offset), offset m[ŷ][bin], p = clip(o_ŷ − offset, 0, 1) and validity (lower: ``admitted``).
    ``rows``: :func:`_rows` of these inputs, already computed for another level of the same model.
    """
    W, psi, min_valid_own, robust_min, offsets, _, _ = _check_calibration(calibration)
    r = _rows(calibration, z, q, d, sdm) if rows is None else rows
    n, y_hat, sdm_flip, v, n_hat = r["n"], r["y_hat"], r["sdm_flip"], r["v"], r["n_hat"]
    thresholds = (offsets, psi, min_valid_own, robust_min)
    cen = _variant(r["centroid"], y_hat, *thresholds)
    eps = dkw_epsilon(n_hat, calibration.alpha)
    v_lower, v_upper = dkw_bounds(v, eps, y_hat)
    low = _variant(_geometry(W, v_lower, r["log_base"], y_hat, sdm_flip), y_hat, *thresholds)
    up = _variant(_geometry(W, v_upper, r["log_base"], y_hat, sdm_flip), y_hat, *thresholds)
    reason = _rejection_reasons(n, min_valid_own, robust_min, sdm_flip, r["d"], cen, low=low)
    admitted = low[0].valid
    # the reasons are exhaustive for the conditions of `valid`
    assert np.array_equal(admitted, reason == ""), "rejection reasons out of sync with admission"
    # a one-level grid {α'}; sdm_mlx.calibration.nested fills these over a grid of levels (DESIGN #25)
    a = float(calibration.alpha)
    return Estimate(prediction=y_hat, admitted=admitted, rejection_reason=reason, sdm_flip=sdm_flip, n_hat=n_hat,
                    epsilon=eps, centroid=cen[0], lower=low[0], upper=up[0],
                    alpha_region_lower=np.where(admitted, a, np.nan),
                    alpha_region_centroid=np.where(cen[0].valid, a, np.nan),
                    decision=np.where(admitted, "allow", "reject").astype(object))
