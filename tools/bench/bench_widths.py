"""Benchmark: training and prediction of sdm_mlx against the author's PyTorch package reexpress-sdm at the widths
LLM features have (docs/performance.md, "Training the estimator at the widths of LLM features").

    python tools/bench/bench_widths.py --reexpress-python /work/peer-venv/bin/python   # D ∈ {32, 384, 3072}, C ∈ {2, 4}
    python tools/bench/bench_widths.py --dims 384 3072 --classes 4 2 --pairs --json w.json  # (384, 4) and (3072, 2)
    python tools/bench/bench_widths.py --dims 32 --classes 2 --epochs 2 --J 1           # sdm_mlx alone (no peer)

Synthetic Gaussian-mixture data (``synthetic``: K sub-clusters per class in a random L-dimensional subspace of
R^D, ambient noise, 0.5 % label noise; the held-out sub-cluster of each class is the shifted set), N rows of
training and N of calibration, 1,000 in-distribution test rows and 1,000 shifted ones; or ``--data`` files
with the acceptance check's keys (train_X, train_y, cal_X, cal_y, test_X, test_y, shift_X, shift_y).

Each package runs in its own process, one after the other, the order alternating from one configuration to
the next (both see the same box; the load average before and after each run is recorded): sdm_mlx through
this script's ``--worker`` mode, reexpress-sdm through ``tools/peer/reexpress_worker.py`` in the Python given by
``--reexpress-python`` (a venv with ``pip install torch==2.13.0 reexpress-sdm==0.4.8``; torch threads
``--threads``).  Both train with J rounds × epochs at the same learning rate and M, the other settings each
package's defaults (the acceptance check's: reexpress batch 64, 2,048 neighbours).  Reported per run: training
wall and CPU seconds, prediction wall and CPU seconds (the test and the shifted set, one call each; reexpress
``SDMModel.score(nearest_exemplars=0)``, sdm_mlx ``SDMEstimator.estimate``), the process's peak RSS, the BLAS
each uses, and the two ratios peer / ours.  A benchmark, not a test: reexpress-sdm is an optional dependency
that CI never installs.
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

import numpy as np

TOOLS = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# data
def synthetic(path: Path, dim: int, classes: int, n: int = 2000, n_eval: int = 1000, seed: int = 0,
              latent: int = 16, subclusters: int = 4, sep: float = 1.0, noise: float = 0.6, ambient: float = 0.15,
              label_noise: float = 0.005) -> Path:
    """A Gaussian mixture in a random latent subspace (module doc), written as the acceptance check's .npz keys."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((dim, latent)))[0] if dim >= latent else np.eye(dim, latent)
    means = sep * rng.standard_normal((classes, subclusters, latent))

    def draw(rows, heldout=False):
        y = rng.integers(0, classes, rows)
        k = np.full(rows, subclusters - 1) if heldout else rng.integers(0, subclusters - 1, rows)
        z = means[y, k] + noise * rng.standard_normal((rows, latent))
        x = z @ basis.T + ambient * rng.standard_normal((rows, dim)) + 0.05
        flip = rng.random(rows) < label_noise
        y = np.where(flip, (y + rng.integers(1, classes, rows)) % classes, y)
        return x.astype(np.float32), y.astype(np.int64)

    splits = {"train": draw(n), "cal": draw(n), "test": draw(n_eval), "shift": draw(n_eval, heldout=True)}
    np.savez(path, **{f"{s}_{a}": v for s, xy in splits.items() for a, v in zip("Xy", xy)})
    return path


