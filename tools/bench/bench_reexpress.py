"""Benchmark: prediction throughput of sdm_mlx vs the author's PyTorch package reexpress-sdm (docs/performance.md).

    python tools/bench/bench_reexpress.py --reexpress-python /path/to/venv/bin/python [--data factcheck random]
    python tools/bench/bench_reexpress.py --venv ~/.cache/sdm_mlx_reexpress      # creates it: pip install reexpress-sdm
    python tools/bench/bench_reexpress.py --smoke [--reexpress-python PATH]       # seconds (tiny data)

Both packages are trained on the SAME rows (the embedded factcheck data: its pool split in half into
training and calibration rows, the held-out split as queries; and a random clustered set, ``--random-rows``
rows of ``--random-dim`` features) with the same epochs, rounds (J) and exemplar width M; the other
settings are each package's defaults.  reexpress-sdm runs in its own Python (it needs torch; sdm_mlx
is not imported there) through ``tools/peer/reexpress_worker.py``, on its CPU device.

Prediction = the full per-row result of each package with 5 nearest exemplars: sdm_mlx
``SDMEstimator.estimate`` (q, d0, d, SDM output, p̂_lower / ⊥), reexpress-sdm ``SDMModel.score``
(q, d0, d, SDM output, nested-region estimates).  Timed alternately, package by package, in
``--rounds`` rounds (both processes niced equally by whoever runs this): a batch of ``--batch``
rows, the whole query set, and ``--single-rows`` rows one at a time (median and p90 latency).
Answers compared: agreement of the predicted class, of admission (sdm_mlx admitted at α' vs
reexpress-sdm lower-region α ≥ α'), and the row counts each admits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sdm_mlx  # noqa: F401  (before mlx: loads OpenBLAS on Linux)
import numpy as np

TOOLS = Path(__file__).resolve().parents[1]
REEXPRESS = "reexpress-sdm==0.4.8"


# ---------------------------------------------------------------------------------------------
# the reexpress-sdm side
def reexpress_python(args) -> str | None:
    """The Python with reexpress-sdm: --reexpress-python, else a venv made at --venv, else None."""
    if args.reexpress_python:
        return args.reexpress_python
    if not args.venv:
        return None
    venv = Path(args.venv).expanduser()
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if subprocess.run([str(python), "-c", "import reexpress_sdm, torch"], capture_output=True).returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", REEXPRESS], check=True)
    return str(python)


class Worker:
    """tools/peer/reexpress_worker.py in the reexpress Python: one JSON command → one JSON answer."""

    def __init__(self, python: str):
        self.proc = subprocess.Popen([python, str(TOOLS / "peer" / "reexpress_worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def __call__(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"reexpress worker exited (code {self.proc.poll()}) on {command['cmd']}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"reexpress worker, {command['cmd']}: {answer['error']}")
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---------------------------------------------------------------------------------------------
# data
def factcheck_data(path: Path, limit: int | None = None) -> Path:
    from sdm_mlx.storage.datasets import factcheck_splits

    pool, heldout, _ = factcheck_splits()
    perm = np.random.default_rng(0).permutation(len(pool.y))[:limit]
    h = len(perm) // 2
    np.savez(path, X_train=pool.X[perm[:h]], y_train=pool.y[perm[:h]], X_cal=pool.X[perm[h:]],
             y_cal=pool.y[perm[h:]], X_test=heldout.X, y_test=heldout.y)
    return path


def random_data(path: Path, rows: int, dim: int, test_rows: int = 2000, seed: int = 0) -> Path:
    """Clustered random features: 16 centres per class, 2 classes, 10% label noise."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(32, dim)) * 0.35
    def draw(n):
        which = rng.integers(0, 32, n)
        X = (centres[which] + rng.normal(size=(n, dim))).astype(np.float32)
        y = np.where(rng.random(n) < 0.1, 1 - which // 16, which // 16)
        return X, y.astype(np.int64)
    Xtr, ytr = draw(rows // 2)
    Xc, yc = draw(rows - rows // 2)
    Xt, yt = draw(test_rows)
    np.savez(path, X_train=Xtr, y_train=ytr, X_cal=Xc, y_cal=yc, X_test=Xt, y_test=yt)
    return path


# ---------------------------------------------------------------------------------------------
# timing
def _time_batch(fn, X, batch: int, repeat: int) -> list[float]:
    X = X[np.arange(batch) % X.shape[0]]
    fn(X)
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(X)
        out.append(time.perf_counter() - t)
    return out


def _time_rows(fn, X, rows: int) -> list[float]:
    fn(X[:1])
    out = []
    for i in range(rows):
        x = X[i % X.shape[0]][None, :]
        t = time.perf_counter()
        fn(x)
        out.append(time.perf_counter() - t)
    return out


def _summary(batch_s: dict, rows_s: list[float]) -> dict:
    out = {f"batch_{b}_rows_per_s": b / float(np.median(t)) for b, t in batch_s.items()}
    out.update(single_row_ms_median=float(np.median(rows_s)) * 1e3,
               single_row_ms_p90=float(np.percentile(rows_s, 90)) * 1e3)
    return out


def bench_dataset(name: str, data: Path, work: Path, args, worker) -> dict:
    from sdm_mlx.estimator import SDMEstimator

    d = np.load(data)
    X_test = d["X_test"]
    t = time.perf_counter()
    est = SDMEstimator(alpha=args.alpha, iterations=args.iterations, epochs=args.epochs,
                       exemplar_dim=args.exemplar_dim, n_exemplars=5).fit(d["X_train"], d["y_train"], d["X_cal"],
                                                                           d["y_cal"])
    ours_train = time.perf_counter() - t
    report = {"data": name, "train_rows": int(len(d["y_train"])), "calibration_rows": int(len(d["y_cal"])),
              "query_rows": int(X_test.shape[0]), "features": int(X_test.shape[1]),
              "sdm_mlx": {"train_s": ours_train, "support_rows": int(est.support_vectors_.shape[0])}}
    ours = lambda X: est.estimate(X)  # noqa: E731
    batches = [args.batch, X_test.shape[0]]
    ours_b, rx_b, ours_r, rx_r = {b: [] for b in batches}, {b: [] for b in batches}, [], []
    if worker is not None:
        model = str(work / f"{name}.sdmkitmodel")
        report["reexpress_sdm"] = worker(cmd="train", data=str(data), out=model, epochs=args.epochs,
                                         iterations=args.iterations, exemplar_dim=args.exemplar_dim, batch_size=64,
                                         learning_rate=1e-5, max_neighbors=2048, seed=0)
        worker(cmd="load", model=model)
    for _ in range(args.rounds):  # alternate: one package, then the other, each round
        for b in batches:
            if worker is not None:
                rx_b[b] += worker(cmd="time_batch", data=str(data), key="X_test", batch=b, repeat=1)["seconds"]
            ours_b[b] += _time_batch(ours, X_test, b, 1)
        if worker is not None:
            rx_r += worker(cmd="time_rows", data=str(data), key="X_test", rows=args.single_rows)["seconds"]
        ours_r += _time_rows(ours, X_test, args.single_rows)
    report["sdm_mlx"].update(_summary(ours_b, ours_r))
    pred = est.estimate(X_test)
    report["sdm_mlx"].update(admitted=int(pred.admitted.sum()),
                             accuracy=float((pred.prediction == d["y_test"]).mean()))
    if worker is not None:
        report["reexpress_sdm"].update(_summary(rx_b, rx_r))
        report["comparison"] = compare(worker, data, work / f"{name}_rx_answers.npz", pred, d["y_test"], args.alpha)
        r, o = report["reexpress_sdm"], report["sdm_mlx"]
        report["speedup"] = {**{f"batch_{b}": o[f"batch_{b}_rows_per_s"] / r[f"batch_{b}_rows_per_s"] for b in batches},
                             "single_row_median": r["single_row_ms_median"] / o["single_row_ms_median"],
                             "single_row_p90": r["single_row_ms_p90"] / o["single_row_ms_p90"]}
    return report


def compare(worker, data: Path, out: Path, pred, y_test, alpha: float) -> dict:
    worker(cmd="score", data=str(data), key="X_test", out=str(out), alpha=alpha)
    rx = np.load(out)
    rx_admitted = rx["lower_alpha"] >= alpha
    both = pred.admitted & rx_admitted
    return {
        "same_prediction": float((rx["prediction"] == pred.prediction).mean()),
        "same_admission": float((rx_admitted == pred.admitted).mean()),
        "admitted_sdm_mlx": int(pred.admitted.sum()), "admitted_reexpress": int(rx_admitted.sum()),
        "admitted_by_both": int(both.sum()),
        "reexpress_accuracy": float((rx["prediction"] == y_test).mean()),
        "reexpress_admitted_accuracy": float((rx["prediction"][rx_admitted] == y_test[rx_admitted]).mean())
        if rx_admitted.any() else None,
        "sdm_mlx_admitted_accuracy": float((pred.prediction[pred.admitted] == y_test[pred.admitted]).mean())
        if pred.admitted.any() else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reexpress-python", default=os.environ.get("SDM_MLX_REEXPRESS_PYTHON"),
                    help="Python of a venv with reexpress-sdm and torch (env SDM_MLX_REEXPRESS_PYTHON)")
    ap.add_argument("--venv", help=f"create / reuse a venv here with `pip install {REEXPRESS}`")
    ap.add_argument("--data", nargs="+", default=["factcheck", "random"], choices=["factcheck", "random"])
    ap.add_argument("--random-rows", type=int, default=10_000, help="train + calibration rows of the random set")
    ap.add_argument("--random-dim", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=1, help="J rounds (reexpress: random shuffles)")
    ap.add_argument("--exemplar-dim", type=int, default=1000, help="M for both packages")
    ap.add_argument("--alpha", type=float, default=0.95)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--single-rows", type=int, default=200, help="rows timed one at a time per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="600 factcheck rows, 1 epoch, M = 64 (seconds)")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.data, args.epochs, args.exemplar_dim, args.batch, args.single_rows, args.rounds = \
            ["factcheck"], 1, 64, 64, 10, 1
    python = reexpress_python(args)
    worker = Worker(python) if python else None
    from sdm_mlx.runtime.blas import describe_blas

    report = {"smoke": bool(args.smoke), "machine": platform.platform(), "cpu_count": os.cpu_count(),
              "sdm_mlx_blas": describe_blas(), "load_average_start": os.getloadavg(),
              "openblas_threads_env": os.environ.get("OPENBLAS_NUM_THREADS"),
              "reexpress": worker(cmd="info") if worker else {"skipped": "no --reexpress-python / --venv given"},
              "settings": {k: getattr(args, k) for k in ("epochs", "iterations", "exemplar_dim", "alpha", "batch",
                                                         "single_rows", "rounds")},
              "results": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            for name in args.data:
                data = (factcheck_data(work / "factcheck.npz", 600 if args.smoke else None) if name == "factcheck"
                        else random_data(work / "random.npz", args.random_rows, args.random_dim))
                r = bench_dataset(name, data, work, args, worker)
                report["results"].append(r)
                print(json.dumps(r, indent=1), flush=True)
    finally:
        if worker:
            worker.close()
    report["load_average_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
