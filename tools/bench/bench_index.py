"""Benchmark: exact support-index throughput vs a plain matmul, and one Alg. 1 epoch.

    python tools/bench/bench_index.py [--support 10000 100000] [--queries 1000] [--dim 1000] [--json out.json]

Reports, for each support size at M = --dim: queries/s of ``ExactIndex.similarity`` (q + d0)
and ``ExactIndex.search`` (top-10), the GFLOP/s they achieve counting the 2·N_q·N_s·M
flops of the distance matmul, and a plain ``mx.matmul`` of the same shape; then the wall time
of one Alg. 1 epoch (training steps + q/d refresh) on the embedded factcheck data, and how
far hnswlib's approximate q departs from the exact q on exemplars of a trained model.
States which BLAS MLX used.  Uses ``import sdm_mlx`` loading OpenBLAS (see sdm_mlx/runtime/blas.py); set SDM_MLX_NO_BLAS_PRELOAD=1 to measure
MLX's bundled BLAS instead. The report says which was used.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import sdm_mlx  # noqa: F401  (before mlx: loads OpenBLAS on Linux)
import mlx.core as mx
import numpy as np

from bench_common import best_time, write_report
from sdm_mlx.runtime.blas import describe_blas
from sdm_mlx.storage.datasets import factcheck_splits
from sdm_mlx.index import ExactIndex, good_neighbours_by_class
from sdm_mlx.estimator.training import RoundSplit, TrainConfig, train_round


def bench_index(n_support: int, n_queries: int, dim: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    support = rng.normal(size=(n_support, dim)).astype(np.float32)
    queries = rng.normal(size=(n_queries, dim)).astype(np.float32)
    labels = rng.integers(0, 2, n_support)
    good = good_neighbours_by_class(labels, labels, 2)
    y_hat = rng.integers(0, 2, n_queries)
    index = ExactIndex(support)
    flops = 2.0 * n_queries * n_support * dim
    t_sim = best_time(lambda: index.similarity(queries, y_hat, good, n_support // 2))
    t_search = best_time(lambda: index.search(queries, 10))
    a, b = mx.array(queries), mx.array(support)

    def matmul():
        mx.eval(a @ b.T)

    t_mm = best_time(matmul)
    return {
        "support": n_support,
        "queries": n_queries,
        "dim": dim,
        "similarity_queries_per_s": n_queries / t_sim,
        "similarity_gflops": flops / t_sim / 1e9,
        "search_top10_queries_per_s": n_queries / t_search,
        "search_top10_gflops": flops / t_search / 1e9,
        "plain_matmul_gflops": flops / t_mm / 1e9,
    }


def bench_epoch(exemplar_dim: int) -> dict:
    pool, _, _ = factcheck_splits()
    rng = np.random.default_rng(0)
    half = rng.permutation(len(pool))
    tr, ca = half[: len(pool) // 2], half[len(pool) // 2 :]
    times = {}
    for epochs in (1, 3):
        cfg = TrainConfig(epochs=epochs, iterations=1, exemplar_dim=exemplar_dim)
        t = time.perf_counter()
        train_round(RoundSplit(pool.X[tr], pool.y[tr], pool.X[ca], pool.y[ca]), 2, cfg, seed=0)
        times[epochs] = time.perf_counter() - t
    return {
        "data": f"factcheck pool {len(pool)} rows (train {len(tr)}, calibration {len(ca)}), D={pool.X.shape[1]}",
        "exemplar_dim": exemplar_dim,
        "epoch_seconds": (times[3] - times[1]) / 2,
        "first_epoch_seconds_incl_setup": times[1],
    }


def _compare_hnsw(support, queries, y_hat, good, k, q_exact, d0_exact, efs=(64, 256)) -> dict:
    """Build hnswlib indexes (ef in ``efs``) and compare their q and d0 with the exact ones."""
    from sdm_mlx.index import HnswIndex

    out = {}
    for ef in efs:
        t = time.perf_counter()
        q_h, d_h = HnswIndex(support, ef=ef).similarity(queries, y_hat, good, k)
        out[f"hnsw_ef{ef}"] = {
            "seconds": time.perf_counter() - t,
            "q_equal_fraction": float((q_h == q_exact).mean()),
            "q_mean_abs_diff": float(np.abs(q_h - q_exact).mean()),
            "q_positive_agreement": float(((q_h > 0) == (q_exact > 0)).mean()),
            "d0_max_rel_diff": float(np.max(np.abs(d_h - d0_exact) / np.maximum(d0_exact, 1e-12))),
        }
    return out


def bench_hnsw_vs_exact(epochs: int = 5) -> dict:
    """q and d0 from hnswlib vs the exact index on a model trained on the embedded data."""
    pool, _, _ = factcheck_splits()
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(pool))
    tr, ca = perm[: len(pool) // 2], perm[len(pool) // 2 :]
    cfg = TrainConfig(epochs=epochs, iterations=1, exemplar_dim=1000)
    r = train_round(RoundSplit(pool.X[tr], pool.y[tr], pool.X[ca], pool.y[ca]), 2, cfg, seed=0)
    good = good_neighbours_by_class(pool.y[tr], r.train.y_hat, 2)
    h_tr, h_ca, yhat = r.train.h, r.calibration.h, r.calibration.z.argmax(1)
    out = {"support": len(tr), "queries": len(ca), "k": r.k, "dim": h_tr.shape[1]}
    t = time.perf_counter()
    exact = ExactIndex(h_tr)
    q_e, d_e = exact.similarity(h_ca, yhat, good, r.k)
    out["exact_seconds"] = time.perf_counter() - t
    out.update(_compare_hnsw(h_tr, h_ca, yhat, good, r.k, q_e, d_e))
    return out


def bench_hnsw_synthetic(n_support: int = 10_000, n_queries: int = 1000, dim: int = 1000, k: int = 5000) -> dict:
    """hnswlib vs exact q on clustered high-dimensional data (40 Gaussian clusters, 2 classes, 10% errors)."""
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(40, dim)).astype(np.float32) * 0.35
    cluster_class = rng.integers(0, 2, 40)

    def draw(n):
        c = rng.integers(0, 40, n)
        return (centers[c] + rng.normal(size=(n, dim)).astype(np.float32) * 0.25), cluster_class[c]

    support, labels = draw(n_support)
    queries, y_hat = draw(n_queries)
    preds = np.where(rng.random(n_support) < 0.1, 1 - labels, labels)
    good = good_neighbours_by_class(labels, preds, 2)
    t = time.perf_counter()
    q_e, d_e = ExactIndex(support).similarity(queries, y_hat, good, k)
    out = {"support": n_support, "queries": n_queries, "dim": dim, "k": k, "exact_seconds": time.perf_counter() - t,
           "exact_mean_q": float(q_e.mean())}
    out.update(_compare_hnsw(support, queries, y_hat, good, k, q_e, d_e))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--support", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--dim", type=int, default=1000)
    p.add_argument("--json", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    report = {"blas": describe_blas(), "machine": platform.platform(), "index": [], "epoch": None}
    print(f"BLAS: {report['blas']}", file=sys.stderr)
    print(f"{'support':>8} {'queries':>7} {'q+d0 q/s':>10} {'GFLOP/s':>8} {'top10 q/s':>10} {'GFLOP/s':>8} {'matmul GFLOP/s':>15}")
    for n in args.support:
        r = bench_index(n, args.queries, args.dim)
        report["index"].append(r)
        print(
            f"{n:>8} {args.queries:>7} {r['similarity_queries_per_s']:>10.1f} {r['similarity_gflops']:>8.1f} "
            f"{r['search_top10_queries_per_s']:>10.1f} {r['search_top10_gflops']:>8.1f} {r['plain_matmul_gflops']:>15.1f}"
        )
    report["epoch"] = bench_epoch(args.dim)
    print(f"Alg. 1 epoch on {report['epoch']['data']}, M={args.dim}: {report['epoch']['epoch_seconds']:.2f} s")
    report["hnsw_vs_exact"] = hv = bench_hnsw_vs_exact()
    report["hnsw_vs_exact_synthetic"] = hs = bench_hnsw_synthetic()
    for title, h_all in (
        (f"factcheck exemplar coordinates (dim {hv['dim']})", hv),
        (f"synthetic clustered data (dim {hs['dim']}, mean exact q {hs['exact_mean_q']:.0f})", hs),
    ):
        print(f"hnswlib vs exact on {title}: {h_all['queries']} queries, {h_all['support']} support, "
              f"k={h_all['k']}: exact {h_all['exact_seconds']:.2f}s")
        for ef in (64, 256):
            h = h_all[f"hnsw_ef{ef}"]
            print(f"  ef={ef}: {h['seconds']:.2f}s, q identical for {h['q_equal_fraction']:.1%} of rows, "
                  f"mean |Δq| {h['q_mean_abs_diff']:.2f}, q>0 agreement {h['q_positive_agreement']:.1%}, "
                  f"max rel Δd0 {h['d0_max_rel_diff']:.2g}")
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
