"""The index-conditional estimator at test time (``eq:index-conditional-sdm-estimator``): centroid, lower
and upper variants, admission and the rejection reasons (precedence: :data:`REJECTION_REASONS`)."""

from __future__ import annotations

import math
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from ..results import Estimate, Variant
from .rescaler import rescaled_output
from ._checks import _SortedTable, _check_lists, _finite, _matrix, _vector, check_alpha
from .bins import _apply_ood_of, _unique_argmax_at, _v_of
from .bounds import _dkw_log, _epsilon_of, _n_hat_of
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


def _geometry(W, v_var, log_base, y_hat, sdm_flip, index) -> tuple:
    """The thresholds-free part of one variant: (v, q~ processed, hard bin, OOD, o, floor(q~) > 0 before
    processing, o has no unique argmax ŷ).  ``W``: W'' in float64; ``index``: 0..N−1."""
    q_raw = np.where(sdm_flip, 0.0, v_var[index, y_hat] * log_base)
    o = rescaled_output(W, v_var, q_raw)
    floor_ok = q_raw >= 1.0  # floor(q~) > 0
    o_flip = ~_unique_argmax_at(o, y_hat, index)
    ood = sdm_flip | ~floor_ok | o_flip
    q_proc, bins = _apply_ood_of(q_raw, ood)
    return v_var, q_proc, bins, ood, o, floor_ok, o_flip


def _validity(geometry: tuple, y_hat, index, offset, *, psi, min_valid_own, robust_min) -> tuple:
    """(p, validity, singleton) of a variant's rows: p = clip(o_ŷ − offset, 0, 1) and the thresholds.

    ``offset``: the rows' offsets m[ŷ][bin]; ``psi`` [C] or one row per input row [N, C]; the two minima
    scalars or [N].  The singleton feeds the rejection reasons (:func:`_rejection_reasons`)."""
    q_proc, ood, o = geometry[1], geometry[3], geometry[4]
    p = (o[index, y_hat] - offset).clip(0.0, 1.0)
    o_adj = o.copy()
    o_adj[index, y_hat] = p
    above = o_adj >= psi
    singleton = (np.add.reduce(above, axis=1) == 1) & above[index, y_hat]
    valid = ~ood & (q_proc >= min_valid_own) & (q_proc >= robust_min) & singleton
    return p, valid, singleton


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


#: :meth:`_Ladder.layout` keeps the index arrays of passes of at most this many stacked rows
_KEPT_LAYOUT_ROWS = 2048


class _Ladder:
    """The per-level constants of calibrations of one model (a nested grid, DESIGN #25, or one level),
    validated and stacked along the levels once: W'' in float64, ln(2/(1−α)) of DKW ε, ψ, the two minima
    and the offset tables (and, when first needed, the output eCDFs and sample sizes as tables, and the
    index arrays of a batch size).  Kept on the frozen owner by :func:`_ladder_of`: a server scores one row
    per verdict, and rebuilding these per call cost more than that row's arithmetic."""

    def __init__(self, calibrations):
        self.checked = [_check_calibration(c) for c in calibrations]
        self.size = len(self.checked)
        first = self.checked[0][0]
        #: every level has the same W'' (then levels can be stacked along the rows)
        self.one_model = all(c[0] is first or np.array_equal(c[0], first) for c in self.checked)
        self.W = [np.asarray(c[0], dtype=np.float64) for c in self.checked]
        self.log_terms = np.array([_dkw_log(c.alpha) for c in calibrations])
        self.psi = np.stack([c[1] for c in self.checked])  # [L, C]
        self.min_valid = np.array([c[2] for c in self.checked])
        self.robust_min = np.array([c[3] for c in self.checked])
        self.tables = [c[4] for c in self.checked]  # offsets m[ŷ][bin], float64 [C, B] each
        same_shape = all(t.shape == self.tables[0].shape for t in self.tables)
        self.offsets = np.stack(self.tables) if same_shape else None  # [L, C, B]
        self._layouts = {}

    @cached_property
    def ecdf_table(self) -> _SortedTable:
        """The first level's output eCDFs (every level's, for one model) as one table, for v."""
        return _SortedTable(self.checked[0][5])

    @cached_property
    def size_table(self) -> _SortedTable:
        """The first level's sample-size arrays (every level's, for one model) as one table, for n̂."""
        return _SortedTable(self.checked[0][6])

    def layout(self, n: int, j0: int, j1: int, keep: int | None) -> tuple:
        """The index arrays of :func:`_ladder_pass` for N = ``n`` rows at levels j0..j1−1 (``keep``: the level
        with the upper variant, or None): (input row of each stacked row, 0..k N − 1, 0..(k + m) N − 1, level
        of each block, level of each row, and that level's ψ [R, C], min valid q~ and robust min valid q~
        [R]).  They depend on the shapes alone: small ones (a server's batches) are kept, read-only."""
        key = (n, j0, j1, keep)
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        m = j1 - j0
        k = m if keep is None else m + 1  # blocks with a geometry of their own (lower, upper)
        levels = np.arange(j0, j1)
        block_levels = np.concatenate([levels, levels] if keep is None else [levels, [keep], levels])
        level = block_levels.repeat(n)
        layout = (np.arange((k + m) * n) % n, np.arange(k * n), np.arange((k + m) * n), block_levels, level,
                  self.psi[level], self.min_valid[level], self.robust_min[level])
        if level.size <= _KEPT_LAYOUT_ROWS:
            for a in layout:
                a.flags.writeable = False
            if len(self._layouts) >= 64:
                self._layouts.clear()
            self._layouts[key] = layout
        return layout

    def offsets_at(self, block_levels, level, y_hat, y_stacked, bins) -> np.ndarray:
        """m[ŷ][bin] of blocks of N rows stacked along the rows, block b at level ``block_levels[b]`` (``level``:
        each row's level, ``y_stacked``: each row's ŷ; ``y_hat``: one block's)."""
        if self.offsets is not None:  # every level's table as one [L, C, B] array
            return lookup_offsets(self.offsets, y_stacked, bins, level=level)
        n = y_hat.shape[0]
        return np.concatenate([lookup_offsets(self.tables[j], y_hat, bins[b * n:(b + 1) * n])
                               for b, j in enumerate(block_levels.tolist())])


