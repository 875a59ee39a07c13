"""Verdicts of a pipeline run's trained verifiers on one split's own answers, before the evaluate stage can run.

The evaluate stage needs every test split's own answers (the tweets too); this reads what exists: each trained
verifier of ``RUN/verifiers/`` estimates the own answers of ``TASK/SPLIT`` (columns sliced to its encoding, as the
evaluate stage slices them), prints one JSON summary per verifier (verified = admitted by p̂_lower with prediction
"correct"; the lowest accuracy among the verified rows of each true and each predicted class) and, with
``--rows``, writes the per-row verdicts of ``--verifier`` in verdicts.jsonl's fields.

    python tools/real_llm/interim_verdicts.py runs/universal2k_qwen15_cpu sentiment heldout \\
        --verifier universal-own+forced-last --rows docs/results/universal2k_qwen15_cpu/interim.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import numpy as np


def summary(name: str, y, task_label, answer_label, verified, admitted, prediction) -> dict:
    accs = [float(y[verified & (key == c)].mean()) for key in (task_label, answer_label) for c in (0, 1)
            if (verified & (key == c)).any()]
    return {"verifier": name, "n": int(len(y)), "verified": int(verified.sum()),
            "verified_fraction": round(float(verified.mean()), 4),
            "min_index_conditional_accuracy": round(min(accs), 4) if accs else None,
            "accuracy_no_reject": round(float(y.mean()), 4), "admitted": int(admitted.sum()),
            "admitted_predicted_wrong": int((admitted & (prediction == 0)).sum())}


def main(argv=None) -> int:
    from sdm_mlx.estimator import SDMEstimator
    from sdm_mlx.pipeline.layout import Layout
    from sdm_mlx.pipeline.verifiers import RowStore, slice_columns

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run"), ap.add_argument("task"), ap.add_argument("split")
    ap.add_argument("--verifier", help="the verifier whose per-row verdicts --rows writes")
    ap.add_argument("--rows", help="per-row verdicts (task, split, id, label, answer, correct, verified, p_lower, "
                                   "reason, stage)")
    a = ap.parse_args(argv)
    layout = Layout(a.run)
    meta, X, recorded = RowStore(layout).own(a.task, a.split)
    y = np.array([int(m["label"]) for m in meta])
    tl = np.array([int(m["task_label"]) for m in meta])
    al = np.array([int(m["answer_label"]) for m in meta])
    for name in sorted(os.listdir(layout.verifiers)):
        path = layout.verifier(name)
        if not os.path.isdir(path) or name.endswith(".partial"):
            continue
        est = SDMEstimator.load(path)
        parts = est.feature_parts_  # the pipeline's verifiers stage records them
        if parts is None:
            raise SystemExit(f"{path} records no feature_parts: train it again with the verifiers stage")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            pred = est.estimate(X[:, slice_columns(recorded, parts, X.shape[1], name)])
        admitted = np.asarray(pred.admitted, dtype=bool)
        prediction = np.asarray(pred.prediction)
        verified = admitted & (prediction == 1)
        print(json.dumps(summary(name, y, tl, al, verified, admitted, prediction)))
        if a.rows and name == a.verifier:
            rows = pred.to_dicts()
            with open(a.rows, "w", encoding="utf-8") as f:
                for m, r, v in zip(meta, rows, verified):
                    f.write(json.dumps({"task": a.task, "split": a.split, "id": m["id"], "label": int(m["task_label"]),
                                        "answer": None if int(m["answer_label"]) < 0 else int(m["answer_label"]),
                                        "correct": bool(m["label"]), "verified": bool(v),
                                        "p_lower": r.get("p_lower"), "reason": None if v else (
                                            r.get("rejection_reason") or "predicted_wrong"),
                                        "stage": "base", "verifier": name}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
