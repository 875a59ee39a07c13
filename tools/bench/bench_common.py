"""Helpers shared by the benchmark scripts in tools/bench/ (timing, random test-size models).

Importing it puts ``tools/builders/`` on ``sys.path`` (``tiny_models.py``: the random models), as tools/README.md
describes."""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from pathlib import Path

BUILDERS = str(Path(__file__).resolve().parents[1] / "builders")
if BUILDERS not in sys.path:
    sys.path.insert(0, BUILDERS)

#: Random phi3 sizes for benchmarks when no --model is given (None = the tiny test model).
SIZES = {
    "tiny": None,
    "small": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 8, "vocab_size": 32064},
    "medium": {"hidden_size": 1024, "intermediate_size": 2752, "num_hidden_layers": 8, "num_attention_heads": 16,
               "num_key_value_heads": 16, "vocab_size": 32064},
}


def best_time(fn, repeat: int = 2) -> float:
    """Best wall time of ``repeat`` calls after one warm-up call (compilation, allocation)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def write_report(path, report: dict) -> None:
    """Write a benchmark's JSON report and say where."""
    from sdm_mlx.storage.files import write_json

    write_json(path, report, indent=2)
    print(f"wrote {path}")


def load_bench_model(model: str | None, size: str):
    """(model, tokenizer, label): ``model`` (dir or hub id) via mlx-lm, else a random phi3 of ``size``."""
    from sdm_mlx.llm.embed import load_model

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if model:
        return (*load_model(model), model)
    from tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(tmp, "phi3", overrides=SIZES[size])
        loaded = load_model(path)
    return (*loaded, f"random phi3 ({size})")


def cpu_times():
    """The machine's cumulative CPU times (user + nice, system, idle + iowait, steal) from /proc/stat, or zeros."""
    import numpy as np

    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return np.zeros(4)
    return np.array([v[0] + v[1], v[2], v[3] + v[4], v[7]], dtype=float)


def rss_mb() -> float:
    """This process's resident memory now (Linux /proc), else its peak (ru_maxrss)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def conditions(c0) -> dict:
    """What a measurement that started at the CPU times ``c0`` ran beside: the load average, the CPU's user / system /
    idle / steal shares since ``c0`` (steal: the hypervisor's), and this process's RSS."""
    dc = cpu_times() - c0
    share = dc / dc.sum() if dc.sum() > 0 else dc
    return {"load_average": os.getloadavg()[0], "cpu_user": share[0], "cpu_system": share[1], "cpu_idle": share[2],
            "cpu_steal": share[3], "rss_mb": rss_mb()}


def timed(mode: str, repeat: int, fn, per: int):
    """``(fn(), row)``: one measurement of ``fn`` as a report row (seconds, per-item seconds over ``per`` items,
    :func:`conditions`), also said on stderr."""
    c0, t0 = cpu_times(), time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    row = {"mode": mode, "repeat": repeat, "seconds": dt, "per_item_s": dt / max(per, 1), **conditions(c0)}
    print(f"{mode:12} repeat {repeat}: {dt:.1f} s, {row['per_item_s']:.3f} s each (load {row['load_average']:.2f}, "
          f"steal {100 * row['cpu_steal']:.0f} %, RSS {row['rss_mb']:.0f} MB)", file=sys.stderr, flush=True)
    return out, row
