"""glibc's allocator for MLX's CPU buffers: kept freed buffers for batch work, bounded memory for a server.

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

A server's memory (:func:`freeze_loaded_objects`, :func:`limit_arenas`, :class:`HeapTrimmer`, :func:`limit_buffer_cache`)
-------------------------------------------------------------------------------------------------------------------------
A server keeps glibc's defaults, and ``load_engine`` (``sdm_mlx.commands._common``, for ``serve`` and ``mcp``)
does four things once its model is loaded, measured under 16 clients on the tiny model for 10 minutes
(``tools/bench/bench_serve_soak.py``, table in ``docs/serving.md``):

* :func:`freeze_loaded_objects`.  Every closed HTTP connection left asyncio's transport in a reference cycle
  that only a full collection frees, and with the loaded objects in the collector's reach a full collection
  came after tens of thousands of requests: ``gc.collect()`` every 30 s found 700-3,000 such objects each time.
  After the freeze a full collection came every 30 s or so by itself.
* :func:`limit_arenas` (2).  glibc had given the server's threads 9 heaps, each fragmenting apart.
* :class:`HeapTrimmer` on the model thread (``sdm_mlx.serve.engine.ModelThread``): at most every 10 s, between
  two decoding steps or once the thread idles, :func:`release_free_memory` collects the garbage and gives the
  heap's free pages back (``malloc_trim(0)``: 3-24 ms on this heap).  The heap fragments, as every prompt and
  batch shape allocates and frees buffers of new sizes between long-lived ones (prompt-cache entries,
  verdicts): before these changes its free bytes (``mallinfo2``) rose from 45 to 79 MiB in 10 minutes while
  its live bytes stayed at 80-95 MiB.
* :func:`limit_buffer_cache` (0 bytes): MLX's CPU buffer cache is off, so glibc reuses the freed buffers.  The
  cache kept 32 MiB of buffers whose sizes later prompts rarely matched.  Without it RSS settled 35-55 MiB
  lower on the tiny model and the heap's free bytes stayed flat after the first 100 s (they had risen from 36
  to 55 MiB over 12 minutes); on the small model the memory kept between batches was 104-115 MiB lower.
  Requests/s did not fall on the tiny model; on the real model they were 0.97x at 4 clients (the median of 6
  alternating pairs, inside the noise).  Measured in ``docs/serving.md``.

Opt out of all four with ``SDM_MLX_TRIM_HEAP=0``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time
from typing import Callable

from ..errors import InputError

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: arrays below this size are served from (and returned to) the heap
MMAP_THRESHOLD_BYTES = 64 << 20
#: freed memory the heap may keep at its top before returning it to the system
TRIM_THRESHOLD_BYTES = 256 << 20

_done = False
_wanted = False


def _glibc(name: str, argtypes: tuple) -> Callable | None:
    """glibc's function ``name`` (returning a C int), or None on other platforms and C libraries (e.g. musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int))
_trim = _glibc("malloc_trim", (ctypes.c_size_t,))


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
    if _mallopt is None or os.environ.get("SDM_MLX_KEEP_FREED_BUFFERS", "1") == "0":
        return False
    _done = bool(_mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _done


def _server_tuning_off() -> bool:
    """``SDM_MLX_TRIM_HEAP=0``: the opt-out of the four server measures (module docstring)."""
    return os.environ.get("SDM_MLX_TRIM_HEAP", "1") == "0"


def release_free_memory() -> bool:
    """Free the garbage cycles (``gc.collect()``), then give the heap's free pages back to the system (glibc
    ``malloc_trim(0)``); whether glibc did the latter.

    Live allocations are untouched; a freed page used again later is faulted in again.  After
    :func:`freeze_loaded_objects` the collection walks only the objects created since, a few milliseconds.
    Only the collection where there is no glibc (other platforms and C libraries); nothing with
    ``SDM_MLX_TRIM_HEAP=0``.
    """
    if _server_tuning_off():
        return False
    gc.collect()
    if _trim is None:
        return False
    _trim(0)
    return True


class HeapTrimmer:
    """Calls :func:`release_free_memory` at most every ``every_s`` seconds, and only after work was done.

    The owner calls :meth:`worked` after each unit of work (a decoding step) and :meth:`maybe_release` where
    a pause costs nobody (between two steps, or when idle); :meth:`due_in` says how long an idle owner may
    block before a release is due (None: nothing to release).

    Parameters
    ----------
    every_s : float, default 10.0
        Seconds between two releases.
    release : callable, default :func:`release_free_memory`
    clock : callable, default ``time.monotonic``

    Attributes
    ----------
    releases : int
        Releases made so far.
    failures : int
        Releases that raised (counted, not propagated: the owner's work goes on).
    """

    def __init__(self, *, every_s: float = 10.0, release: Callable[[], bool] = release_free_memory,
                 clock: Callable[[], float] = time.monotonic):
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s!r}")
        self.every_s, self._release, self._clock = float(every_s), release, clock
        self._last = clock()
        self._dirty = False
        self.releases = self.failures = 0

    def worked(self) -> None:
        """Note that work was done (memory may have been freed since the last release)."""
        self._dirty = True

    def due_in(self) -> float | None:
        """Seconds until a release is due (0.0: now), or None when no work was done since the last one."""
        if not self._dirty:
            return None
        return max(0.0, self._last + self.every_s - self._clock())

    def maybe_release(self) -> bool:
        """Release now if work was done and ``every_s`` passed since the last release; whether it did."""
        if self.due_in() != 0.0:
            return False
        self._last, self._dirty = self._clock(), False
        try:
            self._release()
        except Exception:  # giving memory back is never worth failing the owner's work over
            self.failures += 1
            return False
        self.releases += 1
        return True


