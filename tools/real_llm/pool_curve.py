"""How a pipeline verifier's verified share grows with one task's pool (issue 42: does the universal verifier miss
Sentiment for want of rows?).

For an ``sdm-mlx pipeline`` run this retrains one verifier (default: the recipe's primary) on the first ``k`` pool
prompts of one task, for each ``k`` of ``--sizes``, the other tasks' rows unchanged, and judges the same held-out and
shift own answers as the run's evaluate stage (``evaluate_verifier``).  The pool is stratified by prefix (the first
``k`` rows hold ``k / 2`` of each label: :mod:`sdm_mlx.pipeline.task_data`), so size ``k`` trains on exactly
the rows a recipe with ``pool: k`` would have drawn.  Nothing is decoded again: the rows' recorded features are
sliced.  A size equal to the run's pool reuses the run's own verifier.

    python tools/real_llm/pool_curve.py runs/universal_qwen15_cpu --task sentiment --sizes 1000,2000,3000,4000 \\
        --out docs/results/universal_qwen15_cpu/pool_curve

writes ``OUT/pool_curve.jsonl`` (one verdict per size, task, split and answer, with ``pool_size``),
``OUT/pool_curve.json`` (per size: the verifier's rows, whether Alg. 3 found a threshold, its robust min valid q~,
and per task and split the evaluate stage's summary: ``sdm_mlx.pipeline.table.summarize``).  The verifiers themselves go to
the run directory (``RUN/pool_curve/<name>-pool<k>``, each resumed where it stopped, its index entry beside it).
"""

from __future__ import annotations

import argparse
import os
import sys

from sdm_mlx.pipeline.layout import Layout
from sdm_mlx.pipeline.stage_io import read_json
from sdm_mlx.pipeline.stages import load_run_recipe
from sdm_mlx.pipeline.table import by_task_split
from sdm_mlx.pipeline.verifiers import RowStore, evaluate_verifier, plans, train_verifier
from sdm_mlx.storage.files import write_json, write_jsonl


class PoolPrefixStore(RowStore):
    """A run's rows with ``task``'s pool cut to its first ``size`` rows (own answers and forced rows follow it)."""

    def __init__(self, layout: Layout, task: str, size: int):
        super().__init__(layout)
        self.task, self.size = task, size

    def data(self, task: str, split: str) -> list[dict]:
        rows = super().data(task, split)
        return rows[: self.size] if (task, split) == (self.task, "pool") else rows


def markdown(task: str, curve: list[dict]) -> str:
    keys = list(dict.fromkeys((t, sp) for c in curve for t, splits in c["results"].items() for sp in splits))
    lines = [f"| {task} pool prompts | rows | robust min valid q~ | " + " | ".join(f"{t}/{sp}" for t, sp in keys)
             + " |", "|---" * (3 + len(keys)) + "|"]
    for c in curve:
        q = c["robust_min_valid_qbin"]
        cells = []
        for t, sp in keys:
            r = c["results"].get(t, {}).get(sp)
            acc = r and r["index_conditional_accuracy"]
            cells.append("—" if r is None else f"{r['verified']}/{r['n']} at {'N/A' if acc is None else f'{acc:.3f}'}")
        lines.append(f"| {c['pool_size']} | {c['rows']} | {'none' if q is None else f'{q:.2f}'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _problem(recipe, name: str, plan, task: str | None, sizes: list[int], given: str) -> str | None:
    """What is wrong with the arguments (None: nothing)."""
    if plan is None:
        return f"the recipe has no verifier {name!r} (it has {[p.name for p in plans(recipe)]})"
    if task not in plan.tasks:
        return f"the verifier {name!r} is not trained on {task!r}'s rows (its tasks: {list(plan.tasks)})"
    pool = recipe.task(task).sizes["pool"]
    if not sizes or any(k < 2 or k % 2 or k > pool for k in sizes):
        return f"--sizes must be even whole numbers from 2 to {task}'s pool ({pool}), got {given!r}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="the run directory of sdm-mlx pipeline (its recipe.json, rows and verifiers)")
    ap.add_argument("--task", help="the task whose pool is cut (default: the first task with pool rows)")
    ap.add_argument("--sizes", required=True, help="pool prompts of that task, comma-separated (even numbers)")
    ap.add_argument("--verifier", help="the verifier's name (default: the recipe's primary)")
    ap.add_argument("--out", required=True, help="the output folder (pool_curve.jsonl, pool_curve.json)")
    a = ap.parse_args(argv)
    recipe, layout = load_run_recipe(a.run), Layout(a.run)
    name = a.verifier or recipe.primary_verifier()
    plan = next((p for p in plans(recipe) if p.name == name), None)
    task = a.task or next((t.name for t in recipe.tasks if t.sizes["pool"]), None)
    try:
        sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    except ValueError:
        sizes = []
    problem = _problem(recipe, name, plan, task, sizes, a.sizes)
    if problem:
        print(f"pool_curve: {problem}", file=sys.stderr)
        return 2
    full = recipe.task(task).sizes["pool"]
    verdicts, curve = [], []
    for k in sizes:
        store = PoolPrefixStore(layout, task, k)
        reuse = k == full  # the run's own verifier, trained on the whole pool
        path = layout.verifier(name) if reuse else os.path.join(a.run, "pool_curve", f"{name}-pool{k}")
        entry = (read_json(layout.verifiers_index) or {}).get(name) if reuse else read_json(path + ".entry.json")
        if entry is None and reuse:
            print(f"pool_curve: the run has no trained {name!r}: run its verifiers stage first", file=sys.stderr)
            return 2
        if entry is None:
            entry = train_verifier(plan, recipe, store, path, lambda m: print(m, file=sys.stderr, flush=True))
            write_json(path + ".entry.json", entry)
        rows = [] if entry.get("skipped") else evaluate_verifier(plan, recipe, store, path)
        verdicts += [{"pool_size": k, **r} for r in rows]
        curve.append({"pool_size": k, "run_verifier": reuse, "rows": entry.get("rows"), "labels": entry.get("labels"),
                      "can_admit": bool(entry.get("can_admit")), "skipped": entry.get("skipped"),
                      "robust_min_valid_qbin": entry.get("robust_min_valid_qbin"),
                      "results": by_task_split(rows, recipe)})
        held = curve[-1]["results"].get(task, {}).get("heldout") or {}
        print(f"pool_curve: {task} pool {k}: {held.get('verified')} of {held.get('n')} held-out answers verified",
              file=sys.stderr, flush=True)
    write_jsonl(os.path.join(a.out, "pool_curve.jsonl"), verdicts)
    write_json(os.path.join(a.out, "pool_curve.json"), {"run": os.path.basename(os.path.abspath(a.run)),
                                                        "verifier": name, "task": task, "curve": curve})
    print(markdown(task, curve))
    return 0


if __name__ == "__main__":
    sys.exit(main())
