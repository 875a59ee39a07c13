"""What a verdict is made of, built the fast way, equals the plain definitions (same values and types).

* :meth:`Predictions.to_dicts` converts each column at once: the rows equal :meth:`Column.value` row by row
  and :meth:`Predictions.exemplars`;
* :func:`~sdm_mlx.storage.strict_json.strict` checks the plain JSON types first (by exact type, items
  inline): the same output as the general conversion by isinstance for every kind of value it accepts, and
  the same error for the others.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest

from sdm_mlx import calibration as cal
from sdm_mlx.results import ROW_COLUMNS, Predictions
from sdm_mlx.storage.strict_json import strict


def _typed(x):
    """A value with the types of everything inside it (equality alone would take 1 == 1.0 == True)."""
    if isinstance(x, dict):
        return ("dict", [(_typed(k), _typed(v)) for k, v in x.items()])
    if isinstance(x, list):
        return ("list", [_typed(v) for v in x])
    if isinstance(x, float) and math.isnan(x):
        return (float, "nan")
    return (type(x), x)


def _general_strict(obj):
    """The conversion by isinstance alone, in the order of the general case (NumPy scalars, arrays,
    dataclasses and paths included), written out independently of :func:`strict`."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, np.bool_):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(float(obj)) else None
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, dict):
        return {str(k): _general_strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_general_strict(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _general_strict(obj.tolist())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _general_strict(dataclasses.asdict(obj))
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"cannot write a {type(obj).__name__} as JSON")


@dataclasses.dataclass
class _Record:
    a: float
    b: object


VALUES = [0, -3, 2**70, 1.5, -0.0, math.nan, math.inf, -math.inf, True, False, None, "s", "",
          np.float32(2.5), np.float64(math.nan), np.float32(math.inf), np.int64(3), np.uint8(7), np.bool_(True),
          (1, 2.0), np.array([[1.0, np.nan], [np.inf, 2.0]]), np.array([1, 2]), _Record(1.0, [np.nan, "x"]),
          Path("/tmp/x"), {1: 2, "x": [None, np.float32(math.inf)]}, [1.0, math.nan, [np.int32(4), {"k": math.inf}]],
          {"exemplars": [{"id": np.int64(5), "label": 1, "squared_distance": 0.25}], "q": 3, "p": math.nan}]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_strict_equals_the_general_conversion(value):
    for wrapped in (value, [value], {"k": value}, [[value, 1.0]], {"a": {"b": [value]}}):
        assert _typed(strict(wrapped)) == _typed(_general_strict(wrapped))


def test_strict_refuses_what_json_cannot_hold():
    for bad in (object(), [1, object()], {"k": {1.0, 2.0}}, complex(1, 2)):
        with pytest.raises(TypeError, match="cannot write"):
            strict(bad)


def _predictions(n, n_exemplars, class_names=None, ids=None):
    rng = np.random.default_rng(n + n_exemplars)
    C = 3
    calibration = cal.Calibration(
        alpha=0.9, W=(rng.normal(size=(C, C)) * 4).astype(np.float32), psi=rng.random(C) * 0.5, min_valid=0.5,
        robust_min_valid=[0.7, math.inf][n % 2], offsets=rng.random((C, 3)) * 0.1,
        output_ecdfs=[np.sort(rng.random(30)).astype(np.float32) for _ in range(C)],
        sample_size_arrays=[np.sort(rng.random(40) * 4) for _ in range(C)])
    z = rng.normal(size=(n, C)).astype(np.float32)
    q, d = rng.integers(0, 40, n), rng.random(n).astype(np.float32)
    s = rng.dirichlet(np.ones(C), size=n).astype(np.float32)
    est = cal.estimate(calibration, z, q, d, s)
    est = dataclasses.replace(est, alpha_region_lower=np.where(rng.random(n) < 0.5, 0.9, np.nan))
    index = rng.integers(-1, 20, (n, n_exemplars))
    return Predictions(
        ids=list(range(n)) if ids is None else ids, logits=z, q=q, d0=rng.random(n).astype(np.float32), d=d, sdm=s,
        estimate=est, exemplar_index=index, exemplar_distance=rng.random((n, n_exemplars)).astype(np.float32),
        support_ids=[f"s{j}" if j % 3 else j for j in range(20)], support_labels=rng.integers(0, C, 20),
        support_predictions=rng.integers(0, C, 20), class_names=class_names)


def _rows_one_value_at_a_time(pred):
    arrays = [(col, col.array(pred)) for col in ROW_COLUMNS]
    rows = []
    for i in range(len(pred)):
        row = {col.key: col.value(a, i) for col, a in arrays}
        row["exemplars"] = pred.exemplars(i)
        if pred.class_names:
            row["prediction_name"] = pred.class_names[int(pred.prediction[i])]
        rows.append(row)
    return rows


@pytest.mark.parametrize("n", [0, 1, 8, 40])
@pytest.mark.parametrize("n_exemplars", [0, 5])
def test_to_dicts_equals_the_rows_value_by_value(n, n_exemplars):
    for names, ids in ((None, None), (["a", "b", "c"], [np.int64(i) if i % 2 else f"x{i}" for i in range(n)])):
        pred = _predictions(n, n_exemplars, names, ids)
        assert _typed(pred.to_dicts()) == _typed(_rows_one_value_at_a_time(pred))
    if n:
        for labels in (None, np.zeros(0, np.int64)):
            no_support = dataclasses.replace(pred, exemplar_index=np.full((n, n_exemplars), -1), support_ids=[],
                                             support_labels=labels, support_predictions=labels)
            assert _typed(no_support.to_dicts()) == _typed(_rows_one_value_at_a_time(no_support))
        other_types = dataclasses.replace(pred, support_labels=pred.support_labels.astype(np.float64),
                                          exemplar_distance=pred.exemplar_distance.astype(np.int64))
        assert _typed(other_types.to_dicts()) == _typed(_rows_one_value_at_a_time(other_types))
