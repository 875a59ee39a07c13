"""Safe outputs, strict JSON and input handling — what must work, end to end."""

import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from sdm_mlx.storage.artifact import prepare_run_directory
from sdm_mlx.errors import ArtifactError, OutputError, SDMError
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.storage.files import atomic_write, get_float, iter_jsonl, loads_strict, put_float, strict, write_jsonl
from cli_lab import TINY, cli, rows, snapshot, write_rows  # tests/helpers/ (the lab fixture: conftest.py)


@pytest.fixture
def box(lab, tmp_path):
    b = tmp_path / "box"
    shutil.copytree(lab, b, symlinks=True)
    return b


def _strict_lines(text):
    return [loads_strict(line) for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------ inputs
def test_bom_and_stdin_inputs(box):
    raw = (box / "test.jsonl").read_bytes()
    (box / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + raw)
    ref = cli("predict", "--model", "model", "--input", "test.jsonl", cwd=box)
    bom = cli("predict", "--model", "model", "--input", "bom.jsonl", cwd=box)
    std = cli("predict", "--model", "model", "--input", "-", cwd=box, stdin="\ufeff" + raw.decode())
    assert ref.returncode == bom.returncode == std.returncode == 0, (bom.stderr, std.stderr)
    assert _strict_lines(ref.stdout) == _strict_lines(bom.stdout) == _strict_lines(std.stdout)
    assert len(_strict_lines(ref.stdout)) == 12
    assert [n for n, _ in iter_jsonl(["\ufeff{\"a\": 1}\n", "\n", "{\"b\": 2}\n"])] == [1, 3]


def test_feature_field_is_remembered(box, tmp_path):
    """The model was trained on 'embedding'; rows carrying both fields use it by default."""
    r = cli("predict", "--model", "model", "--input", "test.jsonl", "--output", "p.jsonl", cwd=box)
    assert r.returncode == 0, r.stderr
    est = SDMEstimator.load(box / "model")
    assert est.feature_field_ == "embedding"
    X = np.array([row["embedding"] for row in rows(12, seed=1)], dtype=np.float32)
    got = [row["p_lower"] for row in _strict_lines((box / "p.jsonl").read_text())]
    np.testing.assert_array_equal(np.nan_to_num(got, nan=-1), np.nan_to_num(est.estimate(X).p_lower, nan=-1))
    # an artifact without the field (older versions) falls back to auto: both fields, a clear width error
    est.feature_field_ = None
    est.save(tmp_path / "old")
    r = cli("predict", "--model", tmp_path / "old", "--input", "test.jsonl", cwd=box)
    assert r.returncode == 2 and "test.jsonl" in r.stderr and "--features" in r.stderr
    assert "Traceback" not in r.stderr
    r = cli("predict", "--model", tmp_path / "old", "--input", "test.jsonl", "--features", "embedding", cwd=box)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------ outputs
def test_symlink_output_is_written_through(box):
    (box / "real").mkdir()
    (box / "real" / "p.jsonl").write_text("old\n")
    os.symlink("real/p.jsonl", box / "link.jsonl")
    os.symlink("real/new.jsonl", box / "dangling.jsonl")
    for name in ("link.jsonl", "dangling.jsonl"):
        r = cli("predict", "--model", "model", "--input", "test.jsonl", "--output", name, cwd=box)
        assert r.returncode == 0, r.stderr
        assert os.path.islink(box / name)
    assert len(_strict_lines((box / "real" / "p.jsonl").read_text())) == 12
    assert len(_strict_lines((box / "real" / "new.jsonl").read_text())) == 12
    assert stat.S_IMODE(os.stat(box / "real" / "p.jsonl").st_mode) == 0o644


def test_devices_fifos_and_process_substitution_are_streamed(box):
    r = cli("predict", "--model", "model", "--input", "test.jsonl", "--output", "/dev/null", "--summary",
            "/dev/null", cwd=box)
    assert r.returncode == 0, r.stderr
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    fifo = box / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, encoding="utf-8").read()))
    reader.start()
    r = cli("predict", "--model", "model", "--input", "test.jsonl", "--output", "fifo", cwd=box)
    reader.join(60)
    assert r.returncode == 0, r.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert len(_strict_lines(got[0])) == 12
    assert not [n for n in os.listdir(box) if "tmp" in n]
    cmd = (f"{sys.executable} -m sdm_mlx predict --model model --input test.jsonl --output >(wc -l > count.txt); "
           "sleep 1")
    r = subprocess.run(["bash", "-c", cmd], cwd=box, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for _ in range(50):
        if (box / "count.txt").exists() and (box / "count.txt").read_text().strip():
            break
        time.sleep(0.1)
    assert (box / "count.txt").read_text().strip() == "12"
    assert ".tmp" not in r.stderr


def test_stdout_dash_and_append_outputs_keep_devices(box):
    write_rows(box / "docs.jsonl", [{"id": i, "document": "x"} for i in range(2)])
    # resumable append-mode outputs: a device is opened, never replaced (fails later on the missing model)
    r = cli("embed", "--model", "./no-model", "--input", "docs.jsonl", "--output", "/dev/null", cwd=box)
    assert r.returncode == 2 and "no-model" in r.stderr and "Traceback" not in r.stderr
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_strict_json_everywhere_and_no_threshold_round_trip(box):
    """The lab model has no valid threshold (+inf): every JSON file is strict and it round-trips."""
    cmds = [
        ("predict", "--model", "model", "--input", "test.jsonl", "--output", "p.jsonl", "--summary", "s.json"),
        ("evaluate", "--model", "model", "--input", "test.jsonl", "--report", "r.json", "--label-errors", "le.jsonl",
         "--quiet"),
        ("recalibrate", "--model", "model", "--alpha", "0.9", "--output", "model2"),
    ]
    for c in cmds:
        r = cli(*c, cwd=box)
        assert r.returncode == 0, r.stderr
    files = ["model/manifest.json", "model/training_report.json", "s.json", "r.json", "model2/manifest.json"]
    docs = {f: loads_strict((box / f).read_text()) for f in files}
    for f in ("p.jsonl", "le.jsonl"):
        _strict_lines((box / f).read_text())
    report, meta = docs["model/training_report.json"], docs["model/manifest.json"]["meta"]
    assert report["robust_min_valid_qbin"] is None and report["robust_min_valid_qbin_reason"].startswith("+inf")
    assert report["min_valid_qbin"] is None and "no valid threshold" in report["min_valid_qbin_reason"]
    assert meta["robust_min_valid"] is None and meta["rounds"][0]["min_valid"] is None
    assert get_float(meta["rounds"][0], "min_valid") == math.inf
    est = SDMEstimator.load(box / "model")
    assert est.calibration_.min_valid == math.inf and est.robust_min_valid_ == math.inf
    X = np.array([row["embedding"] for row in rows(12, seed=1)], dtype=np.float32)
    before = est.estimate(X)
    est.save(box / "again")
    after = SDMEstimator.load(box / "again").estimate(X)
    assert not after.admitted.any()
    assert list(after.rejection_reason) == list(before.rejection_reason)
    np.testing.assert_array_equal(after.q_tilde_lower, before.q_tilde_lower)


def test_strict_helpers():
    d = put_float({}, "t", math.inf, "rejects everything")
    assert d == {"t": None, "t_reason": "+inf: rejects everything"} and get_float(d, "t") == math.inf
    assert get_float(put_float({}, "t", 0.5, "x"), "t") == 0.5
    assert math.isnan(get_float(put_float({}, "t", math.nan, "x"), "t"))
    assert strict({"a": np.float32(np.nan), "b": np.arange(2), "c": (np.int64(3), np.bool_(True))}) == \
        {"a": None, "b": [0, 1], "c": [3, True]}


def test_permissions_under_umask_077(box):
    r = subprocess.run([sys.executable, "-m", "sdm_mlx", "train", "--train", "train.jsonl", "--output", "m077",
                        "--features", "embedding", *TINY], cwd=box, capture_output=True, text=True,
                       preexec_fn=lambda: os.umask(0o077))
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(box / "m077").st_mode) == 0o755
    for name in os.listdir(box / "m077"):
        assert stat.S_IMODE(os.stat(box / "m077" / name).st_mode) == 0o644, name
    r = subprocess.run([sys.executable, "-m", "sdm_mlx", "predict", "--model", "m077", "--input", "test.jsonl",
                        "--output", "out/p.jsonl"], cwd=box, capture_output=True, text=True,
                       preexec_fn=lambda: os.umask(0o077))
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(box / "out" / "p.jsonl").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(box / "out").st_mode) == 0o755


