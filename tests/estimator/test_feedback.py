"""Feedback without retraining (docs/feedback.md): support-set appends/removals through the API and the CLI.

One small Gaussian model (two classes in 8-D) is fitted per module.  A far cluster (every
coordinate shifted by +6, all class 1) is rejected as out of distribution; enough correctly
labelled rows from it make its queries admissible.  What changes (q, d0, d, exemplars) and what
does not (adaptor, calibration arrays, eCDFs, W'', thresholds, offsets) is checked bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from sdm_mlx.storage.artifact import ArtifactError
from sdm_mlx.errors import InputError
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.estimator.feedback import LOG_FILE, RETRAIN_FRACTION
from sdm_mlx.estimator.updates import add_support_to_model, remove_support_from_model

FAR_SHIFT = 6.0


def gaussians(rng, n, shift=0.0, dim=8, sep=0.5, label=None):
    y = rng.integers(0, 2, n) if label is None else np.full(n, label)
    mu = np.where(y[:, None] == 1, sep, -sep) * np.ones((n, dim))
    return (mu + rng.normal(size=(n, dim)) + shift).astype(np.float32), y.astype(np.int64)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    rng = np.random.default_rng(0)
    X, y = gaussians(rng, 2000)
    est = SDMEstimator(alpha=0.9, iterations=3, epochs=8, exemplar_dim=32, learning_rate=1e-3,
                       rescaler_max_epochs=200, verbose=False).fit(X, y)
    path = str(tmp_path_factory.mktemp("feedback") / "model")
    est.save(path)
    far_X, far_y = gaussians(np.random.default_rng(1), 400, shift=FAR_SHIFT, label=1)
    near_X, near_y = gaussians(np.random.default_rng(2), 300)
    return {"path": path, "far": (far_X, far_y), "near": (near_X, near_y)}


def fresh(trained, backend="exact") -> SDMEstimator:
    est = SDMEstimator.load(trained["path"])
    est.verbose = False
    if backend != est.index_backend:
        est.index_backend = backend
        est._prepare_predict()
    return est


def same_predictions(a, b) -> bool:
    fields = ("prediction", "logits", "q", "d0", "d", "sdm", "p_lower", "admitted", "exemplar_index",
              "exemplar_distance", "rejection_reason")
    return all(np.array_equal(getattr(a, f), getattr(b, f), equal_nan=getattr(a, f).dtype.kind == "f")
               for f in fields)


def fixed_statistics(est) -> dict:
    """Everything feedback must leave alone: adaptor, calibration split, eCDFs, rounds (W'', ψ, bins), Cauchy."""
    out = {f"adaptor/{k}": np.array(v) for k, v in
           __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(est.model_.parameters())}
    for name in ("calibration_distance_ecdfs_", "training_distance_ecdfs_"):
        for c, a in enumerate(getattr(est, name)):
            out[f"{name}{c}"] = np.array(a)
    for j, r in enumerate(est.rounds_):
        for k, v in r.to_arrays()[0].items():
            out[f"round{j}/{k}"] = v
    out["calibration_logits"] = np.array(est.calibration_logits_)
    out["offsets"] = np.array(est.offsets_, dtype=np.float64)
    out["robust"] = np.array([est.robust_min_valid_, est.calibration_.min_valid, est.k_], dtype=np.float64)
    out["psi"] = np.array(est.calibration_.psi)
    return out


# ------------------------------------------------------------------------------------------------ API


@pytest.mark.parametrize("backend", ["exact", "hnsw"])
def test_far_class_admitted_after_correct_rows(trained, backend):
    est = fresh(trained, backend)
    far_X, far_y = trained["far"]
    before = est.estimate(far_X[:100])
    assert not before.admitted.any() and set(before.rejection_reason) == {"ood_distance"}
    index = est.index_
    size = index.size
    entries = est.add_support(far_X[100:], far_y[100:], ids=[f"far-{i}" for i in range(300)])
    assert est.index_ is index and index.size == size + 300  # appended, not rebuilt
    if backend == "hnsw":
        assert index._index.get_current_count() == size + 300
    assert [e["id"] for e in entries[:2]] == ["far-0", "far-1"] and {e["op"] for e in entries} == {"add"}
    after = est.estimate(far_X[:100])
    assert after.admitted.mean() > 0.8, after.admitted.mean()
    assert (after.d0 < before.d0).all() and (after.d[after.admitted] > 0).all() and (before.d == 0).all()
    assert all(est.support_ids_[j].startswith("far-") for j in after.exemplar_index[:, 0])


def test_wrongly_admitted_row_labelled_wrong_lowers_q_of_neighbours(trained):
    est = fresh(trained)
    near_X, near_y = trained["near"]
    p = est.estimate(near_X)
    i = int(np.flatnonzero(p.admitted & (p.q > 5))[0])
    wrong = 1 - int(p.prediction[i])
    rng = np.random.default_rng(3)
    neighbours = near_X[i] + 0.05 * rng.normal(size=(10, near_X.shape[1])).astype(np.float32)
    q_before = est.estimate(neighbours).q
    est.add_support(near_X[i:i + 1], [wrong], ids=["said-wrong"])  # "this admitted answer was wrong"
    assert est.support_predictions_[-1] != est.support_labels_[-1]
    after = est.estimate(np.concatenate([near_X[i:i + 1], neighbours]))
    assert after.q[0] == 0 and not after.admitted[0]  # its own nearest neighbour is now a bad one
    assert (after.q[1:] < q_before).all()
    est.remove_support(["said-wrong"])
    assert np.array_equal(est.estimate(neighbours).q, q_before)


def test_calibration_statistics_do_not_change(trained):
    est = fresh(trained)
    before = fixed_statistics(est)
    far_X, far_y = trained["far"]
    est.add_support(far_X[:50], far_y[:50])
    est.add_support(trained["near"][0][:20], 1 - trained["near"][1][:20], source="test")
    est.estimate(far_X[50:60])
    after = fixed_statistics(est)
    assert before.keys() == after.keys()
    for k in before:
        assert np.array_equal(before[k], after[k], equal_nan=True), k


def test_undo_restores_predictions_bit_identically(trained):
    est = fresh(trained)
    Q = np.concatenate([trained["far"][0][:30], trained["near"][0][:60]])
    p0 = est.estimate(Q)
    est.add_support(trained["far"][0][100:200], trained["far"][1][100:200], ids=list(range(100)))
    est.add_support(trained["near"][0][:30], trained["near"][1][:30], ids=[f"n{i}" for i in range(30)])
    assert not same_predictions(p0, est.estimate(Q))
    entries = est.remove_support(list(range(100)) + [f"n{i}" for i in range(30)], source="test")
    assert len(entries) == 130 and {e["op"] for e in entries} == {"remove"}
    assert same_predictions(p0, est.estimate(Q))
    assert est.feedback_state_.added() == 0 and len(est.feedback_state_.log) == 260


def test_remove_only_feedback_rows(trained):
    est = fresh(trained)
    est.add_support(trained["near"][0][:2], trained["near"][1][:2], ids=["a", "b"])
    with pytest.raises(InputError, match="only rows added by feedback"):
        est.remove_support([est.support_ids_[0]])
    with pytest.raises(InputError, match="only rows added by feedback"):
        est.remove_support([est.calibration_ids_[0]])
    with pytest.raises(InputError, match="'zz' is not a support row"):
        est.remove_support(["a", "zz"])
    with pytest.raises(InputError, match="given twice"):
        est.remove_support(["a", "a"])
    assert est.support_ids_[-2:] == ["a", "b"]  # a refused removal changes nothing


def test_add_support_validation(trained):
    est = fresh(trained)
    X, y = trained["near"][0][:3], trained["near"][1][:3]
    n = len(est.support_ids_)
    cases = [
        (dict(X=X[:, :5], y=y), "dimension 5"),
        (dict(X=np.where(np.eye(3, 8, dtype=bool), np.nan, X), y=y), "NaN or Inf"),
        (dict(X=X, y=[0, 1, 2]), r"labels must be in 0\.\.1"),
        (dict(X=X, y=[True, False, True]), "integer class labels"),
        (dict(X=X, y=[0, 1]), "2 labels for 3 rows"),
        (dict(X=X, y=y, ids=["a", "b", "a"]), "duplicate id 'a'"),
        (dict(X=X, y=y, ids=["a", "b", est.support_ids_[5]]), "already a support or calibration row"),
        (dict(X=X, y=y, ids=["a", "b", est.calibration_ids_[0]]), "already a support or calibration row"),
        (dict(X=X, y=y, ids=["a", "b", 1.5]), "strings or integers"),
        (dict(X=X, y=y, source=""), "source"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            est.add_support(**kwargs)
    assert len(est.support_ids_) == n and not est.feedback_state_.log


# ------------------------------------------------------------------------------------------------ persistence


def test_persisted_updates_reload_equal_in_memory(trained, tmp_path):
    import shutil

    path = str(tmp_path / "model")
    shutil.copytree(trained["path"], path)
    far_X, far_y = trained["far"]
    mem = fresh(trained)
    mem.estimate(far_X[:5])  # the index exists: the updates below append to / remove from it in place
    mem.add_support(far_X[100:200], far_y[100:200], ids=[f"f{i}" for i in range(100)], source="api")
    mem.remove_support(["f3", "f7"])
    add_support_to_model(path, far_X[100:200], far_y[100:200], ids=[f"f{i}" for i in range(100)], source="api")
    remove_support_from_model(path, ["f3", "f7"])
    loaded = SDMEstimator.load(path)
    Q = np.concatenate([far_X[:40], trained["near"][0][:40]])
    assert same_predictions(mem.estimate(Q), loaded.estimate(Q))
    with open(os.path.join(path, LOG_FILE), encoding="utf-8") as f:
        log = [json.loads(line) for line in f]
    assert [e["op"] for e in log] == ["add"] * 100 + ["remove"] * 2
    assert log[0]["id"] == "f0" and log[0]["label"] == 1 and log[0]["source"] == "api"
    assert {"op", "id", "label", "predicted_label", "time", "source"} == set(log[0])
    predicted = {e["id"]: e["predicted_label"] for e in log if e["op"] == "add"}
    assert [predicted[i] for i in loaded.support_ids_[-98:]] == loaded.support_predictions_[-98:].tolist()
    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    assert LOG_FILE in manifest["texts"] and manifest["meta"]["n_training_support"] == mem.feedback_state_.n_training
    with open(os.path.join(path, LOG_FILE), "a", encoding="utf-8") as f:  # the log is checksummed
        f.write("{}\n")
    with pytest.raises(ArtifactError, match=f"checksum mismatch for {LOG_FILE}"):
        SDMEstimator.load(path)


KILL_SCRIPT = """
import sys, numpy as np
from sdm_mlx.estimator.updates import add_support_to_model
path, n = sys.argv[1], 0
rng = np.random.default_rng(0)
while True:
    X = rng.normal(size=(5, 8)).astype(np.float32)
    add_support_to_model(path, X, rng.integers(0, 2, 5), ids=[f"k{n}-{i}" for i in range(5)], source="kill")
    n += 1
    print(n, flush=True)
