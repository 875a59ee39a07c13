"""Benchmark: the cost of a feedback update (``add_support``) at 10k and 100k support rows.

    python tools/bench/bench_feedback.py [--support 10000 100000] [--dim 1000] [--backends exact hnsw] [--json out.json]

A small estimator is fitted on synthetic rows of width --dim with exemplar dimension M = --dim
(so the exemplar coordinates are --dim wide), then its support set is grown to each size with
``add_support`` (synthetic labelled rows).  Per size and index backend it reports the wall time
of ``add_support`` with 1 row and with 100 rows (index already built: appended in place), the
first ``predict`` of 10 rows after the update (the exact index regroups its columns by class
once after a change) against a steady ``predict``, and for comparison the time to build the index
from scratch.  Persisted: ``add_support_to_model`` on a saved model directory (load + verify
checksums, append, write + fsync a new artifact, swap), which does not depend on the backend.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import sdm_mlx  # noqa: F401  (before mlx: loads OpenBLAS on Linux)
import numpy as np

from bench_common import write_report
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.estimator.updates import add_support_to_model


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def fit_small(dim: int, seed: int = 0) -> SDMEstimator:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(400, dim)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    est = SDMEstimator(iterations=1, epochs=2, exemplar_dim=dim, verbose=False, seed=seed)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return est.fit(X, y)


def grow(est: SDMEstimator, size: int, rng, block: int = 10000) -> None:
    n = len(est.support_ids_)
    while n < size:
        m = min(block, size - n)
        X = rng.normal(size=(m, est.input_dim_)).astype(np.float32)
        est.add_support(X, (X[:, 0] > 0).astype(np.int64), ids=[f"grow-{n + i}" for i in range(m)], source="bench")
        n += m


def bench_memory(est: SDMEstimator, backend: str, rng, repeat: int) -> dict:
    est.index_backend = backend
    build = timed(est._prepare_predict)
    Q = rng.normal(size=(10, est.input_dim_)).astype(np.float32)
    est.estimate(Q)
    out = {"index_build_s": build, "predict10_steady_s": statistics.median(timed(lambda: est.estimate(Q))
                                                                         for _ in range(repeat))}
    for rows in (1, 100):
        add, first = [], []
        for r in range(repeat):
            X = rng.normal(size=(rows, est.input_dim_)).astype(np.float32)
            ids = [f"{backend}-{rows}-{r}-{i}-{len(est.support_ids_)}" for i in range(rows)]
            add.append(timed(lambda: est.add_support(X, (X[:, 0] > 0).astype(np.int64), ids=ids, source="bench")))
            first.append(timed(lambda: est.estimate(Q)))
        out[f"add_{rows}_s"] = statistics.median(add)
        out[f"predict10_after_add_{rows}_s"] = statistics.median(first)
    return out


def bench_persisted(est: SDMEstimator, rng, repeat: int) -> dict:
    out = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        path = os.path.join(tmp, "model")
        est.save(path)
        out["artifact_mb"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 1e6
        out["load_s"] = timed(lambda: SDMEstimator.load(path))
        for rows in (1, 100):
            times = []
            for r in range(repeat):
                X = rng.normal(size=(rows, est.input_dim_)).astype(np.float32)
                ids = [f"disk-{rows}-{r}-{i}" for i in range(rows)]
                times.append(timed(lambda: add_support_to_model(path, X, (X[:, 0] > 0).astype(np.int64), ids=ids,
                                                                source="bench")))
            out[f"add_{rows}_s"] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--support", type=int, nargs="+", default=[10000, 100000])
    ap.add_argument("--dim", type=int, default=1000)
    ap.add_argument("--backends", nargs="+", default=["exact", "hnsw"], choices=["exact", "hnsw"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-persisted", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    est = fit_small(args.dim)
    report = {"machine": platform.platform(), "cpus": os.cpu_count(), "dim": args.dim, "results": []}
    for size in sorted(args.support):
        grow(est, size, rng)
        entry = {"support_rows": len(est.support_ids_)}
        for backend in args.backends:
            entry[backend] = bench_memory(est, backend, rng, args.repeat)
            print(size, backend, {k: round(v, 4) for k, v in entry[backend].items()}, flush=True)
        if not args.no_persisted:
            entry["persisted"] = bench_persisted(est, rng, args.repeat)
            print(size, "persisted", {k: round(v, 4) for k, v in entry["persisted"].items()}, flush=True)
        report["results"].append(entry)
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    sys.exit(main())
