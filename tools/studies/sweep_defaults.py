"""The default-selection sweep behind ``docs/defaults.md``.

For every (dataset, setting) it fits an :class:`~sdm_mlx.estimator.SDMEstimator` and measures

* in distribution: the admitted fraction and the accuracy of the admitted rows;
* on a shifted split: index-conditional calibration — the admitted rows' accuracy, the minimum over
  true classes and over predicted classes of the admitted accuracy (with the admitted counts; it
  should be ≥ α′ = 0.95), and the admitted fraction;
* fit wall time, epochs run, and how far the adaptor moved (‖W_g − W_g,0‖_F / ‖W_g,0‖_F, best round).

Datasets: the embedded factcheck data (held-out topic statements in distribution; the LLM-generated
statements shifted), seeded multi-class Gaussians (C = 2, 5, 10; 2,800 × 32; a covariate-shifted
split) and 400 black-box LLM answers passed through ``sdm-mlx api-features`` (a simulated 4-choice
model; the shifted split is a weaker, over-confident model).

    nice -n 10 python tools/studies/sweep_defaults.py --output runs/sweep_defaults.json > runs/sweep.log 2>&1

Settings are named ``lr=…,J=…xE`` (fixed epochs) or ``lr=…,J=…xE,P=…`` (convergence-aware
stopping: at most E epochs, stop after P without a better balanced median q).  Each finished run
is appended to the JSON file, so an interrupted sweep continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's sdm_mlx
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "builders"))  # gaussians.py (tools/README.md)

import numpy as np  # noqa: E402

from sdm_mlx.llm.api_features import feature_row  # noqa: E402
from sdm_mlx.storage.datasets import factcheck_splits  # noqa: E402
from sdm_mlx.estimator import SDMEstimator  # noqa: E402
from gaussians import gaussian_classes  # noqa: E402  (tools/builders/gaussians.py)

ALPHA = 0.95


# ---------------------------------------------------------------------------------------------
# datasets: name -> (X_pool, y_pool, X_id, y_id, X_shift, y_shift)


def factcheck():
    pool, heldout, generated = factcheck_splits(0.15, seed=0)
    return pool.X, pool.y, heldout.X, heldout.y, generated.X, generated.y


def gaussians(num_classes: int):
    def make():
        X, y = gaussian_classes(2800, num_classes, 32, separation=3.0, seed=num_classes, draw_seed=1)
        Xi, yi = gaussian_classes(800, num_classes, 32, separation=3.0, seed=num_classes, draw_seed=2)
        Xs, ys = gaussian_classes(800, num_classes, 32, separation=3.0, seed=num_classes, draw_seed=3,
                                  shift=1.5, noise_scale=1.2)
        return X, y, Xi, yi, Xs, ys
    return make


def _simulated_answer(rng, truth: int, p_know: float, overconfident: bool) -> dict:
    """One black-box answer row (response JSON text + top-1 token logprobs) for api-features."""
    knows = rng.random() < p_know
    letter = truth if knows else int(rng.integers(4))
    p_letter = rng.uniform(0.75, 1.0) if knows else rng.uniform(0.3, 0.9)
    conf = rng.uniform(0.8, 1.0) if (knows or overconfident) else rng.uniform(0.3, 0.85)
    digits = f"{min(conf, 0.99):.2f}"[2:]
    toks = [('{"answer_letter": "', 0.0), ("ABCD"[letter], math.log(p_letter)),
            ('", "confidence_in_answer_letter": ', 0.0), ("0", 0.0), (".", 0.0),
            (digits, math.log(rng.uniform(0.4, 1.0))), (', "short_explanation_for_answer_confidence": "', 0.0)]
    toks += [(w, math.log(rng.uniform(0.5 if knows else 0.2, 1.0))) for w in ("It", " is", " known", ".")]
    toks.append(('"}', 0.0))
    return {"label": "ABCD"[truth], "response": "".join(t for t, _ in toks),
            "logprobs": [{"token": t, "logprob": lp} for t, lp in toks]}


def api_features_rows(n: int, seed: int, p_know: float, overconfident: bool) -> tuple[np.ndarray, np.ndarray]:
    """``n`` simulated answers through :func:`sdm_mlx.llm.api_features.feature_row` (the 7-dim attributes)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        raw = _simulated_answer(rng, int(rng.integers(4)), p_know, overconfident)
        rows.append(feature_row({"id": f"q{i}", **raw}))
    return np.array([r["attributes"] for r in rows], np.float32), np.array([r["label"] for r in rows], np.int64)


def api_features():
    X, y = api_features_rows(400, 0, p_know=0.75, overconfident=False)
    Xi, yi = api_features_rows(400, 1, p_know=0.75, overconfident=False)
    Xs, ys = api_features_rows(400, 2, p_know=0.55, overconfident=True)
    return X, y, Xi, yi, Xs, ys


DATASETS = {"factcheck": factcheck, "gauss2": gaussians(2), "gauss5": gaussians(5), "gauss10": gaussians(10),
            "api_features": api_features}


# ---------------------------------------------------------------------------------------------
# settings and metrics


def parse_setting(name: str) -> dict:
    """``lr=1e-4,J=5x20[,P=5]`` -> estimator keyword arguments."""
    out = {"patience": None}  # fixed epochs unless P= is given
    for part in name.split(","):
        key, value = part.split("=")
        if key == "lr":
            out["learning_rate"] = float(value)
        elif key == "J":
            j, e = value.split("x")
            out["iterations"], out["epochs"] = int(j), int(e)
        elif key == "P":
            out["patience"] = int(value)
        else:
            raise ValueError(f"unknown setting key {key!r} in {name!r}")
    return out


