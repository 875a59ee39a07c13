"""The index-conditional estimator at test time (``eq:index-conditional-sdm-estimator``): centroid, lower
and upper variants, admission and the rejection reasons (precedence: :data:`REJECTION_REASONS`).

The per-row work is named records: :class:`Rows` (what no threshold changes), :class:`Geometry` (one
variant before the thresholds), :class:`Conditions` (a variant with what the reasons read) and
:class:`AnchorLevel` (the model's own level, α'); the levels' constants are a
:class:`~sdm_mlx.calibration.ladder.Ladder`.  :func:`estimate` and the nested estimate check their inputs
unless the caller made them (``check_input=False``: the estimator's own arrays)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..results import Estimate, Variant
from .rescaler import rescaled_output
from ._checks import _matrix, _vector
from .bins import _apply_ood_of, _unique_argmax_at, _v_of
from .bounds import _epsilon_of, _n_hat_of
from .ladder import Ladder
from ..errors import InputError

if TYPE_CHECKING:  # types only
    from .rounds import Calibration


#: The conditions of :func:`_rejection_reasons` in precedence order, each named by its reason: the two
#: model-wide ones, then the per-row ones (``argmax_flip`` twice: the centroid's, then the lower variant's).
#: The one source of the order; the module docstring of :mod:`sdm_mlx.calibration` describes each.
REJECTION_CONDITIONS = ("no_valid_threshold", "no_robust_threshold", "ood_distance", "argmax_flip", "ood_similarity",
                        "argmax_flip", "below_model_min_qbin", "below_robust_min_qbin", "below_threshold_psi")
#: Rejection reasons in precedence order (the first condition of each, :data:`REJECTION_CONDITIONS`); "" means
#: admitted.
REJECTION_REASONS = tuple(dict.fromkeys(REJECTION_CONDITIONS))
#: the reason of each condition, in order, then "" (none fails: admitted)
_REASON_OF_CONDITION = np.array(REJECTION_CONDITIONS + ("",), dtype=object)
#: the model-wide conditions come first: their codes
_NO_VALID, _NO_ROBUST = 0, 1


class Geometry(NamedTuple):
    """One variant's rows before the thresholds (:func:`_geometry`)."""

    v: np.ndarray  #: the variant's v [N, C]
    q_tilde: np.ndarray  #: q~, processed (0 when OOD) [N]
    hard_bin: np.ndarray  #: the hard bin (0 when OOD) [N]
    ood: np.ndarray  #: OOD [N]
    o: np.ndarray  #: the rescaled output, before the offset [N, C]
    floor_ok: np.ndarray  #: floor(q~) > 0 before processing [N]
    o_flip: np.ndarray  #: o has no unique argmax ŷ [N]


class Rows(NamedTuple):
    """The per-row quantities no threshold changes (:func:`_rows`), valid for every level of one model (the same
    W'', eCDFs and sample sizes)."""

    n: int
    d: np.ndarray  #: the Distance quantile d [N]
    v: np.ndarray  #: float64 [N, C]
    y_hat: np.ndarray  #: int64 [N]
    sdm_flip: np.ndarray  #: the SDM output has no unique argmax ŷ [N]
    log_base: np.ndarray  #: ln(2 + q) [N]
    centroid: Geometry  #: the centroid's geometry (the same at every level)
    n_hat: np.ndarray  #: n̂ [N, C]
    index: np.ndarray  #: 0..N−1
    sign: np.ndarray  #: −1 at ŷ, +1 elsewhere [N, C]: the lower DKW bound is v + sign ε


class Conditions(NamedTuple):
    """One variant at one level and what the rejection reasons read of it."""

    variant: Variant
    floor_ok: np.ndarray  #: floor(q~) > 0 before processing
    o_flip: np.ndarray  #: o has no unique argmax ŷ
    singleton: np.ndarray  #: {c : o_c ≥ ψ_c} = {ŷ} after the offset at ŷ


class AnchorLevel(NamedTuple):
    """The model's own level (α'): DKW ε and the three variants."""

    epsilon: np.ndarray
    lower: Conditions
    centroid: Conditions
    upper: Conditions


class AnchorFields(NamedTuple):
    """The fields of the :class:`~sdm_mlx.results.Estimate` at α' but its α regions and decision."""

    prediction: np.ndarray
    admitted: np.ndarray
    rejection_reason: np.ndarray
    sdm_flip: np.ndarray
    n_hat: np.ndarray
    epsilon: np.ndarray
    centroid: Variant
    lower: Variant
    upper: Variant


