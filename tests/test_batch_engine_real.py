"""The batched engine on the real model (Qwen2.5-Coder-1.5B-Instruct, float32): batch and prompt cache change nothing.

Factcheck verification prompts (the paper's system message and template; ≈42 of their ≈59 tokens
are a shared prefix) decoded alone without a prompt cache, and together in one batch whose prompts
are prefilled from the shared prefix computed once: the same tokens, and verifier features within
``BATCH_RTOL`` relative (float rounding of batched products; measured ~1e-6 relative on this model).
"""

from __future__ import annotations

import numpy as np
import pytest

from real_llm_lab import BATCH_RTOL  # tests/helpers/; the model_path fixture: conftest.py

from sdm_mlx.llm import embed as E
from sdm_mlx.storage.datasets import load_factcheck
from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS

pytestmark = pytest.mark.real_llm


def test_batch_and_prompt_cache_do_not_change_answers_or_features(model_path):
    from sdm_mlx.decoding import DecodeEngine, DecodeRequest, PrefixCache

    model, tok = E.load_model(model_path)
    docs = load_factcheck("generated").documents[:6]
    template = PRESETS["factcheck"]["prompt_template"]
    ids = [E.encode(tok, E.chat_text(tok, d, system=PAPER_SYSTEM, prompt_template=template)) for d in docs]
    alone = [DecodeEngine(model, tok, max_batch=1, prefix_cache=False).run([DecodeRequest(p, 16, features=True)])[0]
             for p in ids]
    cache = PrefixCache()
    together = DecodeEngine(model, tok, max_batch=6, prefix_cache=cache).run(
        [DecodeRequest(p, 16, features=True) for p in ids])
    assert cache.hits == len(ids) and all(d.cached_prompt_tokens >= 30 for d in together)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.stop_reason == b.stop_reason
        scale = float(np.abs(a.features).max())
        assert float(np.abs(a.features - b.features).max()) <= BATCH_RTOL * scale
