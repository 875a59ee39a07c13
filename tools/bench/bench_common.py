"""Helpers shared by the benchmark scripts in tools/bench/ (timing, random test-size models).

Importing it puts ``tools/builders/`` on ``sys.path`` (``tiny_models.py``: the random models), as tools/README.md
describes."""

from __future__ import annotations

import os
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