def _ladder_of(owner, calibrations) -> _Ladder:
    """The :class:`_Ladder` of ``calibrations``, built once and kept on their frozen ``owner`` (a
    :class:`~sdm_mlx.calibration.rounds.Calibration` for itself, a nested calibration for its levels)."""
    ladder = owner.__dict__.get("_ladder")
    if ladder is None:
        ladder = _Ladder(calibrations)
        object.__setattr__(owner, "_ladder", ladder)
    return ladder


#: the reason of each condition of :func:`_rejection_reasons`, in its order, then "" (none fails: admitted)
_REASON_OF_CONDITION = np.array(["no_valid_threshold", "no_robust_threshold", "ood_distance", "argmax_flip",
                                 "ood_similarity", "argmax_flip", "below_model_min_qbin", "below_robust_min_qbin",
                                 "below_threshold_psi", ""], dtype=object)


def _rejection_reasons(n, min_valid_own, robust_min, sdm_flip, d, cen, *, low) -> tuple[np.ndarray, np.ndarray]:
    """(first failing condition per row in the order of :data:`REJECTION_REASONS`, "" = admitted; whether
    any condition fails) as an object array of str and a bool array."""
    (_, cen_floor_ok, cen_o_flip, _), (low_v, low_floor_ok, low_o_flip, low_singleton) = cen, low
    # the per-row conditions (the two model-wide ones come first, below), then "none failed"
    conditions = np.empty((8, n), dtype=bool)
    np.logical_and(sdm_flip, d <= 0, out=conditions[0])
    np.logical_or(sdm_flip, cen_floor_ok & cen_o_flip, out=conditions[1])
    np.logical_not(low_floor_ok, out=conditions[2])
    conditions[3] = low_o_flip
    np.less(low_v.q_tilde, min_valid_own, out=conditions[4])
    np.less(low_v.q_tilde, robust_min, out=conditions[5])
    np.logical_not(low_singleton, out=conditions[6])
    conditions[7] = True
    code = conditions.argmax(axis=0) + 2  # the first true row
    # the two model-wide conditions: every row fails them alike
    if robust_min == math.inf:
        code[:] = 1
    if math.isinf(min_valid_own) and min_valid_own > 0:
        code[:] = 0
    return _REASON_OF_CONDITION[code], code != len(_REASON_OF_CONDITION) - 1


