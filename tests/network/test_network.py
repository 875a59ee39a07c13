"""SDM network (DESIGN #17-21): heads, loss, mask, β schedule, compiled step, generation, artifacts — fast unit tests."""

import json
import math
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from sdm_mlx.llm.embed import chat_text, load_model, prompt_completion_features
from sdm_mlx.network import (
    DecodeSettings, HeadShapeError, NetworkArtifactError, SDMHeads, beta_schedule, greedy_generate, joint_argmax,
    load_network,
    network_loss, parse_task_prediction, regularization_mask, save_network,
)
from sdm_mlx.network.generation import first_json_object, is_closed
from sdm_mlx.llm.model import model_dims
from sdm_mlx.network.loss import rescaled_regularizer
from sdm_mlx.network.step import EpochOrder, EpochTokens, MiniBatches
from sdm_mlx.network.trainer import completion_token_positions, make_optimizer, make_train_step, train_epoch
from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS
from greedy_margins import assert_same_greedy  # tests/helpers/

TEMPLATE = PRESETS["sentiment"]["prompt_template"]
DOCS = ["A warm and funny film with a wonderful cast.", "The plot is dull and the acting is wooden.",
        "Boring, too long, and badly written.", "I loved every minute of this movie!"]


@pytest.fixture(scope="module")
def phi3(tiny_phi3_path):
    return load_model(tiny_phi3_path)


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_path):
    return load_model(tiny_qwen2_path)


def _prompts(tok):
    return [chat_text(tok, d, system=PAPER_SYSTEM, prompt_template=TEMPLATE) for d in DOCS]


def _params(model):
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


# ------------------------------------------------------------------------------------------ heads
@pytest.mark.parametrize("which", ["phi3", "qwen2"])
def test_joint_argmax_equals_base_argmax_before_training(which, request):
    model, tok = request.getfixturevalue(which)
    heads = SDMHeads(model)
    V, D = model_dims(model)
    assert heads.pos.weight.shape == (V, D) and heads.pos.weight.dtype == mx.float32
    assert heads.tied == (which == "qwen2")
    assert [k for k, _ in tree_flatten(heads.trainable_parameters())] == ["pos.weight"]
    ids = [t for p in _prompts(tok) for t in tok.encode(p)][:60]
    x = mx.array([ids])
    base = mx.argmax(model(x).astype(mx.float32), axis=-1)
    joint = heads.next_tokens(heads.hidden_states(x))
    assert np.array_equal(np.array(base), np.array(joint))
    # the positive half equals the reference half exactly: the joint argmax is in the negative half
    h = heads.hidden_states(x)
    assert np.array_equal(np.array(heads.pos_logits(h)), np.array(heads.ref_logits(h)))


def test_greedy_joint_decoding_matches_mlx_lm_greedy_generation(phi3):
    from mlx_lm.generate import generate_step

    model, tok = phi3
    heads = SDMHeads(model)
    prompts = _prompts(tok)
    outs = greedy_generate(heads, tok, prompts, DecodeSettings(max_new_tokens=6, stop_at_delimiter=False, batch_size=3))
    eos = set(tok.eos_token_ids)
    for p, o in zip(prompts, outs):
        ref = []
        for t, _ in generate_step(mx.array(tok.encode(p)), model, max_tokens=6):
            t = int(t)
            if t in eos:
                break
            ref.append(t)
        assert o.stop_reason in ("eos", "max_tokens")
        # batches of 3 against mlx-lm's batch of one: the same tokens but at a near tie (tests/helpers/greedy_margins.py)
        assert_same_greedy(model, o.prompt_ids, o.token_ids, ref, heads)


