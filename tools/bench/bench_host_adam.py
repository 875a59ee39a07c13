"""Benchmark the host W_pos step's dW + Adam pass (``sdm_mlx/network/host_step.py``): split between threads with
each block product on one BLAS thread (what the step does), against the pass before e8af06a (one Python thread,
OpenBLAS's threads inside each of the |V| / 128 block products).

    python tools/bench/bench_host_adam.py [--size qwen15] [--batch 50] [--steps 4] [--repeats 3]
                                          [--modes before threads1 threads2] [--json out.json]

One process, one head-only model of the size (``bench_network.py``: |V| x D random float32 head), the modes
alternating ``--repeats`` times; per measurement ``--steps`` full host steps after one warm-up step, timed whole and
in the pass.  Recorded beside each: the load average and the CPU's user / system / idle / steal shares over the
measurement (``/proc/stat``; steal is the time the hypervisor gave this VM's CPUs to others, which is what stalls a
multi-threaded product's barrier), and the BLAS libraries with their thread counts.  Reported: the median per mode
and the ratios of the medians to ``before``, all from this one run.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

import sdm_mlx  # noqa: E402,F401  (before mlx: OpenBLAS on Linux)
import mlx.core as mx  # noqa: E402
from bench_common import conditions, cpu_times, rss_mb  # noqa: E402
from bench_network import SIZES, _head_only_model  # noqa: E402
from sdm_mlx.network.heads import SDMHeads  # noqa: E402
from sdm_mlx.network.host_step import HostTrainStep  # noqa: E402
from sdm_mlx.network.step import make_optimizer  # noqa: E402
from sdm_mlx.runtime.blas import describe_blas  # noqa: E402


class PassBefore(HostTrainStep):
    """The dW + Adam pass as it was before e8af06a: the step's block loop on the calling thread alone, with the
    BLAS's own threads inside each block product (no :func:`~sdm_mlx.runtime.blas.one_blas_thread`)."""

    def __init__(self, heads, optimizer):
        super().__init__(heads, optimizer, threads=1)

    def _adam(self, grad, h):
        grad, consts = self._adam_constants(grad)
        self._rows(0, 0, self.w_pos.shape[0], grad, h, consts)


def make_step(mode: str, heads, opt):
    if mode == "before":
        return PassBefore(heads, opt)
    return HostTrainStep(heads, opt, threads=int(mode.removeprefix("threads")))


def measure(mode: str, model, batches, steps: int) -> dict:
    heads = SDMHeads(model)
    step = make_step(mode, heads, make_optimizer(1e-5))
    pass_s = []
    adam = step._adam

    def timed(grad, h):
        t0 = time.perf_counter()
        adam(grad, h)
        pass_s.append(time.perf_counter() - t0)

    step._adam = timed
    step.begin()
    step(*batches[0], 0.05)  # warm-up: Adam's moments are first touched here
    pass_s.clear()
    c0, t0 = cpu_times(), time.perf_counter()
    for b in range(1, steps + 1):
        step(*batches[b], 0.05)
    wall = (time.perf_counter() - t0) / steps
    seen = conditions(c0)
    step.end()
    del step._adam  # the timing wrapper refers to the step: without this, every measurement's W_pos, m and v
    del step, heads  # (3 x |V| x D float32) would wait for the cycle collector, and a qwen15 run ran out of memory
    gc.collect()
    mx.clear_cache()
    return {"mode": mode, "step_s": wall, "pass_s": float(np.median(pass_s)), **seen,
            "rss_mb": rss_mb()}  # after the measurement's arrays are freed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="qwen15", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["before", "threads1", "threads2"],
                    help="before, or threadsN (the step's pass over N threads)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for mode in args.modes:
        if mode != "before" and not (mode.startswith("threads") and mode[7:].isdigit() and int(mode[7:]) >= 1):
            ap.error(f"--modes: {mode!r} is neither 'before' nor threadsN with N >= 1")
    from threadpoolctl import threadpool_info

    vocab, hidden = SIZES[args.size]
    model = _head_only_model(vocab, hidden, None)
    rng = np.random.default_rng(0)
    batches = [((rng.standard_normal((args.batch, hidden)) * 3).astype(np.float32),
                rng.integers(vocab, 2 * vocab, args.batch), rng.uniform(1, 30, args.batch).astype(np.float32),
                rng.uniform(0.3, 1, args.batch).astype(np.float32)) for _ in range(args.steps + 1)]
    rows = []
    for r in range(args.repeats):
        for mode in args.modes:
            row = measure(mode, model, batches, args.steps)
            row["repeat"] = r
            rows.append(row)
            print(f"{mode:9} repeat {r}: step {row['step_s']:.2f} s, pass {row['pass_s']:.2f} s  (load "
                  f"{row['load_average']:.2f}, steal {100 * row['cpu_steal']:.0f} %, RSS {row['rss_mb']:.0f} MB)", file=sys.stderr, flush=True)
    med = {m: {k: float(np.median([x[k] for x in rows if x["mode"] == m])) for k in ("step_s", "pass_s")}
           for m in args.modes}
    ratios = ({m: {k: med["before"][k] / med[m][k] for k in ("step_s", "pass_s")} for m in args.modes}
              if "before" in med else {})
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "blas": describe_blas(),
                          "numpy_blas": [{k: lib.get(k) for k in ("internal_api", "num_threads", "version", "filepath")}
                                         for lib in threadpool_info()]},
              "size": args.size, "vocab": vocab, "hidden": hidden, "batch": args.batch, "steps": args.steps,
              "rows": rows, "median": med, "speedup_over_before": ratios}
    print(f"\n{'mode':9} {'step s':>8} {'pass s':>8} {'x before (step)':>16} {'x before (pass)':>16}")
    for m in args.modes:
        rs = ratios.get(m, {})
        print(f"{m:9} {med[m]['step_s']:>8.2f} {med[m]['pass_s']:>8.2f} {rs.get('step_s', float('nan')):>16.2f} "
              f"{rs.get('pass_s', float('nan')):>16.2f}")
    if args.json:
        from sdm_mlx.storage.files import write_json

        write_json(args.json, report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
