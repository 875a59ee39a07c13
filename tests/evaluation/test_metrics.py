"""Tests for sdm_mlx.evaluation.metrics (index-conditional report, table, label errors) and sdm_mlx.evaluation.plots."""

import json
import sys

import numpy as np
import pytest

from sdm_mlx.evaluation import metrics
from sdm_mlx.evaluation.metrics import (
    format_results_table,
    index_conditional_report,
    label_error_rows,
)

# Expected schema: key -> type(s).  "cond" entries are checked per condition.
SCHEMA = {
    "alpha": float,
    "num_classes": int,
    "class_conditional": list,
    "prediction_conditional": list,
    "marginal": dict,
    "min_conditional_accuracy": (float, type(None)),
    "index_conditional_calibrated": bool,
    "violations": list,
    "all_rejected": bool,
}
CONDITION_SCHEMA = {
    "class": int,
    "n": int,
    "n_admitted": int,
    "n_correct": int,
    "accuracy": (float, type(None)),
    "admitted_fraction": float,
    "admitted_fraction_of_condition": (float, type(None)),
    "meets_alpha": (bool, type(None)),
}
MARGINAL_SCHEMA = {k: CONDITION_SCHEMA[k] for k in
                   ("n", "n_admitted", "n_correct", "accuracy", "admitted_fraction", "meets_alpha")}
VIOLATION_SCHEMA = {"condition": str, "class": int, "accuracy": float, "n_admitted": int}


def check_schema(report, num_classes):
    assert set(report) == set(SCHEMA)
    assert tuple(SCHEMA) == metrics.REPORT_KEYS
    for k, t in SCHEMA.items():
        assert isinstance(report[k], t), k
    for key in ("class_conditional", "prediction_conditional"):
        assert len(report[key]) == num_classes
        for c, cond in enumerate(report[key]):
            assert set(cond) == set(CONDITION_SCHEMA) == set(metrics.CONDITION_KEYS)
            assert cond["class"] == c
            for k, t in CONDITION_SCHEMA.items():
                assert isinstance(cond[k], t), (key, k)
    assert set(report["marginal"]) == set(MARGINAL_SCHEMA) == set(metrics.MARGINAL_KEYS)
    for k, t in MARGINAL_SCHEMA.items():
        assert isinstance(report["marginal"][k], t), k
    for v in report["violations"]:
        assert set(v) == set(VIOLATION_SCHEMA) == set(metrics.VIOLATION_KEYS)
        for k, t in VIOLATION_SCHEMA.items():
            assert isinstance(v[k], t)
        assert v["condition"] in ("class", "prediction")
    # round-trips through JSON unchanged
    assert json.loads(json.dumps(report)) == report


# --------------------------------------------------------------------------- hand example

