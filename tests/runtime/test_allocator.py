"""``keep_freed_buffers``: glibc's mmap and trim thresholds are set once on Linux, and the opt-out is honoured."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sdm_mlx.runtime import allocator


def _run(code: str, **env) -> str:
    import os

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


def test_thresholds_fit_in_a_c_int():
    assert 0 < allocator.MMAP_THRESHOLD_BYTES < 2**31 and 0 < allocator.TRIM_THRESHOLD_BYTES < 2**31
