"""Benchmark: the exact support index and hnswlib at 100k, 1M and 4M support rows (docs/scale.md).

    python tools/bench/bench_scale.py [--sizes 100000 1000000 4000000] [--dims 1000 128] [--queries 256]
                                [--data-dir DIR] [--shard-rows 1000000] [--hnsw-max-cells 2e8] [--lock FILE]
                                [--json out.json] [--markdown docs/scale_table.md] [--sharded 2]
    python tools/bench/bench_scale.py --smoke        # seconds: 3000 rows, dims 64 and 16

Data: random but structured exemplar vectors — 64 cluster centres per class (2 classes), each row a
centre plus Gaussian noise of random scale, 10% label noise, and a support-set prediction that is
right 85% of the time — so q (the run of good neighbours) is non-trivial.  ``--dims`` gives the
exemplar width: M = 1000, and a D < M case (the exact index then works on D-dim coordinates).

Each configuration runs in its own child process (clean RSS / MLX peaks).  The support is written
once, chunk by chunk, to a float32 ``.npy`` file in ``--data-dir`` and memory-mapped, never held
twice: the exact index is built on shards of at most ``--shard-rows`` rows, one shard at a time
(each query batch is searched shard after shard and the shards' answers merged: d0 is the minimum,
the top-n neighbours merge by (distance, support index)).  A 4M × 1000 float32 support is 16 GB
on disk: a 1M-row shard holds 4 GB in MLX (8 GB while it is built), so that is the memory bound.
q at one shard is the index's own; over several shards it is the run of good neighbours in the
merged top-n (exact whenever q < n; the rows where q reaches n are counted).

Reported per configuration: build time (exact: per shard, summed; hnswlib: M=16, ef_construction
200), peak RSS and MLX peak memory, query throughput (rows/s) of the exact index (similarity +
top-n neighbours, query batches of ``--query-batch`` rows, distance blocks of
``DISTANCE_BLOCK_BYTES``) and of hnswlib (ef = 64, raised to k), and hnswlib's agreement with exact:
recall@n of the neighbours, fraction of rows with the same q and the same d0 (to 1e-5 relative: hnswlib's distances are float32 sums, the exact index's are
float64 rounded to float32).  Runs of more than
~4 GB must be wrapped in ``flock /work/briefs/bigmem.lock`` on the shared machine.

``--sharded R``: also run the exact index sharded over R ranks under ``mlx.launch`` (ring backend, local
hosts), if this checkout has ``sdm_mlx.index.sharded``; otherwise the column says why it is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLASSES = 2
CENTRES_PER_CLASS = 64


# ---------------------------------------------------------------------------------------------
# data
def make_support(path: Path, rows: int, dim: int, seed: int = 0, chunk: int = 65536):
    """Write the structured support (float32 .npy) and its labels / predictions (.npz); returns paths."""
    import numpy as np

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(CLASSES * CENTRES_PER_CLASS, dim)).astype(np.float32)
    centre_class = np.repeat(np.arange(CLASSES), CENTRES_PER_CLASS)
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim))
    labels = np.empty(rows, np.int64)
    for a in range(0, rows, chunk):
        b = min(a + chunk, rows)
        which = rng.integers(0, centres.shape[0], b - a)
        noise = rng.standard_normal((b - a, dim), dtype=np.float32)
        noise *= rng.uniform(0.6, 1.4, (b - a, 1)).astype(np.float32)
        mm[a:b] = centres[which] + noise
        labels[a:b] = centre_class[which]
    mm.flush()
    del mm
    flip = rng.random(rows) < 0.10
    labels = np.where(flip, 1 - labels, labels)
    preds = np.where(rng.random(rows) < 0.85, labels, 1 - labels)
    np.savez(path.with_suffix(".labels.npz"), labels=labels, predictions=preds, centres=centres)
    return path


def queries_for(path: Path, n: int, seed: int = 1):
    """n queries from the same clusters, and their predicted class ŷ."""
    import numpy as np

    meta = np.load(path.with_suffix(".labels.npz"))
    centres = meta["centres"]
    rng = np.random.default_rng(seed)
    which = rng.integers(0, centres.shape[0], n)
    q = (centres[which] + rng.standard_normal((n, centres.shape[1]), dtype=np.float32)).astype(np.float32)
    y_hat = which // CENTRES_PER_CLASS
    return q, y_hat.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# one configuration (child process)
def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: reset at exec, unlike ru_maxrss, which a child inherits)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024.0 if sys.platform != "darwin" else 2**20)


class AnonPeak:
    """Peak anonymous RSS (RssAnon, sampled every 0.1 s by a thread): memory not backed by the mapped file."""

    def __init__(self):
        import threading

        self.peak_kb, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                with open("/proc/self/status") as f:
                    for line in f:
                        if line.startswith("RssAnon:"):
                            self.peak_kb = max(self.peak_kb, int(line.split()[1]))
            except OSError:
                return

    def mb(self) -> float:
        return self.peak_kb / 1024.0


def exact_sharded(support, good, queries, y_hat, k, n, shard_rows, query_batch):
    """(q, d0, top-n d, top-n i, build s, query s, shards) of the exact index built shard by shard."""
    import mlx.core as mx
    import numpy as np

    from sdm_mlx.index import ExactIndex, similarity_from_neighbours

    rows = support.shape[0]
    best_d = np.full((queries.shape[0], n), np.inf, np.float32)
    best_i = np.full((queries.shape[0], n), -1, np.int64)
    q_single = None
    build = query = 0.0
    bounds = [(a, min(a + shard_rows, rows)) for a in range(0, rows, shard_rows)]
    for a, b in bounds:
        t = time.perf_counter()
        index = ExactIndex(support[a:b])
        index.similarity(queries[:1], y_hat[:1], good[:, a:b], k)  # builds the class grouping of the support
        build += time.perf_counter() - t
        t = time.perf_counter()
        parts = [index.similarity_and_neighbours(queries[s : s + query_batch], y_hat[s : s + query_batch],
                                                 good[:, a:b], k, n)
                 for s in range(0, queries.shape[0], query_batch)]
        query += time.perf_counter() - t
        q_part = np.concatenate([p[0] for p in parts])
        d = np.concatenate([best_d, np.concatenate([p[2] for p in parts])], axis=1)
        i = np.concatenate([best_i, np.concatenate([p[3] for p in parts]) + a], axis=1)
        i = np.where(np.isfinite(d), i, np.iinfo(np.int64).max)
        order = np.lexsort((i, d), axis=-1)[:, :n]
        best_d, best_i = np.take_along_axis(d, order, 1), np.take_along_axis(i, order, 1)
        best_i[~np.isfinite(best_d)] = -1
        q_single = q_part if len(bounds) == 1 else None
        del index, parts
        mx.clear_cache()
    q_merged = np.minimum(similarity_from_neighbours(best_i, y_hat, good), k)
    q = q_single if q_single is not None else q_merged
    return q, q_merged, best_d[:, 0], best_d, best_i, build, query, len(bounds)


def hnsw_run(support, good, queries, y_hat, ks, n, threads):
    """hnswlib build, then for each k of ``ks``: (q, d0, top-n indices, query seconds)."""
    import numpy as np

    from sdm_mlx.index import HnswIndex

    t = time.perf_counter()
    index = HnswIndex(np.asarray(support), num_threads=threads)
    build = time.perf_counter() - t
    runs = []
    for k in ks:
        t = time.perf_counter()
        q, d0, top_d, top_i = index.similarity_and_neighbours(queries, y_hat, good, k, n)
        runs.append((q, d0, top_i, time.perf_counter() - t))
    return build, runs


def run_one(cfg: dict) -> dict:
    """One (rows, dim) configuration: exact (sharded in-process) and, up to a size, hnswlib."""
    import sdm_mlx  # noqa: F401  (OpenBLAS before MLX)
    import mlx.core as mx
    import numpy as np

    from sdm_mlx.index import good_neighbours_by_class

    path = Path(cfg["path"])
    support = np.load(path, mmap_mode="r")
    meta = np.load(path.with_suffix(".labels.npz"))
    good = good_neighbours_by_class(meta["labels"], meta["predictions"], CLASSES)
    k = int(np.bincount(meta["labels"]).max())  # the paper's k: the largest class count
    queries, y_hat = queries_for(path, cfg["queries"])
    n = cfg["neighbours"]
    anon = AnonPeak()
    mx.reset_peak_memory()
    q, q_merged, d0, top_d, top_i, build, query, shards = exact_sharded(
        support, good, queries, y_hat, k, n, cfg["shard_rows"], cfg["query_batch"])
    out = {
        "rows": int(support.shape[0]), "dim": int(support.shape[1]), "queries": int(queries.shape[0]),
        "k": k, "neighbours": n, "exact": {
            "shards": shards, "shard_rows": cfg["shard_rows"], "build_s": build, "query_s": query,
            "rows_per_s": queries.shape[0] / query, "q_median": float(np.median(q)),
            "q_reaches_n_rows": int((q_merged >= n).sum()),
            "peak_rss_mb": _peak_rss_mb(), "peak_anon_rss_mb": anon.mb(), "mlx_peak_mb": mx.get_peak_memory() / 2**20,
            "q": q.tolist(), "d0": d0.tolist(),
        },
    }
    if shards == 1:
        capped = q_merged < n
        out["exact"]["merged_q_matches_index_q"] = bool(np.array_equal(q[capped], q_merged[capped]))
    if support.shape[0] * support.shape[1] <= cfg["hnsw_max_cells"]:
        paper_k = support.shape[0] <= cfg["hnsw_paper_k_max_rows"]
        ks = [cfg["hnsw_k"], k] if paper_k else [cfg["hnsw_k"]]
        hbuild, runs = hnsw_run(support, good, queries, y_hat, ks, n, cfg["threads"])
        (hq_small, hd0_small, hi_small, hquery_small) = runs[0]
        hq, hd0, hi, hquery = runs[-1]
        recall = np.mean([len(set(a[a >= 0]) & set(b[b >= 0])) / max(1, (b >= 0).sum()) for a, b in zip(hi, top_i)])
        exact_small = np.minimum(q, cfg["hnsw_k"])
        out["hnsw"] = {
            "paper_k_queried": paper_k,
            "build_s": hbuild, "query_s": hquery if paper_k else None,
            "rows_per_s": queries.shape[0] / hquery if paper_k else None,
            "small_k": cfg["hnsw_k"], "small_k_rows_per_s": queries.shape[0] / hquery_small,
            "small_k_same_q_capped": float((hq_small == exact_small).mean()),
            "recall_at_n": float(recall), "same_q": float((hq == q).mean()) if paper_k else None,
            "same_d0": float((np.abs(hd0 - d0) <= 1e-5 * np.maximum(d0, 1e-30)).mean()),
            "d0_bitwise_equal": float((hd0 == d0).mean()),
            "d0_rel_err_max": float(np.max(np.abs(hd0 - d0) / np.maximum(d0, 1e-30))),
            "peak_rss_mb": _peak_rss_mb(), "peak_anon_rss_mb": anon.mb(),
        }
    else:
        out["hnsw"] = {"skipped": f"rows x dim above --hnsw-max-cells {cfg['hnsw_max_cells']:.3g}"}
    return out


# ---------------------------------------------------------------------------------------------
# sharded over ranks (mlx.launch)
def run_sharded(cfg: dict) -> dict:
    """Rank body under mlx.launch: ShardedExactIndex over the memory-mapped support; rank 0 reports."""
    import sdm_mlx  # noqa: F401
    import mlx.core as mx
    import numpy as np

    from sdm_mlx.index import good_neighbours_by_class
    from sdm_mlx.index.sharded import ShardedExactIndex

    group = mx.distributed.init()
    path = Path(cfg["path"])
    support = np.load(path, mmap_mode="r")
    meta = np.load(path.with_suffix(".labels.npz"))
    good = good_neighbours_by_class(meta["labels"], meta["predictions"], CLASSES)
    k = int(np.bincount(meta["labels"]).max())
    queries, y_hat = queries_for(path, cfg["queries"])
    t = time.perf_counter()
    index = ShardedExactIndex.from_full(support, group=group)
    build = time.perf_counter() - t
    t = time.perf_counter()
    parts = [index.similarity_and_neighbours(queries[s : s + cfg["query_batch"]], y_hat[s : s + cfg["query_batch"]],
                                             good, k, cfg["neighbours"])
             for s in range(0, queries.shape[0], cfg["query_batch"])]
    query = time.perf_counter() - t
    report = {"ranks": group.size(), "build_s": build, "query_s": query, "rows_per_s": queries.shape[0] / query,
              "peak_rss_mb_rank": _peak_rss_mb(), "q": np.concatenate([p[0] for p in parts]).tolist(),
              "d0": np.concatenate([p[1] for p in parts]).tolist()}
    return report if group.rank() == 0 else {}


def sharded_column(cfg: dict, ranks: int) -> dict:
    try:
        import sdm_mlx.index.sharded  # noqa: F401
    except ImportError:
        return {"skipped": "sdm_mlx.index.sharded is not in this checkout"}
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = [launcher, "-n", str(ranks), "--backend", "ring", "--python", sys.executable, __file__,
               "--rank-config", json.dumps({**cfg, "out": str(out)})]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.get("timeout", 7200))
        if run.returncode != 0 or not out.exists():
            return {"failed": run.stderr[-2000:]}
        return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------
# driver
def child(cfg: dict, lock: str | None = None) -> dict:
    """Run one configuration in a fresh process (under ``flock lock`` when given and the configuration
    may take more than ~4 GB); its JSON comes back on stdout's last line."""
    cmd = [sys.executable, __file__, "--one-config", json.dumps(cfg)]
    if lock and estimated_bytes(cfg) > 4 * 2**30:
        cmd = ["flock", lock] + cmd
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.get("timeout", 7200))
    if run.returncode != 0:
        raise RuntimeError(f"configuration {cfg['rows']} x {cfg['dim']} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def estimated_bytes(cfg: dict) -> int:
    """Peak memory estimate: a shard twice (building the centred MLX copy) plus hnswlib's copy."""
    shard = min(cfg["rows"], cfg["shard_rows"]) * cfg["dim"] * 4
    hnsw = cfg["rows"] * (cfg["dim"] * 4 + 200) if cfg["rows"] * cfg["dim"] <= cfg["hnsw_max_cells"] else 0
    return 2 * shard + hnsw


def markdown(results: list[dict], header: dict) -> str:
    lines = [
        f"Machine: {header['machine']}, {header['cpu_count']} cores; BLAS: {header['blas']}; "
        f"load average at start {header['load_average_start']}, at end {header['load_average_end']}.",
        "",
        "| support rows | dim | exact build s | exact rows/s | peak RSS MB (anon) | MLX peak MB | shards | "
        "hnsw build s | hnsw rows/s (k) | hnsw rows/s (small k) | hnsw recall@n | hnsw same q | hnsw same d0 (1e-5) | "
        "sharded rows/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        e, h, s = r["exact"], r["hnsw"], r.get("sharded", {})
        small = (f"{h['small_k_rows_per_s']:.0f} (k={h['small_k']}, same capped q {h['small_k_same_q_capped']:.3f})"
                 if "small_k_rows_per_s" in h else "not run")
        hn = ("skipped", "", "", "", "", "") if "skipped" in h else (
            f"{h['build_s']:.1f}", f"{h['rows_per_s']:.1f}" if h.get("rows_per_s") else "not run", small,
            f"{h['recall_at_n']:.3f}", f"{h['same_q']:.3f}" if h.get("same_q") is not None else "", f"{h['same_d0']:.3f}")
        sh = (f"{s['rows_per_s']:.0f} (same q {s['same_q_as_exact']:.3f}, d0 {s['same_d0_as_exact']:.3f})"
              if "same_q_as_exact" in s else f"{s['rows_per_s']:.0f}") if "rows_per_s" in s else (s.get("skipped") or "failed" if s else "not run")
        anon = f" ({e['peak_anon_rss_mb']:.0f})" if "peak_anon_rss_mb" in e else ""
        lines.append(f"| {r['rows']:,} | {r['dim']} | {e['build_s']:.1f} | {e['rows_per_s']:.1f} | "
                     f"{e['peak_rss_mb']:.0f}{anon} | {e['mlx_peak_mb']:.0f} | {e['shards']} | "
                     + " | ".join(hn) + f" | {sh} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 4_000_000])
    ap.add_argument("--dims", type=int, nargs="+", default=[1000, 128], help="exemplar widths (M, and D < M)")
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--query-batch", type=int, default=256)
    ap.add_argument("--neighbours", type=int, default=32, help="top-n neighbours per query")
    ap.add_argument("--shard-rows", type=int, default=1_000_000, help="rows per in-process exact shard")
    ap.add_argument("--hnsw-max-cells", type=float, default=2e8,
                    help="skip hnswlib when rows x dim exceeds this (its build is the slow part: ~290 s at 100k x 1000 "
                         "on 2 shared cores)")
    ap.add_argument("--hnsw-paper-k-max-rows", type=int, default=100_000,
                    help="query hnswlib with the paper's k (the largest class count) only up to this many rows: "
                         "ef is raised to k, 4 rows/s at 100k x 1000")
    ap.add_argument("--lock", help="run configurations of more than ~4 GB under `flock LOCK` (shared machines)")
    ap.add_argument("--threads", type=int, default=2, help="hnswlib threads")
    ap.add_argument("--hnsw-k", type=int, default=128,
                    help="also query hnswlib with this k (q capped at k) next to the paper's k")
    ap.add_argument("--data-dir", default=None, help="where the memory-mapped supports go (default: a temp dir)")
    ap.add_argument("--keep-data", action="store_true", help="keep the generated supports")
    ap.add_argument("--sharded", type=int, default=0, help="also run the exact index over this many ranks")
    ap.add_argument("--smoke", action="store_true", help="3000 rows, dims 64 and 16, 32 queries (seconds)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--markdown", help="write the markdown table here")
    ap.add_argument("--one-config", help=argparse.SUPPRESS)
    ap.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one_config:
        print(json.dumps(run_one(json.loads(args.one_config))))
        return 0
    if args.rank_config:
        cfg = json.loads(args.rank_config)
        report = run_sharded(cfg)
        if report:
            Path(cfg["out"]).write_text(json.dumps(report))
        return 0
    if args.smoke:
        args.sizes, args.dims, args.queries, args.query_batch, args.shard_rows = [3000], [64, 16], 32, 16, 2000
    return drive(args)


def drive(args) -> int:
    import sdm_mlx  # noqa: F401
    from sdm_mlx.runtime.blas import describe_blas

    header = {"machine": platform.platform(), "cpu_count": os.cpu_count(), "blas": describe_blas(),
              "load_average_start": [round(x, 2) for x in os.getloadavg()], "smoke": bool(args.smoke)}
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="sdm_scale_"))
    data_dir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for dim in args.dims:
            for rows in args.sizes:
                path = data_dir / f"support_{rows}x{dim}.npy"
                t = time.perf_counter()
                if not path.exists() or not path.with_suffix(".labels.npz").exists():
                    make_support(path, rows, dim)
                cfg = {"path": str(path), "rows": rows, "dim": dim, "queries": args.queries,
                       "query_batch": args.query_batch, "neighbours": args.neighbours,
                       "shard_rows": args.shard_rows, "hnsw_max_cells": args.hnsw_max_cells, "threads": args.threads,
                       "hnsw_k": args.hnsw_k, "hnsw_paper_k_max_rows": args.hnsw_paper_k_max_rows}
                print(f"[{rows} x {dim}] data ready in {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
                r = child(cfg, args.lock)
                if args.sharded:
                    r["sharded"] = sharded_column(cfg, args.sharded)
                    if "q" in r["sharded"]:
                        sq, sd = r["sharded"].pop("q"), r["sharded"].pop("d0")
                        r["sharded"]["same_q_as_exact"] = sum(a == b for a, b in zip(sq, r["exact"]["q"])) / len(sq)
                        r["sharded"]["same_d0_as_exact"] = sum(a == b for a, b in zip(sd, r["exact"]["d0"])) / len(sd)
                results.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
                if not args.keep_data:
                    path.unlink()
                    path.with_suffix(".labels.npz").unlink()
    finally:
        if not args.keep_data and not args.data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
    header["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    table = markdown(results, header)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({**header, "results": results}, indent=2))
        print(f"wrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