def conditional(pred, y) -> dict:
    """Admitted fraction/accuracy and the min over true and predicted classes of admitted accuracy."""
    adm = np.asarray(pred.admitted, bool)
    out = {"n": int(adm.size), "admitted": int(adm.sum()), "admitted_fraction": float(adm.mean())}
    correct = pred.prediction == y
    out["admitted_accuracy"] = float(correct[adm].mean()) if adm.any() else None
    for key, groups in (("true", y), ("predicted", pred.prediction)):
        accs = [(float(correct[adm & (groups == c)].mean()), int((adm & (groups == c)).sum()))
                for c in np.unique(groups[adm])]
        worst = min(accs) if accs else (None, 0)
        out[f"min_acc_by_{key}"], out[f"min_acc_by_{key}_n"] = worst
    return out


def run_one(data, setting: str, seed: int) -> dict:
    X, y, Xi, yi, Xs, ys = data
    kwargs = parse_setting(setting)
    est = SDMEstimator(alpha=ALPHA, seed=seed, verbose=False, **kwargs)
    t = time.perf_counter()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est.fit(X, y)
    seconds = time.perf_counter() - t
    best = est.round_summaries_[est.best_round_]
    return {
        "seconds": round(seconds, 1),
        "epochs_run": sum(r.get("epochs_run", kwargs["epochs"]) for r in est.round_summaries_),
        "projection_movement": best.get("projection_movement"),
        "min_valid": _finite(est.calibration_.min_valid), "robust_min_valid": _finite(est.robust_min_valid_),
        "in_distribution": conditional(est.estimate(Xi), yi),
        "shifted": conditional(est.estimate(Xs), ys),
    }


def _finite(x: float):
    return float(x) if math.isfinite(x) else None


# ---------------------------------------------------------------------------------------------
# grid, table


#: The grid, in priority order (a run is ~4-330 s; the whole grid is ≈ 40 min of one core): every learning
#: rate at the cheap budget J=5x20 everywhere, convergence-aware stopping (J=5, ≤50 epochs, P=5) where it
#: decides the default, and the paper budget J=10x50 where it is affordable (on factcheck ~310 s per run).
LRS = ("1e-5", "1e-4", "3e-4", "1e-3")


def default_grid() -> list[tuple[str, str]]:
    grid = [("api_features", f"lr={lr},{b}") for b in ("J=5x20", "J=5x50,P=5") for lr in LRS]
    grid += [("api_features", f"lr={lr},J=10x50") for lr in ("1e-5", "1e-4")]
    grid += [(ds, f"lr={lr},J=5x20") for ds in ("gauss5", "factcheck") for lr in LRS]
    grid += [("gauss5", f"lr={lr},J=5x50,P=5") for lr in ("1e-4", "3e-4")]
    grid += [("factcheck", "lr=1e-4,J=5x50,P=5")]
    grid += [("gauss10", f"lr={lr},J=5x20") for lr in ("1e-5", "1e-4", "1e-3")]
    grid += [("gauss2", f"lr={lr},J=5x20") for lr in ("1e-5", "1e-4", "1e-3")]
    grid += [("factcheck", f"lr={lr},J=10x50") for lr in ("1e-5", "1e-4")]
    return grid


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def table(results: list[dict]) -> str:
    head = ("| data | setting | s | epochs | W_g moved | ID admit | ID acc | shift admit | shift acc | "
            "shift min acc (true / pred, n) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        i, s = r["in_distribution"], r["shifted"]
        lines.append(
            f"| {r['dataset']} | {r['setting']} | {r['seconds']:.0f} | {r['epochs_run']} | "
            f"{fmt(r['projection_movement'], '.1%')} | {i['admitted_fraction']:.1%} | {fmt(i['admitted_accuracy'])} | "
            f"{s['admitted_fraction']:.1%} | {fmt(s['admitted_accuracy'])} | "
            f"{fmt(s['min_acc_by_true'])} ({s['min_acc_by_true_n']}) / {fmt(s['min_acc_by_predicted'])} "
            f"({s['min_acc_by_predicted_n']}) |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default="runs/sweep_defaults.json", help="results JSON (appended per run)")
    p.add_argument("--also", nargs="*", default=[], help="more results files to include in the printed table")
    p.add_argument("--datasets", nargs="+", choices=sorted(DATASETS), default=None, help="subset of the grid")
    p.add_argument("--settings", nargs="+", default=None, help="explicit settings instead of the grid")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table-only", action="store_true", help="print the table of the results file and exit")
    args = p.parse_args(argv)
    results = json.loads(Path(args.output).read_text()) if os.path.exists(args.output) else []
    if not args.table_only:
        grid = default_grid()
        if args.settings:
            grid = [(ds, s) for ds in (args.datasets or list(DATASETS)) for s in args.settings]
        elif args.datasets:
            grid = [(ds, s) for ds, s in grid if ds in args.datasets]
        done = {(r["dataset"], r["setting"], r["seed"]) for r in results}
        cache = {}
        for ds, setting in grid:
            if (ds, setting, args.seed) in done:
                continue
            data = cache.setdefault(ds, DATASETS[ds]())
            r = {"dataset": ds, "setting": setting, "seed": args.seed, **run_one(data, setting, args.seed)}
            results.append(r)
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            Path(args.output).write_text(json.dumps(results, indent=1))
            print(table([r]).splitlines()[-1], flush=True)
    for extra in args.also:
        results += json.loads(Path(extra).read_text())
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