def test_joint_argmax_mod_vocab():
    z_neg = mx.array([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    z_pos = mx.array([[0.0, 0.0, 6.0], [0.0, 3.0, 0.0], [1.0, 1.0, 1.0]])
    # row 0: positive index 2 wins; row 1: tie 3 vs 3 -> lowest joint index (negative 0); row 2: all ties -> 0
    assert joint_argmax(z_neg, z_pos).tolist() == [2, 0, 0]


def test_quantized_head_is_dequantized_to_float32(tiny_phi3_path):
    model, _ = load_model(tiny_phi3_path)
    nn.quantize(model, group_size=32, bits=8)
    assert hasattr(model.lm_head, "scales")
    heads = SDMHeads(model)
    L = model.lm_head
    expect = mx.dequantize(L.weight, L.scales, L.biases, group_size=32, bits=8).astype(mx.float32)
    assert heads.pos.weight.dtype == mx.float32 and heads.pos.weight.shape == expect.shape
    np.testing.assert_array_equal(np.array(heads.pos.weight), np.array(expect))
    h = heads.hidden_states([[3, 10, 20, 30]])
    np.testing.assert_allclose(np.array(heads.pos_logits(h)), np.array(heads.ref_logits(h)), atol=1e-4)


def test_pos_weight_shape_is_checked(phi3):
    model, _ = phi3
    V, D = model_dims(model)
    with pytest.raises(HeadShapeError, match="different model"):
        SDMHeads(model, mx.zeros((V + 1, D)))


# ------------------------------------------------------------------------------------------- loss
def _np_log_sdm(z, q, d):
    s = z * (d * np.log(2 + q))[:, None]
    s = s - s.max(1, keepdims=True)
    return (s - np.log(np.exp(s).sum(1, keepdims=True))) / np.log(2 + q)[:, None]


def _np_loss(z_ref, z_neg, z_pos, t, q, d, beta):
    V = z_ref.shape[1]
    f_gen = _np_log_sdm(np.concatenate([z_neg, z_pos], 1), q, d)
    f_ref = _np_log_sdm(np.concatenate([z_ref, z_ref], 1), q, d)
    L = -f_gen[np.arange(len(t)), t].mean()
    mask = np.ones_like(f_gen)
    for n in range(len(t)):
        for j in (z_ref[n].argmax(), z_ref[n].argmax() + V, z_neg[n].argmax(), z_pos[n].argmax() + V, t[n]):
            mask[n, j] = 0.0
    R = np.sqrt(((mask * (f_ref - f_gen)) ** 2).sum(1)).mean()
    s = min(max(np.log(L) / np.log(R), 0.0), 1.0)
    Rp = np.sqrt(max(R, 1.0) ** s)
    return L + beta * Rp, L, R, Rp


def test_loss_equals_hand_computed_numpy_value():
    rng = np.random.default_rng(0)
    V, N = 5, 4
    z_ref = rng.normal(size=(N, V)) * 2
    z_neg = z_ref + rng.normal(size=(N, V)) * 0.5
    z_pos = rng.normal(size=(N, V)) * 3
    t = np.array([V + 1, V + 3, V + 0, V + 4])
    q = np.array([0.0, 3.0, 10.0, math.e - 2])
    d = np.array([0.2, 1.0, 0.7, 1.0])
    beta = 0.37
    total, (L, R, Rp) = network_loss(*(mx.array(a.astype(np.float32)) for a in (z_ref, z_neg, z_pos)),
                                     mx.array(t), mx.array(q.astype(np.float32)), mx.array(d.astype(np.float32)),
                                     beta=beta)
    expect = _np_loss(z_ref, z_neg, z_pos, t, q, d, beta)
    np.testing.assert_allclose([float(total), float(L), float(R), float(Rp)], expect, rtol=2e-5)
    assert float(R) > 1.0 and 0.0 < float(Rp) - 1.0  # the rescaling is active on this example


def test_rescaling_edge_cases():
    # R <= 1 -> R' = 1 whatever s is (incl. s = NaN at R = 1, L = 1)
    for L, R in [(2.0, 0.5), (1.0, 1.0), (0.5, 1.0), (3.0, 1.0)]:
        assert float(rescaled_regularizer(mx.array(L), mx.array(R))) == pytest.approx(1.0)
    # L < 1 with R > 1 -> s < 0 -> exponent 0 -> R' = 1; L > R > 1 -> s > 1 -> clipped to 1 -> sqrt(R)
    assert float(rescaled_regularizer(mx.array(0.5), mx.array(4.0))) == pytest.approx(1.0)
    assert float(rescaled_regularizer(mx.array(9.0), mx.array(4.0))) == pytest.approx(2.0)
    # s = ln 2 / ln 4 = 0.5 -> sqrt(4 ** 0.5)
    assert float(rescaled_regularizer(mx.array(2.0), mx.array(4.0))) == pytest.approx(math.sqrt(2.0))


def test_rescaling_exponent_has_no_gradient():
    # d/dR sqrt(R^s) with s held fixed = s/2 * R^(s/2 - 1); with s depending on R it would differ
    L, R = 2.0, 4.0
    g = mx.grad(lambda r: rescaled_regularizer(mx.array(L), r))(mx.array(R))
    s = math.log(L) / math.log(R)
    assert float(g) == pytest.approx(s / 2 * R ** (s / 2 - 1), rel=1e-5)


def test_mask_zeroes_exactly_the_five_indices():
    V = 6
    z_ref = mx.array([[0.0, 9.0, 0.0, 0.0, 0.0, 0.0]])  # argmax 1
    z_neg = mx.array([[0.0, 0.0, 9.0, 0.0, 0.0, 0.0]])  # argmax 2
    z_pos = mx.array([[0.0, 0.0, 0.0, 9.0, 0.0, 0.0]])  # argmax 3 -> joint 9
    t = mx.array([V + 5])
    m = np.array(regularization_mask(z_ref, z_neg, z_pos, t))[0]
    assert sorted(np.flatnonzero(m == 0).tolist()) == [1, 2, V + 1, V + 3, V + 5]
    assert m.sum() == 2 * V - 5


def test_mask_with_coinciding_indices():
    V = 4
    z = mx.array([[0.0, 0.0, 7.0, 0.0], [5.0, 0.0, 0.0, 0.0]])
    t = mx.array([V + 2, V + 3])  # row 0: target = argmax z_pos + |V| = argmax z_ref + |V|
    m = np.array(regularization_mask(z, z, z, t))
    assert np.flatnonzero(m[0] == 0).tolist() == [2, V + 2]
    assert np.flatnonzero(m[1] == 0).tolist() == [0, V + 0, V + 3]
    # at initialisation (W_pos = W_ref) the masked difference is exactly 0 and the gradient is finite
    q, d = mx.array([1.0, 2.0]), mx.array([1.0, 0.5])
    g = mx.grad(lambda zp: network_loss(z, z, zp, t, q, d, beta=mx.array(0.1))[0])(z)
    assert np.isfinite(np.array(g)).all()


def test_beta_schedule():
    b = beta_schedule(4, 0.0, 0.1)
    np.testing.assert_allclose(b, [0.0, 0.025, 0.05, 0.075])
    np.testing.assert_allclose(beta_schedule(1, 0.2, 1.0), [0.2])
    assert beta_schedule(0).size == 0


def test_beta_resets_every_epoch_and_tokens_are_shuffled():
    seen = []

    def fake_step(h, t, q, d, beta):
        seen.append((float(beta), np.array(t).tolist()))
        z = mx.array(1.0)
        return z, z, z, z

    class _H:
        state = {}

    H = mx.zeros((7, 3))
    T = mx.arange(7)
    rng = np.random.default_rng(0)
    for _ in range(2):
        m = train_epoch(fake_step, _H(), type("O", (), {"state": {}})(), EpochTokens(H, T, np.ones(7), np.ones(7)),
                        MiniBatches(3, 0.0, 0.1), order=EpochOrder(rng))
        assert m["batches"] == 3 and m["beta_first"] == 0.0
    betas = [b for b, _ in seen]
    np.testing.assert_allclose(betas, [0.0, 0.1 / 3, 0.2 / 3] * 2, rtol=1e-6)
    epoch1 = sorted(x for _, ts in seen[:3] for x in ts)
    assert epoch1 == list(range(7))  # every token once per epoch
    assert [ts for _, ts in seen[:3]] != [ts for _, ts in seen[3:]]  # reshuffled


# --------------------------------------------------------------------------------- training step
def _batch(heads, rng, n=12):
    V = heads.vocab_size
    h = mx.array(rng.normal(size=(n, heads.hidden_size)).astype(np.float32))
    t = mx.array(rng.integers(V, 2 * V, size=n).astype(np.int32))
    q = mx.array(rng.uniform(1, 20, size=n).astype(np.float32))
    d = mx.array(rng.uniform(0.2, 1, size=n).astype(np.float32))
    return h, t, q, d


def test_gradients_reach_only_w_pos(tiny_phi3_path):
    model, _ = load_model(tiny_phi3_path)
    before = _params(model)
    heads = SDMHeads(model)
    w0 = np.array(heads.pos.weight)
    opt = make_optimizer(1e-2)
    step = make_train_step(heads, opt)
    rng = np.random.default_rng(1)
    for i in range(3):
        out = step(*_batch(heads, rng), mx.array(0.05 * i))
        mx.eval(out, heads.state, opt.state)
    after = _params(model)
    assert before.keys() == after.keys()
    for k in before:  # trunk, embeddings and the reference/negative head are unchanged
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    assert np.abs(np.array(heads.pos.weight) - w0).max() > 1e-3
    assert list(opt.state.keys()) == ["step", "learning_rate", "pos"]


def test_compiled_step_equals_eager_step(tiny_phi3_path):
    model, _ = load_model(tiny_phi3_path)
    results = []
    for compiled in (True, False):
        heads = SDMHeads(model)
        opt = make_optimizer(1e-2)
        step = make_train_step(heads, opt, compile=compiled)
        rng = np.random.default_rng(2)
        losses = []
        for i in range(3):
            out = step(*_batch(heads, rng), mx.array(0.1 * i))
            mx.eval(out, heads.state, opt.state)
            losses.append([float(o) for o in out])
        results.append((np.array(losses), np.array(heads.pos.weight)))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5)
    np.testing.assert_allclose(results[0][1], results[1][1], atol=1e-6)


# ------------------------------------------------------------------------------- generation bits
def test_is_closed_and_parsing():
    assert not is_closed('{"sentiment": "pos')
    assert is_closed('{"sentiment": "positive"}')
    assert not is_closed('{"a": "}"')  # a brace inside a JSON string does not close
    assert is_closed('{"a": {"b": 1}}') and not is_closed('{"a": {"b": 1}')
    assert is_closed("done.", ".")
    comps = PRESETS["factcheck"]["completions"]
    assert parse_task_prediction('{"correctness": true}', comps) == 1
    assert parse_task_prediction(' {"correctness":false} trailing', comps) == 0
    assert parse_task_prediction('{"correctness": maybe}', comps) == -1
    assert parse_task_prediction("no json", comps) == -1
    assert parse_task_prediction("yes", ["no", "yes"]) == 1
    assert first_json_object('x {bad} {"k": 1}') == {"k": 1}


def test_completion_token_positions(phi3):
    model, tok = phi3
    prompt = _prompts(tok)[0]
    comp = '{"sentiment": "positive"}'
    ids, pos, tg = completion_token_positions(tok, prompt, comp, "}", 500)
    p_ids = tok.encode(prompt)
    assert ids[: len(p_ids)] == p_ids
    assert pos[0] == len(p_ids) - 1  # the last prompt state predicts the first completion token
    assert tg == [ids[p + 1] for p in pos]
    assert tok.decode(tg).strip() == comp  # targets = completion tokens up to and incl. the delimiter token
    _, pos_cut, _ = completion_token_positions(tok, prompt, comp, "}", len(p_ids) + 1)
    assert pos_cut == pos[:2]


def test_generation_features_equal_force_decoded_features(phi3):
    model, tok = phi3
    heads = SDMHeads(model)
    prompts = _prompts(tok)
    gens = greedy_generate(heads, tok, prompts, DecodeSettings(max_new_tokens=5, batch_size=4, stop_at_delimiter=False))
    # force-decode prompt ids + generated ids through embed.py; "}" is absent so the prompt states are pooled
    feats = prompt_completion_features(model, tok, [g.prompt_ids for g in gens], [g.token_ids for g in gens],
                                       on_missing="prompt")
    for g, f in zip(gens, feats.embeddings):
        assert g.feature_info["missing_delimiter"] == ("}" not in g.text)
        np.testing.assert_allclose(g.features.reshape(-1), f, atol=2e-5)
    # a "generation" that contains the delimiter: pooled up to the state predicting it
    comp_ids = tok.encode('{"sentiment": "positive"}', add_special_tokens=False)
    ref = prompt_completion_features(model, tok, [tok.encode(prompts[0])], [comp_ids], on_missing="error")
    from sdm_mlx.llm.embed import generated_n_kept, pool_hidden

    p_ids = tok.encode(prompts[0])
    h = heads.hidden_states([p_ids + comp_ids])[0]
    n, info = generated_n_kept(tok, len(p_ids), comp_ids)
    assert not info["missing_delimiter"] and n == ref.n_kept[0]
    np.testing.assert_allclose(pool_hidden(np.array(h), n), ref.embeddings[0], atol=2e-5)


# --------------------------------------------------------------------------------------- artifact
def test_save_load_roundtrip_and_errors(tiny_phi3_path, tiny_qwen2_path, tmp_path, phi3):
    model, tok = phi3
    heads = SDMHeads(model)
    rng = np.random.default_rng(3)
    heads.pos.weight = heads.pos.weight + mx.array(rng.normal(size=heads.pos.weight.shape).astype(np.float32))
    vdir = tmp_path / "fake_verifier"
    vdir.mkdir()
    (vdir / "manifest.json").write_text("{}")
    out = save_network(tmp_path / "net", heads, tiny_phi3_path, str(vdir), settings={"delimiter": "}"})
    assert sorted(os.listdir(out)) == ["network_config.json", "positive_head.safetensors", "verifier"]
    assert not any(p.name.startswith("net.") for p in tmp_path.iterdir())  # no temp / backup left
    cfg = json.loads((tmp_path / "net" / "network_config.json").read_text())
    assert cfg["base_model"] == os.path.relpath(os.path.realpath(tiny_phi3_path), os.path.realpath(out))
    assert cfg["base_model_kind"] == "local" and cfg["verifier"] == "verifier"
    assert cfg["base_model_absolute"] == os.path.realpath(tiny_phi3_path)

    net = load_network(out, load_verifier=False)  # a freshly mlx_lm.load-ed base model
    np.testing.assert_array_equal(np.array(net.heads.pos.weight), np.array(heads.pos.weight))
    x = [tok.encode(_prompts(tok)[1])]
    h1, h2 = heads.hidden_states(x), net.heads.hidden_states(x)
    np.testing.assert_array_equal(np.array(net.heads.joint_logits(h2)), np.array(heads.joint_logits(h1)))
    g1 = greedy_generate(heads, tok, _prompts(tok), DecodeSettings(max_new_tokens=4))
    g2 = net.generate(_prompts(tok), max_new_tokens=4)
    assert [g.token_ids for g in g1] == [g.token_ids for g in g2]

    # saving again replaces atomically, only when asked to
    with pytest.raises(NetworkArtifactError, match="--overwrite"):
        save_network(tmp_path / "net", heads, tiny_phi3_path, str(vdir))
    save_network(tmp_path / "net", heads, tiny_phi3_path, str(vdir), overwrite=True)
    qmodel, qtok = load_model(tiny_qwen2_path)
    with pytest.raises(HeadShapeError, match="wrong base model"):
        load_network(out, model=qmodel, tokenizer=qtok, load_verifier=False)
    head_file = tmp_path / "net" / "positive_head.safetensors"
    head_file.write_bytes(head_file.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(NetworkArtifactError, match="checksum"):
        load_network(out, model=model, tokenizer=tok, load_verifier=False)
    with pytest.raises(NetworkArtifactError, match="no SDM network"):
        load_network(tmp_path / "missing", model=model, tokenizer=tok)


# ------------------------------------------------------------------------------ selection rule (Alg. 4)
class FakeVerifier:
    """Stands in for SDMEstimator (same interface) so the selection logic is tested in isolation."""

    def __init__(self, **params):
        self.params = params

    def fit(self, X, y, ids_train=None, **kwargs):
        self.input_dim_ = X.shape[1]
        self.support_ids_ = [i for k, i in enumerate(ids_train) if k % 2 == 0]
        self.calibration_ids_ = [i for k, i in enumerate(ids_train) if k % 2 == 1]
        return self

    def similarity_distance(self, X, distance_ecdfs="calibration"):
        assert distance_ecdfs == "training"
        n = len(X)
        return np.full(n, 5), np.full(n, 0.8), np.ones(n, dtype=int)

    def estimate(self, X, ids=None, n_exemplars=None, alpha=None):
        from types import SimpleNamespace

        return SimpleNamespace(admitted=np.ones(len(X), bool), prediction=np.ones(len(X), int))

    def save(self, path, overwrite=False):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "fake.json"), "w") as f:
            json.dump(self.params, f)


