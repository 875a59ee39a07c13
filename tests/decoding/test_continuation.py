"""sdm_mlx/decoding/continuation.py: a completion after prompts the engine kept runs only its own tokens, and gives
the force-decoded features of the whole sequence (what ``prompt_completion_features`` computes from scratch).

On the tiny Phi-3 and Qwen2 (different tokenizers): prompts of different lengths decoded in one batch with
``keep_prompt=True``, then two completions each (the preset answers), merged into one left-padded pass."""

import numpy as np
import pytest

from sdm_mlx.decoding import DecodeEngine, DecodeRequest, PrefixCache
from sdm_mlx.decoding.continuation import continuation_features
from sdm_mlx.errors import InputError
from sdm_mlx.llm.embed import (chat_text, encode, load_model, prompt_completion_features,
                               prompt_completion_kept_lengths)
from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS

DOCS = ["A warm and funny film with a wonderful cast, and a score to remember.", "Dull.",
        "The plot is thin and the acting is wooden, but the photography is lovely.", "I loved every minute!"]
PARTS = ("max", "mean", "last")


@pytest.mark.parametrize("which", ["tiny_phi3_path", "tiny_qwen2_path"])
def test_continuations_of_kept_prompts_are_the_force_decoded_features(which, request):
    model, tok = load_model(request.getfixturevalue(which))
    preset = PRESETS["sentiment"]
    prompts = [chat_text(tok, d, system=PAPER_SYSTEM, prompt_template=preset["prompt_template"]) for d in DOCS]
    engine = DecodeEngine(model, tok, max_batch=4, prefix_cache=PrefixCache())
    decs = engine.run([DecodeRequest(encode(tok, p), 3, features=True, feature_parts=PARTS, keep_prompt=True)
                       for p in prompts])
    assert all(d.prompt_cache is not None and d.prompt_cache[1].shape[0] == len(d.prompt_ids) for d in decs)
    pairs = [(k, c) for k in range(len(prompts)) for c in preset["completions"]]
    ps, cs = [prompts[k] for k, _ in pairs], [c for _, c in pairs]
    n_kept = prompt_completion_kept_lengths(tok, ps, cs)
    conts = []
    for (k, _), p, c in zip(pairs, ps, cs):
        full = encode(tok, p + c)
        assert full[:len(decs[k].prompt_ids)] == list(decs[k].prompt_ids)
        conts.append(full[len(decs[k].prompt_ids):])
    got = continuation_features(model, [decs[k].prompt_cache for k, _ in pairs], conts, n_kept, PARTS)
    want = prompt_completion_features(model, tok, ps, cs, parts=PARTS, batch_size=3).embeddings
    assert got.shape == want.shape == (len(pairs), 3 * got.shape[1] // 3)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # a request without keep_prompt keeps nothing; a kept length outside the continuation is refused
    plain = engine.run([DecodeRequest(encode(tok, prompts[0]), 2)])[0]
    assert plain.prompt_cache is None
    with pytest.raises(InputError, match="cannot keep"):
        continuation_features(model, [decs[0].prompt_cache], [conts[0]], [len(decs[0].prompt_ids)], PARTS)
