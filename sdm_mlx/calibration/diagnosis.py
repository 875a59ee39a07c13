"""Why a fitted SDM estimator cannot admit anything, per class, with the numbers and the next step.

Three conditions make every prediction ⊥ (``calibration.estimate`` reasons 1, 2, and an empty
admission region):

* ``no_valid_threshold``: Alg. 3 (``alg:estimate-soft-q-bin``) found no candidate q~ at which every
  class c has ψ_c ≥ α′ in the best round.  Per class we report its calibration rows, its non-OOD
  rows (floor(q~) > 0), its plain accuracy (ŷ = y), and its *best reachable share*: over thresholds
  t keeping at least ⌈1/(1−α′)⌉ of its non-OOD rows (all of them if it has fewer), the largest share
  of kept rows whose rescaled output at the true label reaches α′.  Alg. 3 needs that share ≥ α′
  (up to the quantile's rounding) for every class at one common t;
* ``no_robust_threshold``: the Cauchy robust min valid q~ (``eq:cauchyMinValidQBin``) is +inf because
  the MAD over the J rounds' min valid q~ is not finite (half or more rounds found no threshold);
* ``threshold_above_calibration``: both thresholds are finite but no calibration row of the best
  round is non-OOD with q~ at or above max(min valid q~, robust min valid q~).

The suggestion: the largest α′ (in steps of 0.01, above max(0.5, 1/C)) at which both thresholds are
finite and some calibration rows of the best round clear them, with that row count — an upper bound
on what is admitted there, since admission also uses the DKW lower q~ and ψ.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from .cauchy import cauchy_robust_min, mad
from .rounds import RoundCalibration
from ..storage.files import finite_or_none


def best_reachable_share(q_tilde: np.ndarray, good: np.ndarray, n_min: int) -> float:
    """max over suffixes (by q~) with ≥ min(n_min, n) rows of the share of ``good`` rows; 0 if no rows."""
    n = q_tilde.size
    if n == 0:
        return 0.0
    order = np.argsort(q_tilde, kind="stable")
    g = good[order].astype(np.float64)
    suffix_good = np.cumsum(g[::-1])[::-1]
    kept = np.arange(n, 0, -1)
    allowed = kept >= min(n_min, n)
    starts = np.r_[True, np.diff(q_tilde[order]) > 0]  # a threshold keeps whole ties
    share = suffix_good / kept
    return float(share[allowed & starts].max())


def class_table(rnd: RoundCalibration, alpha: float, class_names=None) -> list[dict]:
    """Per true class of the best round's calibration rows: counts, accuracy and best reachable share."""
    n_min = math.ceil(1.0 / (1.0 - alpha))
    keep = rnd.non_ood & (np.floor(rnd.q_tilde) > 0)
    rows = []
    for c in range(rnd.num_classes):
        mine = rnd.y == c
        sel = mine & keep
        rows.append({
            "class": c,
            "name": None if class_names is None else str(class_names[c]),
            "calibration_rows": int(mine.sum()),
            "non_ood_rows": int(sel.sum()),
            "accuracy": float((rnd.y_hat[mine] == c).mean()) if mine.any() else None,
            "best_reachable_share": best_reachable_share(rnd.q_tilde[sel], rnd.o_true[sel] >= alpha, n_min),
            "too_few_rows": bool(mine.sum() < n_min),
        })
    return rows


def rows_clearing(rnd: RoundCalibration, threshold: float) -> int:
    """Calibration rows of the round that are non-OOD with q~ ≥ ``threshold`` (0 if it is +inf)."""
    if not math.isfinite(threshold):
        return 0
    return int((rnd.non_ood & (rnd.q_tilde >= threshold) & (np.floor(rnd.q_tilde) > 0)).sum())


def thresholds_at(rounds, best_index: int, alpha: float) -> tuple[float, float, int]:
    """(best round's min valid q~, robust min valid q~, calibration rows clearing both) at ``alpha``."""
    at = [r if r.alpha == alpha else r.with_alpha(alpha) for r in rounds]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        robust = cauchy_robust_min([r.min_valid for r in at], best_index, alpha)
    own = at[best_index].min_valid
    return own, robust, rows_clearing(at[best_index], max(own, robust))


def suggest_alpha(rounds, best_index: int, alpha: float) -> tuple[float | None, int]:
    """The largest α′ < ``alpha`` (0.01 steps) where calibration rows clear both thresholds, and how many."""
    lower = max(0.5, 1.0 / rounds[0].num_classes)
    a = math.floor(alpha * 100 - 1e-9) / 100
    while a > lower + 1e-9:
        _, _, n = thresholds_at(rounds, best_index, a)
        if n > 0:
            return a, n
        a = round(a - 0.01, 2)
    return None, 0


def _label(row: dict) -> str:
    return f"class {row['class']}" + (f" ({row['name']!r})" if row["name"] is not None else "")


