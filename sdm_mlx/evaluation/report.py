"""Presentation of an evaluation report (:func:`sdm_mlx.evaluation.evaluate.evaluate`): the text tables, the label-error
records of admitted rows, and the plots.  Re-exported by :mod:`sdm_mlx.evaluation.evaluate`."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..storage.datasets import Dataset
from .metrics import format_results_table, label_error_rows

__all__ = ["format_evaluation", "format_ladder", "label_error_records", "write_html", "write_plots"]


def _fmt(x, spec=".3f") -> str:
    return "N/A" if x is None else format(x, spec)


def format_ladder(ladder: Sequence[Mapping[str, Any]], n: int) -> str:
    """The admission report at every grid level (nested ladder of the lower estimator; DESIGN #25)."""
    head = ("   alpha  admitted  fraction  min cond. acc  accuracy  holds  centroid  paper  lifted  dropped")
    lines = ["admission at every alpha level (nested: admitted at alpha iff alpha_region_lower >= alpha; "
             "'paper' = the per-level rule, 'lifted'/'dropped' = what nesting changes):", head, "-" * len(head)]
    for p in ladder:
        acc = _fmt(p["min_conditional_accuracy"])
        if p["min_conditional_accuracy"] is not None and not p["index_conditional_calibrated"]:
            acc += "*"
        lines.append(f"{p['alpha']:8.4g}  {p['n_admitted']:>4}/{n:<4}  {_fmt(p['admitted_fraction']):>8}  {acc:>13}  "
                     f"{_fmt(p['marginal_accuracy']):>8}  {'yes' if p['index_conditional_calibrated'] else 'no':>5}  "
                     f"{p['n_admitted_centroid']:>8}  {p['n_paper']:>5}  {p['lifted']:>6}  {p['dropped']:>7}")
    return "\n".join(lines)


def rejection_reason_lines(ds: Mapping[str, Any]) -> list[str]:
    """Why sdm_p_lower rejected the rows it did not admit: one line per reason, most frequent first."""
    reasons = ds.get("rejection_reasons") or {}
    if not reasons:
        return []
    total = sum(reasons.values())
    from ..calibration.reasons import reason_words

    lines = [f"rejected by sdm_p_lower: {total} of {ds['n']} rows, by reason (the first failing condition; "
             "then what would change it):"]
    width = len(str(max(reasons.values())))
    for reason, count in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {count:>{width}}  {reason}: {reason_words(reason).plain_line}")
    return lines


def format_evaluation(report: Mapping[str, Any]) -> str:
    """One table per evaluation set (all estimators, at the report's α') plus a one-line verdict each."""
    blocks = []
    names = report.get("class_names")
    for name, ds in report["datasets"].items():
        items = [(e, ds["reports"][e]) for e in report["estimators"]]
        title = f"== {name}: {ds['n']} rows"
        if ds.get("source") and ds["source"] != name:
            title += f" ({ds['source']})"
        title += " =="
        lines = [format_results_table(items, title=title)]
        if names:
            lines.append("classes: " + ", ".join(f"{i}={n}" for i, n in enumerate(names)))
        ok = [e + (" (nothing admitted)" if e in ds["all_rejected"] else "") for e in ds["calibrated"]]
        lines.append(f"index-conditional calibration at alpha'={report['alpha']:g} holds for: "
                     + (", ".join(ok) if ok else "none"))
        lines.append("violated by: " + (", ".join(ds["violated"]) if ds["violated"] else "none"))
        if ds.get("ladder"):
            lines.append(format_ladder(ds["ladder"], ds["n"]))
        if ds.get("decisions"):
            policy = report.get("decision_policy") or {}
            lines.append("decisions: " + ", ".join(f"{k} {v}" for k, v in ds["decisions"].items())
                         + (f" (allow: region >= {policy['allow']:g}, review: >= {policy['review']:g})"
                            if policy else ""))
        lines += rejection_reason_lines(ds)
        blocks.append("\n".join(lines))
    skipped = report.get("baselines", {}).get("skipped") or {}
    if skipped:
        blocks.append("skipped baselines: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    return "\n\n".join(blocks)


def label_error_records(datasets: Mapping[str, Dataset], predictions: Mapping[str, Any],
                        class_names: Sequence[str] | None = None, limit: int | None = None) -> list[dict]:
    """Admitted (p_lower) rows whose label differs from the prediction, sorted by p_lower descending
    (paper: Data Quality Analysis, Table ``tab:mmlu-pro-annotation-errors-cs``).  ``n_hat`` is the
    effective sample size of the predicted class n̂_ŷ; ``n_hat_per_class`` all of them."""
    records = []
    for name, ds in datasets.items():
        pred = predictions[name]
        adm = np.asarray(pred.admitted, dtype=bool)
        y = np.asarray(ds.y, dtype=np.int64)
        y_hat = np.asarray(pred.prediction, dtype=np.int64)
        for i in np.flatnonzero(adm & (y != y_hat)):
            yi, pi = int(y[i]), int(y_hat[i])
            row = {
                "id": ds.ids[i],
                "dataset": name,
                "document": ds.documents[i],
                "label": yi,
                "prediction": pi,
                "p_lower": float(pred.p_lower[i]),
                "p_centroid": float(pred.p_centroid[i]),
                "p_upper": float(pred.p_upper[i]),
                "n_hat": int(pred.n_hat[i][pi]),
                "n_hat_per_class": [int(v) for v in pred.n_hat[i]],
                "hard_bin": int(pred.hard_bin[i]),
                "admitted": True,
            }
            if class_names:
                row["label_name"] = str(class_names[yi])
                row["prediction_name"] = str(class_names[pi])
            records.append(row)
    rows = label_error_rows(records, limit=limit)
    for r in rows:
        r.pop("admitted", None)
    return rows


def _safe_name(name: str) -> str:
    keep = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(name))
    return keep.strip("._") or "dataset"


def write_plots(report: Mapping[str, Any], directory) -> list[str]:
    """PNG plots per evaluation set: admitted fraction vs min conditional accuracy across α' (every
    estimator) and the hard q-bin histogram of admitted vs rejected rows (SDM p_lower).

    Raises ImportError (with an install hint) when matplotlib is not installed.
    """
    import os

    from . import plots

    if not plots.plots_available():
        raise ImportError("plotting needs matplotlib; install it with: pip install 'sdm_mlx[plots]'")
    from ..storage.files import make_parent

    make_parent(os.path.join(directory, "x"))  # the directory (0755) if missing; existing files are kept
    paths = []
    for name, ds in report["datasets"].items():
        base = os.path.join(directory, _safe_name(name))
        curves = {e: [(p["alpha"], p["admitted_fraction"], p["min_conditional_accuracy"]) for p in pts]
                  for e, pts in ds["sweep"].items()}
        paths.append(plots.plot_admitted_vs_accuracy(
            curves, base + "_admitted_vs_accuracy.png", title=f"{name}: admitted fraction vs conditional accuracy"))
        hb = ds["hard_bins"]
        bins = np.asarray(hb["bins"], dtype=np.int64)
        paths.append(plots.plot_qbin_histogram(
            np.repeat(bins, hb["admitted"]), np.repeat(bins, hb["rejected"]), base + "_hard_bins.png",
            title=f"{name}: sdm_p_lower at alpha'={report['alpha']:g}"))
    return paths


def _ladder_html(ladder: Sequence[Mapping[str, Any]], n: int) -> str:
    """The admission report at every level as an HTML table (numbers only: nothing to escape but the title)."""
    from .verdict_html import num

    head = ("<h2>Admission at every α level</h2><table><tr><th>α</th><th>admitted</th><th>fraction</th>"
            "<th>min conditional accuracy</th><th>accuracy</th><th>holds</th><th>centroid</th><th>paper</th>"
            "<th>lifted</th><th>dropped</th></tr>")
    rows = "".join(
        f"<tr><td>{p['alpha']:g}</td><td>{p['n_admitted']}/{n}</td><td>{num(p['admitted_fraction'], '.3f')}</td>"
        f"<td>{num(p['min_conditional_accuracy'], '.3f')}</td><td>{num(p['marginal_accuracy'], '.3f')}</td>"
        f"<td>{'yes' if p['index_conditional_calibrated'] else 'no'}</td><td>{p['n_admitted_centroid']}</td>"
        f"<td>{p['n_paper']}</td><td>{p['lifted']}</td><td>{p['dropped']}</td></tr>" for p in ladder)
    return head + rows + "</table><h2>Rows</h2>"


def write_html(report: Mapping[str, Any], directory, datasets: Mapping[str, Dataset], predictions: Mapping[str, Any],
               context) -> list[str]:
    """Verdict pages of every evaluated row (``DIR/<set>/rows/``), one index per set with its admission ladder
    (``DIR/<set>/index.html``) and ``DIR/index.html`` linking the sets; returns the index paths."""
    import os

    from ..storage.files import make_dirs, write_text
    from .verdict_html import PageWriter, _page, esc

    make_dirs(directory)
    links, paths = [], []
    for name, ds in datasets.items():
        sub = _safe_name(name)
        pages = PageWriter(os.path.join(directory, sub), context)
        for i, row in enumerate(predictions[name].to_dicts()):
            row["label"] = int(ds.y[i])
            pages.add(row, ds.documents[i])
        rep = report["datasets"][name]
        paths.append(pages.finish(f"Evaluation: {name}", _ladder_html(rep.get("ladder") or [], rep["n"])))
        links.append(f"<li><a href=\"{esc(sub)}/index.html\">{esc(name)}</a> ({rep['n']} rows)</li>")
    top = os.path.join(directory, "index.html")
    write_text(top, _page("Evaluation", f"<h1>Evaluation</h1><ul>{''.join(links)}</ul>"))
    return [top] + paths
