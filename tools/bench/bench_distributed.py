"""Benchmark: the sharded exact index and the estimator under ``mlx.launch`` against one process.

    # one process (the plain ExactIndex)
    python tools/bench/bench_distributed.py index --rows 200000 --dim 1000 --queries 1000
    # R ranks (each builds only its shard; rank 0 prints the report)
    mlx.launch -n 2 --backend ring --python $(which python) -- tools/bench/bench_distributed.py index --rows 200000 ...
    # fit + estimate on the embedded factcheck data
    python tools/bench/bench_distributed.py fit [--epochs 5 --iterations 2 --exemplar-dim 1000]

``index`` reports build time, ``similarity_and_neighbours`` (q, d0, top-5) and ``search`` (top-10) wall times,
the time spent inside collectives (waiting included) and the peak RSS of every rank.  The support rows are
drawn chunk by chunk from per-chunk seeds, so any rank can draw exactly its own shard.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import sdm_mlx  # noqa: F401  (before mlx: loads OpenBLAS on Linux)
import numpy as np

from sdm_mlx.runtime import distributed as dist

CHUNK = 10_000


def support_rows(start: int, stop: int, dim: int, seed: int) -> np.ndarray:
    """Rows [start, stop) of the random support set (standard normal, float32), the same on every rank."""
    parts = []
    for c in range(start // CHUNK, (stop - 1) // CHUNK + 1):
        block = np.random.default_rng([seed, c]).standard_normal((CHUNK, dim), dtype=np.float32)
        lo, hi = max(start, c * CHUNK) - c * CHUNK, min(stop, (c + 1) * CHUNK) - c * CHUNK
        parts.append(block[lo:hi])
    return np.concatenate(parts)


class _CollectiveClock:
    """Wall time spent in the collective helpers (wrapping distributed._collective)."""

    def __init__(self):
        self.seconds, self.calls, self._inner = 0.0, 0, dist._collective

    def __enter__(self):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return self._inner(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        dist._collective = timed
        return self

    def __exit__(self, *exc):
        dist._collective = self._inner


def bench_index(args) -> dict:
    from sdm_mlx.index import ExactIndex, good_neighbours_by_class
    from sdm_mlx.index.sharded import ShardedExactIndex

    rng = np.random.default_rng(args.seed + 1)
    labels = rng.integers(0, 2, args.rows)
    preds = np.where(rng.random(args.rows) < 0.9, labels, 1 - labels)
    good = good_neighbours_by_class(labels, preds, 2)
    queries = support_rows(0, args.queries, args.dim, args.seed + 7)
    y_hat = rng.integers(0, 2, args.queries)
    times = {}
    t = time.perf_counter()
    if dist.is_distributed():
        start, stop = dist.shard_bounds(args.rows, dist.rank(), dist.size())
        index = ShardedExactIndex(support_rows(start, stop, args.dim, args.seed), start, args.rows)
    else:
        index = ExactIndex(support_rows(0, args.rows, args.dim, args.seed))
    times["build_s"] = time.perf_counter() - t
    with _CollectiveClock() as clock:
        t = time.perf_counter()
        index.similarity_and_neighbours(queries, y_hat, good, 1000, 5)
        times["similarity_s"] = time.perf_counter() - t
        t = time.perf_counter()
        index.search(queries, 10)
        times["search_s"] = time.perf_counter() - t
    times["collective_s"], times["collective_calls"] = clock.seconds, clock.calls
    times["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return times


def bench_fit(args) -> dict:
    from sdm_mlx.storage.datasets import factcheck_splits
    from sdm_mlx.estimator import SDMEstimator

    pool, heldout, _ = factcheck_splits()
    est = SDMEstimator(iterations=args.iterations, epochs=args.epochs, exemplar_dim=args.exemplar_dim,
                       learning_rate=1e-3, rescaler_max_epochs=40, patience=None)
    with _CollectiveClock() as clock:
        t = time.perf_counter()
        est.fit(pool.X, pool.y, ids_train=pool.ids)
        fit_s = time.perf_counter() - t
        t = time.perf_counter()
        est.estimate(heldout.X)
        estimate_s = time.perf_counter() - t
    return {"fit_s": fit_s, "estimate_s": estimate_s, "collective_s": clock.seconds,
            "collective_calls": clock.calls, "support_rows": len(est.support_ids_),
            "heldout_rows": int(heldout.X.shape[0]),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["index", "fit"])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=1000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--exemplar-dim", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="append the report as one JSON line to this file")
    args = p.parse_args()
    result = bench_index(args) if args.mode == "index" else bench_fit(args)
    keys = sorted(result)
    every = dist.all_gather_rows(np.array([float(result[k]) for k in keys]), "gathering the report")
    if not dist.is_primary():
        return 0
    report = {"mode": args.mode, "ranks": dist.size(),
              **({"rows": args.rows, "dim": args.dim, "queries": args.queries} if args.mode == "index" else
                 {"epochs": args.epochs, "iterations": args.iterations, "exemplar_dim": args.exemplar_dim}),
              "per_rank": {k: [round(float(v), 4) for v in every[:, i]] for i, k in enumerate(keys)}}
    line = json.dumps(report)
    print(line)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
