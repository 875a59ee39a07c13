"""Keep freed activation buffers in the process (glibc ``mallopt``), so MLX's CPU kernels do not page-fault.

On Linux, MLX's CPU buffers come from glibc ``malloc``.  glibc serves a request above its mmap threshold
(128 KiB, raised dynamically up to the size of the largest block freed so far) with a fresh ``mmap`` and
returns it with ``munmap`` on free, so every new array of that size touches fresh pages again.  The
activations of a batched forward pass (``[rows, 8960]`` float32 of a 1.5B model's MLP: 12 MB at 348 rows)
are such arrays, allocated and freed once per layer: measured on the 2-core box, the MLP activation of 348
rows took 48.6 ms with the default and 18.1 ms with the buffers kept, and the features of 32 factcheck rows
9.9 s against 8.8 s.

:func:`keep_freed_buffers` fixes the mmap threshold at 64 MiB (arrays below it come from the heap and are
reused after ``free``) and lets the heap keep up to 256 MiB of freed memory at its top.

It is for batch work, not for servers.  The batch commands (``embed``, ``network-train``, ``generate``) call
:func:`keep_freed_buffers_after_load`, and :func:`sdm_mlx.llm.model.load_model` applies it *after* the
weights are read: reading the weights into heap memory instead of fresh mappings was 2x slower.  ``serve``
does not.  Under 16 clients for 5 minutes on the tiny model, its RSS crept from 225 to 242 MiB with the
buffers kept (13,219 requests; +12.9 MiB over the second half), against 207-219 MiB without them (13,427
requests; +2.2 MiB).  It does nothing on other platforms or C libraries.  Opt out with
``SDM_MLX_KEEP_FREED_BUFFERS=0``.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: arrays below this size are served from (and returned to) the heap
MMAP_THRESHOLD_BYTES = 64 << 20
#: freed memory the heap may keep at its top before returning it to the system
TRIM_THRESHOLD_BYTES = 256 << 20

_done = False
_wanted = False


def keep_freed_buffers_after_load() -> None:
    """Ask :func:`sdm_mlx.llm.model.load_model` to call :func:`keep_freed_buffers` once its weights are read (the
    batch commands do; a long-running server does not, see the module docstring)."""
    global _wanted
    _wanted = True


def apply_after_load() -> bool:
    """:func:`keep_freed_buffers` if this process asked for it (:func:`keep_freed_buffers_after_load`)."""
    return keep_freed_buffers() if _wanted else False


def keep_freed_buffers() -> bool:
    """Set glibc's mmap and trim thresholds once per process (see the module docstring); whether they are set."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or os.environ.get("SDM_MLX_KEEP_FREED_BUFFERS", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _done
