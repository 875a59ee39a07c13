"""Alg. 4's calibration count verifies each generation with the features its verification layer was trained on:
a layer recorded as ``last`` (1 x hidden) gets last-state features from the decoding, not concat(mean, last)."""

from __future__ import annotations

import numpy as np
import pytest

from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.llm import embed as E
from sdm_mlx.network.generation import DecodeSettings, greedy_generate
from sdm_mlx.network.heads import SDMHeads
from sdm_mlx.network.selection import count_verified

pytestmark = [pytest.mark.filterwarnings("ignore:the fitted model admits nothing:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:calibration halves will hold:UserWarning")]


def test_count_verified_pools_as_the_layer_was_trained(tiny_phi3_path):
    model, tok = E.load_model(tiny_phi3_path)
    heads = SDMHeads(model)
    rows = [{"id": f"r{i}", "prompt": E.chat_text(tok, f"review number {i}: {'good' if i % 2 else 'bad'} film")}
            for i in range(24)]
    settings = DecodeSettings(max_new_tokens=6, batch_size=8, feature_parts=("last",))
    gens = greedy_generate(heads, tok, [r["prompt"] for r in rows], settings)
    hidden = E.trunk(model).norm.weight.shape[0]
    X = np.concatenate([g.features for g in gens])
    assert X.shape == (24, hidden)
    y = np.arange(24) % 2
    est = SDMEstimator(iterations=1, epochs=2, exemplar_dim=8, batch_size=8, rescaler_max_epochs=5, seed=0)
    est.fit(X, y, ids_train=[r["id"] for r in rows], num_classes=2, feature_parts="last")
    # the run's settings say nothing of the parts (DESIGN #21's default): the layer's recorded parts decide
    res = count_verified(heads, tok, est, rows, None, DecodeSettings(max_new_tokens=6, batch_size=8))
    assert res["documents"] == 24
    unrecorded = SDMEstimator(iterations=1, epochs=2, exemplar_dim=8, batch_size=8, rescaler_max_epochs=5, seed=0)
    unrecorded.fit(X, y, num_classes=2)  # 1 x hidden, but read as mean,last: the widths disagree
    with pytest.raises(ValueError):
        count_verified(heads, tok, unrecorded, rows, None, DecodeSettings(max_new_tokens=6, batch_size=8))


def test_repeated_prompts_are_decoded_once(tiny_phi3_path, monkeypatch):
    """Own answers plus their constructed negatives repeat every prompt: greedy_generate decodes each prompt once and
    hands its repeats the same output, in input order; the progress callback still reaches every row."""
    from sdm_mlx.decoding import batching

    model, tok = E.load_model(tiny_phi3_path)
    heads = SDMHeads(model)
    texts = [E.chat_text(tok, f"review number {i}: {'good' if i % 2 else 'bad'} film") for i in range(5)]
    prompts = [texts[i] for i in (0, 1, 0, 2, 3, 1, 4, 0)]
    seen = []
    real_run = batching.DecodeEngine.run

    def counting_run(self, reqs, progress=None):
        seen.append(len(reqs))
        return real_run(self, reqs, progress=progress)

    monkeypatch.setattr(batching.DecodeEngine, "run", counting_run)
    done = []
    settings = DecodeSettings(max_new_tokens=4, batch_size=4, stop_at_delimiter=False)
    gens = greedy_generate(heads, tok, prompts, settings, progress=done.append)
    assert seen == [5] and sum(done) == len(prompts) == len(gens)
    assert gens[0] is gens[2] is gens[7] and gens[1] is gens[5]
    assert len({id(g) for g in gens}) == 5 and all(g.token_ids for g in gens)