def _geometry(W, v_var, log_base, y_hat, sdm_flip, index) -> Geometry:
    """The thresholds-free part of one variant.  ``W``: W'' in float64; ``index``: 0..N−1."""
    q_raw = np.where(sdm_flip, 0.0, v_var[index, y_hat] * log_base)
    o = rescaled_output(W, v_var, q_raw)
    floor_ok = q_raw >= 1.0  # floor(q~) > 0
    o_flip = ~_unique_argmax_at(o, y_hat, index)
    ood = sdm_flip | ~floor_ok | o_flip
    q_proc, bins = _apply_ood_of(q_raw, ood)
    return Geometry(v_var, q_proc, bins, ood, o, floor_ok, o_flip)


def _validity(geometry: Geometry, y_hat, index, offset, *, psi, min_valid_own, robust_min) -> tuple:
    """(p, validity, singleton) of a variant's rows: p = clip(o_ŷ − offset, 0, 1) and the thresholds.

    ``offset``: the rows' offsets m[ŷ][bin]; ``psi`` [C] or one row per input row [N, C]; the two minima
    scalars or [N].  The singleton feeds the rejection reasons (:func:`_rejection_reasons`)."""
    q_proc, ood, o = geometry.q_tilde, geometry.ood, geometry.o
    p = (o[index, y_hat] - offset).clip(0.0, 1.0)
    o_adj = o.copy()
    o_adj[index, y_hat] = p
    above = o_adj >= psi
    singleton = (np.add.reduce(above, axis=1) == 1) & above[index, y_hat]
    valid = ~ood & (q_proc >= min_valid_own) & (q_proc >= robust_min) & singleton
    return p, valid, singleton


def _rejection_reasons(n, min_valid_own, robust_min, sdm_flip, d, cen: Conditions, *,
                       low: Conditions) -> tuple[np.ndarray, np.ndarray]:
    """(first failing condition per row in the order of :data:`REJECTION_CONDITIONS`, "" = admitted; whether
    any condition fails) as an object array of str and a bool array."""
    # the per-row conditions (the two model-wide ones come first, below), then "none failed"
    conditions = np.empty((8, n), dtype=bool)
    np.logical_and(sdm_flip, d <= 0, out=conditions[0])
    np.logical_or(sdm_flip, cen.floor_ok & cen.o_flip, out=conditions[1])
    np.logical_not(low.floor_ok, out=conditions[2])
    conditions[3] = low.o_flip
    np.less(low.variant.q_tilde, min_valid_own, out=conditions[4])
    np.less(low.variant.q_tilde, robust_min, out=conditions[5])
    np.logical_not(low.singleton, out=conditions[6])
    conditions[7] = True
    code = conditions.argmax(axis=0) + 2  # the first true row
    # the two model-wide conditions: every row fails them alike
    if robust_min == math.inf:
        code[:] = _NO_ROBUST
    if math.isinf(min_valid_own) and min_valid_own > 0:
        code[:] = _NO_VALID
    return _REASON_OF_CONDITION[code], code != len(_REASON_OF_CONDITION) - 1


def _rows(calibration: "Calibration", z, q, d, sdm, *, check_input: bool = True) -> Rows:
    """The per-row quantities no threshold changes: v, ŷ, the SDM flip, log(2+q), the centroid's geometry and
    n̂ (valid for every level of one model: the same W'', eCDFs and sample sizes).

    ``check_input=False``: z' and the SDM output finite [N, C], q ≥ 0 and d ≥ 0 finite [N], as the estimator
    computes them (then not checked again)."""
    checked = calibration.checked
    ladder = calibration.ladder
    C = checked.W.shape[0]
    if check_input:
        z = _matrix("z", z, c=C)
        n = z.shape[0]
        sdm = _matrix("sdm", sdm, n, C)
        q = _vector("q", q, n).astype(np.float64)
        d = _vector("d", d, n)
        if (q < 0).any():
            raise InputError("q must be ≥ 0")
        if (d < 0).any():
            raise InputError("d must be ≥ 0")
    else:
        n = z.shape[0]
        q = np.asarray(q).reshape(-1).astype(np.float64)
        d = np.asarray(d).reshape(-1)
    index = np.arange(n)
    v = _v_of(sdm, checked.output_ecdfs, ladder.ecdf_table)  # float64
    y_hat = z.argmax(axis=1).astype(np.int64)
    sdm_flip = ~_unique_argmax_at(sdm, y_hat, index)
    log_base = np.log(2.0 + q)
    sign = np.ones_like(v)  # −1 at ŷ: the lower DKW bound is v − ε there, v + ε elsewhere (dkw_bounds)
    sign[index, y_hat] = -1.0
    centroid = _geometry(ladder.W[0], v, log_base, y_hat, sdm_flip, index)
    return Rows(n=n, d=d, v=v, y_hat=y_hat, sdm_flip=sdm_flip, log_base=log_base, centroid=centroid,
                n_hat=_n_hat_of(centroid.q_tilde, checked.sample_sizes, ladder.size_table), index=index, sign=sign)


