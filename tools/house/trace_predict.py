"""Trace one ``sdm-mlx predict`` of 50 rows on a tiny model: which ``sdm_mlx`` modules it runs, and how many
calls go from one ``sdm_mlx`` module into another (docs/architecture.md reports the counts).

Usage::

    python tools/house/trace_predict.py [--rows 50] [--work runs/trace_predict] [--json]

A tiny estimator (6 features, 2 classes, 2 epochs) is trained once by a ``sdm-mlx train`` subprocess (not
traced); then ``sdm_mlx.cli.main(["predict", ...])`` runs twice in this process, the second time under
:func:`sys.setprofile` (the first run imports what ``predict`` imports lazily; ``--cold`` traces the first run
instead, imports included).  A module counts when
one of its functions runs (a module body run by an import counts too); a cross-module call is a Python call
whose caller and callee are both ``sdm_mlx`` functions of different modules.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np

TINY = ["--epochs", "2", "--iterations", "1", "--exemplar-dim", "8", "--rescaler-max-epochs", "20", "--quiet"]


def _write_rows(path: Path, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            y = i % 2
            f.write(json.dumps({"id": i, "label": y, "embedding": (rng.normal(size=6) + 3 * y).round(4).tolist()})
                    + "\n")
    return str(path)


def _module(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == "sdm_mlx" or name.startswith("sdm_mlx.") else None


def trace(argv: list[str]) -> dict:
    """Run ``sdm_mlx.cli.main(argv)`` under a profiler: ``{modules, cross_module_calls, per_module, rc}``."""
    import sdm_mlx.cli

    seen: Counter = Counter()
    edges: Counter = Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = _module(frame)
        if callee is None:
            return
        seen[callee] += 1
        caller = _module(frame.f_back) if frame.f_back is not None else None
        if caller is not None and caller != callee:
            edges[(caller, callee)] += 1

    sys.setprofile(profile)
    try:
        rc = sdm_mlx.cli.main(argv)
    finally:
        sys.setprofile(None)
    return {"rc": rc, "modules": len(seen), "cross_module_calls": sum(edges.values()),
            "per_module": dict(sorted(seen.items())),
            "edges": {f"{a} -> {b}": n for (a, b), n in sorted(edges.items())}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=50)
    p.add_argument("--work", default="runs/trace_predict", help="directory for the model and the rows")
    p.add_argument("--cold", action="store_true", help="trace the first run of the process (imports included)")
    p.add_argument("--json", action="store_true", help="print the per-module counts and edges as JSON too")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "model").exists():
        _write_rows(work / "train.jsonl", 80, 0)
        subprocess.run([sys.executable, "-m", "sdm_mlx", "train", "--train", str(work / "train.jsonl"), "--output",
                        str(work / "model"), "--features", "embedding", "--alpha", "0.6", *TINY], check=True)
    rows = _write_rows(work / f"test{args.rows}.jsonl", args.rows, 1)
    argv = ["predict", "--model", str(work / "model"), "--input", rows, "--output", str(work / "out.jsonl"), "--quiet"]
    if not args.cold:
        import sdm_mlx.cli

        sdm_mlx.cli.main(argv)
    out = trace(argv)
    print(f"{out['modules']} sdm_mlx modules, {out['cross_module_calls']} cross-module calls (rc {out['rc']})")
    if args.json:
        print(json.dumps(out, indent=1))
    return 0 if out["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