"""


def test_kill9_during_updates_leaves_a_loadable_model(trained, tmp_path):
    import shutil

    path = str(tmp_path / "model")
    shutil.copytree(trained["path"], path)
    n_train = len(SDMEstimator.load(path).support_ids_)
    rng = np.random.default_rng(0)
    sizes = set()
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, path], stdout=subprocess.PIPE, text=True)
        try:
            proc.stdout.readline()  # at least one update done; kill the next one somewhere in its course
            time.sleep(float(rng.uniform(0.0, 0.4)))
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
        est = SDMEstimator.load(path)  # previous or new state, never corrupt
        added = len(est.support_ids_) - n_train
        assert added % 5 == 0 and est.feedback_state_.added() == added
        assert len(est.feedback_state_.log) == added
        assert est.support_vectors_.shape[0] == len(est.support_labels_) == len(est.support_ids_)
        sizes.add(added)
    assert max(sizes) >= 5
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".sdm-tmp") or n.endswith(".sdm-previous")]
    add_support_to_model(path, np.zeros((1, 8), np.float32), [0], ids=["last"])  # the next update cleans up
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".sdm-tmp")], leftovers


# ------------------------------------------------------------------------------------------------ CLI


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "sdm_mlx", *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=120)


def write_rows(path, X, y, ids):
    with open(path, "w", encoding="utf-8") as f:
        for rid, x, label in zip(ids, X, y):
            f.write(json.dumps({"id": rid, "label": int(label), "embedding": x.tolist()}) + "\n")


def test_cli_add_support_undo_and_inspect(trained, tmp_path):
    import shutil

    path = str(tmp_path / "model")
    shutil.copytree(trained["path"], path)
    far_X, far_y = trained["far"]
    queries = tmp_path / "queries.jsonl"
    write_rows(queries, far_X[:50], far_y[:50], [f"q{i}" for i in range(50)])

    def admitted() -> float:
        r = cli("predict", "--model", path, "--input", queries)
        assert r.returncode == 0, r.stderr
        return float(np.mean([json.loads(line)["admitted"] for line in r.stdout.splitlines()]))

    assert admitted() == 0.0
    rows = tmp_path / "rows.jsonl"
    write_rows(rows, far_X[100:], far_y[100:], list(range(300)))
    r = cli("add-support", "--model", path, "--input", rows, "--source", "reviewer")
    assert r.returncode == 0, r.stderr
    assert "added 300 row(s)" in r.stdout and "RETRAIN" not in r.stdout
    assert "note:" in r.stderr and "retrain" in r.stderr  # 300 rows > 10% of the class-1 training support
    assert admitted() > 0.8
    r = cli("inspect", "--model", path, "--json")
    s = json.loads(r.stdout)
    assert s["added_rows"] == 300 and s["added_by_source"] == {"reviewer": 300} and s["retrain_recommended"]
    assert s["added_fraction"] > RETRAIN_FRACTION and s["last_update"]
    r = cli("inspect", "--model", path)
    assert r.returncode == 0 and "added since training: 300 rows" in r.stdout and "RETRAIN" in r.stdout
    r = cli("add-support", "--model", path, "--undo", *range(300))
    assert r.returncode == 0, r.stderr
    assert "removed 300 row(s)" in r.stdout and admitted() == 0.0
    s = json.loads(cli("inspect", "--model", path, "--json").stdout)
    assert s["added_rows"] == 0 and s["removed_rows"] == 300 and not s["retrain_recommended"]


def test_cli_errors(trained, tmp_path):
    import shutil

    path = str(tmp_path / "model")
    shutil.copytree(trained["path"], path)
    X, y = trained["near"]
    rows = tmp_path / "rows.jsonl"
    write_rows(rows, X[:2], [0, 5], ["a", "b"])
    bad_label = cli("add-support", "--model", path, "--input", rows)
    write_rows(rows, X[:2, :4], y[:2], ["a", "b"])
    bad_width = cli("add-support", "--model", path, "--input", rows)
    both = cli("add-support", "--model", path, "--input", rows, "--undo", "a")
    undo_training = cli("add-support", "--model", path, "--undo", SDMEstimator.load(path).support_ids_[0])
    missing = cli("add-support", "--model", tmp_path / "nope", "--undo", "a")
    inside = os.path.join(path, "rows.jsonl")
    shutil.copy(rows, inside)
    input_inside = cli("add-support", "--model", path, "--input", inside)
    os.remove(inside)
    inspect_missing = cli("inspect", "--model", tmp_path / "nope")
    for r, message in [(bad_label, "labels must be in 0..1"), (bad_width, "dimension 4"),
                       (both, "exactly one of --input"), (undo_training, "only rows added by feedback"),
                       (missing, "no model artifact"), (inspect_missing, "no model artifact"),
                       (input_inside, "contains the input --input")]:
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (message, r.stderr)
    assert not SDMEstimator.load(path).feedback_state_.log  # nothing was written by the refused updates
    assert not os.path.exists(tmp_path / ".nope.sdm-lock")
    fresh_model = cli("inspect", "--model", path)
    assert fresh_model.returncode == 0 and "added since training: 0 rows" in fresh_model.stdout
    assert "last update: never" in fresh_model.stdout


def test_labels_in_the_estimators_label_space():
    import warnings

    rng = np.random.default_rng(5)
    X, y = gaussians(rng, 200)
    names = np.array(["neg", "pos"])[y]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = SDMEstimator(iterations=1, epochs=2, exemplar_dim=8, verbose=False).fit(X, names)
    entries = est.add_support(X[:2], ["pos", "neg"], ids=["s1", "s2"])
    assert [e["label"] for e in entries] == [1, 0]  # the log holds class indices of classes_
    assert est.support_labels_[-2:].tolist() == [1, 0]
    with pytest.raises(InputError, match=r"\['maybe'\] are not classes of this model"):
        est.add_support(X[:1], ["maybe"], ids=["s3"])
    with pytest.raises(InputError, match="not classes of this model"):
        est.add_support(X[:1], [1], ids=["s3"])
