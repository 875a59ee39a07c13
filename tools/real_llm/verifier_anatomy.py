"""Where a pipeline verifier's Alg. 3 threshold comes from, per task (issue 42: why one verifier over every task
admits less of a task than that task's own verifier).

For one verifier of an ``sdm-mlx pipeline`` run (default: the recipe's primary) this recomputes, from the run's
recorded rows and the saved verifier alone (no model runs):

* **the calibration rows by q~**: every calibration row's task, kind (own answer or constructed negative), label,
  predicted class and q~ (``q_tilde_lower``), written one per row (``--rows``); per task and q~ bin, the rows of each
  predicted class and their accuracy; and for thresholds t, the accuracy of each predicted class over all tasks
  among the rows with q~ >= t, beside the verifier's min valid and robust min valid q~ (Alg. 3, the Cauchy offsets);
* **twins as nearest neighbours**, for a row set with constructed negatives: per encoding and task, how often a
  row's nearest neighbour (per-dimension standardised columns, L2) is its twin (the same prompt with the other
  answer, so the other label), and how often it shares the row's label. Similarity q counts the nearest
  neighbours that share the label, so an encoding whose nearest neighbour is the twin leaves q near 0.

    python tools/real_llm/verifier_anatomy.py runs/universal_qwen15_cpu \\
        --rows docs/results/universal_qwen15_cpu/primary_calibration.jsonl \\
        --json docs/results/universal_qwen15_cpu/primary_anatomy.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from sdm_mlx.pipeline.layout import Layout
from sdm_mlx.pipeline.stages import load_run_recipe
from sdm_mlx.index.exact import ExactIndex
from sdm_mlx.llm.pooling import FEATURE_PARTS, check_feature_parts
from sdm_mlx.pipeline.verifiers import RowStore, plans, slice_columns, training_rows
from sdm_mlx.storage.files import write_json, write_jsonl

BIN_EDGES = (0.0, 1.0, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, float("inf"))
THRESHOLDS = (2.0, 2.5, 3.0, 3.25, 3.5, 3.75, 4.0)
TWIN_ENCODINGS = ("last", "mean,last", "mean", "max", "max,mean,last")


def _accuracy(y, yhat, mask, c) -> dict:
    m = mask & (yhat == c)
    n = int(m.sum())
    return {"n": n, "accuracy": round(float((y[m] == c).mean()), 3) if n else None}


def _finite(x) -> float | None:
    x = float(x)
    return x if np.isfinite(x) else None


def calibration_anatomy(est, ids, X, y, meta) -> tuple[list[dict], dict]:
    """Per-row calibration verdicts and the per-task, per-q~-bin table of one fitted verifier."""
    where = {i: k for k, i in enumerate(ids)}
    missing = [i for i in est.calibration_ids_ if i not in where]
    if missing:
        raise SystemExit(f"{len(missing)} calibration ids are not among the run's rows (e.g. {missing[:3]}): the "
                         "verifier was trained on other rows than the run now records")
    cal = np.array([where[i] for i in est.calibration_ids_], dtype=np.int64)
    pred = est.estimate(X[cal], [ids[k] for k in cal])
    qt = np.asarray(pred.column("q_tilde_lower"), dtype=np.float64)
    yhat = np.asarray(pred.column("prediction"), dtype=np.int64)
    yc = y[cal]
    tasks = np.array([meta[k]["task"] for k in cal])
    rows = [{"id": ids[k], "task": meta[k]["task"], "kind": meta[k].get("kind"), "label": int(yc[j]),
             "prediction": int(yhat[j]), "q_tilde_lower": round(float(qt[j]), 6)} for j, k in enumerate(cal)]
    per_task = {}
    for t in sorted(set(tasks.tolist())):
        m = tasks == t
        per_task[t] = {"n": int(m.sum()), "bins": [
            {"q_from": lo, "q_to": hi if np.isfinite(hi) else None, "n": int((m & (qt >= lo) & (qt < hi)).sum()),
             **{f"pred_{c}": _accuracy(yc, yhat, m & (qt >= lo) & (qt < hi), c) for c in (0, 1)}}
            for lo, hi in zip(BIN_EDGES[:-1], BIN_EDGES[1:])]}
    above = [{"t": t, **{f"pred_{c}": _accuracy(yc, yhat, qt >= t, c) for c in (0, 1)},
              "per_task": {k: int(((qt >= t) & (tasks == k)).sum()) for k in per_task}} for t in THRESHOLDS]
    cal_state = est.calibration_
    table = {"min_valid": _finite(cal_state.min_valid), "robust_min_valid": _finite(est.robust_min_valid_),
             "alpha": float(est.alpha), "per_task": per_task, "at_or_above": above}
    return rows, table


def twin_neighbours(plan, store, forced_completions: str, seed: int, recorded=FEATURE_PARTS,
                    encodings=TWIN_ENCODINGS) -> list[dict]:
    """Per encoding and task: the share of rows whose nearest neighbour is its twin, and that share its label (the
    rows are read once with every ``recorded`` part; encodings of other parts are skipped; the neighbours come from
    the exact support index)."""
    recorded = check_feature_parts(recorded)
    ids, X_all, y, meta = training_rows(dataclasses.replace(plan, parts=recorded), store, forced_completions, seed)
    key = np.array([i.removesuffix("/forced") for i in ids])
    tasks = np.array([m["task"] for m in meta])
    out = []
    for enc in (e for e in encodings if set(check_feature_parts(e)) <= set(recorded)):
        X = X_all[:, slice_columns(recorded, check_feature_parts(enc), X_all.shape[1], enc)].astype(np.float64)
        Z = ((X - X.mean(0)) / (X.std(0) + 1e-6)).astype(np.float32)
        _, nn = ExactIndex(Z).search(Z, 1, exclude=np.arange(len(ids)))
        nn = nn[:, 0]
        for t in sorted(set(tasks.tolist())):
            m = tasks == t
            out.append({"encoding": enc, "task": t, "rows": int(m.sum()),
                        "nn_is_twin": round(float((key[nn] == key)[m].mean()), 3),
                        "nn_same_label": round(float((y[nn] == y)[m].mean()), 3)})
    return out


def markdown(name: str, table: dict, twins: list[dict]) -> str:
    def acc(a):
        return f"{a['n']} at {a['accuracy']:.3f}" if a["n"] else "0"

    def q(x):
        return "none" if x is None else f"{x:.2f}"

    lines = [f"## `{name}`: calibration rows by q~ (min valid {q(table['min_valid'])}, robust min valid "
             f"{q(table['robust_min_valid'])}, α' = {table['alpha']})", "",
             "| task | q~ | rows | predicted wrong: n at accuracy | predicted right: n at accuracy |", "|---|---|---|---|---|"]
    for t, d in table["per_task"].items():
        for b in d["bins"]:
            if b["n"]:
                hi = "∞" if b["q_to"] is None else f"{b['q_to']:g}"
                lines.append(f"| {t} | [{b['q_from']:g}, {hi}) | {b['n']} | {acc(b['pred_0'])} | {acc(b['pred_1'])} |")
    lines += ["", "| q~ ≥ t | predicted wrong | predicted right | rows per task |", "|---|---|---|---|"]
    for a in table["at_or_above"]:
        per = ", ".join(f"{k} {v}" for k, v in a["per_task"].items())
        lines.append(f"| {a['t']:g} | {acc(a['pred_0'])} | {acc(a['pred_1'])} | {per} |")
    if twins:
        lines += ["", "| encoding | task | rows | nearest neighbour is the twin | nearest neighbour shares the label |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['encoding']} | {r['task']} | {r['rows']} | {r['nn_is_twin']:.3f} | {r['nn_same_label']:.3f} |"
                  for r in twins]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from sdm_mlx.estimator import SDMEstimator

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="the run directory of sdm-mlx pipeline (its recipe.json, rows and verifiers)")
    ap.add_argument("--verifier", help="the verifier's name (default: the recipe's primary)")
    ap.add_argument("--rows", help="write one JSON row per calibration row")
    ap.add_argument("--json", help="write the tables as JSON")
    ap.add_argument("--no-twins", action="store_true", help="skip the nearest-neighbour study")
    a = ap.parse_args(argv)
    recipe, layout = load_run_recipe(a.run), Layout(a.run)
    name = a.verifier or recipe.primary_verifier()
    plan = next((p for p in plans(recipe) if p.name == name), None)
    if plan is None:
        print(f"verifier_anatomy: the recipe has no verifier {name!r} (it has {[p.name for p in plans(recipe)]})",
              file=sys.stderr)
        return 2
    store = RowStore(layout)
    ids, X, y, meta = training_rows(plan, store, recipe.verifier.forced_completions, recipe.seed)
    rows, table = calibration_anatomy(SDMEstimator.load(layout.verifier(name)), ids, X, y, meta)
    twins = [] if a.no_twins or not plan.uses_forced() else twin_neighbours(
        plan, store, recipe.verifier.forced_completions, recipe.seed, recipe.record_features)
    if a.rows:
        write_jsonl(a.rows, rows)
    if a.json:
        write_json(a.json, {"verifier": name, "calibration": table, "twins": twins})
    print(markdown(name, table, twins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
