"""RMSNorm and RoPE of a decoding step for MLX on the CPU: one compiled function each instead of MLX's fallback.

MLX has no CPU kernel for ``mx.fast.rms_norm`` or ``mx.fast.rope``: on the CPU it evaluates their fallback
graphs (square, sum, multiply, add, rsqrt; arange, exp, multiply, cos, sin, slices, concatenate, with the
broadcasts between them), and each of their operations is a task with a fixed cost of microseconds, whatever
its size.  A decoding step of a small model is mostly such tasks: a 16-row step of the 2-layer tiny test model
is 303 operations, 71 of them broadcasts.  Here the one-token inputs of a decoding step (``[B, 1, D]`` for a
norm, ``[B, H, 1, d]`` with per-row offsets for RoPE, as mlx-lm's ``BatchKVCache`` gives them) go through one
``mx.compile``'d function each (one trace per batch size, so as many as the rows decoded at once: a bounded
number, unlike the prompt shapes of :mod:`.cpu_swiglu`), which computes what the fallback computes, bit for bit
(``tests/llm/test_cpu_decode_ops.py``), in fused kernels.  Every other input (a prompt's many positions, an
integer offset, the traditional RoPE, another dtype than float32) goes to the layer's own ``__call__``.

Measured on the tiny model (2 cores, MLX 0.32.4), milliseconds per decoding step, alternating runs:
1.61 → 1.24 with 1 row, 1.55 → 1.23 with 4 rows, 2.12 → 1.97 with 16 rows.  On a 1.5B model, whose step is
hundreds of milliseconds of matrix products, the saving is lost in the noise.

:func:`use_cpu_decode_ops` switches the ``mlx.nn.RMSNorm`` and ``mlx.nn.RoPE`` layers of a model (those classes
exactly: a subclass has its own formula) when MLX computes on the CPU; :func:`sdm_mlx.llm.model.load_model`
calls it.  The parameters are untouched (same objects, same names).  On Metal nothing changes.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn

from .cpu_swiglu import on_cpu


@functools.lru_cache(maxsize=None)
def _norm_step(eps: float):
    """The compiled RMSNorm of float32 rows (traced once per shape): the fallback's operations, in its order."""

    def norm(x, weight):
        y = x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps)
        return weight * y

    return mx.compile(norm)


@functools.lru_cache(maxsize=None)
def _rope_step(dims: int, base: float, scale: float):
    """The compiled RoPE (not traditional) of one position per row at per-row offsets: ``x`` float32
    ``[B, H, 1, d]``, ``offset`` ``[B]``."""
    half = dims // 2
    inverse = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(base) / half))
    mx.eval(inverse)

    def rope(x, offset):
        angle = (offset.astype(mx.float32) * scale)[:, None, None, None] * inverse
        cos, sin = mx.cos(angle), mx.sin(angle)
        x1, x2 = x[..., :half], x[..., half:dims]
        return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., dims:]], axis=-1)

    return mx.compile(rope)


class StepRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose one-token float32 inputs go through :func:`_norm_step`."""

    def __call__(self, x):
        weight = self["weight"]
        if x.ndim == 3 and x.shape[1] == 1 and x.dtype == mx.float32 and weight.dtype == mx.float32:
            return _norm_step(float(self.eps))(x, weight)
        return super().__call__(x)


class StepRoPE(nn.RoPE):
    """``nn.RoPE`` whose one-position float32 inputs at per-row offsets go through :func:`_rope_step`."""

    def __call__(self, x, offset=0):
        if (not self.traditional and isinstance(offset, mx.array) and offset.ndim == 1 and x.ndim == 4
                and x.shape[2] == 1 and x.shape[0] == offset.shape[0] and x.dtype == mx.float32
                and self.dims % 2 == 0):
            return _rope_step(int(self.dims), float(self.base), float(self.scale))(x, offset)
        return super().__call__(x, offset)


_SWITCH = {nn.RMSNorm: StepRMSNorm, nn.RoPE: StepRoPE}


def use_cpu_decode_ops(model) -> int:
    """Switch ``model``'s ``nn.RMSNorm`` and ``nn.RoPE`` layers to :class:`StepRMSNorm` / :class:`StepRoPE` when
    MLX computes on the CPU; how many were switched (0 on Metal, or when they already are)."""
    if not on_cpu():
        return 0
    switched = 0
    for _, module in model.named_modules():
        fast = _SWITCH.get(type(module))
        if fast is not None:
            module.__class__ = fast
            switched += 1
    return switched
