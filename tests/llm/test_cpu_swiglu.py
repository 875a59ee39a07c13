"""sdm_mlx.llm.cpu_swiglu: the CPU activation equals mlx-lm's, and the switched models compute what they did."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu
from mlx_lm.utils import load_model as mlx_lm_load_model

from sdm_mlx.llm import cpu_swiglu
from sdm_mlx.llm.embed import hidden_states, load_model


def test_swiglu_matches_float64_and_mlx_lm():
    gate = np.concatenate([np.random.default_rng(0).normal(0, 4, 20000), np.linspace(-120, 120, 4001),
                           [0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5]]).astype(np.float32)
    x = np.random.default_rng(1).normal(0, 1, gate.shape).astype(np.float32)
    ours = np.array(cpu_swiglu.swiglu(mx.array(gate), mx.array(x)))
    g64 = gate.astype(np.float64)
    exact = g64 / (1 + np.exp(-g64)) * x
    assert np.all(np.isfinite(ours))
    big = np.abs(exact) > 1e-12  # relative error where float32 has room; the far negative tail is ~0 either way
    assert np.max(np.abs(ours - exact)[big] / np.abs(exact)[big]) < 1e-6
    assert np.max(np.abs(ours - exact)[~big]) < 1e-12
    np.testing.assert_allclose(ours, np.array(mlx_lm_swiglu(mx.array(gate), mx.array(x))), rtol=2e-6, atol=1e-12)


def test_swiglu_keeps_the_dtype_and_has_the_exact_gradient():
    gate, x = mx.random.normal((3, 50)) * 3, mx.random.normal((3, 50))
    assert cpu_swiglu.swiglu(gate.astype(mx.float16), x.astype(mx.float16)).dtype == mx.float16

    def loss(f):
        return lambda g, v: (f(g, v) * mx.cos(v)).sum()

    ours = mx.grad(loss(cpu_swiglu.swiglu), argnums=(0, 1))(gate, x)
    ref = mx.grad(loss(mlx_lm_swiglu), argnums=(0, 1))(gate, x)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["phi3", "qwen2", "llama"])
def test_load_model_switches_every_mlp_and_keeps_the_states(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}_path")
    ours, _ = load_model(path)
    plain, _ = mlx_lm_load_model(Path(path))
    layers = ours.model.layers
    assert all(type(layer.mlp).__module__ == cpu_swiglu.__name__ for layer in layers)
    assert cpu_swiglu.use_cpu_swiglu(ours) == 0  # already switched
    assert [k for k, _ in tree_flatten(ours.parameters())] == [k for k, _ in tree_flatten(plain.parameters())]
    ids = [[5, 9, 14, 3, 22, 7, 31, 2], [8, 8, 3, 1, 40, 2, 6, 11]]
    np.testing.assert_allclose(np.array(hidden_states(ours, ids)), np.array(hidden_states(plain, ids)),
                               rtol=1e-5, atol=1e-5)
    assert cpu_swiglu.use_cpu_swiglu(plain) == len(layers)


def test_nothing_changes_off_the_cpu(tiny_qwen2_path, monkeypatch):
    plain, _ = mlx_lm_load_model(Path(tiny_qwen2_path))
    monkeypatch.setattr(cpu_swiglu, "on_cpu", lambda: False)
    assert cpu_swiglu.use_cpu_swiglu(plain) == 0
    assert all(type(layer.mlp).__module__ != cpu_swiglu.__name__ for layer in plain.model.layers)
