"""The verified-generation lab shared by test_generate, test_serve, test_mcp and test_feedback_serve: review
prompts, a positive head fitted to answer them in JSON, and a verification layer (the ``setup`` fixture of
tests/conftest.py builds it once per test module)."""

from __future__ import annotations

import random
import types

import mlx.core as mx
import numpy as np

from sdm_mlx.llm import embed as E

SYSTEM = "You are a helpful AI assistant."
TEMPLATE = ("Classify the sentiment of the following movie review. "
            'Respond using the following JSON: {"sentiment": str}. REVIEW: {document}')
ANSWERS = ['{"sentiment": "negative"}', '{"sentiment": "positive"}']
WRONG = ['{"correctness": true}', '{"correctness": false}', '{"sentiment": "sentiment"}', '{"answer_letter": "A"}']
POS = ["warm", "funny", "wonderful", "moving", "sharp", "lovely", "great"]
NEG = ["dull", "wooden", "boring", "bad", "long", "weak", "awful"]
PATTERNS = ["The film is {a} and {b}.", "A {a}, {b} movie.", "The acting is {a} and the plot is {b}.",
            "I found it {a} but also {b}."]
OOD_PROMPT = "0123456789 ;;;; ---- ???? 9876543210 !!!! 55555 11111 @@@@ #### %%%% 2468 ]]]] ^^^^ 13579"
N_DOCS = 200


def reviews(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = i % 2
        a, b = rng.sample(POS if label else NEG, 2)
        out.append((rng.choice(PATTERNS).format(a=a, b=b), label))
    return out


def _fit_head(model, tok, docs, steps: int = 150):
    """W_pos fitted on the frozen states predicting the JSON answer tokens (see the module docstring)."""
    import mlx.nn as nn
    import mlx.optimizers as optim

    from sdm_mlx.network.heads import token_hidden_states

    seqs, positions = [], []
    for doc, label in docs:
        prompt = E.chat_text(tok, doc, system=SYSTEM, prompt_template=TEMPLATE)
        p_ids, full = E.encode(tok, prompt), E.encode(tok, prompt + ANSWERS[label])
        seqs.append(full)
        positions.append(list(range(len(p_ids) - 1, len(full) - 1)))
    H = mx.array(token_hidden_states(model, seqs, positions))
    Y = mx.array(np.concatenate([np.asarray(s)[np.asarray(p) + 1] for s, p in zip(seqs, positions)]).astype(np.int32))
    params = {"W": E.lm_head_weight(model)}
    loss_and_grad = mx.value_and_grad(lambda p: nn.losses.cross_entropy(H @ p["W"].T, Y, reduction="mean"))
    opt = optim.Adam(learning_rate=1e-2)
    for _ in range(steps):
        _, g = loss_and_grad(params)
        opt.update(params, g)
        mx.eval(params, opt.state)
    return params["W"]


def build_verified_lab(tiny_phi3_path, root):
    """A positive head, a verification layer and their SDM-network directory on a tiny model (the module
    docstring of tests/verified/test_generate.py says how the verified answer is made deterministic)."""
    from sdm_mlx.estimator import SDMEstimator
    from sdm_mlx.network.artifact import save_network
    from sdm_mlx.network.generation import DecodeSettings, greedy_generate
    from sdm_mlx.network.heads import SDMHeads

    model, tok = E.load_model(tiny_phi3_path)
    docs = reviews(N_DOCS, seed=0)
    heads = SDMHeads(model, _fit_head(model, tok, docs[:24]))
    prompts = [E.chat_text(tok, d, system=SYSTEM, prompt_template=TEMPLATE) for d, _ in docs]
    outs = greedy_generate(heads, tok, prompts, DecodeSettings(max_new_tokens=16, batch_size=25), features=False)
    rng = random.Random(1)
    seqs, spans, labels, ids = [], [], [], []
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        p_ids = E.encode(tok, prompt)
        seqs += [p_ids + out.token_ids, E.encode(tok, prompt + rng.choice(WRONG))]
        spans += [(len(p_ids), None)] * 2
        labels += [1, 0]
        ids += [f"own-{i}", f"perturbed-{i}"]
    X = E.document_features(model, tok, seqs, spans, batch_size=16, on_missing="error").embeddings
    y = np.array(labels)
    est = SDMEstimator(alpha=0.9, iterations=1, epochs=10, exemplar_dim=16, batch_size=8, learning_rate=3e-3,
                       rescaler_max_epochs=300, rescaler_learning_rate=3e-3, rescaler_patience=5, verbose=False,
                       seed=0)
    est.fit(X, y, ids_train=ids)
    verifier_dir = str(root / "verifier")
    est.save(verifier_dir)
    settings = {"system": SYSTEM, "prompt_template": TEMPLATE, "delimiter": "}", "max_new_tokens": 24,
                "max_length": 500, "use_chat_template": True}
    head_dir = save_network(root / "network", heads, tiny_phi3_path, est, settings=settings)
    pred = est.estimate(X[y == 1])
    ok = np.flatnonzero(pred.admitted & (pred.prediction == 1))
    assert ok.size, "fixture: the verifier admits none of the model's own answers"
    lab = types.SimpleNamespace(model_path=tiny_phi3_path, verifier_dir=verifier_dir, head_dir=head_dir, root=root,
                                outs=outs, docs=docs, admitted_fraction=float(pred.admitted.mean()))
    # The verified document is one whose answer, generated alone as the tests generate it, is verified, and verified
    # again when its token ids are verified on their own (``verify``, /v1/verify): the batch above (25 rows), the
    # force-decoded features and a request alone round differently (~1e-6), which can move a row that sits on the
    # admission boundary, or a near tie of two tokens, to the other side.
    gen = verified_generator(lab, on_reject="abstain")
    for i in ok[:10]:
        r = gen.generate(docs[int(i)][0])
        if not (r.verified and r.text == outs[int(i)].text):
            continue
        v = gen.verify(docs[int(i)][0], r.attempts[0].token_ids)
        if v.verified and abs(v.p_lower - r.p_lower) <= 1e-6:  # test_verified_answer compares the two
            lab.verified_doc, lab.verified_answer = docs[int(i)][0], r.text
            return lab
    raise AssertionError("fixture: none of the first 10 admitted answers is verified both generated alone and "
                         "by verify()")


def verified_generator(s, **kw):
    """A ``VerifiedGenerator`` on the lab ``s`` (the ``setup`` fixture): its model, verifier and head."""
    from sdm_mlx.verified import VerifiedGenerator

    return VerifiedGenerator(s.model_path, s.verifier_dir, head_path=s.head_dir, **kw)
