"""The writer protocol of a model directory (``sdm_mlx.storage.artifact``), through the CLI and the Python API.

Concurrent ``add-support`` / ``--undo`` processes, a Python API writer and readers on one model: no row
is lost (the rows on disk always equal the update log), no reader sees a mix of versions; ``kill -9`` at
random points leaves a model whose rows equal its log; a write-protected directory is refused and left
as it was; a moved model is not revived; storage failures and hand-edited manifests get clear exit-2
errors.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from sdm_mlx.errors import ArtifactError
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.estimator.updates import add_support_to_model
from sdm_mlx.estimator.feedback import summary

CLI = [sys.executable, "-m", "sdm_mlx"]
DIM = 6


def rows_file(path, prefix: str, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{prefix}{i}", "label": i % 2,
                                "embedding": rng.normal(size=DIM).round(4).tolist()}) + "\n")
    return str(path)


def consistent(path) -> dict:
    """The model's summary, after checking that its added rows equal what its update log says."""
    est = SDMEstimator.load(path)
    s = summary(est)
    adds = sum(e["op"] == "add" for e in est.feedback_state_.log)
    removes = sum(e["op"] == "remove" for e in est.feedback_state_.log)
    assert s["added_rows"] == adds - removes, (s["added_rows"], adds, removes)
    return s


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    n = 200
    y = np.arange(n) % 2
    X = (rng.normal(size=(n, DIM)) + 2.0 * y[:, None]).astype(np.float32)
    est = SDMEstimator(alpha=0.7, iterations=1, epochs=2, exemplar_dim=8, rescaler_max_epochs=20, verbose=False)
    est.fit(X, y)
    path = tmp_path_factory.mktemp("writers") / "base"
    est.save(path)
    return path


def fresh(model_dir, tmp_path, name="m"):
    dst = tmp_path / name
    shutil.copytree(model_dir, dst)
    return dst


#: reads the model in a loop until the file ``stop`` exists (the writers are done), at most ``seconds``
_READER = """
import os, sys, time
from sdm_mlx.estimator import SDMEstimator
path, stop, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
ok = bad = 0
end = time.time() + seconds
while time.time() < end and not (ok and os.path.exists(stop)):
    try:
        est = SDMEstimator.load(path)
        assert len(est.support_ids_) == est.support_vectors_.shape[0]
        ok += 1
    except Exception as e:
        bad += 1
        print("reader error:", type(e).__name__, e, file=sys.stderr)
print(ok, bad)
"""

_API_WRITER = """
import sys
import numpy as np
from sdm_mlx.estimator.updates import add_support_to_model
path, rounds = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(7)
for r in range(rounds):
    add_support_to_model(path, rng.normal(size=(2, 6)), [0, 1], ids=[f"api{r}-0", f"api{r}-1"], source="api")
print("done")
"""


def test_concurrent_cli_api_writers_and_readers_lose_nothing(model_dir, tmp_path):
    path = fresh(model_dir, tmp_path)
    (tmp_path / "reader.py").write_text(_READER)
    (tmp_path / "api.py").write_text(_API_WRITER)
    stop = tmp_path / "writers_done"
    reader = subprocess.Popen([sys.executable, str(tmp_path / "reader.py"), str(path), str(stop), "240"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    api = subprocess.Popen([sys.executable, str(tmp_path / "api.py"), str(path), "4"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writers = []
    for w in range(3):
        for r in range(2):
            f = rows_file(tmp_path / f"w{w}r{r}.jsonl", f"w{w}r{r}-", 3, seed=10 * w + r)
            writers.append(f)
    procs = [subprocess.Popen([*CLI, "add-support", "--model", str(path), "--input", f],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in writers]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    out, err = api.communicate(timeout=300)
    assert api.returncode == 0, err
    undo = subprocess.run([*CLI, "add-support", "--model", str(path), "--undo", "w0r0-0", "api0-1"],
                          capture_output=True, text=True, timeout=300)
    assert undo.returncode == 0, undo.stderr
    stop.touch()  # the reader read throughout the writes (it ran 25 s whatever they took before)
    out, err = reader.communicate(timeout=300)
    ok, bad = map(int, out.split())
    assert bad == 0 and ok > 0, err[-2000:]
    s = consistent(path)
    assert s["added_rows"] == 3 * 2 * 3 + 4 * 2 - 2
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".sdm-tmp", ".sdm-previous", ".sdm-lock"))]


_COUNTER = """
import os, sys
from sdm_mlx.storage.locks import artifact_lock
path, n = sys.argv[1], int(sys.argv[2])
counter = path + ".count"
for _ in range(n):
    with artifact_lock(path):  # read, yield the CPU, write: a lost update unless the lock excludes
        value = int(open(counter).read())
        os.sched_yield()
        with open(counter, "w") as f:
            f.write(str(value + 1))
print("done")
"""


def test_the_lock_excludes_while_its_file_comes_and_goes(tmp_path):
    # the lock file is removed by each holder on release (no litter); a waiter that then holds an unlinked file
    # must take the new one, or two processes would hold "the" lock at once and lose increments
    path = str(tmp_path / "m")
    (tmp_path / "m.count").write_text("0")
    (tmp_path / "counter.py").write_text(_COUNTER)
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "counter.py"), path, "150"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "done", err
    assert (tmp_path / "m.count").read_text() == str(4 * 150)
    assert not (tmp_path / ".m.sdm-lock").exists()


_UPDATER = """
import sys
import numpy as np
from sdm_mlx.estimator.updates import add_support_to_model, remove_support_from_model
path, tag = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(int(tag))
print("ready", flush=True)
for i in range(1000):
    add_support_to_model(path, rng.normal(size=(3, 6)), [0, 1, 1], ids=[f"k{tag}-{i}-{j}" for j in range(3)])
    if i % 3 == 2:
        remove_support_from_model(path, [f"k{tag}-{i}-0"])
"""


def test_kill_9_at_random_points_keeps_rows_equal_to_the_log(model_dir, tmp_path):
    path = fresh(model_dir, tmp_path)
    (tmp_path / "upd.py").write_text(_UPDATER)
    rnd = random.Random(3)
    for k in range(6):
        p = subprocess.Popen([sys.executable, str(tmp_path / "upd.py"), str(path), str(k)], stdout=subprocess.PIPE,
                             text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rnd.uniform(0.05, 1.5))
        p.send_signal(signal.SIGKILL)
        p.wait()
        consistent(path)
    add_support_to_model(path, np.zeros((1, DIM)), [1], ids=["after"])  # the next writer cleans up
    consistent(path)
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".sdm-tmp", ".sdm-previous"))]