def _ladder_pass(ladder: Ladder, rows: Rows, j0: int, j1: int, keep: int | None = None):
    """Lower and centroid validity at levels j0..j1−1 of ``ladder`` (one W''), bool [N, j1 − j0] each.

    Every variant is one block of N rows, the blocks stacked along the rows, each block with its level's
    ε, offsets, ψ and minima: the lower variant at each level, then (with ``keep``, a level of this part)
    the upper variant at ``keep``, then the centroid at each level.  So a whole ladder is a few array
    operations.  With ``keep``, also returns that level's :class:`AnchorLevel` (else None), for the full
    estimate there."""
    n, m = rows.n, j1 - j0
    k = m if keep is None else m + 1  # blocks with a geometry of their own (lower, upper)
    layout = ladder.layout(n, j0, j1, keep)
    source = layout.source

    def tiled(a, blocks):  # `a` [N, ...] repeated for `blocks` blocks
        return a if blocks == 1 else a.take(source[: blocks * n], axis=0)

    y_hat, v, sign = rows.y_hat, rows.v, rows.sign
    # DKW ε at each level (dkw_epsilon; levels along a leading axis, then rows l N + i) and the bounds
    # v ∓ ε at ŷ, v ± ε elsewhere (dkw_bounds): the lower one at every level, the upper one at `keep`
    eps = _epsilon_of(rows.n_hat, ladder.log_terms[j0:j1, None, None]).reshape(m * n, v.shape[1])
    shifted = tiled(v, m) + tiled(sign, m) * eps
    if keep is not None:
        at_keep = slice((keep - j0) * n, (keep - j0 + 1) * n)
        shifted = np.concatenate([shifted, v - sign * eps[at_keep]])
    bounds = shifted.clip(0.0, 1.0)
    shifted_geometry = _geometry(ladder.W[j0], bounds, tiled(rows.log_base, k), tiled(y_hat, k),
                                 tiled(rows.sdm_flip, k), layout.at_k)
    # the centroid's geometry (the same at every level) after them, for one pass over the thresholds
    cen = rows.centroid
    stacked = Geometry(None, *(np.concatenate([a, tiled(c, m)]) for a, c in
                               zip(shifted_geometry[1:5], cen[1:5])), None, None)
    y = tiled(y_hat, k + m)
    offset = ladder.offsets_at(layout.block_levels, layout.level, y_hat, y, stacked.hard_bin)
    p, valid, singleton = _validity(stacked, y, layout.at, offset, psi=layout.psi, min_valid_own=layout.min_valid,
                                    robust_min=layout.robust_min)
    lower, centroid = valid[: m * n].reshape(m, n).T, valid[k * n:].reshape(m, n).T
    if keep is None:
        return lower, centroid, None

    def variant(s, g: Geometry, at=None) -> Conditions:  # rows `s` of geometry `g` (`at`: of the stacked rows)
        at = s if at is None else at
        return Conditions(Variant(v=g.v[s], q_tilde=g.q_tilde[s], hard_bin=g.hard_bin[s], ood=g.ood[s], o=g.o[s],
                                  offset=offset[at], p=p[at], valid=valid[at]), g.floor_ok[s], g.o_flip[s],
                          singleton[at])

    cen_rows = slice(k * n + at_keep.start, k * n + at_keep.stop)
    anchor = AnchorLevel(epsilon=eps[at_keep], lower=variant(at_keep, shifted_geometry),
                         centroid=variant(slice(None), cen, cen_rows),
                         upper=variant(slice(m * n, k * n), shifted_geometry))
    return lower, centroid, anchor


