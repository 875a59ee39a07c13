"""Small first-hour surprises, through the interface a user touches: ``inspect`` reports the exemplar width M
the model was trained with, ``est.save(path, overwrite=True)`` keeps the training report of the same training,
and ``Dataset.to_jsonl`` writes the JSONL that ``sdm-mlx`` reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sdm_mlx.storage.datasets import Dataset, factcheck_splits, read_jsonl
from sdm_mlx.errors import InputError
from sdm_mlx.estimator import SDMEstimator


def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "sdm_mlx", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model trained by ``sdm-mlx train`` with M = 200 on 32 input features, from rows Dataset.to_jsonl wrote."""
    d = tmp_path_factory.mktemp("first_hour_model")
    pool = factcheck_splits()[0].subset(range(0, 1200))
    assert pool.to_jsonl(d / "train.jsonl") == 1200
    r = cli("train", "--train", "train.jsonl", "--output", "model", "--iterations", "1", "--epochs", "2",
            "--exemplar-dim", "200", "--quiet", cwd=d)
    assert r.returncode == 0, r.stderr
    return d


def test_inspect_reports_the_exemplar_width_m(trained):
    r = cli("inspect", "--model", "model", cwd=trained)
    assert r.returncode == 0, r.stderr
    assert "input dim: 32   exemplar dim (M): 200" in r.stdout
    assert "stores 32 coordinates per row" in r.stdout  # the exact change of basis, said as such
    s = json.loads(cli("inspect", "--model", "model", "--json", cwd=trained).stdout)
    assert s["exemplar_dim"] == 200 and s["support_coordinate_dim"] == 32


def test_save_with_overwrite_keeps_the_report_of_the_same_training(trained, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(trained / "model", model)
    report = (model / "training_report.json").read_text()
    est = SDMEstimator.load(model)
    pool = factcheck_splits()[0]
    est.add_support(pool.X[1200:1210], pool.y[1200:1210], ids=pool.ids[1200:1210])  # feedback, no retraining
    est.save(model, overwrite=True)
    assert (model / "training_report.json").read_text() == report
    assert len(SDMEstimator.load(model).support_ids_) == len(est.support_ids_)
    # a model of another training does not inherit a report that describes a different one
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a one-epoch model that admits nothing warns so
        other = SDMEstimator(iterations=1, epochs=1, exemplar_dim=16, seed=3, verbose=False).fit(pool.X[:400],
                                                                                               pool.y[:400])
    other.save(model, overwrite=True)
    assert not (model / "training_report.json").exists()


def test_dataset_to_jsonl_round_trips_and_names_its_field(tmp_path):
    _, _, generated = factcheck_splits()
    n = generated.to_jsonl(tmp_path / "g.jsonl")
    back = read_jsonl(tmp_path / "g.jsonl")
    assert n == len(generated) == len(back) and back.features == "attributes"
    assert back.ids == generated.ids and np.array_equal(back.y, generated.y)
    assert np.array_equal(back.X, generated.X) and back.documents == generated.documents
    ds = Dataset(ids=["a", "b"], X=np.eye(2, dtype=np.float32))  # no labels, no field: 'embedding'
    assert ds.to_dicts() == [{"id": "a", "embedding": [1.0, 0.0]}, {"id": "b", "embedding": [0.0, 1.0]}]
    both = Dataset(ids=["a"], X=np.ones((1, 3), dtype=np.float32), features="embedding+attributes")
    with pytest.raises(InputError, match="give field='embedding' or field='attributes'"):
        both.to_jsonl(tmp_path / "x.jsonl")
    assert both.to_dicts(field="attributes") == [{"id": "a", "attributes": [1.0, 1.0, 1.0]}]
