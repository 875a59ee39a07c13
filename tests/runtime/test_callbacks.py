"""One callback protocol (sdm_mlx.runtime.callbacks): the library is silent by default, a Callback receives the
Alg. 1 events, the CLI shows tqdm progress (elapsed, ETA) on stderr and --quiet silences it."""

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from sdm_mlx.runtime.callbacks import SILENT, Callback, CallbackList, TqdmProgress, as_callback
from sdm_mlx.estimator import SDMEstimator

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")  # tiny fits admit little

TINY = dict(iterations=2, epochs=2, exemplar_dim=8, rescaler_max_epochs=20, patience=None, seed=0)


def _data(n=120, d=6):
    rng = np.random.default_rng(0)
    y = np.arange(n) % 2
    X = (rng.normal(size=(n, d)) + 3.0 * y[:, None]).astype(np.float32)
    return X, y


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_epoch_end(self, j, epoch, metrics):
        self.events.append(("epoch", j, epoch, sorted(metrics)))

    def on_round_end(self, j, result):
        self.events.append(("round", j, result.best_epoch))

    def on_rounds_state(self, state):
        self.events.append(("state", state.next_round))

    def message(self, text):
        self.events.append(("message", text))


def test_library_is_silent_by_default_and_a_callback_gets_every_alg1_event(capfd):
    X, y = _data()
    SDMEstimator(**TINY).fit(X, y)
    out, err = capfd.readouterr()
    assert out == "" and "round" not in err and "epoch" not in err
    rec = Recorder()
    est = SDMEstimator(**TINY).fit(X, y, callback=rec)
    kinds = [e[0] for e in rec.events]
    assert kinds.count("epoch") == 4 and kinds.count("round") == 2 and kinds.count("state") == 2
    assert [e[1:] for e in rec.events if e[0] == "state"] == [(1,), (2,)]
    epoch = next(e for e in rec.events if e[0] == "epoch")
    assert {"loss", "balanced_median_q", "cal_accuracy", "epochs", "rounds"} <= set(epoch[3])
    messages = [e[1] for e in rec.events if e[0] == "message"]
    assert any(m.startswith("round 1: min valid q~") for m in messages)  # the per-round calibration's line
    assert messages[-1].startswith("fitted: best round")
    assert capfd.readouterr().err == ""  # a custom callback replaces the default output
    assert len(est.rounds_) == 2


def test_verbose_estimator_and_tqdm_bars_report_elapsed_and_eta(capfd):
    X, y = _data()
    SDMEstimator(**TINY, verbose=True).fit(X, y)
    err = capfd.readouterr().err
    assert "round 1/2 epoch 1/2 loss" in err and "round 2/2: best epoch" in err and "fitted: best round" in err
    stream = io.StringIO()
    with TqdmProgress(stream=stream).progress(4, "embed", unit="doc") as bar:
        for _ in range(4):
            bar.update(1, loss="0.5")
    text = stream.getvalue()
    assert "embed" in text and "4/4" in text and "doc" in text and "<" in text  # [elapsed<remaining]


def test_helpers_compose():
    rec1, rec2 = Recorder(), Recorder()
    both = CallbackList([rec1, None, rec2])
    both.message("hi")
    assert rec1.events == rec2.events == [("message", "hi")]
    assert as_callback(None, False) is SILENT and isinstance(as_callback(None, True), TqdmProgress)
    assert as_callback(rec1, True) is rec1
    with SILENT.progress(3) as bar:
        bar.update(3)  # draws nothing


def test_cli_train_shows_progress_and_quiet_silences_it(tmp_path):
    X, y = _data()
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": i, "label": int(t), "embedding": x.tolist()}) + "\n"
                            for i, (x, t) in enumerate(zip(X, y))))
    base = [sys.executable, "-m", "sdm_mlx", "train", "--train", str(data), "--iterations", "1", "--epochs", "2",
            "--exemplar-dim", "8", "--rescaler-max-epochs", "20"]
    loud = subprocess.run(base + ["--output", str(tmp_path / "a")], capture_output=True, text=True)
    assert loud.returncode == 0, loud.stderr
    assert "round 1/1 epoch 2/2 loss" in loud.stderr and "fitted: best round" in loud.stderr
    quiet = subprocess.run(base + ["--output", str(tmp_path / "b"), "--quiet"], capture_output=True, text=True)
    assert quiet.returncode == 0 and " loss " not in quiet.stderr and "fitted:" not in quiet.stderr  # warnings stay