def _ladder_estimate(ladder: Ladder, anchor: int, rows: Rows) -> tuple[AnchorFields, np.ndarray, np.ndarray]:
    """(the fields of the estimate at level ``anchor`` but its α regions and decision, lower valid =
    admitted and centroid valid at every level, bool [N, L] each) from :func:`_rows` of the same model.

    The levels go through :func:`_ladder_levels`; the anchor's level adds the upper variant and the reasons."""
    lower, centroid, at = _ladder_levels(ladder, rows, anchor)
    level = ladder.checked[anchor]
    reason, rejected = _rejection_reasons(rows.n, level.min_valid, level.robust_min, rows.sdm_flip, rows.d,
                                          at.centroid, low=at.lower)
    admitted = at.lower.variant.valid
    # the reasons are exhaustive for the conditions of `valid`
    assert np.array_equal(admitted, ~rejected), "rejection reasons out of sync with admission"
    fields = AnchorFields(prediction=rows.y_hat, admitted=admitted, rejection_reason=reason, sdm_flip=rows.sdm_flip,
                          n_hat=rows.n_hat, epsilon=at.epsilon, centroid=at.centroid.variant,
                          lower=at.lower.variant, upper=at.upper.variant)
    return fields, lower, centroid


def _one_level(fields: AnchorFields, alpha: float) -> Estimate:
    """The estimate of :func:`_ladder_estimate`'s fields on a one-level grid {α'}: region α' iff valid."""
    a = float(alpha)
    admitted = fields.admitted
    return Estimate(**fields._asdict(), alpha_region_lower=np.where(admitted, a, np.nan),
                    alpha_region_centroid=np.where(fields.centroid.valid, a, np.nan),
                    decision=np.where(admitted, "allow", "reject").astype(object))


def level_validity(calibration: "Calibration", rows: Rows) -> tuple[np.ndarray, np.ndarray]:
    """(lower valid = admitted, centroid valid) at one level from :func:`_rows` of the same model: the
    lower variant's geometry at this level's ε and the thresholds of this level (no upper variant, no
    reasons: what the nested ladder needs, DESIGN #25)."""
    lower, centroid, _ = _ladder_pass(calibration.ladder, rows, 0, 1)
    return lower[:, 0], centroid[:, 0]


#: most levels x rows :func:`_ladder_pass` stacks at once (each level a lower and a centroid block of rows):
#: small batches (a server's verdicts) gain from few array operations, large ones keep the working memory
#: of one level
STACKED_ROWS = 4096


def levels_validity(calibrations, rows: Rows) -> tuple[np.ndarray, np.ndarray]:
    """:func:`level_validity` at every level of ``calibrations`` (one model's, as the nested ladder's), bool
    ``[N, L]`` each.  Levels are stacked along the rows (row ``l N + i`` is row ``i`` at level ``l``, each
    with its own ε, offsets, ψ and minima), up to :data:`STACKED_ROWS` rows at a time: one row's ladder of
    19 levels takes 0.25 ms instead of 2.4 ms one level at a time.  The same values as the per-level calls (the
    nested tests compare them with the full estimator at every level, and with a reference computed one level
    and one variant at a time)."""
    if not calibrations:
        return np.empty((rows.n, 0), dtype=bool), np.empty((rows.n, 0), dtype=bool)
    lower, centroid, _ = _ladder_levels(Ladder(calibrations), rows)
    return lower, centroid


def _ladder_levels(ladder: Ladder, rows: Rows, anchor: int | None = None):
    """(lower valid, centroid valid) at every level of ``ladder``, bool [N, L] each, through :func:`_ladder_pass`
    up to :data:`STACKED_ROWS` stacked rows at a time (one level at a time for levels of different W''), and
    with ``anchor`` that level's :class:`AnchorLevel` (else None)."""
    n, L = rows.n, ladder.size
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
             rows: Rows | None = None) -> Estimate:
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
    r = _rows(calibration, z, q, d, sdm) if rows is None else rows
    fields, _, _ = _ladder_estimate(calibration.ladder, 0, r)
    # a one-level grid {α'}; sdm_mlx.calibration.nested fills the regions over a grid of levels (DESIGN #25)
    return _one_level(fields, calibration.alpha)