# ---------------------------------------------------------------------------------------------
# sdm_mlx side: ``--worker data.npz`` runs in its own process and prints one JSON line
def worker(args) -> int:
    import sdm_mlx  # noqa: F401  (before mlx: loads OpenBLAS on Linux)
    from sdm_mlx.estimator import SDMEstimator
    from sdm_mlx.runtime.blas import describe_blas

    d = np.load(args.worker)
    t, cpu = time.perf_counter(), time.process_time()
    est = SDMEstimator(alpha=args.alpha, iterations=args.J, epochs=args.epochs, learning_rate=args.lr,
                       exemplar_dim=args.exemplar_dim, seed=0)
    est.fit(d["train_X"], d["train_y"], d["cal_X"], d["cal_y"])
    train_s, train_cpu = time.perf_counter() - t, time.process_time() - cpu
    out = {"train_s": train_s, "train_cpu_s": train_cpu, "blas": describe_blas(), "predict": {},
           "rescaler_epochs": [r.rescaler.epochs_run for r in est.rounds_ if r.rescaler is not None],
           "epochs_run": [s["epochs_run"] for s in est.round_summaries_]}
    for key in ("test", "shift"):
        X = d[f"{key}_X"]
        t, cpu = time.perf_counter(), time.process_time()
        res = est.estimate(X)
        out["predict"][key] = {"rows": int(X.shape[0]), "seconds": time.perf_counter() - t,
                               "cpu_seconds": time.process_time() - cpu, "admitted": int(res.admitted.sum()),
                               "accuracy": float((np.asarray(est.classes_)[res.prediction] == d[f"{key}_y"]).mean())}
    print(json.dumps(out), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# the driver
def _wait(proc) -> tuple[int, float]:
    """(exit code, peak RSS in MB) of a finished child (``os.wait4``: the child's own maximum)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024


def run_ours(data: Path, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(data), "--J", str(args.J), "--epochs",
           str(args.epochs), "--lr", repr(args.lr), "--exemplar-dim", str(args.exemplar_dim), "--alpha", repr(args.alpha)]
    load = os.getloadavg()[0]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    code, rss = _wait(proc)
    if code != 0:
        raise RuntimeError(f"sdm_mlx worker failed (exit {code})")
    r = json.loads(out.strip().splitlines()[-1])
    r.update(peak_rss_mb=rss, load=[load, os.getloadavg()[0]],
             predict_s=sum(p["seconds"] for p in r["predict"].values()),
             predict_cpu_s=sum(p["cpu_seconds"] for p in r["predict"].values()))
    return r


def run_peer(data: Path, args, work: Path) -> dict:
    load = os.getloadavg()[0]
    proc = subprocess.Popen([args.reexpress_python, str(TOOLS / "peer" / "reexpress_worker.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(**command):
        proc.stdin.write(json.dumps(command) + "\n")
        proc.stdin.flush()
        answer = json.loads(proc.stdout.readline())
        if "error" in answer:
            raise RuntimeError(f"reexpress worker, {command['cmd']}: {answer['error']}")
        return answer

    # the worker reads X_train, y_train, X_cal, y_cal and the query matrices by these names
    peer_data = work / f"peer_{data.name}"
    d = np.load(data)
    np.savez(peer_data, X_train=d["train_X"], y_train=d["train_y"], X_cal=d["cal_X"], y_cal=d["cal_y"],
             X_test=d["test_X"], X_shift=d["shift_X"])
    info = ask(cmd="info", threads=args.threads)
    model = str(work / f"peer_{data.stem}.sdmkitmodel")  # one per data set: the peer refuses to overwrite
    train = ask(cmd="train", data=str(peer_data), out=model, epochs=args.epochs, iterations=args.J,
                exemplar_dim=args.exemplar_dim, batch_size=64, learning_rate=args.lr, max_neighbors=2048, seed=0)
    ask(cmd="load", model=model)
    scored = ask(cmd="score_time", data=str(peer_data), keys=["X_test", "X_shift"])
    proc.stdin.close()
    code, rss = _wait(proc)
    return {"train_s": train["train_s"], "train_cpu_s": train["train_cpu_s"], "info": info,
            "predict_s": sum(v["seconds"] for v in scored.values()),
            "predict_cpu_s": sum(v["cpu_seconds"] for v in scored.values()), "peak_rss_mb": rss,
            "load": [load, os.getloadavg()[0]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--reexpress-python", default=os.environ.get("SDM_MLX_REEXPRESS_PYTHON"),
                    help="Python of a venv with reexpress-sdm 0.4.8 and torch (env SDM_MLX_REEXPRESS_PYTHON); "
                         "without it sdm_mlx runs alone")
    ap.add_argument("--dims", type=int, nargs="+", default=[32, 384, 3072])
    ap.add_argument("--classes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--pairs", action="store_true", help="zip --dims with --classes instead of every combination")
    ap.add_argument("--data", nargs="+", type=Path, help="use these .npz files (the check's keys) instead")
    ap.add_argument("--rows", type=int, default=2000, help="N: training rows and calibration rows each")
    ap.add_argument("--J", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--exemplar-dim", type=int, default=1000)
    ap.add_argument("--alpha", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the peer")
    ap.add_argument("--peer-first", action="store_true", help="start with the peer (then alternate)")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    import sdm_mlx  # noqa: F401
    from sdm_mlx.runtime.blas import describe_blas

    report = {"machine": platform.platform(), "cpu_count": os.cpu_count(), "sdm_mlx_blas": describe_blas(),
              "settings": {k: getattr(args, k) for k in ("rows", "J", "epochs", "lr", "exemplar_dim", "alpha",
                                                         "threads")},
              "load_average_start": os.getloadavg(), "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.data:
            configs = [(None, None, p) for p in args.data]
        else:
            shapes = (list(zip(args.dims, args.classes)) if args.pairs
                      else [(d, c) for d in args.dims for c in args.classes])
            configs = [(d, c, None) for d, c in shapes]
        peer_first = args.peer_first
        for dim, classes, path in configs:
            path = path or synthetic(work / f"syn_d{dim}_c{classes}.npz", dim, classes, n=args.rows)
            with np.load(path) as d:
                dim, classes = int(d["train_X"].shape[1]), int(max(d["train_y"].max(), d["cal_y"].max()) + 1)
            row = {"dim": dim, "classes": classes, "data": path.name}
            order = ["peer", "ours"] if peer_first else ["ours", "peer"]
            for who in order:
                if who == "ours":
                    row["sdm_mlx"] = run_ours(path, args)
                elif args.reexpress_python:
                    row["reexpress_sdm"] = run_peer(path, args, work)
            if "reexpress_sdm" in row:
                o, p = row["sdm_mlx"], row["reexpress_sdm"]
                row["train_ratio"] = p["train_s"] / o["train_s"]
                row["predict_ratio"] = p["predict_s"] / o["predict_s"]
            row["order"] = order
            report["results"].append(row)
            print(_line(row), flush=True)
            peer_first = not peer_first  # alternate the order from one configuration to the next
    report["load_average_end"] = os.getloadavg()
    print("\n" + table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def _run_text(r: dict) -> str:
    return (f"train {r['train_s']:.1f} s ({r['train_cpu_s']:.0f} CPU s), predict {r['predict_s']:.2f} s "
            f"({r['predict_cpu_s']:.2f} CPU s), peak RSS {r['peak_rss_mb']:.0f} MB, load {r['load'][0]:.1f}"
            f"->{r['load'][1]:.1f}")


def _line(row: dict) -> str:
    text = f"D={row['dim']} C={row['classes']}: sdm_mlx {_run_text(row['sdm_mlx'])}"
    if "reexpress_sdm" in row:
        text += (f" | reexpress-sdm {_run_text(row['reexpress_sdm'])} | train {row['train_ratio']:.2f}x, "
                 f"predict {row['predict_ratio']:.2f}x")
    return text


def table(report: dict) -> str:
    """The report as a Markdown table (docs/performance.md)."""
    head = ("| D | C | sdm_mlx train s (CPU s) | peer train s (CPU s) | train peer/ours | sdm_mlx predict s (CPU s) "
            "| peer predict s (CPU s) | predict peer/ours | peak RSS ours / peer (MB) | load (ours; peer) |")
    lines = [head, "|" + "---|" * 10]
    for row in report["results"]:
        o, p = row["sdm_mlx"], row.get("reexpress_sdm")
        cell = lambda r, k: f"{r[k + '_s']:.1f} ({r[k + '_cpu_s']:.0f})" if r else "—"  # noqa: E731
        pcell = lambda r: f"{r['predict_s']:.2f} ({r['predict_cpu_s']:.2f})" if r else "—"  # noqa: E731
        load = lambda r: f"{r['load'][0]:.1f}–{r['load'][1]:.1f}" if r else "—"  # noqa: E731
        lines.append(f"| {row['dim']} | {row['classes']} | {cell(o, 'train')} | {cell(p, 'train')} | "
                     f"{row.get('train_ratio', float('nan')):.2f}× | {pcell(o)} | {pcell(p)} | "
                     f"{row.get('predict_ratio', float('nan')):.2f}× | {o['peak_rss_mb']:.0f} / "
                     f"{p['peak_rss_mb'] if p else float('nan'):.0f} | {load(o)}; {load(p)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