#: malloc arenas of a server process (:func:`limit_arenas`)
SERVER_ARENAS = 2


def limit_arenas(n: int = SERVER_ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``n`` (``M_ARENA_MAX``) for the threads that allocate from now on; whether set.

    glibc gives threads that allocate at the same time arenas of their own (up to 8 per core), and each
    fragments and keeps its free pages apart.  A server calls this before it starts its threads.  Opt out with
    ``SDM_MLX_TRIM_HEAP=0``.
    """
    if _mallopt is None or _server_tuning_off():
        return False
    return bool(_mallopt(_M_ARENA_MAX, int(n)))


#: MLX's CPU buffer cache of a server process, in bytes (:func:`limit_buffer_cache`)
SERVER_BUFFER_CACHE_BYTES = 0


def limit_buffer_cache(n: int | None = None) -> int | None:
    """Set MLX's CPU buffer cache to ``n`` bytes (default :data:`SERVER_BUFFER_CACHE_BYTES`, or the environment's
    ``SDM_MLX_BUFFER_CACHE_BYTES``); the limit set, or None where it does not apply.

    MLX keeps freed CPU buffers in its own cache (32 MiB by default) and hands one out again only for a request
    within two pages of its size; once the cache is full it frees the newly freed buffer instead.  A server's
    buffer sizes change with every prompt length and batch size, so the cache fills with the sizes freed first,
    pins them across the heap, and most frees and allocations pass it by anyway.  Without it glibc's bins reuse
    freed memory for any size and join freed neighbours.  Measured under 16 clients on the tiny and small
    models (``tools/bench/bench_serve_soak.py``, table in ``docs/serving.md``).  Only where glibc serves MLX's
    buffers (Linux, computing on the CPU); opt out with ``SDM_MLX_TRIM_HEAP=0``.
    """
    if _mallopt is None or _server_tuning_off():
        return None
    import mlx.core as mx

    if mx.metal.is_available() or mx.default_device() != mx.cpu:
        return None
    raw = os.environ.get("SDM_MLX_BUFFER_CACHE_BYTES", str(SERVER_BUFFER_CACHE_BYTES)) if n is None else str(n)
    if not (raw.isascii() and raw.isdigit()):  # also refuses "-1" and "1.5"
        fix = (f"unset it for the default ({SERVER_BUFFER_CACHE_BYTES})" if n is None else "pass 0 or more")
        raise InputError(f"{'SDM_MLX_BUFFER_CACHE_BYTES' if n is None else 'n'} must be a whole number of bytes "
                         f">= 0, got {raw!r}: {fix}")
    mx.set_cache_limit(int(raw))
    return int(raw)


def freeze_loaded_objects() -> int:
    """Collect, then move every object alive now out of the garbage collector's reach (``gc.freeze``); how many.

    A server calls this once its model is loaded.  CPython runs a full collection only when the objects that
    survived into the oldest generation since the last one exceed a quarter of those that survived it, and a
    loaded model, tokenizer and verifier are about 85,000 such objects.  Without the freeze, the cycles a
    request leaves behind that outlive a few young collections (each closed connection leaves asyncio's
    ``_SelectorSocketTransport`` in a cycle with its own bound method) wait for a full collection that comes
    after tens of thousands of requests, and hold their memory until then.  Frozen objects are never walked
    again, so full collections come often and cost little.  Nothing with ``SDM_MLX_TRIM_HEAP=0`` (returns 0).
    """
    if _server_tuning_off():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
