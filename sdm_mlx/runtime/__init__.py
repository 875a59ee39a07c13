"""Process concerns (layer 0): the BLAS preload (:mod:`.blas`), glibc's allocator thresholds for MLX's CPU
buffers and a server's heap trimming (:mod:`.allocator`), multi-process data parallelism over
``mlx.core.distributed`` (:mod:`.distributed`), ``mx.compile`` with a bound on its traces (:mod:`.compiled`)
and training callbacks with the progress bar (:mod:`.callbacks`).

May import: :mod:`sdm_mlx.errors` and third-party packages only; everything else in sdm_mlx sits above it.
Nothing is imported until used (PEP 562).
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "preload_openblas": "blas", "BoundedCompile": "compiled",
    "keep_freed_buffers": "allocator", "keep_freed_buffers_after_load": "allocator",
    "HeapTrimmer": "allocator", "release_free_memory": "allocator", "limit_arenas": "allocator",
    "limit_buffer_cache": "allocator", "freeze_loaded_objects": "allocator",
    "Callback": "callbacks", "CallbackList": "callbacks",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
