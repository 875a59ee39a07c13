"""``mx.compile`` with a bound on the traces it keeps: a long-running process's memory stays flat.

``mx.compile(fun)`` (without ``shapeless=True``) traces ``fun`` again for every new combination of input
shapes and dtypes and keeps every trace, with its compiled graph, for as long as the compiled function lives.
On this box (MLX 0.32.4, CPU) that is 40–60 KB per trace.  A function that sees a prompt's ``[B, L, F]``
activations meets a new ``(B, L)`` with almost every batch of prompts, so a server that has run for a while
holds thousands of traces.  Under a 16-client load with prompts of 1–30 words, the median RSS of ``sdm-mlx
serve`` grew by 22.3 MiB from the second to the last quarter of a 5-minute run, while MLX's buffers and
Python's objects stayed flat.  With this bound it grew by 6.4–10.5 MiB (``docs/serving.md``).
``shapeless=True`` would keep one trace, but MLX cannot infer
every primitive's output shape (``view``, which :mod:`sdm_mlx.llm.cpu_swiglu`'s exponent needs, raises).

:class:`BoundedCompile` keeps the compiled function and counts the distinct input signatures it has been
called with.  At ``max_traces`` it starts a new compiled function (over a new function object: MLX keys its
trace cache by the function's identity) and lets go of the old one, which frees all its traces.  A signature
seen again then costs one new trace (about 0.6 ms for the SwiGLU); the values are those of the same compiled
graph, bit for bit.
"""

from __future__ import annotations

import functools
import threading

import mlx.core as mx

#: distinct input signatures a compiled function keeps traces for before it starts afresh
DEFAULT_MAX_TRACES = 128


def _signature(args) -> tuple:
    return tuple((a.shape, a.dtype) if isinstance(a, mx.array) else (type(a), a) for a in args)


class BoundedCompile:
    """``mx.compile(fun)`` that keeps the traces of at most ``max_traces`` distinct input signatures.

    Parameters
    ----------
    fun : callable
        The function to compile; called with positional arguments (arrays, or hashable constants).
    max_traces : int, default 128
        Distinct signatures (shapes and dtypes of the array arguments, values of the others) before every
        trace is dropped and tracing starts again.

    Attributes
    ----------
    resets : int
        How many times the traces were dropped.
    """

    def __init__(self, fun, *, max_traces: int = DEFAULT_MAX_TRACES):
        if max_traces < 1:
            raise ValueError(f"max_traces must be >= 1, got {max_traces}")
        self.fun = fun
        self.max_traces = int(max_traces)
        self.resets = 0
        self._lock = threading.Lock()
        self._signatures: set = set()
        self._compiled = self._fresh()
        functools.update_wrapper(self, fun)

    def _fresh(self):
        fun = self.fun

        def traced(*args):  # a new function object each time: a new key in MLX's trace cache
            return fun(*args)

        return mx.compile(traced)

    @property
    def traces(self) -> int:
        """Distinct input signatures traced since the last reset."""
        return len(self._signatures)

    def __call__(self, *args):
        signature = _signature(args)
        with self._lock:
            if signature not in self._signatures:
                if len(self._signatures) >= self.max_traces:
                    self._compiled = self._fresh()  # the old compiled function, once unreferenced, frees its traces
                    self._signatures.clear()
                    self.resets += 1
                self._signatures.add(signature)
            compiled = self._compiled
        return compiled(*args)