def _rows(calibration: "Calibration", z, q, d, sdm) -> dict:
    """The per-row quantities no threshold changes: validated inputs, v, ŷ, the SDM flip, log(2+q), the
    centroid's geometry and n̂ (valid for every level of one model: the same W'', eCDFs and sample sizes)."""
    W, _, _, _, _, ecdfs, arrays = _check_calibration(calibration)
    ladder = _ladder_of(calibration, (calibration,))
    C = W.shape[0]
    z = _matrix("z", z, c=C)
    n = z.shape[0]
    sdm = _matrix("sdm", sdm, n, C)
    q = _vector("q", q, n).astype(np.float64)
    d = _vector("d", d, n)
    if (q < 0).any():
        raise InputError("q must be ≥ 0")
    if (d < 0).any():
        raise InputError("d must be ≥ 0")
    index = np.arange(n)
    v = _v_of(sdm, ecdfs, ladder.ecdf_table)  # float64
    y_hat = z.argmax(axis=1).astype(np.int64)
    sdm_flip = ~_unique_argmax_at(sdm, y_hat, index)
    log_base = np.log(2.0 + q)
    sign = np.ones_like(v)  # −1 at ŷ: the lower DKW bound is v − ε there, v + ε elsewhere (dkw_bounds)
    sign[index, y_hat] = -1.0
    centroid = _geometry(ladder.W[0], v, log_base, y_hat, sdm_flip, index)
    return dict(n=n, d=d, v=v, y_hat=y_hat, sdm_flip=sdm_flip, log_base=log_base, centroid=centroid,
                n_hat=_n_hat_of(centroid[1], arrays, ladder.size_table), index=index, sign=sign)


def _ladder_pass(ladder: _Ladder, rows: dict, j0: int, j1: int, keep: int | None = None):
    """Lower and centroid validity at levels j0..j1−1 of ``ladder`` (one W''), bool [N, j1 − j0] each.

    Every variant is one block of N rows, the blocks stacked along the rows, each block with its level's
    ε, offsets, ψ and minima: the lower variant at each level, then (with ``keep``, a level of this part)
    the upper variant at ``keep``, then the centroid at each level.  So a whole ladder is a few array
    operations.  With ``keep``, also returns that level's ε and its lower, centroid and upper variants
    ((:class:`~sdm_mlx.results.Variant`, floor(q~) > 0 before processing, o has no unique argmax ŷ,
    singleton) each), for the full estimate there."""
    n, m = rows["n"], j1 - j0
    k = m if keep is None else m + 1  # blocks with a geometry of their own (lower, upper)
    source, at_k, at, block_levels, level, psi, min_valid, robust_min = ladder.layout(n, j0, j1, keep)

    def tiled(a, blocks):  # `a` [N, ...] repeated for `blocks` blocks
        return a if blocks == 1 else a.take(source[: blocks * n], axis=0)

    y_hat, v, sign = rows["y_hat"], rows["v"], rows["sign"]
    # DKW ε at each level (dkw_epsilon; levels along a leading axis, then rows l N + i) and the bounds
    # v ∓ ε at ŷ, v ± ε elsewhere (dkw_bounds): the lower one at every level, the upper one at `keep`
    eps = _epsilon_of(rows["n_hat"], ladder.log_terms[j0:j1, None, None]).reshape(m * n, v.shape[1])
    shifted = tiled(v, m) + tiled(sign, m) * eps
    if keep is not None:
        at_keep = slice((keep - j0) * n, (keep - j0 + 1) * n)
        shifted = np.concatenate([shifted, v - sign * eps[at_keep]])
    bounds = shifted.clip(0.0, 1.0)
    shifted_geometry = _geometry(ladder.W[j0], bounds, tiled(rows["log_base"], k), tiled(y_hat, k),
                                 tiled(rows["sdm_flip"], k), at_k)
    # the centroid's geometry (the same at every level) after them, for one pass over the thresholds
    cen = rows["centroid"]
    geometry = (None,) + tuple(np.concatenate([a, tiled(c, m)]) for a, c in zip(shifted_geometry[1:5], cen[1:5]))
    y = tiled(y_hat, k + m)
    offset = ladder.offsets_at(block_levels, level, y_hat, y, geometry[2])
    p, valid, singleton = _validity(geometry, y, at, offset, psi=psi, min_valid_own=min_valid, robust_min=robust_min)
    lower, centroid = valid[: m * n].reshape(m, n).T, valid[k * n:].reshape(m, n).T
    if keep is None:
        return lower, centroid, None

    def variant(s, g):  # the (Variant, floor_ok, o_flip, singleton) of rows `s` of geometry `g`
        return (Variant(v=g[0][s], q_tilde=g[1][s], hard_bin=g[2][s], ood=g[3][s], o=g[4][s], offset=offset[s],
                        p=p[s], valid=valid[s]), g[5][s], g[6][s], singleton[s])

    low = variant(at_keep, shifted_geometry)
    up = variant(slice(m * n, k * n), shifted_geometry)
    cen_rows = slice(k * n + at_keep.start, k * n + at_keep.stop)
    cen = (Variant(v=cen[0], q_tilde=cen[1], hard_bin=cen[2], ood=cen[3], o=cen[4], offset=offset[cen_rows],
                   p=p[cen_rows], valid=valid[cen_rows]), cen[5], cen[6], singleton[cen_rows])
    return lower, centroid, (eps[at_keep], low, cen, up)