def _conditions(rounds, best_index: int, alpha: float, robust_min: float, classes: list[dict]) -> list[dict]:
    best = rounds[best_index]
    out = []
    if not math.isfinite(best.min_valid):
        failing = [c for c in classes if c["best_reachable_share"] < alpha]
        out.append({
            "condition": "no_valid_threshold",
            "detail": "Alg. 3 found no q~ threshold at which every class reaches alpha' in the best round",
            "classes": [c["class"] for c in failing] or [c["class"] for c in classes],
            "common_threshold_missing": not failing,
        })
    if not math.isfinite(robust_min) and len(rounds) > 1 and not math.isfinite(mad([r.min_valid for r in rounds])):
        missing = [j for j, r in enumerate(rounds) if not math.isfinite(r.min_valid)]
        out.append({
            "condition": "no_robust_threshold",
            "detail": "the MAD of the J rounds' min valid q~ is not finite (eq:cauchyMinValidQBin)",
            "rounds_without_threshold": missing,
            "rounds": len(rounds),
        })
    if not out and rows_clearing(best, max(best.min_valid, robust_min)) == 0:
        out.append({
            "condition": "threshold_above_calibration",
            "detail": "no calibration row is non-OOD with q~ at or above max(min valid q~, robust min valid q~)",
            "threshold": float(max(best.min_valid, robust_min)),
        })
    return out


def admission_diagnosis(rounds, best_index: int, alpha: float, robust_min: float, class_names=None,
                        movement: float | None = None) -> dict:
    """Structured diagnosis (JSON-ready, no infinities) of whether the fitted estimator can admit rows."""
    best = rounds[best_index]
    classes = class_table(best, alpha, class_names)
    conditions = _conditions(rounds, best_index, alpha, robust_min, classes)
    diag = {
        "can_admit": not conditions,
        "alpha": float(alpha),
        "min_valid_qbin": finite_or_none(best.min_valid),
        "robust_min_valid_qbin": finite_or_none(robust_min),
        "round_min_valid_qbin": [finite_or_none(r.min_valid) for r in rounds],
        "calibration_rows_clearing_thresholds": rows_clearing(best, max(best.min_valid, robust_min)),
        "projection_movement": movement,
        "rescaler": None if best.rescaler is None else {
            "epochs_run": int(best.rescaler.epochs_run), "stopped_early": bool(best.rescaler.stopped_early)},
        "classes": classes,
        "failed": conditions,
    }
    if conditions:
        diag["suggested_alpha"], diag["rows_clearing_at_suggested_alpha"] = suggest_alpha(rounds, best_index, alpha)
        diag["next_step"] = next_step(diag)
    return diag


def next_step(diag: dict) -> str:
    """The concrete advice for a diagnosis that cannot admit."""
    steps = []
    thin = [_label(c) for c in diag["classes"] if c["too_few_rows"]]
    if thin:
        n_min = math.ceil(1.0 / (1.0 - diag["alpha"]))
        steps.append(f"add calibration rows for {', '.join(thin)} (Alg. 3 needs >= {n_min} per class at "
                     f"alpha' = {diag['alpha']:g})")
    moved = diag.get("projection_movement")
    weak = [c for c in diag["classes"] if c["best_reachable_share"] < diag["alpha"]]
    accurate = [c for c in weak if c["accuracy"] is not None and c["accuracy"] >= diag["alpha"]]
    resc = diag.get("rescaler")
    if accurate and resc is not None and not resc["stopped_early"]:
        steps.append(f"raise --rescaler-max-epochs: {', '.join(_label(c) for c in accurate)} predict(s) accurately "
                     f"but the rescaled output stays below alpha'; W'' ran all {resc['epochs_run']} epochs without "
                     "converging")
        weak = [c for c in weak if c not in accurate]
    if weak or moved is not None and moved < 0.1:
        extra = f" (W_g moved only {moved:.1%} from its initialisation)" if moved is not None else ""
        steps.append(f"raise --learning-rate or --epochs{extra}")
    if diag.get("suggested_alpha") is not None:
        steps.append(f"lower --alpha to {diag['suggested_alpha']:g}, where {diag['rows_clearing_at_suggested_alpha']} "
                     "calibration rows clear both thresholds")
    elif steps:
        steps[-1] += " (lowering --alpha does not help: no alpha' above the minimum admits calibration rows)"
    if not steps:
        steps.append("add calibration rows or use stronger features: no alpha' above the minimum admits rows")
    return "; or ".join(steps)


def diagnosis_message(diag: dict) -> str:
    """One warning text: every failed condition, the classes with their numbers, and the next step."""
    parts = [f"the fitted model admits nothing at alpha' = {diag['alpha']:g}:"]
    for cond in diag["failed"]:
        parts.append(f"[{cond['condition']}] {cond['detail']}")
        if cond["condition"] == "no_valid_threshold":
            by = {c["class"]: c for c in diag["classes"]}
            if cond["common_threshold_missing"]:
                parts.append("every class reaches alpha' above some threshold, but not above the same one")
            for c in cond["classes"]:
                r = by[c]
                acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
                parts.append(
                    f"{_label(r)}: best reachable share {r['best_reachable_share']:.3f} < {diag['alpha']:g} "
                    f"({r['calibration_rows']} calibration rows, {r['non_ood_rows']} not OOD, accuracy {acc})")
        elif cond["condition"] == "no_robust_threshold":
            vals = ["none" if v is None else f"{v:.3f}" for v in diag["round_min_valid_qbin"]]
            parts.append(f"{len(cond['rounds_without_threshold'])} of {cond['rounds']} rounds found no threshold "
                         f"(min valid q~ per round: {', '.join(vals)})")
        else:
            parts.append(f"threshold {cond['threshold']:.3f}")
    parts.append(f"Next step: {diag['next_step']}.")
    return "\n  ".join(parts)
