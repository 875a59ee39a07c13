"""BoundedCompile: mx.compile's values, with at most max_traces traces kept (a server's memory stays flat)."""

import platform
import subprocess
import sys

import numpy as np
import pytest

import sdm_mlx  # noqa: F401
import mlx.core as mx

from sdm_mlx.llm import cpu_swiglu
from sdm_mlx.runtime.compiled import BoundedCompile


def _chain(a, b):
    return mx.exp(-a) * b + a / (1.0 + b * b)


def test_values_are_mx_compile_s_bit_for_bit_across_resets():
    bounded, plain = BoundedCompile(_chain, max_traces=3), mx.compile(_chain)
    rng = np.random.default_rng(0)
    for n in [1, 2, 3, 4, 5, 1, 2, 7, 3]:
        a, b = (mx.array(rng.normal(size=(n, 5)).astype(np.float32)) for _ in range(2))
        assert np.array_equal(np.array(bounded(a, b)), np.array(plain(a, b)))
    assert bounded.traces <= 3 and bounded.resets >= 2


def test_traces_are_counted_per_signature_and_dropped_at_the_bound():
    calls = []

    def fun(x):
        calls.append(x.shape)
        return x * 2

    f = BoundedCompile(fun, max_traces=2)
    for shape in [(1,), (1,), (2,), (2,)]:
        f(mx.ones(shape))
    assert (f.traces, f.resets, len(calls)) == (2, 0, 2)  # traced once per shape
    f(mx.ones((1,), dtype=mx.int32))  # a new dtype is a new signature: the bound drops both traces
    assert (f.traces, f.resets) == (1, 1)
    f(mx.ones((1,)))  # seen before the reset: traced again
    assert len(calls) == 4 and f.traces == 2


def test_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_traces"):
        BoundedCompile(_chain, max_traces=0)


_GROWTH = """
import ctypes, sys
import sdm_mlx
import mlx.core as mx
from sdm_mlx.llm import cpu_swiglu
from sdm_mlx.runtime.compiled import BoundedCompile

def rss_mib():
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap given back: what is measured is what is held
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

def run(fun, lengths):
    for n in lengths:
        g = mx.ones((1, n, 8))
        mx.eval(fun(g, g))

fun = (BoundedCompile(cpu_swiglu._swiglu_float32, max_traces=16) if sys.argv[1] == "bounded"
       else mx.compile(cpu_swiglu._swiglu_float32))
run(fun, range(1, 1300))  # MLX's buffer cache and the heap reach their working size
before = rss_mib()
run(fun, range(1300, 2300))
print(rss_mib() - before)
"""


def _held_mib(kind: str) -> float:
    out = subprocess.run([sys.executable, "-c", _GROWTH, kind], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="reads /proc/self/status and calls glibc's malloc_trim")
def test_memory_stays_flat_over_many_prompt_lengths_where_mx_compile_grows():
    """The leak this fixes: every new [1, L, F] kept a trace of the SwiGLU (about 40 KB each).  Each kind runs
    in a fresh process, so what other tests left in MLX's buffer cache does not count."""
    held_unbounded, held_bounded = _held_mib("unbounded"), _held_mib("bounded")
    assert held_unbounded > 15, held_unbounded  # the control: mx.compile alone keeps 1000 more traces
    assert held_bounded < 5, held_bounded


def test_the_cpu_swiglu_bounds_the_traces_of_prompt_shapes_and_keeps_its_values():
    """Prompt shapes [B, L, F] go through the bounded compile; a step's [B, 1, F] through the plain one (one trace
    per batch size); either way the values are mx.compile's."""
    prompt = cpu_swiglu._swiglu_prompt
    assert isinstance(prompt, BoundedCompile) and not isinstance(cpu_swiglu._swiglu_step, BoundedCompile)
    reference = mx.compile(cpu_swiglu._swiglu_float32)
    rng = np.random.default_rng(1)
    resets = prompt.resets
    for n in range(2, 2 + prompt.max_traces + 5):
        # F = 13: shapes no other test traces, so the 133 lengths are all new signatures
        gate, x = (mx.array(rng.normal(size=(1, n, 13)).astype(np.float32) * 4) for _ in range(2))
        assert np.array_equal(np.array(cpu_swiglu.swiglu(gate, x)), np.array(reference(gate, x)))
    assert prompt.traces <= prompt.max_traces and prompt.resets > resets
    step_traces = prompt.traces
    for b in (1, 3):
        gate = mx.array(rng.normal(size=(b, 1, 13)).astype(np.float32))
        assert np.array_equal(np.array(cpu_swiglu.swiglu(gate, gate)), np.array(reference(gate, gate)))
    assert prompt.traces == step_traces  # the step's shapes did not go through the bounded compile