def _ladder_estimate(ladder: _Ladder, anchor: int, rows: dict) -> tuple[dict, np.ndarray, np.ndarray]:
    """(the fields of the estimate at level ``anchor`` but its α regions and decision, lower valid =
    admitted and centroid valid at every level, bool [N, L] each) from :func:`_rows` of the same model.

    The levels go through :func:`_ladder_levels`; the anchor's level adds the upper variant and the reasons."""
    n = rows["n"]
    lower, centroid, (eps, low, cen, up) = _ladder_levels(ladder, rows, anchor)
    _, _, min_valid_own, robust_min, _, _, _ = ladder.checked[anchor]
    reason, rejected = _rejection_reasons(n, min_valid_own, robust_min, rows["sdm_flip"], rows["d"], cen, low=low)
    admitted = low[0].valid
    # the reasons are exhaustive for the conditions of `valid`
    assert np.array_equal(admitted, ~rejected), "rejection reasons out of sync with admission"
    fields = dict(prediction=rows["y_hat"], admitted=admitted, rejection_reason=reason, sdm_flip=rows["sdm_flip"],
                  n_hat=rows["n_hat"], epsilon=eps, centroid=cen[0], lower=low[0], upper=up[0])
    return fields, lower, centroid


def _one_level(fields: dict, alpha: float) -> Estimate:
    """The estimate of :func:`_ladder_estimate`'s fields on a one-level grid {α'}: region α' iff valid."""
    a = float(alpha)
    admitted = fields["admitted"]
    return Estimate(**fields, alpha_region_lower=np.where(admitted, a, np.nan),
                    alpha_region_centroid=np.where(fields["centroid"].valid, a, np.nan),
                    decision=np.where(admitted, "allow", "reject").astype(object))


def level_validity(calibration: "Calibration", rows: dict) -> tuple[np.ndarray, np.ndarray]:
    """(lower valid = admitted, centroid valid) at one level from :func:`_rows` of the same model: the
    lower variant's geometry at this level's ε and the thresholds of this level (no upper variant, no
    reasons: what the nested ladder needs, DESIGN #25)."""
    lower, centroid, _ = _ladder_pass(_ladder_of(calibration, (calibration,)), rows, 0, 1)
    return lower[:, 0], centroid[:, 0]


#: most levels x rows :func:`_ladder_pass` stacks at once (each level a lower and a centroid block of rows):
#: small batches (a server's verdicts) gain from few array operations, large ones keep the working memory
#: of one level
STACKED_ROWS = 4096


def levels_validity(calibrations, rows: dict) -> tuple[np.ndarray, np.ndarray]:
    """:func:`level_validity` at every level of ``calibrations`` (one model's, as the nested ladder's), bool
    ``[N, L]`` each.  Levels are stacked along the rows (row ``l N + i`` is row ``i`` at level ``l``, each
    with its own ε, offsets, ψ and minima), up to :data:`STACKED_ROWS` rows at a time: one row's ladder of
    19 levels takes 0.25 ms instead of 2.4 ms one level at a time.  The same values as the per-level calls (the
    nested tests compare them with the full estimator at every level, and with a reference computed one level
    and one variant at a time)."""
    if not calibrations:
        return np.empty((rows["n"], 0), dtype=bool), np.empty((rows["n"], 0), dtype=bool)
    lower, centroid, _ = _ladder_levels(_Ladder(calibrations), rows)
    return lower, centroid


def _ladder_levels(ladder: _Ladder, rows: dict, anchor: int | None = None):
    """(lower valid, centroid valid) at every level of ``ladder``, bool [N, L] each, through :func:`_ladder_pass`
    up to :data:`STACKED_ROWS` stacked rows at a time (one level at a time for levels of different W''), and
    with ``anchor`` that level's ε and variants (:func:`_ladder_pass`'s last item; else None)."""
    n, L = rows["n"], ladder.size
    lower, centroid = np.empty((n, L), dtype=bool), np.empty((n, L), dtype=bool)
    group = max(1, STACKED_ROWS // max(n, 1)) if ladder.one_model else 1
    at_anchor = None
    for j0 in range(0, L, group):
        j1 = min(L, j0 + group)
        keep = anchor if anchor is not None and j0 <= anchor < j1 else None
        lower[:, j0:j1], centroid[:, j0:j1], kept = _ladder_pass(ladder, rows, j0, j1, keep)
        at_anchor = kept if kept is not None else at_anchor
    return lower, centroid, at_anchor


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
    ladder = _ladder_of(calibration, (calibration,))
    r = _rows(calibration, z, q, d, sdm) if rows is None else rows
    fields, _, _ = _ladder_estimate(ladder, 0, r)
    # a one-level grid {α'}; sdm_mlx.calibration.nested fills the regions over a grid of levels (DESIGN #25)
    return _one_level(fields, calibration.alpha)
