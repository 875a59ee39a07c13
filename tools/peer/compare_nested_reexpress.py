"""Compare sdm_mlx's nested calibration (DESIGN #25) with the nested regions of the author's ``reexpress-sdm``.

    pip download --no-deps reexpress-sdm==0.4.8 -d /tmp/rx && unzip -q /tmp/rx/*.whl -d /tmp/rx/src
    python tools/peer/compare_nested_reexpress.py --reexpress-src /tmp/rx/src [--json out.json]

Only ``reexpress_sdm.calibration`` (``NestedCalibrator``) and ``reexpress_sdm.math`` (``region_accepts_many``)
are imported — they need NumPy alone, so torch is not required; the package's ``__init__`` (which imports
torch) is bypassed by loading the modules into an empty package.  Their code is run, not copied.

Both are given the SAME quantities, those of the best round of an sdm_mlx model fitted on the embedded
factcheck data: the calibration rows' rescaled outputs o, processed q~, labels and predictions (their
``probabilities``, ``q_prime``, ``labels``, ``predictions``), and, for the test rows, the centroid o and q~.

Compared where both define the quantity:

* per level α: our Alg. 3 (min valid q~, ψ on ALL calibration rows) vs their region (minimum q', thresholds on
  the rows no higher level admitted — their "residual" ladder);
* per test row: our ``alpha_region_centroid`` vs their first-matching region (``assigned_region_alpha``) over
  the same centroid o and q~.  Ours also applies the Cauchy robust min valid q~ and offsets over J rounds
  (``eq:cauchyMinValidQBin``, ``eq:cauchyIteratedLower``) and anchors at α'; theirs has neither.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import types
from pathlib import Path

import sdm_mlx  # noqa: F401  (before mlx: loads OpenBLAS on Linux)
import numpy as np


def load_reexpress(src: Path):
    """(calibration module, math module) of reexpress_sdm without running its ``__init__``."""
    pkg = types.ModuleType("reexpress_sdm")
    pkg.__path__ = [str(src / "reexpress_sdm")]
    sys.modules["reexpress_sdm"] = pkg
    return importlib.import_module("reexpress_sdm.calibration"), importlib.import_module("reexpress_sdm.math")


def fitted(args):
    from sdm_mlx.storage.datasets import factcheck_splits
    from sdm_mlx.estimator import SDMEstimator

    train, _, test = factcheck_splits()
    est = SDMEstimator(iterations=args.iterations, epochs=args.epochs, seed=args.seed).fit(train.X, train.y)
    return est, test


def level_table(est, regions) -> list[dict]:
    """Per grid level: our Alg. 3 on all calibration rows vs their residual region at that α."""
    theirs = {round(r.alpha, 10): r for r in regions}
    rows = []
    for a in est.nested_.grid:
        cal = est.nested_.at(a)
        r = theirs.get(round(a, 10))
        rows.append({
            "alpha": a,
            "ours_min_valid": None if not np.isfinite(cal.min_valid) else float(cal.min_valid),
            "ours_robust_min_valid": None if not np.isfinite(cal.robust_min_valid) else float(cal.robust_min_valid),
            "ours_psi": [round(float(p), 6) for p in cal.psi],
            "theirs_min_q": None if r is None else float(r.minimum_rescaled_similarity),
            "theirs_thresholds": None if r is None else [round(float(t), 6) for t in r.output_thresholds],
        })
    return rows


def row_regions(est, test, regions, rmath) -> dict:
    """Our centroid regions vs theirs (first matching region from the top) on the test rows."""
    pred = est.estimate(test.X)
    cen = pred.estimate.centroid
    grid = set(est.nested_.grid)
    theirs = np.zeros(len(test.ids))
    for region in regions:  # descending α, first match wins (their assigned_region_alpha)
        if round(region.alpha, 10) not in {round(g, 10) for g in grid}:
            continue
        hit = rmath.region_accepts_many(cen.q_tilde, cen.o, pred.prediction, region, 0) & (theirs == 0)
        theirs[hit] = region.alpha
    ours = np.nan_to_num(pred.estimate.alpha_region_centroid, nan=0.0)
    return {
        "rows": len(test.ids),
        "same_region": int((np.round(ours, 10) == np.round(theirs, 10)).sum()),
        "ours_higher": int((ours > theirs + 1e-12).sum()),
        "theirs_higher": int((theirs > ours + 1e-12).sum()),
        "ours_any": int((ours > 0).sum()), "theirs_any": int((theirs > 0).sum()),
        "ours_at_or_above_alpha": int((ours >= est.alpha).sum()),
        "theirs_at_or_above_alpha": int((theirs >= est.alpha).sum()),
        "paper_admitted_lower": int(pred.admitted.sum()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reexpress-src", type=Path, required=True, help="the unpacked reexpress-sdm wheel")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the comparison here")
    args = p.parse_args(argv)
    rcal, rmath = load_reexpress(args.reexpress_src)
    est, test = fitted(args)
    best = est.rounds_[est.best_round_]
    regions = rcal.NestedCalibrator(est.num_classes_, 0.01, 0).fit(best.o, best.q_tilde, best.y, best.y_hat)
    out = {"alpha": est.alpha, "levels": level_table(est, regions), "rows": row_regions(est, test, regions, rmath)}
    print(f"{'alpha':>6} {'ours min q~':>11} {'robust':>8} {'ours psi':>20} {'theirs min q':>12} {'theirs thresholds':>20}")
    fmt = lambda x: "—" if x is None else f"{x:.4f}"  # noqa: E731
    for r in out["levels"]:
        print(f"{r['alpha']:>6g} {fmt(r['ours_min_valid']):>11} {fmt(r['ours_robust_min_valid']):>8} "
              f"{str(r['ours_psi']):>20} {fmt(r['theirs_min_q']):>12} {str(r['theirs_thresholds']):>20}")
    print(json.dumps(out["rows"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
