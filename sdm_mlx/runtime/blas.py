"""Fast matrix products for MLX on Linux CPUs.

The ``mlx[cpu]`` wheel for Linux ships a slow reference BLAS (~2 GFLOP/s on a
2-core machine).  Its ``cblas_sgemm`` is an interposable symbol, so an
optimised OpenBLAS (Debian: ``apt-get install libopenblas0-pthread``) loaded
into the process's global symbol scope *before* MLX is imported serves every
MLX matmul instead: measured 30–50x faster here.  ``import sdm_mlx`` does this
automatically on Linux when the library is installed and ``mlx.core`` is not
imported yet (so import ``sdm_mlx`` before ``mlx`` in your own scripts, or
export ``LD_PRELOAD=<path to libopenblas.so.0>``).  Opt out with
``SDM_MLX_NO_BLAS_PRELOAD=1``.  macOS (Accelerate / Metal) needs nothing.

OpenBLAS's worker threads busy-wait (``sched_yield``) for 2^28 cycles (about 0.1 s) after every
multi-threaded product before they sleep.  Between MLX's products that spinning takes a core from MLX's
own stream thread and from Python: serving the tiny test model to one client, the spinning worker used
4.1 s of system time in 8 s, and the median request took 65 ms against 48 ms with the wait cut short.
So the library is loaded with ``OPENBLAS_THREAD_TIMEOUT=4`` (2^4 cycles: a worker sleeps at once and is
woken for the next product) unless the environment sets it.  A process started with ``LD_PRELOAD`` has
read the variable already (export it yourself); ``import sdm_mlx`` still sets it for its child processes.

Many small products in a row are another matter: each multi-threaded product ends in a barrier, and on a
shared virtual machine a worker whose core the hypervisor has taken away (steal time) holds every other
thread there.  :func:`one_blas_thread` runs products on the calling thread only, for code that splits its
own work between threads (the W_pos step's dW blocks: 1,187 products of 128 x 50 x 1,536 per step took
9-14 s beside other work where they take 1.5 s alone; one BLAS thread per worker, 1.0-2.1 s in both cases).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

_loaded_in_process: str | None = None
#: OpenBLAS's busy-wait after a job, as a power of two of CPU cycles (its default 28; see the module docstring)
THREAD_TIMEOUT = "4"


#: Threads of the host's row-block passes (the estimator's and the W_pos step's Adam): at most the CPU count; two
#: measured fastest on the 2-core box (docs/performance.md)
PASS_THREADS = min(2, os.cpu_count() or 1)

_controller = None


def block_ranges(rows: int, block_rows: int, workers: int) -> list[tuple[int, int]]:
    """``workers`` contiguous ``(start, stop)`` ranges over ``rows`` rows, each of whole ``block_rows`` blocks (the
    last range ends at ``rows``), for a pass split between threads that each take their own rows."""
    blocks = -(-rows // block_rows)
    workers = max(1, min(workers, blocks))
    cut = [(blocks * i // workers) * block_rows for i in range(workers)] + [rows]
    return list(zip(cut[:-1], cut[1:]))


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Every BLAS loaded in the process (NumPy's, and the OpenBLAS serving MLX) computes on the calling thread
    while the block runs (``threadpoolctl``; the thread counts are restored after).  See the module docstring."""
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()  # the libraries loaded by now; NumPy's is loaded with sdm_mlx
    with _controller.limit(limits=1, user_api="blas"):
        yield


def find_openblas() -> str | None:
    """Path of an installed OpenBLAS shared library, or None."""
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    return None


def preload_openblas() -> str | None:
    """On Linux, load OpenBLAS with RTLD_GLOBAL before MLX (see module doc); returns the path or None."""
    global _loaded_in_process
    if _loaded_in_process or not sys.platform.startswith("linux"):
        return _loaded_in_process
    if os.environ.get("SDM_MLX_NO_BLAS_PRELOAD"):
        return None
    # read once, when the library loads: here below, or in the child processes (with LD_PRELOAD too)
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
    if "mlx.core" in sys.modules or blas_preloaded():
        return None
    lib = find_openblas()
    if lib is None:
        return None
    try:
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    _loaded_in_process = lib
    return lib


def blas_preloaded() -> bool:
    """True if OpenBLAS serves MLX's matmuls in this process (LD_PRELOAD or :func:`preload_openblas`)."""
    return bool(_loaded_in_process) or "openblas" in os.environ.get("LD_PRELOAD", "")


def describe_blas() -> str:
    """One line for benchmark reports: which BLAS MLX's CPU matmul uses."""
    if sys.platform == "darwin":
        return "macOS (Accelerate/Metal)"
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return f"OpenBLAS via LD_PRELOAD ({os.environ['LD_PRELOAD']})"
    if _loaded_in_process:
        return f"OpenBLAS loaded by sdm_mlx before MLX ({_loaded_in_process})"
    return "mlx[cpu] wheel's bundled reference BLAS (slow; see sdm_mlx/runtime/blas.py)"


def maybe_warn_slow_blas() -> None:
    """Print a one-line hint on stderr when running on Linux with the slow bundled BLAS."""
    if sys.platform.startswith("linux") and not blas_preloaded() and not os.environ.get("SDM_MLX_NO_BLAS_PRELOAD"):
        print(
            "sdm-mlx: note: MLX is using its slow bundled BLAS; `apt-get install libopenblas0-pthread` "
            "makes matrix products 30-50x faster (picked up automatically).",
            file=sys.stderr,
        )
