"""Worker for tools/bench/bench_reexpress.py, run by the Python of a venv with ``reexpress-sdm`` and torch.

It does not import sdm_mlx.  Protocol: one JSON command per stdin line, one JSON answer per stdout line.

    {"cmd": "train", "data": "data.npz", "out": "model.sdmkitmodel", "epochs": 5, "iterations": 1,
     "exemplar_dim": 1000, "batch_size": 50, "learning_rate": 1e-5, "max_neighbors": 2048, "seed": 0}
    {"cmd": "load", "model": "model.sdmkitmodel"}
    {"cmd": "score", "data": "data.npz", "key": "X_test", "out": "answers.npz", "alpha": 0.95}
    {"cmd": "time_batch", "data": "data.npz", "key": "X_test", "batch": 1024, "repeat": 3}
    {"cmd": "time_rows", "data": "data.npz", "key": "X_test", "rows": 200}
    {"cmd": "score_time", "data": "data.npz", "keys": ["X_test", "X_shift"]}
    {"cmd": "info", "threads": 2}

``data.npz`` holds X_train, y_train, X_cal, y_cal and the query matrices.  Every timing scores with
``SDMModel.score(..., nearest_exemplars=n)`` on the CPU device (the full per-row result: q, d0, d,
the SDM output, the nested-region estimates and n nearest exemplars); ``train`` and ``score_time`` also answer
the process's CPU seconds (``tools/bench/bench_widths.py``; ``score_time`` scores each matrix once, as
``speed/run_reexpress.py`` of the acceptance check does, with ``nearest_exemplars=0``).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
from reexpress_sdm import SDMModel, TrainingConfig, train_iterations
from reexpress_sdm.artifact import write_artifact

STATE: dict = {}


def _train(c: dict) -> dict:
    d = np.load(c["data"])
    config = TrainingConfig(number_of_classes=int(d["y_train"].max()) + 1, exemplar_dimension=c["exemplar_dim"],
                            epochs=c["epochs"], batch_size=c["batch_size"], learning_rate=c["learning_rate"],
                            max_neighbors=c["max_neighbors"], seed=c["seed"])
    t, cpu = time.perf_counter(), time.process_time()
    result = train_iterations(config, d["X_train"], d["y_train"].tolist(), d["X_cal"], d["y_cal"].tolist(),
                              number_of_random_shuffles=c["iterations"], backend_options={"device": "cpu"})
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    write_artifact(c["out"], result.artifact)
    return {"train_s": seconds, "train_cpu_s": cpu, "support_rows": len(result.artifact.support_records)}


def _model() -> SDMModel:
    if "model" not in STATE:
        raise RuntimeError("no model loaded: send a 'load' command first")
    return STATE["model"]


def _score(X, n):
    return _model().score(X, nearest_exemplars=n)


def _answers(c: dict) -> dict:
    X = np.load(c["data"])[c["key"]]
    scores = _score(X, c.get("n_exemplars", 5))
    np.savez(c["out"], prediction=np.array([s.prediction for s in scores]), q=np.array([s.q for s in scores]),
             d0=np.array([s.d0 for s in scores]), lower_alpha=np.array([s.lower_region_alpha for s in scores]),
             centroid_alpha=np.array([s.centroid_region_alpha for s in scores]),
             nearest=np.array([s.nearest_support_index for s in scores]))
    return {"rows": len(scores)}


def _time_batch(c: dict) -> dict:
    X = np.load(c["data"])[c["key"]]
    X = X[np.arange(c["batch"]) % X.shape[0]]
    _score(X, c.get("n_exemplars", 5))  # warm-up
    times = []
    for _ in range(c["repeat"]):
        t = time.perf_counter()
        _score(X, c.get("n_exemplars", 5))
        times.append(time.perf_counter() - t)
    return {"seconds": times}


def _time_rows(c: dict) -> dict:
    X = np.load(c["data"])[c["key"]]
    _score(X[:1], c.get("n_exemplars", 5))
    times = []
    for i in range(c["rows"]):
        x = X[i % X.shape[0]][None, :]
        t = time.perf_counter()
        _score(x, c.get("n_exemplars", 5))
        times.append(time.perf_counter() - t)
    return {"seconds": times}


def _score_time(c: dict) -> dict:
    d = np.load(c["data"])
    out = {}
    for key in c["keys"]:
        X = d[key]
        t, cpu = time.perf_counter(), time.process_time()
        _score(X, c.get("n_exemplars", 0))
        out[key] = {"rows": int(X.shape[0]), "seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - cpu}
    return out


def _info(c: dict) -> dict:
    import reexpress_sdm

    if c.get("threads"):
        torch.set_num_threads(int(c["threads"]))

    return {"torch": torch.__version__, "reexpress_sdm": getattr(reexpress_sdm, "__version__", "?"),
            "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "torch_blas": torch.__config__.show().split("BLAS_INFO=")[-1].split(",")[0]
            if "BLAS_INFO=" in torch.__config__.show() else "?"}


def main() -> int:
    commands = {
        "train": _train,
        "load": lambda c: (STATE.update(model=SDMModel.load(c["model"], device="cpu")),
                           {"support_rows": STATE["model"]._index.count})[1],
        "score": _answers,
        "time_batch": _time_batch,
        "time_rows": _time_rows,
        "score_time": _score_time,
        "info": _info,
    }
    for line in sys.stdin:
        if not line.strip():
            continue
        c = json.loads(line)
        try:
            answer = commands[c["cmd"]](c)
        except Exception as e:  # reported to the driver, which stops with the message
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