@pytest.mark.parametrize("counts, selected", [([5, 3, 7, 7], 2), ([5, 5, 4, 1], 0)])
def test_selection_keeps_strictly_better_epochs(counts, selected, tiny_phi3_path, tmp_path, monkeypatch, phi3):
    from sdm_mlx.network import NetworkConfig, SDMNetworkTrainer
    from sdm_mlx.network.artifact import load_head_weight, read_network_config
    from tiny_tasks import write_synthetic_sentiment

    model, tok = load_model(tiny_phi3_path)
    data = write_synthetic_sentiment(tmp_path / "task.jsonl", n=24, seed=0)
    cfg = NetworkConfig(model=tiny_phi3_path, output_dir=str(tmp_path / "run"), data=data, preset="sentiment",
                        answers="preset",
                        epochs=3, learning_rate=1e-2, batch_size=8, max_new_tokens=3, verbose=False)
    trainer = SDMNetworkTrainer(cfg, model, tok, estimator_factory=FakeVerifier)
    base_head = np.array(trainer.heads.pos.weight)
    it, snapshots = iter(counts), []

    def fake_count(self, est, rows, purpose, base_head=False):
        snapshots.append(np.array(self.heads.pos.weight))
        return {"count": next(it), "admitted_pred1": 0, "admitted": 0, "task_correct": 0, "parse_failures": 0,
                "documents": len(rows), "seconds": 0.0, "example": None}

    monkeypatch.setattr(SDMNetworkTrainer, "calibration_count", fake_count)
    res = trainer.run()
    assert res.selected_epoch == selected and res.initial_count == counts[0]
    assert res.best_count == max(counts[0], max(counts[1:]) if selected else counts[0])
    metrics = json.loads(open(res.metrics_path).read())
    assert [e["selected"] for e in metrics["epochs"]] == [e == selected for e in (1, 2, 3)]
    assert [e["count"] for e in metrics["epochs"]] == counts[1:]
    for e in metrics["epochs"]:
        assert e["beta_first"] == 0.0 and e["beta_last"] < 0.1 and e["tokens"] > 0
    assert read_network_config(res.network_path)["training"]["epoch"] == selected
    saved = load_head_weight(res.network_path)
    np.testing.assert_array_equal(saved, snapshots[selected])
    if selected == 0:
        np.testing.assert_array_equal(saved, base_head)
    else:
        assert not np.array_equal(saved, base_head)
    rows = [json.loads(line) for line in open(os.path.join(cfg.output_dir, "verification_rows.jsonl"))]
    assert {r["split"] for r in rows} == {"train", "calibration"}


