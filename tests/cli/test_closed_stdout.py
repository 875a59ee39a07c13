"""A closed standard output (``sdm-mlx VERB 1>&-``) or one open for reading only (``1</dev/null``): every verb
refuses at once with exit 2 and a message naming the fix, never "internal error" (``predict --output -`` crashed
on ``None.write``, exit 1) and never a success that printed into nothing (``inspect`` exited 0)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sdm_mlx.cli import VERBS
from sdm_mlx.errors import OutputError
from sdm_mlx.storage.files import write_jsonl


def run_without_stdout(args, cwd, how="closed"):
    """``python -m sdm_mlx ARGS`` with file descriptor 1 closed (``1>&-``) or open read-only (``1</dev/null``)."""
    def prepare():
        if how == "closed":
            os.close(1)
        else:
            fd = os.open(os.devnull, os.O_RDONLY)
            os.dup2(fd, 1)
            os.close(fd)

    return subprocess.run([sys.executable, "-m", "sdm_mlx", *map(str, args)], cwd=cwd, stdin=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=prepare,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def refused(r, what="closed"):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert f"standard output is {what}" in r.stderr and ">/dev/null" in r.stderr, r.stderr


@pytest.mark.parametrize("how,what", [("closed", "closed"), ("read-only", "open for reading only")])
def test_predict_to_stdout_and_inspect_refuse_an_unwritable_stdout(lab, how, what):
    refused(run_without_stdout(["predict", "--model", "model", "--input", "test.jsonl", "--output", "-"], lab, how),
            what)
    refused(run_without_stdout(["inspect", "--model", "model"], lab, how), what)
    refused(run_without_stdout(["inspect", "--model", "model", "--json"], lab, how), what)


def test_every_verb_refuses_a_closed_stdout_before_any_work(tmp_path):
    """Every verb prints there (results, a summary, the access log, the MCP protocol): refused before its options
    are even checked, so a long run is not wasted; nothing is written to the working directory."""
    for verb in VERBS:
        refused(run_without_stdout([verb], tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_writing_jsonl_to_a_closed_stdout_is_an_output_error(monkeypatch):
    """The Python API (``write_jsonl('-', ...)`` in a process without stdout): an OutputError naming the fix."""
    monkeypatch.setattr(sys, "stdout", None)
    with pytest.raises(OutputError, match="standard output is closed"):
        write_jsonl("-", [{"id": 1}])