# ------------------------------------------------------------------------------------ directories
def test_overwrite_replaces_only_artifacts(box):
    (box / "model.previous").mkdir()  # a user's directory that merely looks like an old backup name
    (box / "model.previous" / "mine.txt").write_text("keep")
    (box / "model" / "notes.txt").write_text("inside the model dir")
    keep = snapshot(box / "model.previous")
    old = (box / "model" / "manifest.json").read_bytes()
    r = cli("train", "--train", "train.jsonl", "--output", "model", "--features", "embedding", "--overwrite",
            "--seed", "3", *TINY, cwd=box)
    assert r.returncode == 0, r.stderr
    assert (box / "model" / "manifest.json").read_bytes() != old
    assert snapshot(box / "model.previous") == keep
    assert not [n for n in os.listdir(box) if "sdm-tmp" in n or "sdm-previous" in n]
    r = cli("recalibrate", "--model", "model", "--alpha", "0.8", "--overwrite", cwd=box)
    assert r.returncode == 0, r.stderr
    assert SDMEstimator.load(box / "model").alpha == 0.8
    # an empty directory may be used; a symlinked output directory is written at its target
    (box / "empty").mkdir()
    os.symlink("empty", box / "linkdir")
    r = cli("recalibrate", "--model", "model", "--alpha", "0.7", "--output", "linkdir", cwd=box)
    assert r.returncode == 0, r.stderr
    assert os.path.islink(box / "linkdir") and SDMEstimator.load(box / "empty").alpha == 0.7


