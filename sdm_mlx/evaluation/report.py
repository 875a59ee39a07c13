"""Presentation of an evaluation report (:func:`sdm_mlx.evaluation.evaluate.evaluate`): the text tables, the label-error
records of admitted rows, and the plots.  Re-exported by :mod:`sdm_mlx.evaluation.evaluate`."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..storage.datasets import Dataset
from .metrics import format_results_table, label_error_rows

__all__ = ["format_evaluation", "label_error_records", "write_plots"]


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