Y = [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
P = [0, 0, 1, 0, 1, 1, 0, 1, 1, 0]
A = [1, 1, 1, 0, 1, 1, 1, 0, 0, 0]


def test_hand_example_numbers():
    r = index_conditional_report(Y, P, np.array(A, dtype=bool), 2, 0.6)
    check_schema(r, 2)
    c0, c1 = r["class_conditional"]
    assert (c0["n"], c0["n_admitted"], c0["n_correct"]) == (4, 3, 2)
    assert c0["accuracy"] == pytest.approx(2 / 3)
    assert c0["admitted_fraction"] == pytest.approx(0.3)
    assert c0["admitted_fraction_of_condition"] == pytest.approx(0.75)
    assert (c1["n"], c1["n_admitted"], c1["n_correct"]) == (6, 3, 2)
    assert c1["admitted_fraction_of_condition"] == pytest.approx(0.5)
    p0, p1 = r["prediction_conditional"]
    assert (p0["n"], p0["n_admitted"], p0["n_correct"]) == (5, 3, 2)
    assert (p1["n"], p1["n_admitted"], p1["n_correct"]) == (5, 3, 2)
    assert p0["accuracy"] == pytest.approx(2 / 3) and p1["accuracy"] == pytest.approx(2 / 3)
    m = r["marginal"]
    assert (m["n"], m["n_admitted"], m["n_correct"]) == (10, 6, 4)
    assert m["accuracy"] == pytest.approx(2 / 3)
    assert m["admitted_fraction"] == pytest.approx(0.6)
    # class-conditional fractions are over all N rows, so they sum to the marginal one
    assert c0["admitted_fraction"] + c1["admitted_fraction"] == pytest.approx(m["admitted_fraction"])
    assert r["index_conditional_calibrated"] is True
    assert r["violations"] == []
    assert r["min_conditional_accuracy"] == pytest.approx(2 / 3)

    r7 = index_conditional_report(Y, P, A, 2, 0.7)  # 0/1 ints accepted for admitted
    assert r7["index_conditional_calibrated"] is False
    assert {(v["condition"], v["class"]) for v in r7["violations"]} == {
        ("class", 0), ("class", 1), ("prediction", 0), ("prediction", 1)}
    assert r7["marginal"]["meets_alpha"] is False


def test_all_rejected_is_na_and_calibrated():
    r = index_conditional_report(Y, P, np.zeros(10, dtype=bool), 2, 0.95)
    check_schema(r, 2)
    for cond in r["class_conditional"] + r["prediction_conditional"]:
        assert cond["accuracy"] is None and cond["meets_alpha"] is None
        assert cond["n_admitted"] == 0 and cond["admitted_fraction"] == 0.0
    assert r["marginal"]["accuracy"] is None
    assert r["min_conditional_accuracy"] is None
    assert r["index_conditional_calibrated"] is True
    assert r["all_rejected"] is True


def test_calibration_judged_on_admitted_classes_only():
    # 3 classes; only true-class-1 rows (all correct) are admitted, class 0 / 2 rows are all
    # wrong but rejected: those conditions are N/A and do not violate.
    y = [0, 0, 1, 1, 1, 2, 2]
    p = [1, 2, 1, 1, 1, 0, 1]
    a = [0, 0, 1, 1, 1, 0, 0]
    r = index_conditional_report(y, p, a, 3, 0.95)
    check_schema(r, 3)
    cc = r["class_conditional"]
    assert cc[0]["accuracy"] is None and cc[2]["accuracy"] is None
    assert cc[0]["n"] == 2 and cc[0]["admitted_fraction_of_condition"] == 0.0
    assert cc[1]["accuracy"] == 1.0 and cc[1]["n_admitted"] == 3
    pc = r["prediction_conditional"]
    assert pc[0]["accuracy"] is None and pc[2]["accuracy"] is None
    assert pc[1]["accuracy"] == 1.0 and pc[1]["n"] == 5
    assert r["index_conditional_calibrated"] is True
    assert r["marginal"]["admitted_fraction"] == pytest.approx(3 / 7)


def test_single_predicted_class_admitted():
    # like the paper's p_upper row on SentimentOOD: only ŷ=1 admitted, some of them y=0
    y = [0, 0] + [1] * 8 + [0, 1]
    p = [1, 1] + [1] * 8 + [0, 0]
    a = [1, 1] + [1] * 8 + [0, 0]
    r = index_conditional_report(y, p, a, 2, 0.95)
    check_schema(r, 2)
    c0, c1 = r["class_conditional"]
    assert c0["accuracy"] == 0.0 and c0["n_admitted"] == 2 and c0["meets_alpha"] is False
    assert c1["accuracy"] == 1.0
    p0, p1 = r["prediction_conditional"]
    assert p0["accuracy"] is None and p0["n"] == 2
    assert p1["accuracy"] == pytest.approx(0.8)
    assert r["marginal"]["accuracy"] == pytest.approx(0.8)
    assert r["index_conditional_calibrated"] is False
    assert sorted((v["condition"], v["class"]) for v in r["violations"]) == [("class", 0), ("prediction", 1)]
    assert r["min_conditional_accuracy"] == 0.0


def test_accuracy_exactly_alpha_meets():
    y = [0] * 20
    p = [0] * 19 + [1]
    r = index_conditional_report(y, p, [True] * 20, 2, 0.95)
    assert r["class_conditional"][0]["accuracy"] == pytest.approx(0.95)
    assert r["class_conditional"][0]["meets_alpha"] is True
    # the wrong row is the only ŷ=1 row: prediction-conditional accuracy 0 violates
    assert r["prediction_conditional"][1]["accuracy"] == 0.0
    assert r["index_conditional_calibrated"] is False


def test_empty_input_and_numpy_types():
    r = index_conditional_report(np.array([], dtype=np.int64), np.array([], dtype=np.int64),
                                 np.array([], dtype=bool), 2, 0.9)
    check_schema(r, 2)
    assert r["marginal"]["n"] == 0 and r["all_rejected"] is True
    r = index_conditional_report(np.array([0.0, 1.0]), np.array([0, 1], dtype=np.int32),
                                 np.array([True, True]), np.int64(2), np.float32(0.5))
    check_schema(r, 2)


@pytest.mark.parametrize("kwargs", [
    dict(y_true=[0, 2], y_pred=[0, 1], admitted=[1, 1]),      # label out of range
    dict(y_true=[0, 1], y_pred=[0], admitted=[1, 1]),         # length mismatch
    dict(y_true=[0, 1], y_pred=[0, 1], admitted=[1, 2]),      # non-boolean admitted
    dict(y_true=[0, 0.5], y_pred=[0, 1], admitted=[1, 1]),    # non-integer label
])
def test_validation(kwargs):
    with pytest.raises(ValueError):
        index_conditional_report(num_classes=2, alpha=0.9, **kwargs)


def test_alpha_range():
    with pytest.raises(ValueError):
        index_conditional_report([0], [0], [1], 2, 1.5)


def test_curve_point():
    r = index_conditional_report(Y, P, A, 2, 0.6)
    a, f, acc = metrics.curve_point(r)
    assert (a, f) == (0.6, pytest.approx(0.6)) and acc == pytest.approx(2 / 3)
    r0 = index_conditional_report(Y, P, [0] * 10, 2, 0.6)
    assert metrics.curve_point(r0)[2] is None


# --------------------------------------------------------------------------- table


def test_table_contains_numbers():
    results = {
        "no_reject": index_conditional_report(Y, P, [1] * 10, 2, 0.6),
        "hand": index_conditional_report(Y, P, A, 2, 0.6),
        "all_rejected_estimator": index_conditional_report(Y, P, [0] * 10, 2, 0.6),
    }
    table = format_results_table(results, title="toy")
    lines = table.splitlines()
    assert lines[0] == "toy"
    assert "alpha' = 0.6" in table
    for name in results:
        assert name in table
    # no_reject: class 0 acc 3/4, class 1 acc 4/6; pred 0 acc 3/5 (=alpha, no star)
    row = next(l for l in lines if l.startswith("no_reject"))
    assert "0.750" in row and "0.667" in row and "0.600" in row and "0.700" in row
    assert "10/10" in row and "yes" in row
    row = next(l for l in lines if l.startswith("hand"))
    assert row.count("0.667") == 5 and "6/10" in row and "0.30" in row and "0.60" in row
    row = next(l for l in lines if l.startswith("all_rejected_estimator"))
    assert row.count("N/A") == 5 and "0/10" in row
    # fixed width: header and data rows have the same length
    body = [l for l in lines if l.startswith(("estimator", "no_reject", "hand", "all_rejected"))]
    assert len({len(l) for l in body}) == 1
    assert "class-conditional" in table and "prediction-conditional" in table
    assert "yhat=1 acc" in table


def test_table_marks_violations_and_sequence_input():
    r = index_conditional_report(Y, P, A, 2, 0.7)
    table = format_results_table([("est", r)], digits=2)
    row = next(l for l in table.splitlines() if l.startswith("est "))
    assert "0.67*" in row and row.rstrip().endswith("no")


def test_table_mixed_alpha_and_errors():
    table = format_results_table({"a": index_conditional_report(Y, P, A, 2, 0.6),
                                  "b": index_conditional_report(Y, P, A, 2, 0.9)})
    assert "alpha" in table.splitlines()[2]
    with pytest.raises(ValueError):
        format_results_table({})
    with pytest.raises(ValueError):
        format_results_table({"a": index_conditional_report(Y, P, A, 2, 0.6),
                              "b": index_conditional_report([0], [2], [1], 3, 0.6)})


def test_table_tiny_fraction():
    n = 1000
    y = np.zeros(n, dtype=int)
    a = np.zeros(n, dtype=bool)
    a[0] = True
    table = format_results_table({"x": index_conditional_report(y, y, a, 2, 0.9)})
    assert "<0.01" in table


# --------------------------------------------------------------------------- label errors


def _rec(i, label, pred, p_lower, admitted=True):
    return {"id": i, "document": f"doc {i}", "label": label, "prediction": pred,
            "p_lower": p_lower, "p_centroid": p_lower, "p_upper": p_lower,
            "n_hat": 100, "admitted": admitted}


def test_label_error_rows_sorted_and_filtered():
    records = [
        _rec(5, 0, 1, 0.97),
        _rec(3, 1, 1, 0.999),            # correct -> excluded
        _rec(7, 2, 0, 0.99999),
        _rec(1, 0, 2, 0.99, admitted=False),  # rejected -> excluded
        _rec(9, 1, 0, 0.98),
        _rec(2, 1, 0, 0.98),             # tie with id 9 -> id 2 first
        _rec(4, 0, 3, None),             # missing estimate -> last
    ]
    before = [dict(r) for r in records]
    out = label_error_rows(records)
    assert [r["id"] for r in out] == [7, 2, 9, 5, 4]
    assert records == before  # input not mutated
    out[0]["id"] = -1
    assert records[2]["id"] == 7  # copies returned
    assert [r["id"] for r in label_error_rows(records, limit=2)] == [7, 2]
    assert [r["id"] for r in label_error_rows(records, score_key="p_upper")] == [7, 2, 9, 5, 4]
    assert label_error_rows([]) == []


def test_label_error_rows_string_ids_and_missing_field():
    records = [_rec("b", 0, 1, 0.9), _rec("a", 0, 1, 0.9), _rec(10, 0, 1, 0.9)]
    assert [r["id"] for r in label_error_rows(records)] == [10, "a", "b"]
    with pytest.raises(KeyError):
        label_error_rows([{"id": 1, "label": 0, "prediction": 1}])


# --------------------------------------------------------------------------- plots


def test_plots_missing_matplotlib_message(monkeypatch, tmp_path):
    from sdm_mlx.evaluation import plots
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plots.plots_available() is False
    with pytest.raises(ImportError, match=r"pip install 'sdm_mlx\[plots\]'"):
        plots.plot_qbin_histogram([1, 2], [0], tmp_path / "h.png")
    with pytest.raises(ImportError, match=r"sdm_mlx\[plots\]"):
        plots.plot_admitted_vs_accuracy({"a": [(0.9, 0.5, 0.95)]}, tmp_path / "c.png")


def _is_png(path):
    data = path.read_bytes()
    return len(data) > 100 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_admitted_vs_accuracy_png(tmp_path):
    pytest.importorskip("matplotlib")
    from sdm_mlx.evaluation import plots
    assert plots.plots_available() is True
    r = index_conditional_report(Y, P, A, 2, 0.6)
    curves = {
        "softmax": [(0.9, 0.8, 0.91), (0.95, 0.6, 0.93), (0.99, 0.3, None)],
        "p_lower": [(0.9, 0.5, [0.97, 0.99, None]), (0.95, 0.4, r)],
        "all_na": [(0.95, 0.0, None)],
        "from_report": [metrics.curve_point(r)],
    }
    out = tmp_path / "sub" / "curves.png"
    assert plots.plot_admitted_vs_accuracy(curves, out, title="t") == str(out)
    assert _is_png(out)


def test_plot_qbin_histogram_png(tmp_path):
    pytest.importorskip("matplotlib")
    from sdm_mlx.evaluation import plots
    out = tmp_path / "hist.png"
    plots.plot_qbin_histogram([3, 4, 4, 5, 7], np.array([0, 0, 1, 2, 3]), out, title="bins")
    assert _is_png(out)
    out2 = tmp_path / "hist_density.png"
    plots.plot_qbin_histogram([], [0, 1], out2, density=True)
    assert _is_png(out2)
    with pytest.raises(ValueError):
        plots.plot_qbin_histogram([-1], [0], tmp_path / "bad.png")
