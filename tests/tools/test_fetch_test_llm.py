"""tools/fetch_test_llm.py without the download: name mapping, shapes, dtypes, GGUF header, streamed safetensors."""

import struct

import mlx.core as mx
import numpy as np
import pytest

import fetch_test_llm as F  # tools/ is on pytest's pythonpath (pyproject.toml)


def test_gguf_names_map_to_mlx_lm_qwen2():
    assert F.mlx_name("token_embd.weight") == "model.embed_tokens.weight"
    assert F.mlx_name("output.weight") == "lm_head.weight"
    assert F.mlx_name("output_norm.weight") == "model.norm.weight"
    assert F.mlx_name("blk.27.attn_k.bias") == "model.layers.27.self_attn.k_proj.bias"
    assert F.mlx_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert F.mlx_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    for bad in ("blk.x.attn_q.weight", "blk.0.rope_freqs", "rope_freqs.weight"):
        with pytest.raises(F.FetchError, match="no mlx-lm qwen2 counterpart"):
            F.mlx_name(bad)


def test_bfloat16_rounding_matches_mlx():
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 100
    x[:4] = [0.0, -0.0, 1.00390625, 1.01171875]  # ties: round to even
    got = F.to_dtype(x, "bfloat16")
    want = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    np.testing.assert_array_equal(got, want)
    assert F.to_dtype(x, "float16").dtype == np.float16 and F.to_dtype(x, "float32") is not None


def test_gguf_header_check(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(F.FetchError, match="not a GGUF file"):
        F.check_gguf_header(bad)
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5))
    with pytest.raises(F.FetchError, match="0 tensors"):
        F.check_gguf_header(bad)
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 339, 26))
    F.check_gguf_header(bad)


def test_streamed_safetensors_round_trip(tmp_path):
    """Quantised and float tensors of a GGUF come back row-major, dequantised by gguf-py, under mlx-lm names."""
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(0)
    q_w = rng.standard_normal((8, 64)).astype(np.float32)  # [out, in]
    norm = rng.standard_normal(64).astype(np.float32)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(q_w, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    F.check_gguf_header(path)
    reader = gguf.GGUFReader(str(path))
    for dtype, tol in (("float32", 0.0), ("bfloat16", 1e-2)):
        out = tmp_path / f"model_{dtype}.safetensors"
        F.write_safetensors(reader, out, dtype)
        loaded = mx.load(str(out))
        assert set(loaded) == {"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}
        q = np.array(loaded["model.layers.0.self_attn.q_proj.weight"].astype(mx.float32))
        assert q.shape == (8, 64)
        np.testing.assert_allclose(q, gguf.quants.dequantize(reader.tensors[0].data, Q.Q8_0), rtol=tol, atol=tol)
        assert np.abs(q - q_w).max() < 0.05  # Q8_0 error
        np.testing.assert_allclose(np.array(loaded["model.norm.weight"].astype(mx.float32)), norm, rtol=tol, atol=tol)
