"""Run by every rank under ``mlx.launch`` (or started by hand with MLX_RANK / MLX_HOSTFILE) for
``tests/index/test_sharded.py``.  ``python distributed_script.py <mode> <out_dir> [args]``:

* ``index``   — the sharded index on random data with ties, duplicates and self-exclusion; writes
  ``rank<r>.npz`` with every result (compared to a single-process ExactIndex by the test).
* ``fixture`` — ``SDMEstimator.fit`` with the behaviour fixture's settings on every second row of the
  embedded factcheck pool, then ``estimate``; writes ``rank<r>.json`` (results, training history, adaptor fingerprint)
  and saves the model to ``out_dir/model`` (rank 0 alone writes it).
* ``loop``    — builds a sharded index, prints ``ready``, then queries it forever (killed by the test).
* ``selfkill`` — like ``loop``, but rank 1 kills itself (SIGKILL) after the first query.
* ``mismatch`` — rank 1 passes a different support set to ``from_full`` (must be refused on every rank).

A :class:`~sdm_mlx.runtime.distributed.DistributedError` ends the process with its message and status 3.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from sdm_mlx.runtime import distributed as dist  # noqa: E402
from sdm_mlx.index import good_neighbours_by_class  # noqa: E402


def random_case(seed: int = 0, n: int = 1500, m: int = 6, classes: int = 3):
    """Support rows on a small integer grid (many exact ties), 25 duplicates of row 5 spread over the shards,
    labels that cluster (long runs of good neighbours), and queries: 200 support rows (self-excluded) + 100 new."""
    rng = np.random.default_rng(seed)
    support = rng.integers(-2, 3, size=(n, m)).astype(np.float32)
    support[n // 2 : n // 2 + 25] = support[5]
    labels = np.clip((support[:, 0] > 0).astype(int) + (support[:, 1] > 1), 0, classes - 1)
    preds = np.where(rng.random(n) < 0.9, labels, rng.integers(0, classes, n))
    good = good_neighbours_by_class(labels, preds, classes)
    queries = np.concatenate([support[:200], rng.integers(-2, 3, size=(100, m)).astype(np.float32)])
    y_hat = np.clip((queries[:, 0] > 0).astype(int) + (queries[:, 1] > 1), 0, classes - 1)
    exclude = np.concatenate([np.arange(200), -np.ones(100, dtype=np.int64)])
    return support, good, queries, y_hat, exclude


def tiny_case():
    """5 support rows (shards of 3 and 2): a shard with no bad row for class 0, a class with no good row,
    an exact tie across the shards, and n larger than a shard."""
    support = np.array([[0, 0], [1, 0], [0, 1], [1, 0], [3, 3]], dtype=np.float32)
    labels = np.array([0, 0, 0, 1, 1])
    preds = np.array([0, 0, 0, 1, 0])
    good = good_neighbours_by_class(labels, preds, 3)
    queries = np.array([[0, 0], [1, 0], [0.5, 0], [2, 2], [1, 0]], dtype=np.float32)
    return support, good, queries, np.array([0, 1, 0, 2, 0]), np.array([0, 3, -1, -1, 1])


def index_results(index, case) -> dict:
    """Every query the test compares: q/d0/top-n with self-exclusion, without, and search."""
    support, good, queries, y_hat, exclude = case
    out = {}
    out["q_ex"], out["d0_ex"], out["nd_ex"], out["ni_ex"] = index.similarity_and_neighbours(
        queries, y_hat, good, 40, 7, exclude=exclude)
    out["q"], out["d0"] = index.similarity(queries, y_hat, good, 30)
    out["sd"], out["si"] = index.search(queries, 9, exclude=exclude)
    out["sd_all"], out["si_all"] = index.search(queries[:20], support.shape[0] + 3)  # every row, then padding
    return out


def run_index(out: Path) -> None:
    from sdm_mlx.index.sharded import ShardedExactIndex

    case = random_case()
    full = index_results(ShardedExactIndex.from_full(case[0]), case)
    start, stop = dist.shard_bounds(case[0].shape[0], dist.rank(), dist.size())
    by_shard = index_results(ShardedExactIndex(case[0][start:stop], start, case[0].shape[0]), case)
    tiny = tiny_case()
    small = index_results(ShardedExactIndex.from_full(tiny[0]), tiny)
    np.savez(out / f"rank{dist.rank()}.npz", **full, **{f"shard_{k}": v for k, v in by_shard.items()},
             **{f"tiny_{k}": v for k, v in small.items()})


POOL_EVERY = 2  #: the distributed fit uses every second pool row (compared with a same-run single-process fit)


def run_fixture(out: Path) -> None:
    from mlx.utils import tree_flatten

    from behaviour_fixture import canonical, fit_fixture_estimator, fixture_results

    # the behaviour fixture's settings on every POOL_EVERY-th pool row; the test fits the same in one process
    est = fit_fixture_estimator(POOL_EVERY, shard_index=True)
    results = fixture_results(est)
    est.save(out / "model")
    params = [np.array(v) for _, v in tree_flatten(est.model_.parameters())]
    record = {
        "results": canonical(results), "history": est.history_, "round_summaries": est.round_summaries_,
        "adaptor": dist.fingerprint(*params), "index": type(est.index_).__name__,
    }
    (out / f"rank{dist.rank()}.json").write_text(json.dumps(record, sort_keys=True), encoding="utf-8")


def run_loop(out: Path, selfkill: bool) -> None:
    from sdm_mlx.index.sharded import ShardedExactIndex

    dist.install_sigterm_message()
    support, good, queries, y_hat, _ = random_case()
    timeout = float(os.environ.get("SDM_TEST_TIMEOUT", "300"))
    index = ShardedExactIndex.from_full(support, timeout=timeout)
    index.similarity(queries, y_hat, good, 30)
    print(f"ready {dist.rank()}", flush=True)
    if selfkill and dist.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        index.similarity(queries, y_hat, good, 30)


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    try:
        if mode == "index":
            run_index(out)
        elif mode == "fixture":
            run_fixture(out)
        elif mode in ("loop", "selfkill"):
            run_loop(out, mode == "selfkill")
        elif mode == "mismatch":
            from sdm_mlx.index.sharded import ShardedExactIndex

            support = random_case()[0]
            ShardedExactIndex.from_full(support + dist.rank())
        else:
            raise SystemExit(f"unknown mode {mode}")
    except dist.DistributedError as e:
        print(f"DistributedError: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
