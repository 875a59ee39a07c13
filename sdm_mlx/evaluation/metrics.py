"""Estimator-agnostic evaluation of selective classifiers (paper: Experiments, Table
``tab:experiments-classification-combined``, Def. ``defn:index-conditional-calibration``).

Every estimator (SDM p_lower / p_centroid / p_upper, or a baseline from
:mod:`sdm_mlx.evaluation.baselines`) reduces to three arrays over the evaluation split:

* ``y_true [N]``  -- true labels in ``0..C-1``;
* ``y_pred [N]``  -- predictions ŷ in ``0..C-1``;
* ``admitted [N]`` -- bool, True where the estimator does not reject the row.

:func:`index_conditional_report` computes the paper's table columns from these
(class-conditional, prediction-conditional and marginal accuracy over the
admitted rows, and admitted fractions), and checks index-conditional
calibration at ``alpha`` (α'):

    p(y = ŷ | ŷ, E(x) ≥ α') ≥ α'   ∧   p(y = ŷ | y, E(x) ≥ α') ≥ α'

i.e. every class-conditional and every prediction-conditional accuracy over the
admitted set is at least α'.  A condition with nothing admitted is "N/A"
(``None``) and is *not* a violation (the paper: "N/A indicates all predictions
were rejected, which is preferred over falling under the expected accuracy").

Admitted fractions follow the paper's table, whose column is ``n / |D_te|``:
the admitted count of the condition divided by the size of the *whole*
evaluation set (so the class-conditional fractions sum to the marginal one).
The fraction relative to the condition's own size (``n_admitted / n``) is also
reported, as ``admitted_fraction_of_condition``.

Report schema (all values JSON-serialisable; ``None`` = N/A)::

    {
      "alpha": float,
      "num_classes": int,
      "class_conditional":      [CONDITION, ...],   # one per true class y = 0..C-1
      "prediction_conditional": [CONDITION, ...],   # one per predicted class ŷ = 0..C-1
      "marginal": MARGINAL,
      "min_conditional_accuracy": float | None,     # min over the non-N/A conditions
      "index_conditional_calibrated": bool,
      "violations": [{"condition": "class" | "prediction", "class": int,
                      "accuracy": float, "n_admitted": int}, ...],
      "all_rejected": bool,
    }
    CONDITION = {
      "class": int,                    # y (class-conditional) or ŷ (prediction-conditional)
      "n": int,                        # rows with y == class (resp. ŷ == class), admitted or not
      "n_admitted": int,               # ... of which admitted
      "n_correct": int,                # ... admitted and y == ŷ
      "accuracy": float | None,        # n_correct / n_admitted, None if n_admitted == 0
      "admitted_fraction": float,      # n_admitted / N  (the paper's n/|D_te| column)
      "admitted_fraction_of_condition": float | None,   # n_admitted / n, None if n == 0
      "meets_alpha": bool | None,      # accuracy >= alpha, None if N/A
    }
    MARGINAL = {"n", "n_admitted", "n_correct", "accuracy", "admitted_fraction",
                "meets_alpha"}          # same meanings, over all rows

The module also renders several estimators' reports as a fixed-width terminal
table (:func:`format_results_table`) and builds the paper's data-quality
(label-error) listing (:func:`label_error_rows`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..validation import label_indices, level
from ..errors import InputError

__all__ = [
    "REPORT_KEYS",
    "CONDITION_KEYS",
    "MARGINAL_KEYS",
    "VIOLATION_KEYS",
    "index_conditional_report",
    "curve_point",
    "format_results_table",
    "label_error_rows",
]

#: Top-level keys of :func:`index_conditional_report`'s result.
REPORT_KEYS = (
    "alpha",
    "num_classes",
    "class_conditional",
    "prediction_conditional",
    "marginal",
    "min_conditional_accuracy",
    "index_conditional_calibrated",
    "violations",
    "all_rejected",
)
#: Keys of each entry of ``class_conditional`` / ``prediction_conditional``.
CONDITION_KEYS = (
    "class",
    "n",
    "n_admitted",
    "n_correct",
    "accuracy",
    "admitted_fraction",
    "admitted_fraction_of_condition",
    "meets_alpha",
)
#: Keys of ``marginal``.
MARGINAL_KEYS = ("n", "n_admitted", "n_correct", "accuracy", "admitted_fraction", "meets_alpha")
#: Keys of each entry of ``violations``.
VIOLATION_KEYS = ("condition", "class", "accuracy", "n_admitted")


# --------------------------------------------------------------------------- report


def _labels(x, name: str, num_classes: int) -> np.ndarray:
    return label_indices(x, name, num_classes)


def _ratio(num: int, den: int) -> float | None:
    return None if den == 0 else float(num) / float(den)


def _condition(cls: int, mask: np.ndarray, admitted: np.ndarray, correct: np.ndarray,
               n_total: int, alpha: float) -> dict[str, Any]:
    n = int(mask.sum())
    adm = mask & admitted
    n_adm = int(adm.sum())
    n_cor = int((adm & correct).sum())
    acc = _ratio(n_cor, n_adm)
    return {
        "class": int(cls),
        "n": n,
        "n_admitted": n_adm,
        "n_correct": n_cor,
        "accuracy": acc,
        "admitted_fraction": 0.0 if n_total == 0 else n_adm / n_total,
        "admitted_fraction_of_condition": _ratio(n_adm, n),
        "meets_alpha": None if acc is None else bool(acc >= alpha),
    }


def index_conditional_report(y_true, y_pred, admitted, num_classes: int, alpha: float) -> dict[str, Any]:
    """Class-/prediction-conditional and marginal accuracy over the admitted rows, and
    whether index-conditional calibration (Def. ``defn:index-conditional-calibration``)
    holds at ``alpha``.

    Args:
        y_true: ``[N]`` integer true labels in ``0..num_classes-1``.
        y_pred: ``[N]`` integer predictions ŷ in ``0..num_classes-1``.
        admitted: ``[N]`` bool (non-rejected rows).
        num_classes: C.
        alpha: α' in [0, 1]; a condition violates iff its accuracy is defined and < α'.

    Returns:
        A plain dict with keys :data:`REPORT_KEYS` (schema in the module docstring).
    """
    num_classes = int(num_classes)
    if num_classes < 1:
        raise InputError("num_classes must be >= 1")
    alpha = level(alpha, zero=True, one=True)
    y = _labels(y_true, "y_true", num_classes)
    yhat = _labels(y_pred, "y_pred", num_classes)
    adm = np.asarray(admitted)
    if adm.ndim != 1:
        raise InputError(f"admitted must be 1-D, got shape {adm.shape}")
    if adm.size and adm.dtype != np.bool_:
        if not np.all(np.isin(adm, (0, 1))):
            raise InputError("admitted must be boolean (or 0/1)")
    adm = adm.astype(bool)
    if not (y.shape == yhat.shape == adm.shape):
        raise InputError(f"length mismatch: y_true {y.shape}, y_pred {yhat.shape}, admitted {adm.shape}")

    n_total = int(y.size)
    correct = y == yhat
    class_cond = [_condition(c, y == c, adm, correct, n_total, alpha) for c in range(num_classes)]
    pred_cond = [_condition(c, yhat == c, adm, correct, n_total, alpha) for c in range(num_classes)]
    all_rows = np.ones(n_total, dtype=bool)
    m = _condition(0, all_rows, adm, correct, n_total, alpha)
    marginal = {k: m[k] for k in MARGINAL_KEYS}

    violations = []
    accs = []
    for kind, conds in (("class", class_cond), ("prediction", pred_cond)):
        for c in conds:
            if c["accuracy"] is None:
                continue
            accs.append(c["accuracy"])
            if not c["meets_alpha"]:
                violations.append({"condition": kind, "class": c["class"],
                                   "accuracy": c["accuracy"], "n_admitted": c["n_admitted"]})
    return {
        "alpha": alpha,
        "num_classes": num_classes,
        "class_conditional": class_cond,
        "prediction_conditional": pred_cond,
        "marginal": marginal,
        "min_conditional_accuracy": min(accs) if accs else None,
        "index_conditional_calibrated": not violations,
        "violations": violations,
        "all_rejected": marginal["n_admitted"] == 0,
    }


def curve_point(report: Mapping[str, Any]) -> tuple[float, float, float | None]:
    """``(alpha, marginal admitted fraction, min conditional accuracy)`` of a report:
    one point of the admitted-vs-accuracy curves of :func:`sdm_mlx.evaluation.plots.plot_admitted_vs_accuracy`."""
    return (float(report["alpha"]), float(report["marginal"]["admitted_fraction"]),
            report["min_conditional_accuracy"])


# --------------------------------------------------------------------------- table


def _fmt_acc(cond: Mapping[str, Any], digits: int) -> str:
    # one trailing marker column (" " or "*") keeps the decimal points aligned
    acc = cond["accuracy"]
    if acc is None:
        return "N/A "
    return f"{acc:.{digits}f}" + (" " if cond["meets_alpha"] else "*")


def _fmt_frac(frac: float, digits: int) -> str:
    if frac == 0.0:
        return "0"
    if frac == 1.0:
        return "1"
    smallest = 0.5 * 10.0 ** (-digits)
    if frac < smallest:
        return f"<{10.0 ** (-digits):.{digits}f}"
    return f"{frac:.{digits}f}"


def _as_items(results) -> list[tuple[str, Mapping[str, Any]]]:
    if isinstance(results, Mapping):
        return [(str(k), v) for k, v in results.items()]
    return [(str(k), v) for k, v in results]


def _table_columns(C: int, show_alpha: bool, digits: int, fraction_digits: int) -> list[tuple[str, str, Any]]:
    """The columns of :func:`format_results_table`: ``(group, header, cell function of a report)``."""
    cols: list[tuple[str, str, Any]] = []
    for kind, label in (("class_conditional", "y"), ("prediction_conditional", "yhat")):
        for c in range(C):
            cols.append((kind.replace("_", "-"), f"{label}={c} acc", lambda r, c=c, k=kind: _fmt_acc(r[k][c], digits)))
            cols.append((kind.replace("_", "-"), "n/N",
                         lambda r, c=c, k=kind: _fmt_frac(r[k][c]["admitted_fraction"], fraction_digits)))
    cols.append(("marginal", "acc", lambda r: _fmt_acc(r["marginal"], digits)))
    cols.append(("marginal", "n/N", lambda r: _fmt_frac(r["marginal"]["admitted_fraction"], fraction_digits)))
    cols.append(("marginal", "n", lambda r: f"{r['marginal']['n_admitted']}/{r['marginal']['n']}"))
    cols.append(("", "calibrated", lambda r: "yes" if r["index_conditional_calibrated"] else "no"))
    if show_alpha:
        cols.append(("", "alpha", lambda r: f"{float(r['alpha']):g}"))
    return cols


def _group_line(cols, widths, name_w: int, gap: str) -> str:
    """The header line that labels each group of columns over the span of its columns."""
    line = " " * name_w
    j = 0
    while j < len(cols):
        g = cols[j][0]
        k = j
        while k < len(cols) and cols[k][0] == g:
            k += 1
        span = sum(widths[j:k]) + len(gap) * (k - j)
        line += (gap + g.ljust(span - len(gap))) if g else " " * span
        j = k
    return line


def format_results_table(results, *, digits: int = 3, fraction_digits: int = 2,
                         title: str | None = None) -> str:
    """Render several estimators' reports as a fixed-width text table, one row per estimator,
    with the columns of the paper's Table ``tab:experiments-classification-combined``.

    Args:
        results: ``{estimator name: report}`` (insertion order kept) or a sequence of
            ``(name, report)`` pairs; reports from :func:`index_conditional_report`, all with
            the same ``num_classes``.
        digits: decimals for accuracies.
        fraction_digits: decimals for admitted fractions (``n/N``); tiny non-zero
            fractions are shown as ``<0.01``; exact 0 and 1 as ``0`` and ``1``.
        title: optional first line.

    Returns:
        The table as a string (no trailing newline).  Accuracies below α' carry a ``*``;
        conditions with nothing admitted show ``N/A``; the ``n`` column is the admitted
        count / N; ``calibrated`` is ``yes``/``no`` (index-conditional at α').
    """
    items = _as_items(results)
    if not items:
        raise InputError("no results to format")
    num_classes = {int(r["num_classes"]) for _, r in items}
    if len(num_classes) != 1:
        raise InputError(f"reports disagree on num_classes: {sorted(num_classes)}")
    C = num_classes.pop()
    alphas = sorted({float(r["alpha"]) for _, r in items})

    cols = _table_columns(C, len(alphas) > 1, digits, fraction_digits)
    name_w = max(len("estimator"), *(len(n) for n, _ in items))
    cells = [[fn(r) for _, _, fn in cols] for _, r in items]
    widths = [max(len(h), *(len(row[j]) for row in cells)) for j, (_, h, _) in enumerate(cols)]
    gap = "  "

    group_line = _group_line(cols, widths, name_w, gap)
    head_line = "estimator".ljust(name_w) + "".join(gap + h.rjust(w) for (_, h, _), w in zip(cols, widths))
    rule = "-" * len(head_line)
    lines = []
    if title:
        lines.append(title)
    if len(alphas) == 1:
        lines.append(f"alpha' = {alphas[0]:g}   (* = accuracy below alpha'; N/A = nothing admitted; n/N = admitted / all rows)")
    else:
        lines.append("(* = accuracy below the row's alpha'; N/A = nothing admitted; n/N = admitted / all rows)")
    lines += [group_line.rstrip(), head_line, rule]
    for (name, _), row in zip(items, cells):
        lines.append(name.ljust(name_w) + "".join(gap + v.rjust(w) for v, w in zip(row, widths)))
    return "\n".join(lines)


# --------------------------------------------------------------------------- label errors


def _sort_value(v) -> float:
    if v is None:
        return -math.inf
    try:
        f = float(v)
    except (TypeError, ValueError):
        return -math.inf
    return -math.inf if math.isnan(f) else f


def _id_key(v) -> tuple:
    if isinstance(v, bool):
        return (0, int(v), "")
    if isinstance(v, numbers.Real):
        return (0, float(v), "")
    return (1, 0.0, str(v))


def label_error_rows(records: Iterable[Mapping[str, Any]], *, score_key: str = "p_lower",
                     admitted_key: str = "admitted", label_key: str = "label",
                     prediction_key: str = "prediction", id_key: str = "id",
                     limit: int | None = None) -> list[dict[str, Any]]:
    """Admitted rows whose label differs from the prediction, most confident first
    (paper: Data Quality Analysis, Table ``tab:mmlu-pro-annotation-errors-cs``).

    Args:
        records: per-row mappings, typically with keys ``id, document, label, prediction,
            p_lower, p_centroid, p_upper, n_hat, admitted``; only ``id_key``, ``label_key``,
            ``prediction_key``, ``admitted_key`` and ``score_key`` are read.
        score_key: the estimate to sort by (descending); ``None``/NaN sort last.
        admitted_key: truthy for admitted (non-rejected) rows.
        limit: keep at most this many rows (after sorting).

    Returns:
        Shallow copies of the selected records, sorted by ``score_key`` descending, ties
        broken by id ascending (numbers before strings) so the order is deterministic.
    """
    rows = []
    for i, r in enumerate(records):
        for k in (admitted_key, label_key, prediction_key):
            if k not in r:
                raise KeyError(f"record {i} has no {k!r} field")
        if not bool(r[admitted_key]):
            continue
        if r[label_key] == r[prediction_key]:
            continue
        rows.append(dict(r))
    rows.sort(key=lambda r: (-_sort_value(r.get(score_key)), _id_key(r.get(id_key))))
    if limit is not None:
        rows = rows[: max(0, int(limit))]
    return rows
