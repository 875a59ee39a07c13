"""Fast matrix products for MLX on Linux CPUs.

The ``mlx[cpu]`` wheel for Linux ships a slow reference BLAS (a few GFLOP/s).
Preloading an optimised OpenBLAS (Debian: ``apt-get install
libopenblas0-pthread``) makes the same ``mx.matmul`` ~10-50x faster because the
dynamic linker resolves ``cblas_sgemm`` to it first.  The CLI does this
automatically: on Linux, if the library exists and is not yet preloaded, it
re-executes itself once with ``LD_PRELOAD`` set.  Opt out with
``SDM_MLX_NO_BLAS_PRELOAD=1``.  macOS (Accelerate / Metal) needs nothing.
"""

from __future__ import annotations

import os
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
_REEXEC_FLAG = "SDM_MLX_BLAS_REEXEC"


def find_openblas() -> str | None:
    """Path of an installed OpenBLAS shared library, or None."""
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    return None


def blas_preloaded() -> bool:
    """True if an OpenBLAS is in LD_PRELOAD of this process."""
    return "openblas" in os.environ.get("LD_PRELOAD", "")


def describe_blas() -> str:
    """One line for benchmark reports: which BLAS MLX's CPU matmul uses."""
    if sys.platform == "darwin":
        return "macOS (Accelerate/Metal)"
    if blas_preloaded():
        return f"OpenBLAS preloaded ({os.environ['LD_PRELOAD']})"
    return "mlx[cpu] wheel's bundled BLAS (slow; see sdm_mlx/blas.py)"


def reexec_with_openblas(argv: list[str]) -> None:
    """On Linux, re-run ``python -m sdm_mlx argv`` once with OpenBLAS preloaded (no-op otherwise)."""
    if not sys.platform.startswith("linux") or blas_preloaded():
        return
    if os.environ.get("SDM_MLX_NO_BLAS_PRELOAD") or os.environ.get(_REEXEC_FLAG):
        return
    lib = find_openblas()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = (lib + " " + env.get("LD_PRELOAD", "")).strip()
    env[_REEXEC_FLAG] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "sdm_mlx", *argv], env)


def maybe_warn_slow_blas() -> None:
    """Print a one-line hint on stderr when running on Linux with the slow bundled BLAS."""
    if sys.platform.startswith("linux") and not blas_preloaded() and not os.environ.get("SDM_MLX_NO_BLAS_PRELOAD"):
        print(
            "sdm-mlx: note: MLX is using its slow bundled BLAS; `apt-get install libopenblas0-pthread` "
            "makes matrix products ~10x faster (picked up automatically).",
            file=sys.stderr,
        )