def test_write_protected_model_is_refused_and_untouched(model_dir, tmp_path):
    path = fresh(model_dir, tmp_path)
    before = sorted(os.listdir(path))
    inode = os.stat(path).st_ino
    os.chmod(path, 0o555)
    try:
        rows = rows_file(tmp_path / "add.jsonl", "x", 2, 1)
        r = subprocess.run([*CLI, "add-support", "--model", str(path), "--input", rows], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 2 and "cannot write" in r.stderr and "write-protected" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        with pytest.raises(ArtifactError, match="write-protected"):
            add_support_to_model(path, np.zeros((1, DIM)), [1])
        with pytest.raises(ArtifactError, match="write-protected"):
            SDMEstimator.load(path).save(path, overwrite=True)
        assert os.stat(path).st_ino == inode and sorted(os.listdir(path)) == before
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o555
        assert not [n for n in os.listdir(tmp_path) if n.endswith((".sdm-tmp", ".sdm-previous"))]
    finally:
        os.chmod(path, 0o755)
    consistent(path)


def test_a_moved_model_is_not_revived(model_dir, tmp_path):
    path = fresh(model_dir, tmp_path)
    add_support_to_model(path, np.zeros((1, DIM)), [1], ids=["one"])
    os.rename(path, tmp_path / "moved")
    r = subprocess.run([*CLI, "inspect", "--model", str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no model artifact" in r.stderr
    assert not path.exists() and consistent(tmp_path / "moved")["added_rows"] == 1


def test_a_save_over_a_changed_model_is_refused(model_dir, tmp_path):
    path = fresh(model_dir, tmp_path)
    stale = SDMEstimator.load(path)
    add_support_to_model(path, np.zeros((2, DIM)), [0, 1], ids=["a", "b"])  # another writer
    stale.add_support(np.ones((1, DIM)), [1], ids=["c"])
    with pytest.raises(ArtifactError, match="changed by another writer"):
        stale.save(path, overwrite=True)
    assert consistent(path)["added_rows"] == 2  # the other writer's rows are kept
    fresh_est = SDMEstimator.load(path)
    fresh_est.add_support(np.ones((1, DIM)), [1], ids=["c"])
    fresh_est.save(path, overwrite=True)  # loaded from the current version: allowed
    assert consistent(path)["added_rows"] == 3


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))  # writes beyond fail with EFBIG, like a full disk


@pytest.mark.parametrize("verb", ["add-support", "recalibrate", "train"])
def test_storage_failure_is_exit_2_cannot_write(model_dir, tmp_path, verb):
    path = fresh(model_dir, tmp_path)
    rows = rows_file(tmp_path / "rows.jsonl", "r", 200, 2)
    args = {"add-support": ["--model", path, "--input", rows],
            "recalibrate": ["--model", path, "--alpha", "0.6", "--output", path, "--overwrite"],
            "train": ["--train", rows, "--output", tmp_path / "new", "--epochs", "1", "--iterations", "1",
                      "--exemplar-dim", "4", "--rescaler-max-epochs", "5", "--quiet"]}[verb]
    before = SDMEstimator.load(path).feedback_state_.log
    r = subprocess.run([*CLI, verb, *map(str, args)], capture_output=True, text=True, timeout=300,
                       preexec_fn=_limit_file_size)
    assert r.returncode == 2, r.stderr
    assert "cannot write" in r.stderr and "internal error" not in r.stderr and "Traceback" not in r.stderr
    assert SDMEstimator.load(path).feedback_state_.log == before
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".sdm-tmp", ".sdm-previous"))]


def test_format_version_as_a_string_is_named(model_dir, tmp_path):
    path = fresh(model_dir, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = "1"
    (path / "manifest.json").write_text(json.dumps(manifest))
    r = subprocess.run([*CLI, "inspect", "--model", str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert 'format_version must be the integer 1, found "1" (a str)' in r.stderr, r.stderr
