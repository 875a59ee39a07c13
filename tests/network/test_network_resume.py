"""``sdm-mlx network-train`` continues after its last finished epoch (sdm_mlx/network/resume.py), through the CLI.

The tiny instruction-tuned Phi-3 (tools/builders/make_tiny_model.py, 400 task rows) with the tiny recipe at a learning
rate where epochs 1 and 2 raise the calibration count and epoch 3 does not: the kept network (epoch 2) and the
current W_pos (epoch 3) differ, so both the selection and the training state must carry over.  A run that is
killed (``kill -9`` in the middle of an epoch) or interrupted (Ctrl-C) and then started again with the same
command must end with the uninterrupted run's W_pos, Adam state, per-epoch losses and counts.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

from count_tolerance import assert_same_counts_and_selection  # tests/helpers/
from ports import free_port_pair  # tests/helpers/
from tiny_tool import make_tiny_model_tool  # tests/helpers/

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
SDM = os.path.join(os.path.dirname(PY), "sdm-mlx")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
TIMEOUT = 300
#: ``python -c KILLER <sdm-mlx args>``: the CLI, killed with SIGKILL right after the $KILL_CALL-th call of the
#: trainer's $KILL_AFTER (``train_epoch``: W_pos and Adam moved on, the count, metrics and state of that
#: epoch not yet written; ``count_verified``: the calibration count of the base head or of an epoch)
KILLER = """
import atexit, os, signal, sys
import sdm_mlx.network.decode_journal as decode_journal
import sdm_mlx.network.rank_work as rank_work
import sdm_mlx.network.resume as resume
import sdm_mlx.network.trainer as trainer
name, calls = os.environ["KILL_AFTER"], []
if "." in name:  # a method, e.g. DecodeJournal.add or Resumption.save
    owner = decode_journal if hasattr(decode_journal, name.split(".")[0]) else resume
    module, name = getattr(owner, name.split(".")[0]), name.split(".")[1]
else:
    module = trainer if hasattr(trainer, name) else rank_work
if os.environ.get("JOURNAL_CHUNK"):
    decode_journal.CHUNK_PROMPTS = int(os.environ["JOURNAL_CHUNK"])
