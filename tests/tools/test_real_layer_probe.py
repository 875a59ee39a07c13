"""tools/real_llm/real_layer_probe.py: its final-norm features are the package's own (non-shared pooling), an
intermediate block's are that block's output, and the probe's figures are right on a separable toy."""

import numpy as np

import real_layer_probe as L  # tools/real_llm/ is on pytest's pythonpath (pyproject.toml)


def test_features_equal_the_packages_and_the_blocks_outputs(tiny_qwen2_path):
    import mlx.core as mx

    from sdm_mlx.llm import embed as E
    from sdm_mlx.llm.model import load_model, trunk

    model, tok = load_model(tiny_qwen2_path, head=False)
    docs = ["a warm film", "dull and long, with no end", "great", "a lovely moving film about two old friends"]
    seqs = [E.encode(tok, E.chat_text(tok, d, system="Judge the film.")) for d in docs]
    feats = L.layer_features(model, seqs, [0], batch_size=3)
    ref = E.document_features(model, tok, seqs, position="last", pooling="non-shared", batch_size=2)
    np.testing.assert_allclose(feats["final"], ref.embeddings, rtol=1e-4, atol=1e-5)
    P = E.common_prefix_length(seqs)
    net = trunk(model)
    for i, s in enumerate(seqs):  # block 0's output, alone and unpooled, then pooled over the own positions
        x = mx.array([s])
        h = net.layers[0](net.embed_tokens(x), "causal", None)[0]
        want = np.concatenate([np.array(h[P:].mean(axis=0)), np.array(h[-1])])
        np.testing.assert_allclose(feats[0][i], want, rtol=1e-4, atol=1e-5)


def test_probe_figures_on_a_separable_toy():
    rng = np.random.default_rng(0)
    n = 300
    y = rng.integers(0, 2, n)
    X = rng.normal(size=(n, 6)) + 3.0 * y[:, None]
    split = np.array(["pool"] * 200 + ["heldout_topics"] * 60 + ["generated"] * 40)
    res = L.probe(X, y, split)
    for name in ("heldout_topics", "generated"):
        assert res[name]["accuracy"] > 0.95 and res[name]["auc"] > 0.99
        assert res[name]["top10_wrong_precision"] == 1.0 and res[name]["top10_right_precision"] == 1.0
    p = np.array([0.9, 0.8, 0.2, 0.1, 0.6])
    assert L.top_precision(p, np.array([1, 0, 0, 0, 1]), 1, frac=0.4) == 0.5  # top two "right": 0.9 (1), 0.8 (0)
    assert L.top_precision(p, np.array([1, 0, 0, 0, 1]), 0, frac=0.4) == 1.0  # top two "wrong": 0.1, 0.2
