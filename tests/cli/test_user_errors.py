"""User mistakes met in a first hour are the user's (exit 2, a message naming the fix), never "internal error":
every case runs the CLI in a subprocess, as a user does."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

from sdm_mlx.storage.datasets import factcheck_splits
from sdm_mlx.errors import ArtifactError, InputError, SDMError


def cli(*args, cwd, stdin=None, timeout=180):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "sdm_mlx", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout, input=stdin)


def user_error(r, *fragments):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    for f in fragments:
        assert f in r.stderr, (f, r.stderr)


def write_rows(path, n=None, field="attributes", shift=0):
    pool = factcheck_splits()[0]
    n = len(pool.y) if n is None else n
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "label": int(pool.y[i]) + shift,
                                field: [float(v) for v in pool.X[i]]}) + "\n")
    return path


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    """A directory with training rows under 'attributes', the same rows under 'embedding', and a model."""
    d = tmp_path_factory.mktemp("first_hour")
    write_rows(d / "train.jsonl", n=800)
    write_rows(d / "as_embedding.jsonl", n=200, field="embedding")
    r = cli("train", "--train", "train.jsonl", "--output", "model", "--iterations", "1", "--epochs", "2",
            "--quiet", cwd=d)
    assert r.returncode == 0, r.stderr
    return d


def test_user_error_classes_are_sdm_errors():
    from sdm_mlx.llm.api_features import APIFeatureError
    from sdm_mlx.llm.embed import DocumentError
    from sdm_mlx.network.heads import HeadShapeError

    assert issubclass(HeadShapeError, ArtifactError) and issubclass(DocumentError, InputError)
    assert issubclass(APIFeatureError, InputError)
    assert all(issubclass(c, (SDMError, ValueError)) for c in (HeadShapeError, DocumentError, APIFeatureError))
    assert "index" in inspect.signature(DocumentError).parameters


@pytest.mark.parametrize("verb, model", [
    (["embed", "--input", "rows.jsonl", "--output", "o.jsonl"], "runs/tiny/model"),
    (["make-verification-data", "--input", "rows.jsonl", "--output", "o.jsonl"], "./runs/tiny/model"),
    (["generate", "--verifier", "v", "--prompt", "hi"], "not-a-local-dir-or-cached-hub-id"),
    (["chat", "--verifier", "v"], "runs/tiny/model"),
])
def test_a_missing_llm_model_is_model_not_found(tmp_path, verb, model):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"id": 1, "document": "x"}) + "\n")
    r = cli(*verb, "--model", model, cwd=tmp_path, stdin="")
    user_error(r, f"model not found: {model} (no such directory; hub ids need network access")


def test_a_missing_model_for_network_train_and_a_file_given_as_model(tmp_path):
    (tmp_path / "task.jsonl").write_text(json.dumps({"id": 1, "document": "x", "label": 0}) + "\n")
    r = cli("network-train", "--model", "runs/tiny/model", "--data", "task.jsonl", "--output-dir", "out",
            "--preset", "sentiment", cwd=tmp_path)
    user_error(r, "model not found: runs/tiny/model")
    r = cli("embed", "--model", "task.jsonl", "--input", "task.jsonl", "--output", "o.jsonl", cwd=tmp_path)
    user_error(r, "model not found: task.jsonl (a file, not a model directory)")


def test_a_missing_estimator_model_names_the_path(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"id": 1, "embedding": [0.0]}) + "\n")
    for verb in (["predict", "--input", "rows.jsonl"], ["inspect"], ["recalibrate", "--alpha", "0.9"]):
        user_error(cli(*verb, "--model", "runs/nope/model", cwd=tmp_path), "runs/nope/model")


def test_csv_given_as_jsonl_says_so(tmp_path):
    (tmp_path / "table_export.txt").write_text("id,label,a,b\n1,0,0.1,0.2\n2,1,0.3,0.4\n")
    r = cli("train", "--train", "table_export.txt", "--output", "m", cwd=tmp_path)
    user_error(r, "table_export.txt:1:", "JSONL is expected, one JSON object per line", "looks like CSV")
    (tmp_path / "cut.jsonl").write_text('{"id": 1, "label": 0, "embedding": [0.1]}\n{"id": 2, "lab')
    user_error(cli("train", "--train", "cut.jsonl", "--output", "m", cwd=tmp_path), "cut.jsonl:2: malformed JSON")


def test_labels_starting_at_one_say_labels_are_0_to_c_minus_1(tmp_path):
    write_rows(tmp_path / "shift.jsonl", shift=1)
    r = cli("train", "--train", "shift.jsonl", "--output", "m", "--iterations", "1", "--epochs", "1", cwd=tmp_path)
    user_error(r, "labels must be class indices 0..C-1", "found the values [1, 2]", "class(es) [0] have no rows")


def test_features_under_another_field_than_the_model_are_refused(box):
    assert json.loads((box / "model" / "manifest.json").read_text())  # the field is stored with the model
    r = cli("predict", "--model", "model", "--input", "as_embedding.jsonl", "--output", "o.jsonl", cwd=box)
    user_error(r, "as_embedding.jsonl", "'embedding'", "trained on 'attributes'")
    r = cli("evaluate", "--model", "model", "--input", "as_embedding.jsonl", "--report", "ev.json", cwd=box)
    user_error(r, "trained on 'attributes'")
    ok = cli("predict", "--model", "model", "--input", "train.jsonl", "--output", "o.jsonl", "--quiet", cwd=box)
    assert ok.returncode == 0, ok.stderr


def test_a_closed_stdout_pipe_ends_quietly(box):
    """``predict ... --output - | head -n 1``: no "Broken pipe" error, exit 0, as Unix tools end."""
    r = subprocess.run(f"{sys.executable} -m sdm_mlx predict --model model --input train.jsonl --output - "
                       "| head -n 1", shell=True, capture_output=True, text=True, cwd=box, timeout=180,
                       executable="/bin/bash")
    assert json.loads(r.stdout)["id"] == "r0"
    assert "error" not in r.stderr.lower() and "Broken pipe" not in r.stderr, r.stderr
    status = subprocess.run(f"set -o pipefail; {sys.executable} -m sdm_mlx predict --model model --input "
                            "train.jsonl --output - --quiet | head -c 1 >/dev/null", shell=True, cwd=box,
                            timeout=180, executable="/bin/bash", capture_output=True, text=True)
    assert status.returncode == 0 and status.stderr == "", status.stderr


def test_a_document_without_its_delimiter_and_a_malformed_api_row_are_user_errors(tmp_path, tiny_phi3_path):
    """DocumentError and APIFeatureError (SDMErrors) end the CLI with exit 2 naming the line, never exit 1."""
    (tmp_path / "docs.jsonl").write_text(json.dumps({"id": "x", "document": "b", "completion": "positive"}) + "\n")
    r = cli("embed", "--model", tiny_phi3_path, "--input", "docs.jsonl", "--output", "f.jsonl", "--completion-field",
            "completion", cwd=tmp_path)
    user_error(r, "line 1 (id 'x'): no closing delimiter")
    (tmp_path / "api.jsonl").write_text(json.dumps({"id": "z", "label": 1, "response": "{oops"}) + "\n")
    r = cli("api-features", "--input", "api.jsonl", "--output", "o.jsonl", cwd=tmp_path)
    user_error(r, "api.jsonl: line 1 (id 'z')")
