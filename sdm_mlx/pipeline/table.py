"""The ``table`` stage: per task and split, what the base model + verifier and the SDM network achieve.

For every group of verdicts (a verifier or the network; a task; a split) :func:`summarize` reports ``n``, the
no-reject task accuracy, the verified count and fraction, and the task accuracy among the verified answers: overall
and **index-conditional** (the minimum over the true classes and over the predicted classes, the paper's
conditional accuracy; None when nothing is verified); for a verifier also the AUC of a linear probe trained on its
rows (how separable right and wrong answers are in that encoding).  Outputs: ``table.json`` (everything),
``table.md`` (the tables a reader wants), ``verdicts.jsonl`` (one row per (task, split, id, stage): ``task, split,
id, label, answer, correct, verified, p_lower, reason, stage`` with stage ``base`` = the primary verifier on the
model's own answers, ``network`` = ``sdm-mlx generate --head`` with the network after Alg. 4) and, when matplotlib is
installed, a risk–coverage plot per task (answers ranked by the verifier's p̂_lower of "right"; the verified
answers marked).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Sequence

from .layout import Layout
from .recipe import TEST_SPLITS, Recipe
from .verifiers import PARSE_FAILURE

#: the fields of a verdicts.jsonl row, in order
VERDICT_FIELDS = ("task", "split", "id", "label", "answer", "correct", "verified", "p_lower", "reason", "stage")


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


def _ratio(a: int, b: int):
    return round(a / b, 4) if b else None


def index_conditional(rows: list[dict]) -> tuple:
    """``(min accuracy, {"true": {label: acc}, "predicted": {answer: acc}})`` among the verified ``rows``: the task
    accuracy within each true class and within each predicted class, and the smallest of them (None, {} when
    nothing is verified)."""
    v = [r for r in rows if r["verified"]]
    if not v:
        return None, {}
    per = {}
    for key, name in (("label", "true"), ("answer", "predicted")):
        groups = defaultdict(list)
        for r in v:
            groups[r[key]].append(bool(r["correct"]))
        per[name] = {str(k): round(sum(g) / len(g), 4) for k, g in sorted(groups.items(), key=lambda kv: str(kv[0]))}
    return min(min(d.values()) for d in per.values()), per


def summarize(rows: list[dict]) -> dict:
    """n, no-reject task accuracy, verified count / fraction / accuracy, index-conditional accuracy among the
    verified, and the reasons of the rest."""
    n = len(rows)
    correct = sum(bool(r["correct"]) for r in rows)
    verified = [r for r in rows if r["verified"]]
    m, per = index_conditional(rows)
    reasons = defaultdict(int)
    for r in rows:
        if not r["verified"]:
            reasons[str(r.get("reason"))] += 1
    probe = None
    if rows and all(r.get("probe") is not None for r in rows):
        from .verifiers import auc

        probe = auc([r["probe"] for r in rows], [bool(r["correct"]) for r in rows])
    return {"n": n, "no_reject_accuracy": _ratio(correct, n), "unparsable": sum(r["answer"] is None for r in rows),
            "probe_auc": None if probe is None else round(probe, 4),
            "verified": len(verified), "verified_fraction": _ratio(len(verified), n),
            "verified_accuracy": _ratio(sum(bool(r["correct"]) for r in verified), len(verified)),
            "index_conditional_accuracy": None if m is None else round(m, 4), "per_class": per,
            "admitted_as_wrong": sum(1 for r in rows if r.get("admitted") and r.get("prediction") == 0),
            "not_verified_reasons": dict(sorted(reasons.items()))}


def by_task_split(rows: list[dict], recipe: Recipe) -> dict:
    out = {}
    for t in recipe.tasks:
        for s in TEST_SPLITS:
            part = [r for r in rows if r["task"] == t.name and r["split"] == s]
            if part:
                out.setdefault(t.name, {})[s] = summarize(part)
    return out


def network_verdicts(recipe: Recipe, layout: Layout, base: Sequence[dict] = ()) -> list[dict]:
    """Verdict rows (stage ``network``) of ``sdm-mlx generate --head``'s answers to the held-out and shift rows; the
    ``base`` verdicts again when Alg. 4 kept epoch 0 (:func:`~.network_stages.base_head_kept`)."""
    from ..network.generation import parse_task_prediction
    from .network_stages import base_head_kept, replayed_ids

    if base_head_kept(layout):
        return [{**r, "stage": "network"} for r in base]
    same = replayed_ids(layout)  # answers the network decodes as the base model did: the base verdicts stand
    out = [{**r, "stage": "network"} for r in base if f"{r['task']}/{r['id']}" in same]
    answers = {r["id"]: r for r in _read(layout.network_answers)}
    for t in recipe.tasks:
        gen = {i[len(t.name) + 1:]: r for i, r in answers.items() if str(i).startswith(t.name + "/")}
        if not gen:
            continue
        comps = t.answer_completions()
        for split in TEST_SPLITS:
            for d in _read(layout.data(t.name, split)) if t.sizes.get(split) else []:
                g = gen.get(str(d["id"]))
                if g is None or f"{t.name}/{d['id']}" in same:
                    continue
                answer = parse_task_prediction(g.get("answer") or "", comps)
                last = (g.get("attempts") or [{}])[-1].get("verifier") or {}
                verified = bool(g.get("verified")) and answer >= 0
                reason = None if verified else (g.get("reason") or (PARSE_FAILURE if answer < 0 else None))
                out.append({"task": t.name, "split": split, "id": d["id"], "label": int(d["label"]),
                            "answer": answer if answer >= 0 else None, "correct": answer == int(d["label"]),
                            "verified": verified, "p_lower": g.get("p_lower"), "reason": reason, "stage": "network",
                            "prediction": last.get("prediction"), "admitted": last.get("admitted")})
    return out


def network_selection(layout: Layout) -> dict | None:
    """Alg. 4's record from network-train's metrics: counts before and after each epoch, the kept epoch."""
    if not os.path.exists(layout.network_metrics):
        return None
    with open(layout.network_metrics, encoding="utf-8") as f:
        m = json.load(f)
    return {"initial_count": (m.get("initial") or {}).get("count"),
            "epochs": [{**{k: e.get(k) for k in ("epoch", "count", "loss", "tokens", "tokens_per_s", "epoch_seconds")},
                        # the count's prompts replayed from the base decodings (networks.md) and their total
                        "replayed": (e.get("calibration") or {}).get("replayed"),
                        "documents": (e.get("calibration") or {}).get("documents")}
                       for e in m.get("epochs", [])],
            "selected_epoch": m.get("selected_epoch"), "finished": m.get("finished"),
            "epochs_completed": m.get("epochs_completed"), "stopped": m.get("stopped")}


def _fmt(x, spec=".3f") -> str:
    return "N/A" if x is None else format(x, spec)


def _cell(s: dict | None) -> str:
    if not s:
        return "—"
    return (f"{_fmt(s['no_reject_accuracy'])} | {s['verified']} ({_fmt(s['verified_fraction'])}) | "
            f"{_fmt(s['index_conditional_accuracy'])}")


def markdown(table: dict) -> str:
    """The tables of ``table.md``."""
    lines = [f"# {table['name']}", "",
             f"Model `{table['model']}`; primary verifier `{table['primary']}` (α' = {table.get('alpha')}). "
             "Per task and split: n, the no-reject task accuracy (unparsable = wrong), the verified answers "
             "(p̂_lower admits them as right) and their share, and the index-conditional task accuracy among them "
             "(the minimum over true and predicted classes; N/A: nothing verified).", "",
             "| task | split | n | base: no-reject | verified | min acc | network: no-reject | verified | min acc |",
             "|---|---|---|---|---|---|---|---|---|"]
    for task, splits in table["base"].items():
        for split, s in splits.items():
            net = table.get("network", {}).get("results", {}).get(task, {}).get(split)
            lines.append(f"| {task} | {split} | {s['n']} | {_cell(s)} | {_cell(net)} |")
    lines += ["", "## Verifiers", "",
              "Per verifier: its training rows, its encoding, whether Alg. 3 found thresholds, and per task and "
              "split the verified answers at their index-conditional accuracy; beside it the AUC with which a "
              "linear probe trained on the same rows ranks the answers' rightness (the separability ceiling).", "",
              "| verifier | rows (right / wrong) | features | admits | " + " | ".join(
                  f"{t} {s}" for t, ss in table["base"].items() for s in ss) + " |",
              "|---|---|---|---|" + "---|" * sum(len(ss) for ss in table["base"].values())]
    for name, v in table["verifiers"].items():
        e = v["index"]
        if e.get("skipped"):
            lines.append(f"| `{name}` | {e['rows']} | {','.join(e['features'])} | skipped: {e['skipped']} |")
            continue
        cells = []
        for t, ss in table["base"].items():
            for s in ss:
                r = v.get("results", {}).get(t, {}).get(s)
                cells.append("—" if not r else f"{r['verified']}/{r['n']} at {_fmt(r['index_conditional_accuracy'])}"
                             f" (probe AUC {_fmt(r.get('probe_auc'))})")
        lines.append(f"| `{name}` | {e['rows']} ({e['labels']['1']} / {e['labels']['0']}) | {','.join(e['features'])} "
                     f"| {'yes' if e.get('can_admit') else 'no'} | " + " | ".join(cells) + " |")
    sel = table.get("network", {}).get("selection")
    if sel:
        counts = ", ".join(str(e["count"]) for e in sel["epochs"])
        lines += ["", "## SDM network (Alg. 4)", "",
                  f"Calibration count (admitted, prediction \"right\", task answer right): {sel['initial_count']} "
                  f"before training{'; after each epoch: ' + counts if counts else ''}; kept: epoch "
                  f"{sel['selected_epoch']} (finished: {sel['finished']})."
                  + (" Epoch 0 is the base head: the network is the base model, and its rows are the base rows."
                     if sel["selected_epoch"] == 0 else "")
                  + "".join(f" Epoch {e['epoch']}'s count replayed {e['replayed']} of its {e['documents']} prompts "
                            "(answers the epoch did not change) and decoded the rest."
                            for e in sel["epochs"] if e.get("replayed") is not None)]
    if table.get("stages"):
        lines += ["", "## Cost per stage (last run)", "",
                  "| stage | wall s | rows | rows/s | tokens/s | peak RSS GB | load |", "|---|---|---|---|---|---|---|"]
        for name, st in table["stages"].items():
            lines.append(f"| {name} | {st.get('wall_s')} | {st.get('rows')} | {_fmt(st.get('rows_per_s'))} | "
                         f"{_fmt(st.get('tokens_per_s'), '.1f')} | {_fmt(st.get('peak_rss_gb'), '.2f')} | "
                         f"{_fmt(st.get('load_average'), '.1f')} |")
    return "\n".join(lines) + "\n"


def risk_coverage(rows: list[dict]) -> tuple:
    """``(coverage, risk)`` lists: answers ranked by the verifier's belief that they are right (p̂_lower when it
    predicts "right", minus p̂_lower when it predicts "wrong", unparsable last), task risk of each prefix."""
    def score(r):
        if r["answer"] is None or r.get("p_lower") is None:
            return -2.0
        return r["p_lower"] if r.get("prediction") == 1 else -r["p_lower"]

    ranked = sorted(rows, key=score, reverse=True)
    cov, risk, right = [], [], 0
    for k, r in enumerate(ranked, 1):
        right += bool(r["correct"])
        cov.append(k / len(ranked))
        risk.append(1 - right / k)
    return cov, risk


def plot_risk_coverage(path: str, task: str, groups: dict) -> bool:
    """One risk–coverage figure (``groups``: {label: rows}); False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from ..storage.files import make_dirs

    make_dirs(os.path.dirname(path))
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, rows in groups.items():
        if not rows:
            continue
        cov, risk = risk_coverage(rows)
        line, = ax.plot(cov, risk, label=label)
        v = [r for r in rows if r["verified"]]
        if v:
            ax.plot([len(v) / len(rows)], [1 - sum(bool(r["correct"]) for r in v) / len(v)], "o",
                    color=line.get_color())
    ax.set_xlabel("coverage (answers kept, most trusted first)")
    ax.set_ylabel("task risk (wrong among kept)")
    ax.set_title(f"{task}: risk–coverage (dot: verified answers)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path + ".partial.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def build_table(recipe: Recipe, layout: Layout, verifier_index: dict, stages: dict | None = None) -> dict:
    """Write table.json, table.md, verdicts.jsonl and the plots; returns the table."""
    from ..storage.files import write_json, write_jsonl, write_text

    primary = recipe.primary_verifier()
    table = {"name": os.path.basename(layout.out), "model": recipe.model, "primary": primary,
             "alpha": recipe.verifier.train.get("alpha", 0.95),
             "tasks": {t.name: {"preset": t.preset, "sizes": t.sizes} for t in recipe.tasks},
             "base": {}, "verifiers": {}}
    rows_by_verifier = {}
    for name, entry in verifier_index.items():
        rows = _read(layout.evaluate(name))
        rows_by_verifier[name] = rows
        table["verifiers"][name] = {"index": {k: v for k, v in entry.items() if k != "admission"},
                                    "results": by_task_split(rows, recipe)}
    base = [{**r, "stage": "base"} for r in rows_by_verifier.get(primary, [])]
    table["base"] = by_task_split(base, recipe)
    net = network_verdicts(recipe, layout, base)
    selection = network_selection(layout)
    if selection is not None or net:
        table["network"] = {"selection": selection, "results": by_task_split(net, recipe)}
    if stages:
        table["stages"] = {name: dict(s["runs"][-1]) for name, s in stages.items() if s.get("runs")}
    write_jsonl(layout.verdicts, [{k: r[k] for k in VERDICT_FIELDS} for r in base + net])
    write_json(layout.table_json, table)
    write_text(layout.table_md, markdown(table))
    for t in recipe.tasks:
        groups = {f"{stage} {s}": [r for r in rows if r["task"] == t.name and r["split"] == s]
                  for stage, rows in (("base", base), ("network", net)) for s in TEST_SPLITS}
        if any(groups.values()):
            plot_risk_coverage(layout.plot(t.name), t.name, groups)
    return table