def test_python_save_refuses_without_overwrite(box):
    est = SDMEstimator.load(box / "model")
    with pytest.raises(ArtifactError, match="overwrite"):
        est.save(box / "model")
    (box / "foreign").mkdir()
    (box / "foreign" / "a.txt").write_text("x")
    with pytest.raises(ArtifactError, match="not an sdm_mlx artifact"):
        est.save(box / "foreign", overwrite=True)
    assert (box / "foreign" / "a.txt").read_text() == "x"
    assert issubclass(ArtifactError, SDMError)


def test_run_directories(tmp_path):
    run = tmp_path / "run"
    prepare_run_directory(run, "demo", overwrite=False)
    (run / "report.json").write_text("{}")
    with pytest.raises(OutputError, match="--overwrite"):
        prepare_run_directory(run, "demo", overwrite=False)
    prepare_run_directory(run, "demo", overwrite=True)
    assert (run / "report.json").read_text() == "{}"  # nothing is deleted
    with pytest.raises(OutputError, match="'demo' run"):
        prepare_run_directory(run, "network-train", overwrite=True)


def test_atomic_write_failure_keeps_the_old_file(tmp_path):
    p = tmp_path / "out.jsonl"
    p.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_write(p) as f:
            f.write("partial")
            raise RuntimeError("boom")
    assert p.read_text() == "old\n" and os.listdir(tmp_path) == ["out.jsonl"]
    write_jsonl(p, [{"x": float("inf")}])
    assert loads_strict(p.read_text()) == {"x": None}
    # temporaries of a killed writer are removed by the next write; a live writer's are kept
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f".out.jsonl.{dead.pid}.abc.sdm-tmp").write_text("partial")
    (tmp_path / f".out.jsonl.{os.getpid()}.xyz.sdm-tmp").write_text("in progress")
    write_jsonl(p, [{"x": 1}])
    assert sorted(os.listdir(tmp_path)) == [f".out.jsonl.{os.getpid()}.xyz.sdm-tmp", "out.jsonl"]


# ------------------------------------------------------------------------------------ kill -9
_SAVER = """
import sys
import sdm_mlx
from sdm_mlx.estimator import SDMEstimator
path = sys.argv[1]
est = SDMEstimator.load(path)
print("ready", flush=True)
while True:  # one writer alternating two versions (a save over a version it did not load is refused)
    est.recalibrate(0.75)
    est.save(path, overwrite=True)
    est.recalibrate(0.7)
    est.save(path, overwrite=True)
"""


def test_kill_9_during_save_keeps_a_loadable_artifact(tmp_path):
    rng = np.random.default_rng(5)
    n, dim = 600, 64
    y = np.arange(n) % 2
    X = (rng.normal(size=(n, dim)) + 1.5 * y[:, None]).astype(np.float32)
    est = SDMEstimator(alpha=0.7, iterations=1, epochs=2, exemplar_dim=64, rescaler_max_epochs=20, verbose=False)
    est.fit(X, y)
    path = tmp_path / "big"
    est.save(path)
    Xt = X[:50]
    versions = []
    for alpha in (0.7, 0.75):
        e = SDMEstimator.load(path)
        e.recalibrate(alpha)
        versions.append(e.estimate(Xt))
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    for delay in (0.0, 0.01, 0.03, 0.07, 0.13, 0.2, 0.31, 0.5):
        p = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        loaded = SDMEstimator.load(path)  # the old or the new version, whole
        got = loaded.estimate(Xt)
        assert any(np.array_equal(got.p_lower, v.p_lower, equal_nan=True) and
                   np.array_equal(got.q_tilde_lower, v.q_tilde_lower) for v in versions), delay
    SDMEstimator.load(path).save(path, overwrite=True)  # the next save clears what the killed ones left
    assert sorted(os.listdir(tmp_path)) == ["big", "saver.py"]  # a killed saver's lock file is removed by the next save


# ------------------------------------------------------------------------------------ network heads
def test_network_base_model_is_relative_and_survives_a_move(tiny_phi3_path, lab, tmp_path):
    from sdm_mlx.llm.embed import load_model
    from sdm_mlx.network import SDMHeads, load_network, save_network
    from sdm_mlx.network.artifact import read_network_config

    run = tmp_path / "run"
    shutil.copytree(tiny_phi3_path, run / "base")
    model, tok = load_model(str(run / "base"))
    save_network(run / "net", SDMHeads(model), str(run / "base"), str(lab / "model"))
    stored = json.loads((run / "net" / "network_config.json").read_text())
    assert stored["base_model"] == os.path.join("..", "base") and stored["base_model_kind"] == "local"
    moved = tmp_path / "elsewhere" / "run2"
    shutil.move(str(run), str(moved))
    assert read_network_config(moved / "net")["base_model"] == str(moved / "base")
    net = load_network(moved / "net")
    assert net.verifier is not None and net.heads.vocab_size == SDMHeads(model).vocab_size
    # a hub id is kept as given
    save_network(tmp_path / "hub", SDMHeads(model), "mlx-community/some-model", str(lab / "model"))
    cfg = read_network_config(tmp_path / "hub")
    assert cfg["base_model"] == "mlx-community/some-model" and cfg["base_model_kind"] == "hub"