def test_multi_task_rows_and_per_task_parsing(phi3, tmp_path, monkeypatch):
    import sdm_mlx.network.trainer as tr
    from sdm_mlx.decoding.decode_types import Decoded
    from tiny_tasks import write_synthetic_sentiment

    model, tok = phi3
    a = write_synthetic_sentiment(tmp_path / "a.jsonl", n=6, seed=0)
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"id": i, "label": i % 2, "document": f"Fact {i}."}) + "\n" for i in range(4)))
    cfg = tr.NetworkConfig(model="m", output_dir="o", tasks=[{"name": "sent", "data": a, "preset": "sentiment"},
                                                            {"name": "fact", "data": str(b), "preset": "factcheck"}])
    cfg.validate()
    rows = tr.build_verification_rows(cfg, tok)
    assert len(rows) == 10 and len({r["id"] for r in rows}) == 10
    assert {r["task"] for r in rows} == {"sent", "fact"} and rows[6]["id"] == "fact/0"
    assert "correctness" in rows[6]["completion"] and "REVIEW" in rows[0]["prompt"]
    comps = cfg.resolved_completions()
    assert set(comps) == {"sent", "fact"}

    texts = {}
    for r in rows:  # answer correctly except for the first row of each task; one parse failure
        right = comps[r["task"]][r["task_label"]]
        texts[r["id"]] = right if r["id"] not in ("sent/syn-0", "fact/0", "fact/1") else \
            (comps[r["task"]][1 - r["task_label"]] if r["id"] != "fact/1" else '{"correctness": tru')

    def fake_generate(heads, tokenizer, prompts, **kw):
        by_prompt = {}
        for r in rows:
            by_prompt.setdefault(r["prompt"], texts[r["id"]])
        return [Decoded(prompt_ids=[1], token_ids=[1], text=by_prompt[p], stop_reason="delimiter", seconds=0.0,
                        features=np.zeros((1, 4), np.float32)) for p in prompts]

    from sdm_mlx.network import selection

    monkeypatch.setattr(selection, "greedy_generate", fake_generate)
    res = selection.count_verified(None, tok, FakeVerifier(), rows, comps)
    assert res["documents"] == 10 and res["admitted_pred1"] == 10
    assert res["count"] == 7 and res["task_correct"] == 7 and res["parse_failures"] == 1


