"""Per-step time of data-parallel W_pos training and its communication share (docs/network-data-parallel.md).

    python tools/bench/bench_network_dp.py --hidden 64                        # 1 rank
    mlx.launch -n 2 --backend ring --python $(which python) -- tools/bench/bench_network_dp.py --hidden 64

A random tiny Phi-3 (``tools/builders/tiny_models.py``) with the given hidden size / layers / vocabulary
gives the heads (W_pos is ``vocab × hidden``); random cached states stand in for the token cache.
Measured, as medians over ``--steps`` steps after 3 warm-up steps, each ended by ``mx.eval``:

* ``step_ms``: one W_pos update on a global mini-batch of ``--batch`` tokens (1 rank: the trainer's
  compiled step; N ranks: :func:`sdm_mlx.network.data_parallel.make_dp_train_step` on this rank's
  ``batch/N`` slice, including its two ``all_sum``-s);
* ``allsum_grad_ms``: ``all_sum`` of a W_pos-shaped float32 array alone (the dense gradient exchange);
* ``gather_factors_ms``: ``all_gather`` of the ``[⌈B/N⌉, |V|]`` and ``[⌈B/N⌉, D]`` factors alone (the
  factor exchange);
* ``allsum_scalars_ms``: ``all_sum`` of the two loss sums alone;
* ``comm_share``: (the chosen exchange + allsum_scalars) / step.

Rank 0 prints one JSON line.  Several ranks on one machine share its cores: run them with
``--env OPENBLAS_NUM_THREADS=1`` so they do not oversubscribe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "builders"))  # tiny_models.py (tools/README.md)


def _median_ms(fn, steps: int, warmup: int = 3) -> float:
    import numpy as np

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def allsum_only(vocab: int, hidden: int, steps: int) -> dict:
    """Time the gradient exchange alone for a ``vocab × hidden`` W_pos (no model: e.g. Phi-3.5's 32064 × 3072)."""
    import mlx.core as mx

    from sdm_mlx.network.data_parallel import DataParallel

    dp = DataParallel()
    g = mx.ones((vocab, hidden))
    mx.eval(g)
    ms = _median_ms(lambda: mx.eval(mx.distributed.all_sum(g, group=dp.group)), steps, warmup=1)
    return {"ranks": dp.size, "vocab": vocab, "hidden": hidden, "w_pos_mb": vocab * hidden * 4 / 2**20,
            "allsum_grad_ms": ms} if dp.writer else {}


def bench(hidden: int, layers: int, vocab: int | None, batch: int, steps: int, tmp: str, compile: bool = True,
          exchange: str = "auto") -> dict:
    import mlx.core as mx
    import numpy as np
    from tiny_models import make_tiny_model

    from sdm_mlx.llm.embed import load_model
    from sdm_mlx.network.data_parallel import DataParallel, exchange_for, make_dp_train_step
    from sdm_mlx.network.heads import SDMHeads
    from sdm_mlx.network.trainer import make_optimizer, make_train_step

    dp = DataParallel()
    overrides = {"hidden_size": hidden, "num_hidden_layers": layers}
    if vocab:
        overrides["vocab_size"] = vocab
    model, _ = load_model(make_tiny_model(os.path.join(tmp, f"rank{dp.rank}"), "phi3", overrides=overrides))
    heads = SDMHeads(model)
    V, D = heads.vocab_size, heads.hidden_size
    rng = np.random.default_rng(0)
    H = mx.array(rng.normal(size=(batch, D)).astype(np.float32))
    T = mx.array(rng.integers(V, 2 * V, size=batch).astype(np.int32))
    q = mx.array(rng.uniform(0, 5, size=batch).astype(np.float32))
    d = mx.array(rng.uniform(0.05, 1, size=batch).astype(np.float32))
    beta = mx.array(0.05, dtype=mx.float32)
    opt = make_optimizer(1e-3)
    if dp.active:
        lo, hi = dp.minibatch_slice(batch)
        step = make_dp_train_step(heads, opt, dp, compile=compile, exchange=exchange)
        args = (H[lo:hi], T[lo:hi], q[lo:hi], d[lo:hi], beta, mx.array(float(batch)))
    else:
        step = make_train_step(heads, opt, compile=compile)
        args = (H, T, q, d, beta)

    def one_step():
        mx.eval(step(*args), heads.state, opt.state)

    out = {"ranks": dp.size, "vocab": V, "hidden": D, "layers": layers, "batch": batch, "compiled": compile,
           "w_pos_mb": V * D * 4 / 2**20, "step_ms": _median_ms(one_step, steps)}
    if dp.active:
        g, two = mx.ones((V, D)), mx.ones(2)
        width = -(-batch // dp.size)
        dz, hs = mx.ones((width, V)), mx.ones((width, D))
        out["exchange"] = exchange_for(V, D, batch, dp.size, exchange)
        out["allsum_grad_ms"] = _median_ms(lambda: mx.eval(mx.distributed.all_sum(g, group=dp.group)), steps)
        out["gather_factors_ms"] = _median_ms(lambda: mx.eval(mx.distributed.all_gather(dz, group=dp.group),
                                                              mx.distributed.all_gather(hs, group=dp.group)), steps)
        out["allsum_scalars_ms"] = _median_ms(lambda: mx.eval(mx.distributed.all_sum(two, group=dp.group)), steps)
        chosen = out["gather_factors_ms"] if out["exchange"] == "factors" else out["allsum_grad_ms"]
        out["comm_share"] = (chosen + out["allsum_scalars_ms"]) / out["step_ms"]
    return out if dp.writer else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary rows (default: the tiny tokenizer's 616)")
    ap.add_argument("--batch", type=int, default=50, help="global mini-batch (tokens)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="do not mx.compile the step")
    ap.add_argument("--exchange", default="auto", choices=("auto", "gradient", "factors"),
                    help="how the W_pos gradient crosses the ranks (sdm_mlx.network.data_parallel)")
    ap.add_argument("--allsum-only", action="store_true",
                    help="only time the all_sum of a vocab × hidden array (needs --vocab; no model is built)")
    a = ap.parse_args(argv)
    if a.allsum_only:
        if not a.vocab:
            ap.error("--allsum-only needs --vocab")
        out = allsum_only(a.vocab, a.hidden, a.steps)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = bench(a.hidden, a.layers, a.vocab, a.batch, a.steps, tmp, compile=not a.no_compile,
                        exchange=a.exchange)
    if out:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
