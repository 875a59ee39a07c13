"""Run under ``mlx.launch -n N``: the data-parallel W_pos step against the one-process step (same global batches).

Every rank trains two copies of the same SDMHeads (tiny random Phi-3) for two epochs over random
cached states: one with the one-process compiled step, one with its slice of every global batch and
the data-parallel step (the last global batch holds one token, so a rank gets an empty slice).
Adam (the trainer's) and plain SGD (which, unlike Adam, is not blind to a wrong gradient scale), each
with both gradient exchanges (the dense all_sum and the all-gathered factors).
Rank 0 prints one JSON line: per optimizer/exchange the max |ΔW_pos| and both runs' per-epoch losses.
``python dp_step_check.py TMP [adam,sgd]``: the optimizers to compare (default both).
"""

import json
import os
import sys

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "builders"))  # tiny_models.py
from tiny_models import make_tiny_model  # noqa: E402

from sdm_mlx.llm.embed import load_model  # noqa: E402
from sdm_mlx.network.data_parallel import DataParallel, make_dp_train_step  # noqa: E402
from sdm_mlx.network.heads import SDMHeads  # noqa: E402
from sdm_mlx.network.step import EpochOrder, EpochTokens, MiniBatches  # noqa: E402
from sdm_mlx.network.trainer import make_optimizer, make_train_step, train_epoch  # noqa: E402


def compare(model, dp: DataParallel, optimizer: str, exchange: str) -> dict:
    """``model`` is loaded once: training moves only the heads' own W_pos, never the base model (the tests of
    the trainer check that gradients reach W_pos alone), so every run starts from the same weights."""
    runs = {}
    for mode in ("single", "data_parallel"):
        heads = SDMHeads(model)
        rng = np.random.default_rng(0)
        n, D, V = 23, heads.hidden_size, heads.vocab_size
        H = mx.array((3 * rng.normal(size=(n, D))).astype(np.float32))
        T = mx.array(rng.integers(V, 2 * V, size=n).astype(np.int32))
        q, d = rng.uniform(0, 5, size=n), rng.uniform(0.05, 1, size=n)
        opt = make_optimizer(0.05) if optimizer == "adam" else optim.SGD(learning_rate=2.0)
        if mode == "single":
            step, use = make_train_step(heads, opt), None
        else:
            step, use = make_dp_train_step(heads, opt, dp, exchange=exchange), dp
        order = np.random.default_rng(1)
        runs[mode] = {"epochs": [train_epoch(step, heads, opt, EpochTokens(H, T, q, d), MiniBatches(11, 0.5, 3.0),
                                             order=EpochOrder(order), dp=use)
                                 for _ in range(2)], "w": np.array(heads.pos.weight)}
    a, b = runs["single"], runs["data_parallel"]
    return {
        "max_abs_diff": float(np.abs(a["w"] - b["w"]).max()),
        "max_abs_weight": float(np.abs(a["w"]).max()),
        "moved": float(np.abs(a["w"] - np.array(SDMHeads(model).pos.weight)).max()),
        "losses": [[e[k] for e in r["epochs"] for k in ("loss", "nll", "reg", "reg_rescaled")] for r in (a, b)],
        "batches": [e["batches"] for e in b["epochs"]],
    }


def main(tmp: str, optimizers: tuple = ("adam", "sgd")) -> None:
    dp = DataParallel()
    path = make_tiny_model(os.path.join(tmp, f"rank{dp.rank}"), "phi3", seed=0)
    model, _ = load_model(path)
    out = {"ranks": dp.size, **{f"{name}/{ex}": compare(model, dp, name, ex)
                                for name in optimizers for ex in ("gradient", "factors")}}
    if dp.writer:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("adam", "sgd"))
