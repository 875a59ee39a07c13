"""The estimator's stacked evaluation against a reference computed one level and one variant at a time.

:func:`sdm_mlx.calibration.conditional._ladder_pass` evaluates every level of a model's ladder and every
variant (lower, upper, centroid) in one stack of rows, with per-level constants built once per calibration
(:class:`~sdm_mlx.calibration.ladder.Ladder`).  The reference below is the estimator written out
plainly from the public building blocks (v, the argmax test, the rescaled output, OOD, n̂, DKW ε and bounds,
the offsets): every field of the estimate must be equal bit for bit, on random models that cover one
shared W'' and several, offset tables of one width and of different widths, ψ / minima of +inf, classes
without calibration rows, SDM ties, q = 0 and d = 0, and any grouping of the levels (``STACKED_ROWS``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdm_mlx import calibration as cal
from sdm_mlx.calibration import _checks, conditional
from sdm_mlx.calibration.nested import (
    DecisionPolicy,
    NestedCalibration,
    anchored_region,
    decisions,
    estimate_nested,
    level_admissions,
)
from sdm_mlx.results import Estimate, Variant

REASONS = ["no_valid_threshold", "no_robust_threshold", "ood_distance", "argmax_flip", "ood_similarity",
           "argmax_flip", "below_model_min_qbin", "below_robust_min_qbin", "below_threshold_psi"]


def _geometry_of(W, vv, r):
    rows, y, flip, log_base = r["rows"], r["y"], r["flip"], r["log_base"]
    q_raw = np.where(flip, 0.0, vv[rows, y] * log_base)
    o = cal.rescaled_output(W, vv, q_raw)
    floor_ok = np.floor(q_raw) > 0
    o_flip = ~cal.unique_argmax_is(o, y)
    ood = flip | ~floor_ok | o_flip
    q_proc, bins = cal.apply_ood(q_raw, ood)
    return vv, q_proc, bins, ood, o, floor_ok, o_flip


def _reference_rows(calibration, z, q, d, sdm) -> dict:
    """The per-row quantities of one level (for a ladder: the anchor's, shared by every level of one model)."""
    n = z.shape[0]
    r = dict(n=n, d=d, rows=np.arange(n), y=z.argmax(axis=1).astype(np.int64),
             log_base=np.log(2.0 + np.asarray(q, np.float64).reshape(-1)), v=cal.v_vector(sdm, calibration.output_ecdfs))
    r["flip"] = ~cal.unique_argmax_is(sdm, r["y"])
    r["centroid"] = _geometry_of(np.asarray(calibration.W), r["v"], r)
    r["n_hat"] = cal.effective_sample_size(r["centroid"][1], calibration.sample_size_arrays)
    return r


def _reference_level(calibration, r) -> dict:
    """The estimate at one level, one variant at a time, from the public functions (no stacking, no caches)."""
    W = np.asarray(calibration.W)
    C = W.shape[0]
    offsets = np.zeros((C, 0)) if calibration.offsets is None else np.asarray(calibration.offsets, np.float64)
    psi = np.asarray(calibration.psi, np.float64)
    own, robust = float(calibration.min_valid), float(calibration.robust_min_valid)
    n, rows, y, flip = r["n"], r["rows"], r["y"], r["flip"]

    def variant(g):
        vv, q_proc, bins, ood, o, floor_ok, o_flip = g
        offset = cal.lookup_offsets(offsets, y, bins)
        p = np.clip(o[rows, y] - offset, 0.0, 1.0)
        o_adj = o.copy()
        o_adj[rows, y] = p
        above = o_adj >= psi
        singleton = (above.sum(axis=1) == 1) & above[rows, y]
        valid = ~ood & (q_proc >= own) & (q_proc >= robust) & singleton
        fields = dict(v=vv, q_tilde=q_proc, hard_bin=bins, ood=ood, o=o, offset=offset, p=p, valid=valid)
        return fields, floor_ok, o_flip, singleton

    cen = variant(r["centroid"])
    eps = cal.dkw_epsilon(r["n_hat"], calibration.alpha)
    v_lower, v_upper = cal.dkw_bounds(r["v"], eps, y)
    low, up = variant(_geometry_of(W, v_lower, r)), variant(_geometry_of(W, v_upper, r))
    conditions = [np.full(n, math.isinf(own) and own > 0), np.full(n, robust == math.inf), flip & (r["d"] <= 0),
                  flip | (cen[1] & cen[2]), ~low[1], low[2], low[0]["q_tilde"] < own, low[0]["q_tilde"] < robust,
                  ~low[3]]
    reason = np.select(conditions, REASONS, default="").astype(object)
    return dict(prediction=y, admitted=low[0]["valid"], rejection_reason=reason, sdm_flip=flip, n_hat=r["n_hat"],
                epsilon=eps, centroid=cen[0], lower=low[0], upper=up[0])


def _reference(calibration, z, q, d, sdm) -> dict:
    return _reference_level(calibration, _reference_rows(calibration, z, q, d, sdm))


def _same(a, b, where=""):
    """Equal bit for bit: dtype, shape and every value (NaN == NaN; object arrays: equal items of one type)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype == object:
        assert [(type(x), x) for x in a.tolist()] == [(type(x), x) for x in b.tolist()], where
    elif a.dtype.kind == "f":
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), where  # -0.0 and NaN payloads too
    else:
        assert np.array_equal(a, b), where


def _check_fields(est: Estimate, ref: dict, where=""):
    for name, value in ref.items():
        if isinstance(value, dict):
            got = getattr(est, name)
            assert isinstance(got, Variant)
            for f, arr in value.items():
                _same(getattr(got, f), arr, f"{where} {name}.{f}")
        else:
            _same(getattr(est, name), value, f"{where} {name}")


def _inputs(rng, n, C):
    z = rng.normal(size=(n, C)).astype(np.float32) * 3
    sdm = rng.dirichlet(np.ones(C), size=n).astype(np.float32)
    if n > 3:
        sdm[1] = 1.0 / C  # an SDM tie (d = 0 makes the output uniform): a flip
        sdm[2, :2] = sdm[2, ::-1][:2]  # argmax elsewhere than ŷ (usually)
    q = rng.integers(0, 60, n)
    q[: n // 4] = 0
    d = rng.random(n).astype(np.float32)
    d[n // 4: n // 3] = 0.0
    return z, q, d, sdm


def _calibration(rng, C, alpha, *, W=None, width=None, psi=None, own=None, robust=None, empty_class=False,
                 ecdfs=None, arrays=None):
    width = int(rng.integers(0, 5)) if width is None else width
    if ecdfs is None:
        ecdfs = [np.sort(rng.random(int(rng.integers(5, 40)))).astype(np.float32) for _ in range(C)]
    if arrays is None:
        arrays = [np.sort(rng.random(int(rng.integers(5, 60))) * 4) for _ in range(C)]
    if empty_class:
        arrays[0] = np.zeros(0)
    return cal.Calibration(
        alpha=alpha, W=(rng.normal(size=(C, C)) * 4).astype(np.float32) if W is None else W,
        psi=rng.random(C) * 0.8 if psi is None else psi,
        min_valid=float(rng.random() * 2) if own is None else own,
        robust_min_valid=float(rng.random() * 2) if robust is None else robust,
        offsets=rng.random((C, width)) * 0.1 if width else None, output_ecdfs=ecdfs, sample_size_arrays=arrays)


@pytest.mark.parametrize("C", [2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 8, 57])
@pytest.mark.parametrize("by_comparison", [True, False])
def test_one_level_equals_the_reference(monkeypatch, C, n, by_comparison):
    """(v and n̂ counted in one table by comparison, or by one searchsorted per class: ``COUNT_BY_COMPARISON``.)"""
    monkeypatch.setattr(_checks, "COUNT_BY_COMPARISON", 1 << 40 if by_comparison else 0)
    rng = np.random.default_rng(100 * C + n)
    no_rows = [np.zeros(0, np.float32)] + [np.sort(rng.random(9)).astype(np.float32) for _ in range(C - 1)]
    for trial in range(7):
        kwargs = [{}, dict(own=math.inf), dict(robust=math.inf), dict(empty_class=True), dict(width=0),
                  dict(psi=np.zeros(C), own=0.0, robust=0.0), dict(ecdfs=no_rows)][trial]
        calibration = _calibration(rng, C, 0.9, **kwargs)
        z, q, d, sdm = _inputs(rng, n, C)
        est = cal.estimate(calibration, z, q, d, sdm)
        _check_fields(est, _reference(calibration, z, q, d, sdm), f"trial {trial}")
        a = calibration.alpha
        _same(est.alpha_region_lower, np.where(est.admitted, a, np.nan))
        _same(est.decision, np.where(est.admitted, "allow", "reject").astype(object))


def _nested(rng, C, *, shared_W=True, same_width=True, levels=7, anchor=3):
    """Levels of one model: the same eCDFs and sample sizes (and W'', unless ``shared_W`` is False: the ladder
    then goes one level at a time, each with its own W'' for the lower variant)."""
    grid = sorted(set(np.round(rng.uniform(0.55, 0.99, levels * 3), 2)), reverse=True)[:levels]
    W = (rng.normal(size=(C, C)) * 4).astype(np.float32)
    width = int(rng.integers(1, 5))
    ecdfs = [np.sort(rng.random(int(rng.integers(5, 40)))).astype(np.float32) for _ in range(C)]
    arrays = [np.sort(rng.random(int(rng.integers(5, 60))) * 4) for _ in range(C)]
    cals = tuple(_calibration(rng, C, float(a), W=W if shared_W else None, width=width if same_width else None,
                              own=[None, math.inf][j % 5 == 4], robust=[None, math.inf][j % 6 == 5], ecdfs=ecdfs,
                              arrays=arrays)
                 for j, a in enumerate(grid))
    alpha = cals[anchor].alpha
    return NestedCalibration(alpha=alpha, levels=cals, policy=DecisionPolicy(allow=alpha, review=min(grid)))


def _reference_ladder(nested, z, q, d, sdm):
    r = _reference_rows(nested.levels[nested.anchor], z, q, d, sdm)
    refs = [_reference_level(c, r) for c in nested.levels]
    lower = np.stack([r["admitted"] for r in refs], axis=1).reshape(z.shape[0], -1)
    centroid = np.stack([r["centroid"]["valid"] for r in refs], axis=1).reshape(z.shape[0], -1)
    return refs[nested.anchor], lower, centroid


@pytest.mark.parametrize("stacked_rows", [1, 37, 4096, 10**6])
@pytest.mark.parametrize("shared_W, same_width", [(True, True), (True, False), (False, True)])
def test_ladder_equals_the_reference_at_every_level(monkeypatch, stacked_rows, shared_W, same_width):
    monkeypatch.setattr(conditional, "STACKED_ROWS", stacked_rows)
    rng = np.random.default_rng(stacked_rows % 997 + 7 * shared_W + same_width)
    for n in (1, 2, 9, 40):
        C = int(rng.integers(2, 5))
        nested = _nested(rng, C, shared_W=shared_W, same_width=same_width)
        z, q, d, sdm = _inputs(rng, n, C)
        main_ref, lower_ref, centroid_ref = _reference_ladder(nested, z, q, d, sdm)
        main, lower, centroid = level_admissions(nested, z, q, d, sdm)
        _check_fields(main, main_ref, f"n={n}")
        _same(lower, lower_ref, "lower")
        _same(centroid, centroid_ref, "centroid")
        rows = conditional._rows(nested.levels[nested.anchor], z, q, d, sdm)
        lower_v, centroid_v = conditional.levels_validity(nested.levels, rows)
        _same(lower_v, lower_ref, "levels_validity lower")
        _same(centroid_v, centroid_ref, "levels_validity centroid")
        full = estimate_nested(nested, z, q, d, sdm)
        _check_fields(full, main_ref, f"nested n={n}")
        region = anchored_region(lower_ref, nested.grid, nested.anchor)
        _same(full.alpha_region_lower, region, "region lower")
        _same(full.alpha_region_centroid, anchored_region(centroid_ref, nested.grid, nested.anchor), "region cen")
        _same(full.decision, decisions(region, nested.policy), "decision")


def test_repeated_calls_of_any_batch_size_give_the_same_answers():
    """The per-shape index arrays kept on the ladder (:meth:`~sdm_mlx.calibration.ladder.Ladder.layout`) do not
    leak between batches."""
    rng = np.random.default_rng(5)
    nested = _nested(rng, 3)
    z, q, d, sdm = _inputs(rng, 30, 3)
    whole = estimate_nested(nested, z, q, d, sdm)
    for n in (1, 3, 1, 30, 7, 1):
        for s in range(0, 30, n):
            part = estimate_nested(nested, z[s:s + n], q[s:s + n], d[s:s + n], sdm[s:s + n])
            for name in ("admitted", "alpha_region_lower", "alpha_region_centroid", "decision", "epsilon"):
                _same(getattr(part, name), getattr(whole, name)[s:s + n], name)
            _same(part.lower.p, whole.lower.p[s:s + n], "p_lower")


def _anchored_region_one_row_at_a_time(A, grid, anchor):
    region = np.full(A.shape[0], np.nan)
    for i, row in enumerate(A):
        if row[anchor]:
            j = anchor
            while j > 0 and row[j - 1]:
                j -= 1
            region[i] = grid[j]
        else:
            below = [j for j in range(anchor + 1, len(grid)) if row[j]]
            if below:
                region[i] = grid[below[0]]
    return region


def test_anchored_region_equals_its_definition_row_by_row():
    rng = np.random.default_rng(11)
    for _ in range(300):
        L, n = int(rng.integers(1, 9)), int(rng.integers(0, 12))
        A = rng.random((n, L)) < rng.random()
        grid = tuple(sorted(np.round(rng.uniform(0.5, 0.99, L), 3), reverse=True))
        anchor = int(rng.integers(0, L))
        _same(anchored_region(A, grid, anchor), _anchored_region_one_row_at_a_time(A, grid, anchor))
