"""Another completion of prompts already run: only its own tokens go through the model.

The pipeline's constructed negatives (``forced_completions: flip``) are the model's own answer with the answer
inverted: the same prompt, a completion of about a dozen tokens.  Force-decoding ``prompt + completion`` from scratch
runs the prompt's positions again (about 40 per Rotten Tomatoes sentence after the shared template), while the
engine has just run them for the own answer.  A request with ``keep_prompt=True`` keeps its prompt's keys, values and
final-norm states (:attr:`~.decode_types.Decoded.prompt_cache`); :func:`continuation_features` merges those of many
prompts into one left-padded ``BatchKVCache`` (mlx-lm's ``merge``: each row's positions and mask exclude its
padding), runs the completions right-padded in one pass (a pad after a row's tokens cannot change them: the mask is
causal), and pools each row's prompt and completion states as :func:`sdm_mlx.llm.embed.prompt_completion_features`
does (all positions up to the kept length).  Causality makes the result the force-decoded features of the whole
sequence, up to float rounding.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InputError
from ..llm import embed as _embed
from ..llm.pooling import check_feature_parts, pool_hidden


def continuation_features(model, prompt_caches: Sequence, continuations: Sequence[Sequence[int]],
                          n_kept: Sequence[int], parts=_embed.DEFAULT_FEATURE_PARTS) -> np.ndarray:
    """Features ``[B, len(parts) * D]`` of each kept prompt (``prompt_caches[i]``: a
    :attr:`~.decode_types.Decoded.prompt_cache`, P_i positions) followed by ``continuations[i]`` (token ids), pooled
    over the first ``n_kept[i]`` positions (P_i < n_kept[i] <= P_i + len(continuations[i]))."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    parts = check_feature_parts(parts)
    if not (len(prompt_caches) == len(continuations) == len(n_kept)):
        raise InputError("one prompt cache, continuation and kept length per row")
    if not prompt_caches:
        return np.zeros((0, 0), dtype=np.float32)
    lengths = [int(st.shape[0]) for _, st in prompt_caches]
    for P, c, n in zip(lengths, continuations, n_kept):
        if not c or not P < int(n) <= P + len(c):
            raise InputError(f"a continuation of {len(c)} tokens after a prompt of {P} cannot keep {n} positions")
    merged = []
    for layer in range(len(prompt_caches[0][0])):
        caches = []
        for kv, _ in prompt_caches:
            c = KVCache()
            c.keys, c.values = kv[layer]
            c.offset = int(c.keys.shape[2])
            caches.append(c)
        merged.append(BatchKVCache.merge(caches))
    cut = [list(c[: int(n) - P]) for c, n, P in zip(continuations, n_kept, lengths)]
    h = _embed.hidden_states(model, cut, cache=merged)
    out = [pool_hidden(mx.concatenate([st, h[i, : len(cut[i])]], axis=0), int(n_kept[i]), 0, parts)
           for i, (_, st) in enumerate(prompt_caches)]
    return np.stack(out).astype(np.float32)
