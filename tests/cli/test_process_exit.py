"""``sdm_mlx.cli.run``, the process entry point: the exit code is :func:`main`'s; after a verb that started a model
thread (``serve``, ``mcp``) the process ends with ``os._exit`` but still runs its ``atexit`` functions and
flushes what it printed; other verbs exit normally."""

from __future__ import annotations

import subprocess
import sys

import pytest

_ENTRY = """
import atexit, sys
from sdm_mlx import cli
atexit.register(lambda: print("atexit ran", flush=True))
if sys.argv[1] == "model-thread":
    from sdm_mlx.serve.engine import ModelThread
    ModelThread("test-model")
    import threading  # a thread that never ends: a normal exit would wait for it forever, os._exit does not
    threading.Thread(target=threading.Event().wait).start()
    cli.main = lambda argv=None: (print("buffered, not flushed", end=""), 3)[1]
elif sys.argv[1] == "ok":
    cli.main = lambda argv=None: (print("buffered, not flushed", end=""), 0)[1]
cli.run()
"""


@pytest.mark.parametrize("mode, code", [("model-thread", 3), ("ok", 0)])
def test_run_exits_with_main_s_code_and_loses_no_output(mode, code):
    out = subprocess.run([sys.executable, "-c", _ENTRY, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == code, out.stderr
    assert out.stdout == "buffered, not flushedatexit ran\n"  # printed text flushed, atexit functions run once


def test_the_model_thread_marks_the_process():
    code = ("from sdm_mlx.serve.engine import ModelThread as M; before = M.started; M('t'); print(before, M.started)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_a_bad_verb_still_exits_2_through_the_entry_point():
    out = subprocess.run([sys.executable, "-m", "sdm_mlx", "no-such-verb"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "no-such-verb" in out.stderr
