"""Benchmark: where the time of ``SDMEstimator.estimate`` goes, per stage, at batch 1 and larger batches.

    python tools/bench/bench_latency.py [--model DIR] [--batches 1 64 1024 8192] [--repeat 200] [--json out.json]
    python tools/bench/bench_latency.py --smoke          # seconds: a tiny model, batches 1 and 8

The stages are those of ``estimate`` (sdm_mlx/estimator/sdm_estimator.py), timed one after the other on the same
inputs: input validation, the batch-invariant adaptor forward (z', exemplar coordinates), the
support index (q, d0 and the nearest exemplars in one pass), the distance quantile d, the SDM
activation, the index-conditional estimate (calibration) and the result object.  ``total`` is a
separate timing of the public ``estimate`` call (so it includes the glue between stages), and
``predict_proba`` and ``predict`` (logits only) are timed too.  Each figure is the median over
``--repeat`` calls (p90 for the totals) in milliseconds per call; per-row figures divide by the
batch.  Without ``--model`` the model is fitted on the embedded factcheck data (2.6k support rows,
D = 32 < M = 1000) and cached in the temporary directory.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import sdm_mlx  # noqa: F401  (before mlx: loads OpenBLAS on Linux)
import numpy as np

from bench_common import write_report
from sdm_mlx import validation
from sdm_mlx.runtime.blas import describe_blas
from sdm_mlx.calibration import estimate as calibration_estimate
from sdm_mlx.storage.datasets import factcheck_splits
from sdm_mlx.core.distance import distance_quantile
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.results import Predictions
from sdm_mlx.core.activation import sdm_numpy


def factcheck_model(smoke: bool) -> tuple[SDMEstimator, np.ndarray]:
    """(fitted model, held-out rows): the embedded factcheck data, the model cached across runs."""
    pool, heldout, _ = factcheck_splits()
    if smoke:
        est = SDMEstimator(iterations=1, epochs=1, exemplar_dim=32, rescaler_max_epochs=5)
        return est.fit(pool.X[:400], pool.y[:400]), heldout.X
    path = Path(tempfile.gettempdir()) / "sdm_mlx_bench_latency_factcheck"
    if not (path / "meta.json").exists() and not path.exists():
        SDMEstimator(iterations=2, epochs=5).fit(pool.X, pool.y, ids_train=pool.ids).save(path)
    return SDMEstimator.load(path), heldout.X


def stage_functions(est: SDMEstimator, X: np.ndarray) -> list[tuple[str, callable]]:
    """The stages of ``estimate`` on rows X, each fed by the previous stages' outputs (computed once)."""
    Xv = validation.features(X, "features", dim=est.input_dim_)
    z, h = est._forward_map(Xv)
    y_hat = z.argmax(axis=1)
    good = est._good()
    q, d0, ex_d, ex_i = est.index_.similarity_and_neighbours(h, y_hat, good, est.k_, est.n_exemplars)
    d = distance_quantile(d0, est.calibration_distance_ecdfs_)
    s = sdm_numpy(z, q, d)
    e = calibration_estimate(est.calibration_, z, q, d, s)
    ids = list(range(len(X)))
    return [
        ("validation", lambda: validation.features(X, "features", dim=est.input_dim_)),
        ("adaptor_forward", lambda: est._forward_map(Xv)),
        ("support_labels_good", est._good),
        ("index_q_d0_exemplars", lambda: est.index_.similarity_and_neighbours(h, y_hat, good, est.k_,
                                                                              est.n_exemplars)),
        ("distance_quantile_d", lambda: distance_quantile(d0, est.calibration_distance_ecdfs_)),
        ("sdm_activation", lambda: sdm_numpy(z, q, d)),
        ("calibration_estimate", lambda: calibration_estimate(est.calibration_, z, q, d, s)),
        ("result_object", lambda: Predictions(
            ids=list(ids), logits=z, q=q, d0=d0, d=d, sdm=s, estimate=e, exemplar_index=ex_i,
            exemplar_distance=ex_d, support_ids=est.support_ids_, support_labels=est.support_labels_,
            support_predictions=est.support_predictions_, class_names=est.class_names)),
    ]


def timings(fn, repeat: int) -> np.ndarray:
    """Wall times (s) of ``repeat`` calls after one warm-up call."""
    fn()
    out = np.empty(repeat)
    for r in range(repeat):
        t = time.perf_counter()
        fn()
        out[r] = time.perf_counter() - t
    return out


def bench_batch(est: SDMEstimator, X: np.ndarray, repeat: int) -> dict:
    """Median ms per stage and of the public calls for one batch of rows X."""
    stages = {name: float(np.median(timings(fn, repeat)) * 1e3) for name, fn in stage_functions(est, X)}
    total = timings(lambda: est.estimate(X), repeat) * 1e3
    return {
        "batch": int(X.shape[0]),
        "repeat": repeat,
        "stages_ms": stages,
        "stages_sum_ms": float(sum(stages.values())),
        "estimate_ms_median": float(np.median(total)),
        "estimate_ms_p90": float(np.percentile(total, 90)),
        "estimate_us_per_row": float(np.median(total) * 1e3 / X.shape[0]),
        "predict_proba_ms_median": float(np.median(timings(lambda: est.predict_proba(X), repeat)) * 1e3),
        "predict_ms_median": float(np.median(timings(lambda: est.predict(X), repeat)) * 1e3),
    }


def rows_for(X: np.ndarray, batch: int) -> np.ndarray:
    """``batch`` rows, cycling through X when it has fewer."""
    return X[np.arange(batch) % X.shape[0]]


def print_table(results: list[dict]) -> None:
    names = list(results[0]["stages_ms"])
    head = "stage (median ms per call)".ljust(28) + "".join(f"{'batch ' + str(r['batch']):>14}" for r in results)
    print(head)
    for name in names + ["stages_sum_ms"]:
        vals = [r["stages_ms"][name] if name in r["stages_ms"] else r[name] for r in results]
        print(name.ljust(28) + "".join(f"{v:14.3f}" for v in vals))
    for key in ("estimate_ms_median", "estimate_ms_p90", "estimate_us_per_row", "predict_proba_ms_median",
                "predict_ms_median"):
        print(key.ljust(28) + "".join(f"{r[key]:14.3f}" for r in results))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a saved SDMEstimator directory (default: fit one on the factcheck data)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 1024, 8192])
    ap.add_argument("--repeat", type=int, default=200, help="calls per figure at batch 1 (fewer for big batches)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, batches 1 and 8, few repeats (seconds)")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batches, args.repeat = [1, 8], 5
    if args.model:
        est = SDMEstimator.load(args.model)
        X = np.random.default_rng(0).normal(size=(max(args.batches), est.input_dim_)).astype(np.float32)
    else:
        est, X = factcheck_model(args.smoke)
    results = []
    for b in args.batches:
        repeat = max(3, min(args.repeat, int(args.repeat * 64 / max(b, 64))))
        results.append(bench_batch(est, rows_for(X, b), repeat))
    report = {
        "smoke": bool(args.smoke),
        "support_rows": int(est.support_vectors_.shape[0]),
        "support_dim": int(est.support_vectors_.shape[1]),
        "n_exemplars": int(est.n_exemplars),
        "blas": describe_blas(),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": results,
    }
    print(f"support {report['support_rows']} x {report['support_dim']}, BLAS {report['blas']}, "
          f"load {report['load_average'][0]:.2f}")
    print_table(results)
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
