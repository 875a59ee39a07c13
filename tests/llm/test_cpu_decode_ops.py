"""sdm_mlx.llm.cpu_decode_ops: a decoding step's compiled RMSNorm and RoPE give MLX's values bit for bit, other
inputs go to MLX's layers, and a switched model decodes the same tokens and states."""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_lm_load_model

from sdm_mlx.decoding.batching import DecodeEngine, DecodeRequest
from sdm_mlx.llm import cpu_decode_ops
from sdm_mlx.llm.cpu_decode_ops import StepRMSNorm, StepRoPE
from sdm_mlx.llm.embed import load_model

RNG = np.random.default_rng(0)


def _array(*shape, scale=1.0):
    return mx.array((RNG.normal(size=shape) * scale).astype(np.float32))


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dim,eps", [(64, 1e-5), (96, 1e-6), (3072, 1e-5)])
def test_step_norm_is_mlx_rms_norm_bit_for_bit(rows, dim, eps):
    norm = nn.RMSNorm(dim, eps=eps)
    norm.weight = _array(dim)
    x = _array(rows, 1, dim, scale=3.0)
    step = nn.RMSNorm(dim, eps=eps)
    step.weight = norm.weight
    step.__class__ = StepRMSNorm
    assert mx.array_equal(step(x), mx.fast.rms_norm(x, norm.weight, eps)).item()


@pytest.mark.parametrize("head_dim,dims", [(16, 16), (32, 16), (96, 96), (128, 64)])
@pytest.mark.parametrize("base,scale", [(10000.0, 1.0), (1e6, 0.5), (500000.0, 0.25)])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_step_rope_is_mlx_rope_bit_for_bit(head_dim, dims, base, scale, rows):
    rope = StepRoPE(dims, base=base, scale=scale)
    x = _array(rows, 4, 1, head_dim)
    offset = mx.array(RNG.integers(0, 5000, size=rows).astype(np.int32))
    ref = mx.fast.rope(x, dims, traditional=False, base=base, scale=scale, offset=offset)
    assert mx.array_equal(rope(x, offset), ref).item()


def test_other_inputs_go_to_the_mlx_layers(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_decode_ops, "_norm_step", lambda eps: calls.append("norm"))
    monkeypatch.setattr(cpu_decode_ops, "_rope_step", lambda *a: calls.append("rope"))
    norm = StepRMSNorm(32)
    for x in (_array(2, 5, 32), _array(32), _array(2, 1, 32).astype(mx.float16)):  # a prompt, 1-D, float16
        assert mx.array_equal(norm(x), mx.fast.rms_norm(x, norm.weight, norm.eps)).item()
    x, offset = _array(3, 2, 1, 16), mx.array([4, 9, 1])
    cases = [(StepRoPE(16), _array(3, 2, 7, 16), offset),  # a prompt
             (StepRoPE(16), x, 5),  # an integer offset (one sequence)
             (StepRoPE(16, traditional=True), x, offset),
             (StepRoPE(16), x.astype(mx.float16), offset)]
    for rope, inp, off in cases:
        ref = mx.fast.rope(inp, 16, traditional=rope.traditional, base=rope.base, scale=rope.scale, offset=off)
        assert mx.array_equal(rope(inp, off), ref).item()
    assert calls == []


@pytest.mark.parametrize("arch", ["phi3", "qwen2", "llama"])
def test_switched_model_decodes_the_same_tokens_and_states(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}_path")
    ours, tok = load_model(path)
    assert any(type(m) in (StepRMSNorm, StepRoPE) for _, m in ours.named_modules())
    assert cpu_decode_ops.use_cpu_decode_ops(ours) == 0  # already switched
    plain, _ = load_model(path)
    for _, m in plain.named_modules():  # back to MLX's layers
        if type(m) in (StepRMSNorm, StepRoPE):
            m.__class__ = m.__class__.__bases__[0]
    assert [k for k, _ in tree_flatten(ours.parameters())] == [k for k, _ in tree_flatten(plain.parameters())]
    prompts = [[5, 9, 14, 3, 22, 7, 31, 2], [8, 8, 3, 1, 40, 2], [3, 30, 12]]

    def decode(model):
        engine = DecodeEngine(model, tok, max_batch=4, prefix_cache=False)
        return engine.run([DecodeRequest(p, 12, stop_at_delimiter=False, features=True) for p in prompts])

    for a, b in zip(decode(ours), decode(plain)):
        assert a.token_ids == b.token_ids
        np.testing.assert_array_equal(np.asarray(a.features), np.asarray(b.features))


def test_nothing_changes_off_the_cpu(tiny_qwen2_path, monkeypatch):
    plain, _ = mlx_lm_load_model(Path(tiny_qwen2_path))
    monkeypatch.setattr(cpu_decode_ops, "on_cpu", lambda: False)
    assert cpu_decode_ops.use_cpu_decode_ops(plain) == 0
    assert not any(type(m) in (StepRMSNorm, StepRoPE) for _, m in plain.named_modules())
    monkeypatch.setattr(cpu_decode_ops, "on_cpu", lambda: True)
    assert cpu_decode_ops.use_cpu_decode_ops(plain) > 0
