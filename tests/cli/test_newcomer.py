"""Mistakes a newcomer makes in a first hour (issue 41, section 3), each through the CLI in a subprocess, as a user
runs it: two ``train`` runs on one ``--output``, lock files left behind, a directory that is not a model given to
``serve``, string labels, a model path of the wrong kind, and which options ``--help`` shows as required."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sdm_mlx.storage.datasets import factcheck_splits

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
CLI = [sys.executable, "-m", "sdm_mlx"]


def cli(*args, cwd, timeout=300):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=ENV, timeout=timeout)


def user_error(r, *fragments):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    for f in fragments:
        assert f in r.stderr, (f, r.stderr)


def write_rows(path, n=400, label=lambda y: y):
    pool = factcheck_splits()[0]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "label": label(int(pool.y[i])),
                                "attributes": [float(v) for v in pool.X[i]]}) + "\n")
    return path


def locks(directory) -> list:
    return sorted(n for n in os.listdir(directory) if n.endswith(".sdm-lock"))


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    """A directory with 400 labelled factcheck rows and a model trained on them by ``sdm-mlx train``."""
    d = tmp_path_factory.mktemp("newcomer")
    write_rows(d / "train.jsonl")
    r = cli("train", "--train", "train.jsonl", "--output", "model", "--iterations", "2", "--epochs", "2",
            "--exemplar-dim", "16", "--rescaler-max-epochs", "10", "--quiet", cwd=d)
    assert r.returncode == 0, r.stderr
    return d


def test_a_successful_train_leaves_no_lock_file_and_no_checkpoint(box):
    # two rounds: the checkpoint model.partial was replaced under its lock once, then removed with its lock
    assert locks(box) == [] and not os.path.exists(box / "model.partial"), os.listdir(box)
    r = cli("train", "--train", "train.jsonl", "--output", "model", "--overwrite", "--iterations", "1", "--epochs",
            "1", "--exemplar-dim", "8", "--quiet", cwd=box)  # replacing a model takes (and drops) its lock too
    assert r.returncode == 0, r.stderr
    assert locks(box) == [], os.listdir(box)


def test_a_second_train_on_a_busy_output_stops_at_the_start(box, tmp_path):
    write_rows(tmp_path / "train.jsonl")
    log = open(tmp_path / "first.log", "w")  # a file, not a pipe: a line per epoch would fill an unread pipe and block
    first = subprocess.Popen([*CLI, "train", "--train", "train.jsonl", "--output", "busy", "--iterations", "3",
                              "--epochs", "100000", "--patience", "0", "--exemplar-dim", "8"],
                             cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=log,
                             # Ctrl-C as a terminal delivers it: a runner started in the background (nohup, `&`)
                             # hands its children SIGINT ignored, and Python then never raises KeyboardInterrupt
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 120
        while not locks(tmp_path) and first.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert locks(tmp_path) == [".busy.sdm-lock"], (os.listdir(tmp_path), first.poll())
        t0 = time.time()
        second = cli("train", "--train", "train.jsonl", "--output", "busy", "--iterations", "3", cwd=tmp_path)
        seconds = time.time() - t0
        user_error(second, "--output busy is in use by", f"pid {first.pid}: sdm-mlx train",
                   "wait for it to finish, or choose another --output")
        assert seconds < 60, seconds  # at the start: before reading the rows (the first run trains for minutes)
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGINT)
        try:
            rc = first.wait(timeout=120)
        finally:
            first.kill()
            log.close()
    assert rc == 130, (tmp_path / "first.log").read_text()[-2000:]
    assert locks(tmp_path) == []  # an interrupted run releases (and removes) its lock too
    # and the output is free again
    third = cli("train", "--train", "train.jsonl", "--output", "busy", "--iterations", "1", "--epochs", "1",
                "--exemplar-dim", "8", "--restart", "--quiet", cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    assert locks(tmp_path) == []


def test_serve_on_a_directory_that_is_not_a_model_says_what_is_missing(box, tmp_path):
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "readme.txt").write_text("x")
    r = cli("serve", "-m", "notamodel", "--verifier", box / "model", "--port", "1", cwd=tmp_path)
    user_error(r, "notamodel is not an mlx-lm model directory: config.json is missing",
               "holds config.json, the weights *.safetensors and the tokenizer files")
    assert "write" not in r.stderr  # (was: "cannot read or write notamodel/config.json")
    (tmp_path / "notamodel" / "config.json").write_text("{}")
    r = cli("generate", "-m", "notamodel", "--verifier", box / "model", "--prompt", "hi", cwd=tmp_path)
    user_error(r, "notamodel is not an mlx-lm model directory: the weights (*.safetensors) is missing")


def _fake_runs(box, root):
    """The directories of a first hour, without training: an LLM (its marker files), a demo run holding a model,
    a network-train run holding a network and its verifier."""
    import shutil

    (root / "llm").mkdir()
    (root / "llm" / "config.json").write_text("{}")
    (root / "llm" / "model.safetensors").write_bytes(b"")
    for run, kind, inner in (("demo", "demo", "model"), ("nt", "network-train", "verifier")):
        (root / run).mkdir()
        (root / run / ".sdm_mlx_run.json").write_text(json.dumps({"format": "sdm_mlx_run", "kind": kind}))
        shutil.copytree(box / "model", root / run / inner)
    (root / "nt" / "network").mkdir()
    (root / "nt" / "network" / "network_config.json").write_text(json.dumps({"format": "sdm_mlx_network"}))


def test_a_model_path_of_the_wrong_kind_gets_a_hint_of_what_was_meant(box, tmp_path):
    _fake_runs(box, tmp_path)
    rows = write_rows(tmp_path / "rows.jsonl", n=5)
    cases = [  # (command, what the message says the path is, what it suggests)
        (("predict", "--model", "llm", "--input", rows), "it is an mlx-lm LLM directory",
         "an LLM goes to -m/--model of embed, generate or serve"),
        (("predict", "--model", "demo", "--input", rows), "it is a demo run directory", "did you mean demo/model?"),
        (("evaluate", "--model", "nt", "--input", rows), "it is a network-train run directory",
         "did you mean nt/verifier?"),
        (("inspect", "--model", "rows.jsonl"), "it is a data file", "this option takes an SDM estimator directory"),
        (("predict", "--model", "dmeo/model", "--input", rows), "no model artifact at", "did you mean demo/model?"),
        (("serve", "--head", "nt/verifier"), "it is an SDM estimator",
         "pass it as --verifier (with -m MODEL) instead of --head"),
        (("serve", "--head", "nt"), "it is a network-train run directory", "did you mean nt/network?"),
        (("serve", "--head", "llm"), "it is an mlx-lm LLM directory", "pass it as -m/--model (with --verifier DIR)"),
        (("serve", "-m", "nt/verifier", "--verifier", "nt/verifier"), "it is an SDM estimator",
         "pass it as --verifier; -m/--model takes the LLM"),
        (("generate", "-m", "lmm", "--verifier", "nt/verifier", "--prompt", "hi"), "model not found: lmm",
         "did you mean llm?"),
    ]
    for args, what, meant in cases:
        user_error(cli(*args, cwd=tmp_path), what, meant)


def test_string_labels_name_the_way_out_and_class_names_read_them(box, tmp_path):
    names = ["false", "true"]
    write_rows(tmp_path / "words.jsonl", n=300, label=lambda y: names[y])
    r = cli("train", "--train", "words.jsonl", "--output", "m", cwd=tmp_path)
    user_error(r, "words.jsonl:1: label 'true' is a string", "--class-names", "or relabel the rows with 0..C-1")
    user_error(cli("train", "--train", "words.jsonl", "--output", "m", "--class-names", "false", "yes", cwd=tmp_path),
               "label 'true' is not one of the class names of --class-names ('false', 'yes')")
    # the way out works: --class-names reads the strings as the index of their name, and the model keeps the names
    r = cli("train", "--train", "words.jsonl", "--output", "m", "--class-names", *names, "--iterations", "1",
            "--epochs", "2", "--exemplar-dim", "8", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = cli("evaluate", "--model", "m", "--input", "words.jsonl", "--report", "rep.json", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "rep.json").read_text())["class_names"] == names
    r = cli("predict", "--model", "m", "--input", "words.jsonl", "--output", "p.jsonl", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # a model trained without names cannot know what 'true' means: relabel (or train with names)
    user_error(cli("evaluate", "--model", box / "model", "--input", "words.jsonl", cwd=tmp_path),
               "this model was trained without class names", "relabel the rows with its class indices")


def test_required_options_show_as_required_in_help(tmp_path):
    import re

    from sdm_mlx.cli import build_parser, is_required

    r = cli("predict", "--help", cwd=tmp_path)
    assert r.returncode == 0
    usage = r.stdout.split("\n\n")[0]
    assert " --model MODEL --input INPUT" in usage and "[--model" not in usage and "[--input" not in usage, usage
    r = cli("network-train", "--help", cwd=tmp_path)
    assert " -m MODEL --output OUTPUT_DIR" in r.stdout.split("\n\n")[0], r.stdout[:400]
    r = cli("serve", "--help", cwd=tmp_path)
    assert "Required: --head DIR" in " ".join(r.stdout.split()) and "-m/--model MODEL with --verifier DIR" in \
        " ".join(r.stdout.split())
    # every verb: each option it cannot run without is unbracketed in its usage line, and only those are
    _, subparsers = build_parser()
    for verb, (parser, mod) in subparsers.items():
        usage = " ".join(parser.format_usage().split())
        required = [a for a in parser._actions if is_required(a)]
        assert {a.dest for a in required} >= set(getattr(mod, "REQUIRED", ())), verb
        for a in parser._actions:
            if not a.option_strings or a.dest == "help":
                continue
            bracketed = re.search(r"(\[|\| )" + re.escape(a.option_strings[0]) + r"[ \]|]", usage)  # [--x ..] [a | --x]
            assert bool(bracketed) != (a in required), (verb, a.option_strings, usage)


def test_running_the_quick_start_demo_again_works(tmp_path):
    # the Quick start's `sdm-mlx demo`, twice (the quick settings made smaller still: this is about the directory)
    small = ("--quick", "--no-plots", "--iterations", "1", "--epochs", "1", "--exemplar-dim", "16",
             "--rescaler-max-epochs", "5")
    first = cli("demo", *small, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    report = (tmp_path / "runs" / "demo" / "report.json").stat().st_mtime_ns
    second = cli("demo", *small, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "replacing the outputs of the previous demo run in runs/demo" in second.stderr
    assert (tmp_path / "runs" / "demo" / "report.json").stat().st_mtime_ns != report
    assert sorted(os.listdir(tmp_path / "runs")) == ["demo"] and locks(tmp_path / "runs") == []
    # a directory the user names is still never replaced without --overwrite, nor a foreign runs/demo
    user_error(cli("demo", *small, "--output", "runs/demo", cwd=tmp_path), "pass --overwrite")
    (tmp_path / "other" / "runs" / "demo").mkdir(parents=True)
    (tmp_path / "other" / "runs" / "demo" / "mine.txt").write_text("x")
    user_error(cli("demo", *small, cwd=tmp_path / "other"), "sdm_mlx did not create")
