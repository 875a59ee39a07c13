import json

import numpy as np
import pytest

from sdm_mlx.storage.datasets import check_features, check_labels, factcheck_splits, load_factcheck, read_jsonl


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_embedded_factcheck():
    topics = load_factcheck()
    assert len(topics) == 6085 and topics.X.shape[1] == 32
    assert set(np.unique(topics.y)) == {0, 1}
    gen = load_factcheck("generated")
    assert len(gen) == 245
    pool, held, shifted = factcheck_splits(0.15, seed=0)
    assert len(pool) + len(held) == 6085 and not set(pool.ids) & set(held.ids)


def test_read_jsonl_features(tmp_path):
    p = write(tmp_path / "a.jsonl", [
        {"id": "a", "label": 0, "embedding": [1, 2], "attributes": [3], "document": "x"},
        {"id": "b", "label": 1, "embedding": [4, 5], "attributes": [6]},
    ])
    ds = read_jsonl(p)
    np.testing.assert_array_equal(ds.X, [[1, 2, 3], [4, 5, 6]])
    assert read_jsonl(p, features="embedding").X.shape == (2, 2)
    assert ds.documents == ["x", None]


@pytest.mark.parametrize(
    "rows,match",
    [
        (['{"id": "a", "label": 0, "embedding": [1, 2]}', '{"id": "b", "label": 1, "embe'], "malformed JSON"),
        ([{"id": "a", "label": 0, "embedding": [1, 2]}, {"id": "b", "label": 0, "embedding": [1]}], "earlier rows have 2"),
        ([{"id": "a", "label": 0, "embedding": [1, "NaN"]}], "numbers"),
        ([{"id": "a", "label": 0, "embedding": [1, float("nan")]}], "NaN or Inf"),
        ([{"id": "a", "embedding": [1, 2]}], "missing field 'label'"),
        ([{"label": 0, "embedding": [1, 2]}], "missing field 'id'"),
        ([{"id": "a", "label": 0.5, "embedding": [1, 2]}], "label must be an integer"),
        ([{"id": "a", "label": 0, "embedding": [1]}, {"id": "a", "label": 0, "embedding": [1]}], "duplicate id"),
        ([{"id": "a", "label": 0}], "missing field 'attributes'"),
    ],
)
def test_read_jsonl_errors(tmp_path, rows, match):
    p = write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=match):
        read_jsonl(p)


def test_checks():
    with pytest.raises(ValueError, match=r"0\.\.1"):
        check_labels(np.array([0, 2]), 2, "train")
    with pytest.raises(ValueError, match="dimension 3"):
        check_features(np.zeros((2, 3)), "x", dim=4)
    with pytest.raises(ValueError, match="NaN"):
        check_features(np.array([[np.inf]]), "x")
    with pytest.raises(FileNotFoundError):
        read_jsonl("/nonexistent.jsonl")
