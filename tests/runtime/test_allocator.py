"""``keep_freed_buffers``: glibc's mmap and trim thresholds are set once on Linux, only for processes that ask
(the batch commands), and the opt-out is honoured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sdm_mlx.runtime import allocator


def _run(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env}, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux only")
def test_thresholds_are_set_once_and_buffers_still_work():
    code = ("import numpy as np; from sdm_mlx.runtime.allocator import keep_freed_buffers as k;"
            "a = k(); b = k(); x = np.ones((4096, 1024), np.float32); del x; y = np.ones((4096, 1024), np.float32);"
            "print(a, b, float(y.sum()))")
    first, second, total = _run(code, SDM_MLX_KEEP_FREED_BUFFERS="1").split()
    if first == "False":  # not glibc (e.g. musl): nothing is set, nothing breaks
        assert second == "False"
    else:
        assert first == second == "True"
    assert float(total) == 4096 * 1024


def test_opt_out_leaves_the_allocator_alone():
    code = "from sdm_mlx.runtime.allocator import keep_freed_buffers as k; print(k())"
    assert _run(code, SDM_MLX_KEEP_FREED_BUFFERS="0") == "False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux only")
def test_load_model_applies_it_only_when_the_process_asked(tiny_phi3_path):
    """A server (nothing asked) keeps glibc's defaults after load_model; a batch command's process sets them."""
    code = ("import sys; from sdm_mlx.runtime import allocator as a; from sdm_mlx.llm.model import load_model;"
            "ask = sys.argv[1] == 'ask'; ask and a.keep_freed_buffers_after_load();"
            "load_model(sys.argv[2]); print(a._done)")
    env = {**os.environ, "SDM_MLX_KEEP_FREED_BUFFERS": "1"}
    run = lambda mode: subprocess.run([sys.executable, "-c", code, mode, tiny_phi3_path], capture_output=True,  # noqa: E731
                                      text=True, timeout=300, env=env, check=True).stdout.strip().splitlines()[-1]
    assert run("serve") == "False"
    if _run("from sdm_mlx.runtime.allocator import keep_freed_buffers as k; print(k())") == "True":
        assert run("ask") == "True"


def test_the_batch_commands_ask_and_serve_does_not():
    root = os.path.join(os.path.dirname(allocator.__file__), "..", "commands")
    text = {name: open(os.path.join(root, f"{name}.py"), encoding="utf-8").read()
            for name in ("embed", "network_train", "generate", "serve")}
    assert all("keep_freed_buffers_after_load()" in text[n] for n in ("embed", "network_train", "generate"))
    assert "keep_freed_buffers" not in text["serve"]


def test_thresholds_fit_in_a_c_int():
    assert 0 < allocator.MMAP_THRESHOLD_BYTES < 2**31 and 0 < allocator.TRIM_THRESHOLD_BYTES < 2**31