atexit.register(lambda: print(f"KILLER calls {len(calls)}", file=sys.stderr))
real = getattr(module, name)
def killed_after(*args, **kwargs):
    out = real(*args, **kwargs)
    calls.append(1)
    if len(calls) == int(os.environ["KILL_CALL"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return out
setattr(module, name, killed_after)
from sdm_mlx.cli import main
sys.exit(main(sys.argv[1:]))
"""


#: ``python -c NO_OWN_DECODINGS <sdm-mlx args>``: the CLI of a run that keeps no base decodings of its own (every
#: pass decodes every prompt, as before sdm_mlx/network/own_decodings.py)
NO_OWN_DECODINGS = """
import sys
import sdm_mlx.network.rank_work as rank_work
def none(self):
    self.own_decodings = self.base_decodings = None
    self._base_decodings_checked = False
rank_work.RankWork.init_base_decodings = none
from sdm_mlx.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model and task, and the uninterrupted 3-epoch reference run."""
    tmp = tmp_path_factory.mktemp("network_resume")
    tool = make_tiny_model_tool()
    built = tool.build(str(tmp / "tiny"), rows=400, quiet=True)
    ref = sdm(train_args(built, tmp / "reference"))
    assert ref.returncode == 0, ref.stderr
    return {"tmp": tmp, "built": built, "reference": tmp / "reference"}


def train_args(built, out, *extra) -> list:
    return ["network-train", "-c", os.path.join(ROOT, "recipes", "tiny_sentiment.yaml"), "--model", built["model"],
            "--data", built["task"], "--output", str(out), "--alpha", "0.6", "--learning-rate", "0.05",
            "--epochs", "3", "--quiet", *extra]


def sdm(args, *, killer: tuple | None = None, chunk: int | None = None) -> subprocess.CompletedProcess:
    """``sdm-mlx args`` in a subprocess (``killer``: (function, call) to kill the process after, :data:`KILLER`;
    ``chunk``: prompts per decode-journal chunk)."""
    cmd = [PY, "-c", KILLER, *args] if killer else [SDM, *args]
    env = {**ENV, "KILL_AFTER": killer[0], "KILL_CALL": str(killer[1])} if killer else ENV
    if chunk:
        env["JOURNAL_CHUNK"] = str(chunk)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)


def state(out):
    from sdm_mlx.network.resume import load_state

    return load_state(os.path.join(out, "resume"))


def metrics(out) -> dict:
    return json.loads((out / "metrics.json").read_text())


def assert_same_run(out, ref) -> None:
    """``out`` ended where the uninterrupted ``ref`` did: counts, selection, losses, W_pos (current and kept),
    Adam state and the finished marks."""
    from sdm_mlx.network.artifact import load_head_weight, read_network_config

    m, r = metrics(out), metrics(ref)
    assert m["finished"] is True and m["epochs_completed"] == r["epochs_completed"]
    assert (m["initial"]["count"], m["selected_epoch"], m["best_count"]) == \
        (r["initial"]["count"], r["selected_epoch"], r["best_count"])
    for key in ("epoch", "count", "selected", "tokens", "batches", "beta_first", "beta_last", "q_mean", "d_mean"):
        assert [e[key] for e in m["epochs"]] == [e[key] for e in r["epochs"]], key
    for key in ("loss", "nll", "reg", "reg_rescaled"):
        np.testing.assert_allclose([e[key] for e in m["epochs"]], [e[key] for e in r["epochs"]], rtol=1e-6,
                                   err_msg=key)
    s, t = state(out), state(ref)
    assert (s.epochs_completed, s.best, s.selected) == (t.epochs_completed, t.best, t.selected)
    np.testing.assert_allclose(s.head, t.head, rtol=1e-6, atol=0)  # the current W_pos, after the last epoch
    assert sorted(s.optimizer) == sorted(t.optimizer)
    for key in s.optimizer:
        np.testing.assert_allclose(s.optimizer[key], t.optimizer[key], rtol=1e-6, atol=0, err_msg=key)
    np.testing.assert_allclose(load_head_weight(out / "network"), load_head_weight(ref / "network"), rtol=1e-6,
                               atol=0)  # the kept W_pos
    training = read_network_config(out / "network")["training"]
    assert (training["finished"], training["epoch"], training["epochs_completed"]) == (True, r["selected_epoch"], 3)


def test_the_reference_run_keeps_an_earlier_epoch_than_its_last(tiny):
    """The premise of the tests below: the kept network is not the current W_pos."""
    m = metrics(tiny["reference"])
    assert [e["selected"] for e in m["epochs"]] == [True, True, False], m["epochs"]
    assert m["selected_epoch"] == 2 and "resumed_after_epochs" not in m
    assert state(tiny["reference"]).epochs_completed == 3


def test_a_killed_run_continues_with_the_same_command_to_the_uninterrupted_result(tiny, tmp_path):
    out = tmp_path / "out"
    args = train_args(tiny["built"], out)
    killed = sdm(args, killer=("train_epoch", 2))
    assert killed.returncode == -9, killed.stderr
    assert state(out).epochs_completed == 1 and len(metrics(out)["epochs"]) == 1
    cached = os.stat(out / "token_cache" / "manifest.json").st_mtime_ns  # written once, before the first count
    again = sdm(args)
    assert again.returncode == 0, again.stderr
    assert os.stat(out / "token_cache" / "manifest.json").st_mtime_ns == cached  # read back, not built again
    assert "resuming after epoch 1 of 3 (kept: the head of epoch 1" in again.stderr, again.stderr
    assert_same_run(out, tiny["reference"])
    assert metrics(out)["resumed_after_epochs"] == [1]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2, 3] and summary["selected_epoch"] == 2

    # the same command once more: finished, nothing to do (no file is written)
    stamps = {p: os.stat(p).st_mtime_ns for p in (out / "resume" / "manifest.json", out / "metrics.json",
                                                  out / "network" / "network_config.json")}
    done = sdm(args)
    assert done.returncode == 0, done.stderr
    assert "holds a finished run (3 of 3 epochs; kept: the head of epoch 2" in done.stderr
    assert "nothing to do" in done.stderr and "raise --epochs" in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["selected_epoch"] == 2
    assert {p: os.stat(p).st_mtime_ns for p in stamps} == stamps


def test_a_run_killed_during_an_epochs_count_resumes_with_the_count_not_the_training(tiny, tmp_path):
    """Killed right after epoch 1's trained W_pos is saved (the third state written: after the verifier fit, after
    the base count, after epoch 1's training): the state says 0 epochs finished and holds epoch 1's row; the same
    command counts epoch 1 without training it again (2 epochs trained, not 3) and ends where the uninterrupted
    run did."""
    out = tmp_path / "out"
    args = train_args(tiny["built"], out)
    killed = sdm(args, killer=("Resumption.save", 3))
    assert killed.returncode == -9, killed.stderr
    saved = state(out)
    assert saved.epochs_completed == 0 and saved.metrics["trained_epoch"]["epoch"] == 1
    assert not saved.metrics["epochs"] and "count" not in saved.metrics["trained_epoch"]
    again = sdm(args, killer=("train_epoch", 10**6))
    assert again.returncode == 0, again.stderr
    assert "KILLER calls 2" in again.stderr  # epochs 2 and 3 trained; epoch 1 only counted
    assert "resuming after epoch 0 of 3" in again.stderr, again.stderr
    assert "epoch 1's W_pos was trained before the stop, so only its calibration count runs" in again.stderr
    assert_same_run(out, tiny["reference"])
    assert "trained_epoch" not in metrics(out) and "trained_epoch" not in state(out).metrics


def test_a_run_killed_in_the_middle_of_an_epoch_goes_on_from_its_last_checkpoint(tiny, tmp_path):
    """``--checkpoint-minutes``: the state is also saved in the middle of an epoch's W_pos training (here after
    every mini-batch).  Killed right after the third checkpoint of epoch 2, the state says 1 epoch finished and 3
    mini-batches of epoch 2 done; the same command runs only the rest of epoch 2 (the same token order, the q, d
    computed before its first step, not with the moved W_pos) and ends where the uninterrupted run did."""
    ref = metrics(tiny["reference"])
    nb1, nb2 = ref["epochs"][0]["batches"], ref["epochs"][1]["batches"]
    assert nb1 >= 2 and nb2 >= 5, (nb1, nb2)
    out = tmp_path / "out"
    args = train_args(tiny["built"], out, "--checkpoint-minutes", "1e-9")
    # the states written: the verifier fit, the base count; epoch 1: nb1 - 1 checkpoints, its W_pos, its count;
    # then epoch 2's first three checkpoints
    killed = sdm(args, killer=("Resumption.save", 2 + (nb1 - 1) + 2 + 3))
    assert killed.returncode == -9, killed.stderr
    saved = state(out)
    part = saved.metrics["partial_epoch"]
    assert saved.epochs_completed == 1 and (part["epoch"], part["done"]) == (2, 3)
    assert len(part["q"]) == len(part["d"]) == ref["train_positive_rows"]
    again = sdm(args)
    assert again.returncode == 0, again.stderr
    assert "epoch 2 was saved after 3 mini-batches of its W_pos training, so it goes on from there" in again.stderr
    # The host step holds Adam's v scaled by (1 - β1)² / (1 - β2) between steps and a checkpoint saves v itself, so
    # the resumed epoch starts from v rounded once more than the uninterrupted run's (~6e-8 relative); Adam carries
    # that into W_pos at ~3e-7 (measured).  Everything else is the uninterrupted run's.
    m = metrics(out)
    assert_same_counts_and_selection(m, ref)
    for key in ("epoch", "tokens", "batches", "q_mean", "d_mean"):
        assert [e[key] for e in m["epochs"]] == [e[key] for e in ref["epochs"]], key
    np.testing.assert_allclose([e["loss"] for e in m["epochs"]], [e["loss"] for e in ref["epochs"]], rtol=1e-5)
    w, w_ref = state(out).head, state(tiny["reference"]).head
    assert np.abs(w - w_ref).max() <= 1e-5 * max(1.0, float(np.abs(w_ref).max()))
    assert "partial_epoch" not in m and "partial_epoch" not in state(out).metrics


@pytest.mark.slow  # two CLI trainings; the default tier resumes a run killed mid-epoch (test_a_killed_run_continues...)
def test_a_run_killed_before_its_first_count_skips_the_verifier_fit(tiny, tmp_path):
    """Killed while counting the base head (after the verifier fit): the same command loads the saved verifier
    and split (the verifier's features are not computed again) and ends where the uninterrupted run did."""
    out = tmp_path / "out"
    args = train_args(tiny["built"], out)
    killed = sdm(args, killer=("count_verified", 1))
    assert killed.returncode == -9, killed.stderr
    s = state(out)
    assert s.epochs_completed is None and s.head is None and len(s.rows["calibration"]) == 200
    fitted = {p: os.stat(p).st_mtime_ns for p in (out / "verifier" / "manifest.json", out / "verification_rows.jsonl")}
    again = sdm(args)
    assert again.returncode == 0, again.stderr
    assert "resuming after the verification layer's fit (not fitted again)" in again.stderr, again.stderr
    assert "resuming after epoch" not in again.stderr
    assert {p: os.stat(p).st_mtime_ns for p in fitted} == fitted  # neither written again
    assert_same_run(out, tiny["reference"])


@pytest.mark.slow  # a training and a resume; default tier: a kill -9 resume here, the Ctrl-C message in
#                    test_network_train
def test_ctrl_c_then_the_same_command(tiny, tmp_path, monkeypatch, capsys):
    """Ctrl-C during epoch 3 (in the CLI's process): the message says how to continue, and continuing ends
    where the uninterrupted run did."""
    from sdm_mlx.cli import main
    from sdm_mlx.network.trainer import SDMNetworkTrainer

    out = tmp_path / "out"
    args = train_args(tiny["built"], out)
    real = SDMNetworkTrainer.run_epoch

    def interrupt_epoch_3(self, epoch, *a, **k):
        if epoch == 3:
            raise KeyboardInterrupt
        return real(self, epoch, *a, **k)

    monkeypatch.setattr(SDMNetworkTrainer, "run_epoch", interrupt_epoch_3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(args) == 130  # the CLI's exit status after Ctrl-C
        err = capsys.readouterr().err
        assert "interrupted during epoch 3/3" in err and "the head of epoch 2" in err
        assert "run the same command again to resume after epoch 2 (--restart starts over)" in err
        monkeypatch.setattr(SDMNetworkTrainer, "run_epoch", real)
        assert main(args) == 0
    assert "resuming after epoch 2 of 3" in capsys.readouterr().err
    assert_same_run(out, tiny["reference"])


@pytest.mark.slow  # three CLI trainings; the default tier resumes a killed run and runs a finished one again
def test_raising_epochs_trains_on_and_fewer_epochs_are_refused(tiny, tmp_path):
    """A finished 2-epoch run with --epochs 3 continues from epoch 2's state to the 3-epoch result."""
    from sdm_mlx.network.artifact import read_network_config

    out = tmp_path / "out"
    two = sdm(train_args(tiny["built"], out, "--epochs", "2"))
    assert two.returncode == 0, two.stderr
    assert read_network_config(out / "network")["training"]["finished"] is True
    three = sdm(train_args(tiny["built"], out))
    assert three.returncode == 0, three.stderr
    assert "resuming after epoch 2 of 3" in three.stderr
    assert_same_run(out, tiny["reference"])
    fewer = sdm(train_args(tiny["built"], out, "--epochs", "1"))
    assert fewer.returncode == 2
    assert "already finished 3 epochs, more than --epochs 1: pass --epochs 3 or more" in fewer.stderr
    assert "--restart" in fewer.stderr and "Traceback" not in fewer.stderr


def test_other_settings_or_data_exit_2_naming_restart(tiny, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(tiny["reference"], out)
    built = tiny["built"]
    r = sdm(train_args(built, out, "--learning-rate", "0.01"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "holds a network-train run with different settings (learning_rate 0.05 -> 0.01)" in r.stderr
    assert "pass --restart to start over, or use another --output" in r.stderr

    rows = open(built["task"]).read().splitlines(keepends=True)
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(rows[:-1]))
    r = sdm(train_args(dict(built, task=str(changed)), out))
    assert r.returncode == 2 and "different settings (the contents of --data)" in r.stderr, r.stderr

    same = tmp_path / "same.jsonl"  # the same rows at another path: the same run (finished)
    shutil.copy(built["task"], same)
    r = sdm(train_args(dict(built, task=str(same)), out))
    assert r.returncode == 0 and "holds a finished run" in r.stderr, r.stderr

    # an unreadable state names the fix too
    head = out / "resume" / "head.safetensors"
    data = bytearray(head.read_bytes())
    data[-1] ^= 0xFF
    head.write_bytes(bytes(data))
    r = sdm(train_args(built, out))
    assert r.returncode == 2 and "checksum mismatch" in r.stderr and "pass --restart" in r.stderr, r.stderr


@pytest.mark.slow  # ~10 s; test_network_cli's smoke test runs --restart in the default tier
def test_restart_and_overwrite_start_over(tiny, tmp_path):
    """--restart discards the state (same settings: the same result again); --overwrite with other settings
    starts over and says why."""
    out = tmp_path / "out"
    shutil.copytree(tiny["reference"], out)
    r = sdm(train_args(tiny["built"], out, "--restart"))
    assert r.returncode == 0, r.stderr
    assert "resuming" not in r.stderr and "finished run" not in r.stderr
    assert "resumed_after_epochs" not in metrics(out)
    assert_same_run(out, tiny["reference"])

    r = sdm(train_args(tiny["built"], out, "--overwrite", "--epochs", "1", "--batch-size", "40"))
    assert r.returncode == 0, r.stderr
    assert "holds a run with different settings (batch_size 50 -> 40); --overwrite: starting over" in r.stderr
    m = metrics(out)
    assert m["config"]["batch_size"] == 40 and len(m["epochs"]) == 1 and "resumed_after_epochs" not in m
    assert state(out).fingerprint["batch_size"] == 40


LAUNCH = os.path.join(os.path.dirname(PY), "mlx.launch")




def launch_two(args) -> subprocess.CompletedProcess:
    """``sdm-mlx args`` on two local ranks (ring backend, one BLAS thread each)."""
    cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_port_pair()), "--python", PY, "--",
           "-m", "sdm_mlx", *args]
    env = {**ENV, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)


@pytest.mark.slow  # ~30 s: two mlx.launch runs of two ranks
@pytest.mark.skipif(not os.path.exists(LAUNCH), reason="mlx.launch is not installed next to python")
def test_data_parallel_runs_resume_on_the_same_number_of_ranks(tiny, tmp_path):
    """Rank 0 writes the state, every rank reads it: a finished 2-rank 2-epoch run raised to --epochs 3 continues
    on 2 ranks to the one-process 3-epoch result (within the data-parallel tolerance of
    test_network_distributed.py); one process may not continue a 2-rank state."""
    out = tmp_path / "two"
    first = launch_two(train_args(tiny["built"], out, "--epochs", "2"))
    assert first.returncode == 0, first.stderr
    again = launch_two(train_args(tiny["built"], out))
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("resuming after epoch 2 of 3") == 1, again.stderr  # rank 0 alone says it
    m, r = metrics(out), metrics(tiny["reference"])
    assert m["data_parallel"]["ranks"] == 2 and m["finished"] is True and m["resumed_after_epochs"] == [2]
    assert_same_counts_and_selection(m, r)  # 2 ranks round differently from one process (tests/helpers/)
    np.testing.assert_allclose([e["loss"] for e in m["epochs"]], [e["loss"] for e in r["epochs"]], rtol=1e-5)
    w, w_ref = state(out).head, state(tiny["reference"]).head
    # the one-process reference ran the host step (--train-step auto on a CPU), the ranks MLX's: the contract of
    # tests/network/test_host_step.py, W_pos within 1 % of how far it moved from the model's head
    from sdm_mlx.llm import embed as E

    w0 = np.array(E.lm_head_weight(E.load_model(tiny["built"]["model"])[0]), dtype=np.float32)
    moved = float(np.abs(w_ref - w0).max())
    assert moved > 0 and np.abs(w - w_ref).max() <= 0.01 * moved
    one = sdm(train_args(tiny["built"], out))
    assert one.returncode == 2 and "the number of mlx.launch ranks 2 -> 1" in one.stderr, one.stderr


def test_settings_that_are_not_compared_do_not_stop_a_resume_even_in_an_older_state():
    """A state written while the batch sizes were still part of the fingerprint resumes under code that no longer
    compares them (the engine's rows do not depend on their batch); a real difference is still named."""
    from sdm_mlx.network.resume import fingerprint_differences

    saved = {"learning_rate": 3e-5, "generation_batch_size": 16, "embed_batch_size": 16, "train_step": "mlx"}
    assert fingerprint_differences(saved, {"learning_rate": 3e-5}) == []
    assert fingerprint_differences(saved, {"learning_rate": 1e-5}) == ["learning_rate 3e-05 -> 1e-05"]


def test_a_resumed_run_does_not_keep_the_saved_arrays_twice():
    from sdm_mlx.network.resume import ResumeState, take_arrays

    head, adam = np.ones((4, 3), np.float32), {"pos.weight.m": np.zeros((4, 3), np.float32), "step": np.array(2)}
    state = ResumeState(fingerprint={}, epochs_completed=1, head=head, optimizer=adam, rows={"train": [1]})
    taken_head, taken_adam = take_arrays(state)
    assert taken_head is head and taken_adam is adam
    assert state.head is None and state.optimizer is None and state.epochs_completed == 1 and state.rows


def test_a_saved_token_cache_is_read_only_for_the_rows_model_and_settings_it_was_built_from(tmp_path):
    """Alg. 4's token cache (step (b)) is kept in the run directory and read back by a later run of the same rows,
    model, delimiter and max_length; anything else, or a damaged file, builds it again."""
    from sdm_mlx.network.training_data import TokenCache, load_token_cache, save_token_cache, token_cache_key

    rows = [{"id": "a", "prompt": "p", "completion": "c"}, {"id": "b", "prompt": "p2", "completion": "c2"}]
    key = token_cache_key({"model": "m"}, rows, "}", 500)
    cache = TokenCache(hidden=np.arange(12, dtype=np.float32).reshape(3, 4), targets=np.array([5, 6, 7]),
                       doc=np.array([0, 0, 1]), skipped=["x"])
    path = str(tmp_path / "token_cache")
    assert load_token_cache(path, key) is None
    save_token_cache(path, cache, key)
    got = load_token_cache(path, key)
    for name in ("hidden", "targets", "doc"):
        np.testing.assert_array_equal(getattr(got, name), getattr(cache, name), err_msg=name)
    assert got.skipped == ["x"] and got.hidden.dtype == np.float32
    others = [token_cache_key({"model": "m2"}, rows, "}", 500), token_cache_key({"model": "m"}, rows[::-1], "}", 500),
              token_cache_key({"model": "m"}, [{**rows[0], "completion": "c!"}, rows[1]], "}", 500),
              token_cache_key({"model": "m"}, rows, "]", 500), token_cache_key({"model": "m"}, rows, "}", 400)]
    assert all(load_token_cache(path, k) is None for k in others)
    (tmp_path / "token_cache" / "cache.safetensors").write_bytes(b"damaged")
    assert load_token_cache(path, key) is None


def test_a_run_killed_in_the_middle_of_a_count_decodes_only_the_prompts_it_had_not_finished(tiny, tmp_path):
    """Killed after the third chunk of the base head's calibration count (32 prompts a chunk): the same command
    takes those chunks from OUTPUT/decode_journal/ and decodes the rest, ends where the uninterrupted run with the
    same chunks did, and
    deletes the journal once the state after the count is saved."""
    def adds(run):  # DecodeJournal.add calls of a run that was not killed
        return int(run.stderr.rsplit("KILLER calls ", 1)[1].split()[0])

    whole = sdm(train_args(tiny["built"], tmp_path / "whole"), killer=("DecodeJournal.add", 10**6), chunk=32)
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "out"
    args = train_args(tiny["built"], out)
    killed = sdm(args, killer=("DecodeJournal.add", 3), chunk=32)
    assert killed.returncode == -9, killed.stderr
    journal = out / "decode_journal" / "calibration-epoch0.rank0"
    assert sorted(p.name for p in journal.glob("chunk_*.npz")) == [f"chunk_{i:06d}.npz" for i in range(3)]
    again = sdm(args, killer=("DecodeJournal.add", 10**6), chunk=32)
    assert again.returncode == 0, again.stderr
    assert adds(again) == adds(whole) - 3  # the three finished chunks were not decoded again
    assert_same_run(out, tmp_path / "whole")  # (chunks of 32 decode in other batches than the reference's)
    assert not (out / "decode_journal").exists() or not any((out / "decode_journal").iterdir())


def test_base_decodings_with_decisions_are_replayed_after_each_w_pos_step(tiny, tmp_path):
    """A base-decodings file with the decision states (as the pipeline's answers stage keeps them): after every W_pos
    step the calibration count takes the decodings the trained head makes again (replayed) and decodes the rest; the
    run ends where the reference did (within the counts' rounding tolerance)."""
    from sdm_mlx.decoding import DecodeEngine, DecodeRequest, PrefixCache
    from sdm_mlx.llm.embed import encode, load_model
    from sdm_mlx.network.base_decodings import save_base_decodings
    from sdm_mlx.pipeline.decisions import decode_settings

    ref = tiny["reference"]
    prompts = sorted({json.loads(line)["prompt"] for line in open(ref / "verification_rows.jsonl")})
    model, tok = load_model(tiny["built"]["model"])
    engine = DecodeEngine(model, tok, max_batch=64, prefix_cache=PrefixCache())
    decs = engine.run([DecodeRequest(encode(tok, p), 12, features=True, feature_parts=("mean", "last"),
                                     keep_decisions=True) for p in prompts])
    save_base_decodings(str(tmp_path / "base.npz"), prompts, [d.text for d in decs],
                        np.concatenate([d.features for d in decs]), ("mean", "last"),
                        replay={"token_ids": [d.token_ids for d in decs], "stop_reasons": [d.stop_reason for d in decs],
                                "decisions": [d.decisions for d in decs], "settings": decode_settings(engine, 12)})
    out = tmp_path / "out"
    args = [a for a in train_args(tiny["built"], out, "--base-decodings", str(tmp_path / "base.npz")) if a != "--quiet"]
    r = sdm(args)
    assert r.returncode == 0, r.stderr
    # the token cache took the own right answers' states from the decisions
    given = re.search(r"(\d+) of (\d+) y=1 training documents are the base model's own decodings", r.stderr)
    assert given and 0 < int(given.group(1)) <= int(given.group(2)), r.stderr[-3000:]
    m, reference = metrics(out), metrics(ref)
    assert m["initial"]["given"] == m["initial"]["documents"] > 0
    replayed = [e["calibration"]["replayed"] for e in m["epochs"]]
    assert all(e["calibration"]["given"] == 0 for e in m["epochs"]) and sum(replayed) > 0, replayed
    assert all(0 <= n <= e["calibration"]["documents"] for n, e in zip(replayed, m["epochs"]))
    assert_same_counts_and_selection(m, reference)
    # the decision states are the states the token cache computes for those documents
    from types import SimpleNamespace

    from sdm_mlx.network import SDMHeads
    from sdm_mlx.network.base_decodings import BaseDecodings
    from sdm_mlx.network.training_data import build_token_cache

    base = BaseDecodings(str(tmp_path / "base.npz"), tok)
    rows = [{"id": str(k), "prompt": p, "completion": d.text} for k, (p, d) in enumerate(zip(prompts, decs))
            if d.stop_reason == "delimiter"]
    assert len(rows) >= 4
    cfg = SimpleNamespace(delimiter="}", max_length=500, embed_batch_size=8, verbose=False)
    given = [base.completion_states(r["prompt"], r["completion"]) for r in rows]
    assert all(g is not None for g in given)
    heads = SDMHeads(model)
    ran = build_token_cache(heads, tok, rows, cfg)
    took = build_token_cache(heads, tok, rows, cfg, given=given[:len(rows) // 2] + [None] * (len(rows) - len(rows) // 2))
    np.testing.assert_array_equal(took.targets, ran.targets)
    np.testing.assert_array_equal(took.doc, ran.doc)
    np.testing.assert_allclose(took.hidden, ran.hidden, rtol=1e-4, atol=1e-4)


def test_given_base_decodings_stand_in_for_the_passes_at_the_base_head(tiny, tmp_path):
    """``--base-decodings``: the base model's own decodings of the rows' prompts (as sdm-mlx pipeline writes them
    from its answers stage) serve the count before fine-tuning and epoch 1's q, d; the run ends where the reference
    did (within the counts' rounding tolerance), and a file of other decodings is refused with exit 2."""
    from sdm_mlx.llm.embed import load_model
    from sdm_mlx.network import DecodeSettings, SDMHeads, greedy_generate
    from sdm_mlx.network.base_decodings import save_base_decodings

    ref = tiny["reference"]
    prompts = sorted({json.loads(line)["prompt"] for line in open(ref / "verification_rows.jsonl")})
    model, tok = load_model(tiny["built"]["model"])
    gens = greedy_generate(SDMHeads(model), tok, prompts, DecodeSettings(max_new_tokens=12, batch_size=64))
    feats = np.concatenate([g.features for g in gens])
    save_base_decodings(str(tmp_path / "base.npz"), prompts, [g.text for g in gens], feats, ("mean", "last"))
    out = tmp_path / "out"
    r = sdm(train_args(tiny["built"], out, "--base-decodings", str(tmp_path / "base.npz")))
    assert r.returncode == 0, r.stderr
    m, reference = metrics(out), metrics(ref)
    assert m["initial"]["given"] == m["initial"]["documents"] > 0 and reference["initial"]["given"] == 0
    assert all(e["calibration"]["given"] == 0 for e in m["epochs"])  # trained heads decode for themselves
    assert_same_counts_and_selection(m, reference)
    assert m["epochs"][0]["q_mean"] == pytest.approx(reference["epochs"][0]["q_mean"], rel=0.05)
    # another model's decodings (its texts and states)
    save_base_decodings(str(tmp_path / "other.npz"), prompts, ['{"sentiment": "neutral"}'] * len(gens), 2 * feats,
                        ("mean", "last"))
    bad = sdm(train_args(tiny["built"], tmp_path / "bad", "--base-decodings", str(tmp_path / "other.npz"),
                         "--verifier", str(ref / "verifier")))
    assert bad.returncode == 2 and "does not hold this model's greedy decodings" in bad.stderr, bad.stderr


def test_a_run_given_no_base_decodings_replays_its_own_after_each_w_pos_step(tiny, tmp_path):
    """Without --base-decodings the run keeps its base-head decodings with their decision states
    (``base_decodings.rank0.npz``, sdm_mlx/network/own_decodings.py): epoch 1's q, d take those of the prompts the
    base count decoded, and the count after every W_pos step replays the ones the trained head makes again.  A run
    that keeps none decodes every prompt and ends at the same counts and selection (within their rounding
    tolerance)."""
    ref = tiny["reference"]
    m = metrics(ref)
    assert (ref / "base_decodings.rank0.npz").is_file()
    assert m["initial"]["given"] == 0  # the base count decoded (nothing was given yet)
    replayed = [e["calibration"]["replayed"] for e in m["epochs"]]
    assert sum(replayed) > 0 and all(0 <= n <= e["calibration"]["documents"] for n, e in zip(replayed, m["epochs"]))
    out = tmp_path / "decoded"
    r = subprocess.run([PY, "-c", NO_OWN_DECODINGS, *train_args(tiny["built"], out)], capture_output=True, text=True,
                       timeout=TIMEOUT, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert not (out / "base_decodings.rank0.npz").exists()
    assert all(e["calibration"]["replayed"] == 0 for e in metrics(out)["epochs"])
    assert_same_counts_and_selection(m, metrics(out))