def test_float32_reference_head_for_quantized_models(tiny_phi3_path):
    model, _ = load_model(tiny_phi3_path)
    nn.quantize(model, group_size=32, bits=4)
    heads = SDMHeads(model, reference_head="float32")
    assert [k for k, _ in tree_flatten(heads.trainable_parameters())] == ["pos.weight"]
    h = heads.hidden_states([[3, 10, 20, 30, 40]])
    # float32 copy: z_ref is exactly z_pos at initialisation, and close to the quantised matmul
    np.testing.assert_array_equal(np.array(heads.ref_logits(h)), np.array(heads.pos_logits(h)))
    np.testing.assert_allclose(np.array(heads.ref_logits(h)), np.array(SDMHeads(model).ref_logits(h)), atol=1e-3)
    with pytest.raises(ValueError, match="reference_head"):
        SDMHeads(model, reference_head="bf16")


@pytest.mark.parametrize("which", ["phi3", "qwen2"])
def test_token_states_run_the_shared_prefix_once_and_equal_full_passes(which, request, monkeypatch):
    """The token cache's states (DESIGN #19) with the rows' common prompt prefix prefilled once equal those of
    whole-sequence passes (one row at a time, no prefix) within 1e-5, with and without a given prefix."""
    from sdm_mlx.llm.embed import encode, hidden_states
    from sdm_mlx.network.heads import token_hidden_states

    model, tok = request.getfixturevalue(which)
    comps = PRESETS["sentiment"]["completions"]
    seqs, poss = [], []
    for k, p in enumerate(_prompts(tok)):
        ids, pos, _ = completion_token_positions(tok, p, comps[k % 2], "}", 500)
        seqs.append(ids)
        poss.append(pos)
    want = np.concatenate([np.array(hidden_states(model, [s[: max(p) + 1]])[0][mx.array(np.array(p))])
                           for s, p in zip(seqs, poss)])
    import sdm_mlx.llm.embed as embed_module

    prefilled = []
    real = embed_module.run_shared_prefix
    monkeypatch.setattr(embed_module, "run_shared_prefix", lambda m, ids: prefilled.append(len(ids)) or real(m, ids))
    got = token_hidden_states(model, seqs, poss, batch_size=3)
    assert prefilled and prefilled[0] >= 10  # the system message and template ran once
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    given = token_hidden_states(model, seqs, poss, batch_size=2, prefix_ids=seqs[0][:5])  # a shorter common prefix
    np.testing.assert_allclose(given, want, atol=1e-5, rtol=1e-5)
    assert len(encode(tok, _prompts(tok)[0])) > 5


