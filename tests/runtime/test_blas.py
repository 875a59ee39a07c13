"""``preload_openblas``: OpenBLAS is loaded with a short worker busy-wait (``OPENBLAS_THREAD_TIMEOUT``) unless the
environment sets one, and matrix products still agree with NumPy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sdm_mlx.runtime.blas import THREAD_TIMEOUT, find_openblas

CODE = ("import os, sdm_mlx, numpy as np, mlx.core as mx; from sdm_mlx.runtime.blas import describe_blas;"
        "a = np.random.default_rng(0).normal(size=(300, 200)).astype(np.float32);"
        "ok = np.allclose(np.array(mx.array(a) @ mx.array(a.T)), a @ a.T, rtol=1e-4, atol=1e-3);"
        "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), ok, 'loaded by sdm_mlx' in describe_blas())")


def _run(**env) -> list:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_THREAD_TIMEOUT")}
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120,
                         env={**base, **env}, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux") or find_openblas() is None,
                    reason="sdm_mlx loads OpenBLAS itself only on Linux, when it is installed")
def test_openblas_is_loaded_with_a_short_busy_wait_unless_the_environment_sets_one():
    assert _run() == [THREAD_TIMEOUT, "True", "True"]
    assert _run(OPENBLAS_THREAD_TIMEOUT="28") == ["28", "True", "True"]
    assert _run(SDM_MLX_NO_BLAS_PRELOAD="1")[0] == "None"  # opted out: nothing loaded, nothing set
    # preloaded at exec: the library has read its setting already; the child processes get the short wait
    assert _run(LD_PRELOAD=find_openblas()) == [THREAD_TIMEOUT, "True", "False"]
