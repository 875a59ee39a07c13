"""The stages of ``sdm-mlx pipeline`` over the verifiers (:mod:`.stages`): ``verifiers`` (the universal verifier per
row set and encoding, and per-task ones: :mod:`.verifiers`) and ``evaluate`` (every verifier's verdict on the
held-out and shift own answers)."""

from __future__ import annotations

import os

from ..errors import InputError
from .answers import count_rows
from .layout import Layout
from .recipe import TEST_SPLITS, Recipe
from .stage_io import read_json, stage_log
from .verifiers import plans


def _verifier_state(recipe: Recipe, layout: Layout):
    from .verifiers import RowStore, fingerprint

    store = RowStore(layout)
    index = read_json(layout.verifiers_index) or {}
    want = {p.name: (p, fingerprint(p, recipe, store)) for p in plans(recipe)}
    return store, index, want


def _verifier_current(entry: dict | None, fp: dict, layout: Layout, name: str) -> bool:
    if not entry or entry.get("fingerprint") != fp:
        return False
    return bool(entry.get("skipped")) or os.path.isdir(layout.verifier(name))


def verifiers_done(recipe: Recipe, layout: Layout) -> bool:
    try:
        _, index, want = _verifier_state(recipe, layout)
    except (InputError, OSError):
        return False
    return all(_verifier_current(index.get(n), fp, layout, n) for n, (_, fp) in want.items())


def run_verifiers(recipe: Recipe, layout: Layout) -> dict:
    from ..storage.files import make_dirs, write_json
    from .verifiers import train_verifier

    say = stage_log("verifiers")
    make_dirs(layout.verifiers)
    store, index, want = _verifier_state(recipe, layout)
    rows = 0
    for name, (plan, fp) in want.items():
        if _verifier_current(index.get(name), fp, layout, name):
            say(f"{name}: done")
            continue
        entry = train_verifier(plan, recipe, store, layout.verifier(name), say)
        entry["fingerprint"] = fp
        index[name] = entry
        rows += entry["rows"]
        write_json(layout.verifiers_index, index)  # after every verifier: a stopped stage keeps the finished ones
    write_json(layout.verifiers_index, {n: index[n] for n in want})
    return {"rows": rows}


def _evaluate_fingerprints(recipe: Recipe, layout: Layout) -> dict:
    index = read_json(layout.verifiers_index) or {}
    tests = {f"{t.name}/{s}": count_rows(layout.data(t.name, s)) for t in recipe.tasks for s in TEST_SPLITS
             if t.sizes.get(s)}
    return {n: {"verifier": e.get("fingerprint"), "test_rows": tests} for n, e in index.items() if not e.get("skipped")}


def evaluate_done(recipe: Recipe, layout: Layout) -> bool:
    done = read_json(layout.evaluate_index) or {}
    want = _evaluate_fingerprints(recipe, layout)
    return bool(want) and all(done.get(n) == fp and os.path.exists(layout.evaluate(n)) for n, fp in want.items())


def run_evaluate(recipe: Recipe, layout: Layout) -> dict:
    from ..storage.files import make_dirs, write_json, write_jsonl
    from .verifiers import RowStore, evaluate_verifier

    say = stage_log("evaluate")
    if not verifiers_done(recipe, layout):
        raise InputError("the verifiers are missing or out of date: run the verifiers stage first")
    make_dirs(os.path.dirname(layout.evaluate("x")))
    store = RowStore(layout)
    by_name = {p.name: p for p in plans(recipe)}
    want = _evaluate_fingerprints(recipe, layout)
    done = read_json(layout.evaluate_index) or {}
    n = 0
    for name, fp in want.items():
        if done.get(name) == fp and os.path.exists(layout.evaluate(name)):
            continue
        rows = evaluate_verifier(by_name[name], recipe, store, layout.verifier(name))
        write_jsonl(layout.evaluate(name), rows)
        done[name] = fp
        write_json(layout.evaluate_index, done)
        n += len(rows)
        summary = {}
        for r in rows:
            k = f"{r['task']}/{r['split']}"
            v, c = summary.get(k, (0, 0))
            summary[k] = (v + r["verified"], c + 1)
        say(f"{name}: verified " + ", ".join(f"{k} {v}/{c}" for k, (v, c) in summary.items()))
    return {"rows": n}


# -- Alg. 4 -------------------------------------------------------------------------------------------------------