def test_a_stopped_token_cache_build_computes_only_the_parts_it_had_not_finished(phi3, tmp_path, monkeypatch):
    """Alg. 4 (b): with a journal the token cache is built a few documents at a time, each part written as it
    finishes; a build stopped after its second part and started again computes only the rest, and ends with the
    one-pass cache (states within 1e-5, the same targets and documents); a journal of other rows is not used."""
    import sdm_mlx.network.training_data as training_data
    from sdm_mlx.network.training_data import build_token_cache, token_cache_key
    from sdm_mlx.storage.journal import ChunkJournal

    from types import SimpleNamespace

    model, tok = phi3
    heads = SDMHeads(model)
    settings = SimpleNamespace(delimiter="}", max_length=500, embed_batch_size=3, verbose=False)
    comps = PRESETS["sentiment"]["completions"]
    rows = [{"id": f"r{k}", "prompt": p, "completion": comps[k % 2]} for k, p in enumerate(_prompts(tok) * 3)]
    whole = build_token_cache(heads, tok, rows, settings)
    monkeypatch.setattr(training_data, "TOKEN_CACHE_CHUNK_DOCS", 3)
    parts = -(-len(rows) // 3)
    assert parts >= 4
    key = token_cache_key({"model": "tiny"}, rows, "}", 500)
    journal = ChunkJournal(str(tmp_path / "token_cache.partial.rank0"), key)
    runs, real = [], training_data.token_hidden_states

    def stopped_after_two(model, seqs, *args, **kwargs):
        if len(runs) == 2:
            raise KeyboardInterrupt
        runs.append(len(seqs))
        return real(model, seqs, *args, **kwargs)

    monkeypatch.setattr(training_data, "token_hidden_states", stopped_after_two)
    with pytest.raises(KeyboardInterrupt):
        build_token_cache(heads, tok, rows, settings, journal=journal)
    assert journal.count() == 2
    runs.clear()
    monkeypatch.setattr(training_data, "token_hidden_states", lambda m, seqs, *a, **k: runs.append(len(seqs)) or
                        real(m, seqs, *a, **k))
    again = build_token_cache(heads, tok, rows, settings,
                              journal=ChunkJournal(journal.path, dict(key)))
    assert len(runs) == parts - 2 and sum(runs) == len(rows) - 6
    np.testing.assert_array_equal(again.targets, whole.targets)
    np.testing.assert_array_equal(again.doc, whole.doc)
    np.testing.assert_allclose(again.hidden, whole.hidden, atol=1e-5, rtol=1e-5)
    runs.clear()
    other = token_cache_key({"model": "tiny"}, rows[::-1], "}", 500)
    build_token_cache(heads, tok, rows[::-1], settings, journal=ChunkJournal(journal.path, other))
    assert len(runs) == parts  # the journal of the other rows was discarded, not mixed in


def test_each_tasks_rows_run_after_their_own_shared_prefix(phi3, tmp_path, monkeypatch):
    """Alg. 4 (b) over several tasks (universal verification): the token cache runs each task's rows after that
    task's shared prefix (the templates differ after the system prompt), with or without a journal, and its states
    equal whole-sequence passes within 1e-5."""
    from types import SimpleNamespace

    import sdm_mlx.llm.embed as embed_module
    import sdm_mlx.network.training_data as training_data
    from sdm_mlx.llm.embed import chat_text, hidden_states
    from sdm_mlx.network.training_data import build_token_cache, token_cache_key
    from sdm_mlx.storage.journal import ChunkJournal

    model, tok = phi3
    heads = SDMHeads(model)
    settings = SimpleNamespace(delimiter="}", max_length=500, embed_batch_size=2, verbose=False)
    rows = []
    for task in ("sentiment", "factcheck"):
        comps, template = PRESETS[task]["completions"], PRESETS[task]["prompt_template"]
        for k, doc in enumerate(["A fine film.", "Water boils at 100 C at sea level.", "Dull and long.",
                                 "The moon is made of cheese."]):
            rows.append({"id": f"{task}-{k}", "task": task, "completion": comps[k % 2],
                         "prompt": chat_text(tok, doc, system=PAPER_SYSTEM, prompt_template=template)})
    rows = rows[::2] + rows[1::2]  # the tasks interleaved
    want = []
    for r in rows:
        ids, pos, _ = completion_token_positions(tok, r["prompt"], r["completion"], "}", 500)
        want.append(np.array(hidden_states(model, [ids[: max(pos) + 1]])[0][mx.array(np.array(pos))]))
    want = np.concatenate(want)
    prefilled, real = [], embed_module.run_shared_prefix
    monkeypatch.setattr(embed_module, "run_shared_prefix", lambda m, ids: prefilled.append(list(ids)) or real(m, ids))
    whole = build_token_cache(heads, tok, rows, settings)
    np.testing.assert_allclose(whole.hidden, want, atol=1e-5, rtol=1e-5)
    across = embed_module.common_prefix_length([tok.encode(r["prompt"]) for r in rows])
    assert len(prefilled) == 2 and all(len(p) > across for p in prefilled)  # one longer prefix per task
    monkeypatch.setattr(training_data, "TOKEN_CACHE_CHUNK_DOCS", 3)
    journal = ChunkJournal(str(tmp_path / "token_cache.partial.rank0"), token_cache_key({"model": "tiny"}, rows, "}",
                                                                                          500))
    parts = build_token_cache(heads, tok, rows, settings, journal=journal)
    np.testing.assert_allclose(parts.hidden, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(parts.targets, whole.targets)


def test_the_training_q_d_pool_the_parts_the_verifier_was_trained_on(tiny_phi3_path, tmp_path, phi3):
    """Alg. 4 (c): the q, d of each y = 1 training document come from its generation's features, pooled as the
    verification layer was trained (here `last` alone, D wide), and the decodings are journaled in OUTPUT/."""
    from sdm_mlx.network import NetworkConfig, SDMNetworkTrainer
    from tiny_tasks import write_synthetic_sentiment

    model, tok = load_model(tiny_phi3_path)
    data = write_synthetic_sentiment(tmp_path / "task.jsonl", n=8, seed=0)
    cfg = NetworkConfig(model=tiny_phi3_path, output_dir=str(tmp_path / "run"), data=data, preset="sentiment",
                        answers="preset", epochs=1, batch_size=8, max_new_tokens=3, verbose=False)
    trainer = SDMNetworkTrainer(cfg, model, tok, estimator_factory=FakeVerifier)
    widths = []

    class LastOnly(FakeVerifier):
        feature_parts_ = ("last",)

        def similarity_distance(self, X, distance_ecdfs="calibration"):
            widths.append(X.shape[1])
            return super().similarity_distance(X, distance_ecdfs)

    rows = [{"id": f"r{i}", "prompt": f"Review {i}: fine.", "completion": "x"} for i in range(4)]
    q, d, gens = trainer.document_qd(LastOnly(), rows, "train-qd-epoch1")
    assert widths == [trainer.heads.hidden_size] and q.shape == d.shape == (4,)
    assert all(g.features.size == trainer.heads.hidden_size for g in gens)
    assert (tmp_path / "run" / "decode_journal" / "train-qd-epoch1.rank0" / "chunk_000000.npz").is_file()
