"""Verified generation (sdm_mlx.verified, ``sdm-mlx generate`` / ``chat``) on a tiny local model.

How a verified answer is made deterministic with a random model
-----------------------------------------------------------------
A random tiny model never writes JSON, so the module fixture gives it a
positive head that does: W_pos (initialised from the model's LM head) is fitted
for a few hundred Adam steps on the frozen final-norm states that predict the
answer tokens ``{"sentiment": "negative"|"positive"}`` of 24 templated review
prompts (the SDM-network layout: trunk frozen, only W_pos trained).  With the
head attached, joint neg+pos decoding answers every review prompt in that
JSON.  The verification layer (an ``SDMEstimator`` with tiny settings) is then
trained on features of force-decoded prompt + completion of 200 review
prompts: label 1 = the model's **own** greedy answer (generated token ids),
label 0 = a perturbed completion of another JSON shape.  So the model's own
answers to review prompts are in-distribution and admissible, while a far-away
prompt (digits and punctuation, no template) is not.  Which prompt is used for
the "verified" test is read off the fitted verifier (the first label-1 row it
admits with ŷ = 1), so the test does not depend on where the admission
boundary falls; the data (200 rows per class, α' = 0.9) are sized so that most
label-1 rows are admitted (the DKW bound needs some calibration rows per class).
"""

from __future__ import annotations

import io
import json
import random
import sys
import types

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from sdm_mlx import embed as E  # noqa: E402
from sdm_mlx.cli import main  # noqa: E402

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


@pytest.fixture(scope="module")
def setup(tiny_phi3_path, tmp_path_factory):
    from sdm_mlx.estimator import SDMEstimator
    from sdm_mlx.network.artifact import save_network
    from sdm_mlx.network.generation import greedy_generate
    from sdm_mlx.network.heads import SDMHeads

    root = tmp_path_factory.mktemp("verified")
    model, tok = E.load_model(tiny_phi3_path)
    docs = reviews(N_DOCS, seed=0)
    heads = SDMHeads(model, _fit_head(model, tok, docs[:24]))
    prompts = [E.chat_text(tok, d, system=SYSTEM, prompt_template=TEMPLATE) for d, _ in docs]
    outs = greedy_generate(heads, tok, prompts, max_new_tokens=16, batch_size=25, features=False)
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
    return types.SimpleNamespace(
        model_path=tiny_phi3_path, verifier_dir=verifier_dir, head_dir=head_dir, root=root,
        outs=outs, docs=docs, verified_doc=docs[int(ok[0])][0],
        verified_answer=outs[int(ok[0])].text, admitted_fraction=float(pred.admitted.mean()),
    )


def _generator(s, **kw):
    from sdm_mlx.verified import VerifiedGenerator

    return VerifiedGenerator(s.model_path, s.verifier_dir, head_path=s.head_dir, **kw)


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("fixture_name", ["tiny_phi3_path", "tiny_qwen2_path"])
def test_plain_greedy_equals_mlx_lm(fixture_name, request):
    import mlx_lm

    from sdm_mlx.verified import GreedyDecoder

    path = request.getfixturevalue(fixture_name)
    model, tok = E.load_model(path)
    dec = GreedyDecoder(model, tok, heads=None, stop_at_delimiter=False)
    for doc in ["A warm and funny film.", "Boring, too long, and badly written.", "Hello"]:
        prompt = E.chat_text(tok, doc, system=SYSTEM, prompt_template=TEMPLATE)
        ref = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=30)]
        ref = [t for t in ref if t not in tok.eos_token_ids]
        ref_text = mlx_lm.generate(model, tok, prompt, max_tokens=30)
        segments = []
        got = dec(E.encode(tok, prompt), 30, on_text=segments.append)
        assert got.token_ids == ref
        assert got.text == tok.decode(ref)
        assert "".join(segments) == ref_text  # streamed text = mlx-lm's streamed text
        # with the stopping rule, the answer is the prefix up to the closing delimiter
        stop = GreedyDecoder(model, tok)(E.encode(tok, prompt), 30)
        assert stop.token_ids == ref[: len(stop.token_ids)]
        if stop.stop_reason == "delimiter":
            from sdm_mlx.network.generation import is_closed

            assert is_closed(stop.text) and not is_closed(tok.decode(stop.token_ids[:-1]))


def test_joint_decoding_with_reference_copy_equals_plain(tiny_phi3_path):
    """W_pos = W_ref: argmax(concat(z, z)) mod |V| = argmax z, so the joint path reproduces plain greedy."""
    from sdm_mlx.network.heads import SDMHeads
    from sdm_mlx.verified import GreedyDecoder

    model, tok = E.load_model(tiny_phi3_path)
    ids = E.encode(tok, E.chat_text(tok, "A warm and funny film.", system=SYSTEM, prompt_template=TEMPLATE))
    plain = GreedyDecoder(model, tok, stop_at_delimiter=False)(ids, 20)
    streamed = []
    joint = GreedyDecoder(model, tok, heads=SDMHeads(model), stop_at_delimiter=False)(ids, 20, streamed.append)
    assert joint.token_ids == plain.token_ids
    assert "".join(streamed) == joint.text


def test_head_decodes_json_answers(setup):
    gen = _generator(setup, on_reject="return")
    assert gen.decoding == "joint"
    assert (gen.system, gen.prompt_template, gen.max_tokens) == (SYSTEM, TEMPLATE, 24)  # head settings
    segments = []
    r = gen.generate("The film is sharp and lovely.", on_text=segments.append)
    assert r.attempts[0].stop_reason == "delimiter"
    assert r.parsed in ({"sentiment": "positive"}, {"sentiment": "negative"})
    assert "".join(segments) == r.answer


# --------------------------------------------------------------------------- verification and policies


def test_verified_answer(setup):
    gen = _generator(setup, on_reject="abstain")
    r = gen.generate(setup.verified_doc, id="v1")
    assert r.verified and r.status == "verified" and r.reason is None and r.stopped == "verified"
    assert r.text == r.answer == setup.verified_answer
    assert r.parsed == json.loads(setup.verified_answer)
    assert 0.0 < r.p_lower <= 1.0
    assert len(r.attempts) == 1 and r.attempts[0].verifier["admitted"] and r.attempts[0].verifier["prediction"] == 1
    assert r.exemplars and {"id", "label", "predicted_label", "squared_distance"} <= set(r.exemplars[0])
    d = json.loads(json.dumps(r.to_dict()))  # JSON-serialisable
    assert d["id"] == "v1" and d["n_attempts"] == 1 and d["attempts"][0]["tokens"] == r.tokens > 0
    assert d["decoding"] == "joint"
    assert gen.tokenizer.decode(r.attempts[0].token_ids) == r.answer
    again = gen.verify(setup.verified_doc, r.attempts[0].token_ids)
    assert again.verified and again.p_lower == pytest.approx(r.p_lower, abs=1e-6)


def test_generation_features_match_force_decoded_text(setup):
    """The verifier input of a generated answer = embed.py's force-decoded prompt + completion features."""
    from sdm_mlx.verified import GreedyDecoder

    gen = _generator(setup)
    prompt = gen.prompt_text(setup.verified_doc)
    dec = GreedyDecoder(gen.model, gen.tokenizer, heads=gen.heads)(E.encode(gen.tokenizer, prompt), 24)
    X, _ = gen.verifier.features(E.encode(gen.tokenizer, prompt), dec.token_ids)
    ref = E.prompt_completion_features(gen.model, gen.tokenizer, [prompt], [dec.text]).embeddings
    np.testing.assert_allclose(X, ref, atol=1e-5)


def test_ood_prompt_rejected_with_evidence(setup):
    gen = _generator(setup, on_reject="abstain", system="", prompt_template="{document}")
    r = gen.generate(OOD_PROMPT)
    assert not r.verified and r.status == "abstained"
    assert not r.attempts[0].verifier["admitted"]  # the verification layer itself rejects it
    assert r.reason and r.reason in r.text and r.text.startswith("NOT VERIFIED")
    assert r.answer == r.attempts[0].text and r.exemplars  # the answer and the evidence are kept
    r2 = _generator(setup, on_reject="return", system="", prompt_template="{document}").generate(OOD_PROMPT)
    assert r2.status == "unverified" and r2.text == r2.answer == r.answer and not r2.verified


def test_reask_loop_terminates(setup):
    gen = _generator(setup, on_reject="reask", max_attempts=3, system="", prompt_template="{document}")
    starts = []
    r = gen.generate(OOD_PROMPT, on_attempt_start=starts.append)
    assert 1 <= len(r.attempts) <= 3 and starts == list(range(1, len(r.attempts) + 1))
    assert not r.verified and r.status == "abstained" and r.stopped in ("max_attempts", "repeated_prompt")
    assert [a.attempt for a in r.attempts] == list(range(1, len(r.attempts) + 1))
    assert r.attempts[0].reask_message is None
    for a in r.attempts[1:]:
        assert a.reask_message and a.prompt_tokens > r.attempts[0].prompt_tokens
    assert r.tokens == sum(a.tokens for a in r.attempts)
    assert all(a.seconds > 0 and a.reason for a in r.attempts)


def test_reask_stops_at_first_verified_and_uses_template(setup):
    from sdm_mlx.verified import REASK_TEMPLATE

    gen = _generator(setup, on_reject="reask", max_attempts=4, reask_fallback="return")
    real = gen.verifier.verify_many
    calls = []

    def flaky(items):  # reject the first answer, then defer to the real verifier
        verdicts = real(items)
        for it, v in zip(items, verdicts):
            calls.append(list(it.prompt_ids))
            if len(calls) == 1:
                v.verified, v.reason = False, "below_threshold_psi"
        return verdicts

    gen.verifier.verify_many = flaky
    prompts = []
    orig = gen.engine.submit
    gen.engine.submit = lambda req: (prompts.append(list(req.prompt_ids)), orig(req))[1]
    r = gen.generate(setup.verified_doc)
    assert len(r.attempts) == 2 and r.verified and r.stopped == "verified" and r.status == "verified"
    assert r.attempts[1].reask_message == REASK_TEMPLATE.replace("{previous}", r.attempts[0].text)
    assert calls[0] == calls[1]  # every attempt is verified against the original prompt
    reask_prompt = gen.tokenizer.decode(prompts[1])
    assert r.attempts[0].text in reask_prompt and "<|assistant|>" in reask_prompt
    assert TEMPLATE.split("{")[0] in reask_prompt  # the original request is repeated


def test_verifier_dimension_mismatch(setup, tmp_path):
    from tiny_models import make_tiny_model

    from sdm_mlx.verified import VerifiedGenerator

    other = make_tiny_model(tmp_path, "qwen2", overrides={"hidden_size": 32})
    with pytest.raises(ValueError, match="expects 128-dim features but this model gives 2 x 32"):
        VerifiedGenerator(other, setup.verifier_dir)
    with pytest.raises(ValueError, match="on_reject"):
        _generator(setup, on_reject="ignore")


# --------------------------------------------------------------------------- CLI


def test_cli_single_prompt_without_head(setup, capsys):
    rc = main(["generate", "--model", setup.model_path, "--verifier", setup.verifier_dir, "--prompt", "Hello",
               "--system", SYSTEM, "--prompt-template", TEMPLATE, "--max-tokens", "12", "--on-reject", "return"])
    assert rc == 0
    cap = capsys.readouterr()
    row = json.loads(cap.out)
    assert row["decoding"] == "plain" and row["on_reject"] == "return" and row["n_attempts"] == 1
    assert row["attempts"][0]["tokens"] <= 12 and "attempt 1:" in cap.err
    assert main(["generate", "--model", setup.model_path, "--verifier", setup.verifier_dir]) == 2
    assert main(["generate", "--head", setup.head_dir, "--prompt", "x", "--prompt-template", "no slot"]) == 2


def test_cli_batch_resume(setup, tmp_path, capsys):
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    rows = [{"id": 1, "document": setup.verified_doc}, {"id": "b", "document": "A dull, boring movie."},
            {"id": 3, "document": "The film is warm and great."}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    args = ["generate", "--head", setup.head_dir, "--input", str(inp), "--output", str(out), "--quiet"]
    assert main(args) == 0
    first = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in first] == [1, "b"] and first[0]["verified"]
    # an interrupted run left half a line; the input grew by one prompt
    with open(out, "a") as f:
        f.write('{"id": 3, "prompt": "The film')
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(args[:-1]) == 0
    err = capsys.readouterr().err
    assert "partially written" in err and "resuming: 2 of 3" in err
    final = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in final] == [1, "b", 3] and final[:2] == first
    assert main(args) == 0 and len(out.read_text().splitlines()) == 3  # nothing left to do
    assert "nothing to do" not in capsys.readouterr().err  # --quiet


def test_chat_non_interactive(setup, monkeypatch, capsys, tmp_path):
    log = tmp_path / "chat.jsonl"
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{setup.verified_doc}\n\n{OOD_PROMPT}\n"))
    rc = main(["chat", "--head", setup.head_dir, "--output", str(log), "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert setup.verified_answer in out and "[verified: p_lower=" in out and "[rejected:" in out
    assert "NOT VERIFIED" in out  # the second prompt's answer is not verified: abstention text
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["id"] for r in rows] == [1, 2] and rows[0]["verified"] and rows[1]["status"] == "abstained"
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{setup.verified_doc}\n"))
    assert main(["chat", "--head", setup.head_dir, "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "verified"


# --------------------------------------------------------------------------- verifier features from the decoding


@pytest.mark.parametrize("joint", [False, True])
def test_decoding_features_equal_the_feature_pass(setup, joint):
    """``GreedyDecoder(features=True)``: the pooled decoding states = a separate force-decoded feature pass."""
    from sdm_mlx.embed import trunk
    from sdm_mlx.verified import GreedyDecoder

    gen = _generator(setup)
    norm = trunk(gen.model).norm
    dec = GreedyDecoder(gen.model, gen.tokenizer, heads=gen.heads if joint else None, features=True)
    for doc in (setup.verified_doc, OOD_PROMPT):  # a delimited answer, and (likely) one without the delimiter
        ids = E.encode(gen.tokenizer, gen.prompt_text(doc))
        out = dec(ids, 24)
        X, feats = gen.verifier.features(ids, out.token_ids)
        assert out.features.shape == X.shape
        np.testing.assert_allclose(out.features, X, atol=1e-5, rtol=1e-5)
        assert out.feature_info == {"n_kept": int(feats.n_kept[0]), "delimiter_index": int(feats.delimiter_index[0]),
                                    "missing_delimiter": bool(feats.missing_delimiter[0]),
                                    "truncated": bool(feats.truncated[0])}
        assert trunk(gen.model).norm is norm  # the recording wrapper is gone
    assert GreedyDecoder(gen.model, gen.tokenizer).__call__(ids, 4).features is None  # off by default


def test_first_attempt_is_verified_without_a_second_forward_pass(setup, monkeypatch):
    """Only a re-asked attempt (decoded from another prompt) runs the verifier's own feature pass."""
    gen = _generator(setup, on_reject="reask", max_attempts=2, reask_fallback="return")
    passes = []
    real = type(gen.verifier).features_batch
    monkeypatch.setattr(type(gen.verifier), "features_batch",
                        lambda self, pairs: (passes.append(len(pairs)), real(self, pairs))[1])
    r = gen.generate(setup.verified_doc)
    assert r.verified and len(r.attempts) == 1 and passes == []
    again = gen.verify(setup.verified_doc, r.attempts[0].token_ids)  # the feature pass gives the same verdict
    assert passes and again.verified and again.p_lower == pytest.approx(r.p_lower, abs=1e-5)
    passes.clear()
    r2 = gen.generate(OOD_PROMPT)
    assert len(r2.attempts) == 2 and len(passes) == 1  # the re-ask only


def test_cli_batch_in_input_order_equals_one_at_a_time_and_sampling_flags(setup, tmp_path, capsys):
    """``generate --input`` decodes rows together (--max-batch) yet writes each row's own result, in input order;
    mlx-lm's sampling flags are honoured (same --seed, same text) and bad values exit 2."""
    docs = [OOD_PROMPT, setup.verified_doc, "Hello", "Boring, too long, and badly written.", "A warm film."]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "document": d}) + "\n" for i, d in enumerate(docs)))
    base = ["generate", "--head", setup.head_dir, "--input", str(inp), "--quiet", "--on-reject", "reask",
            "--max-attempts", "2"]
    assert main(base + ["--output", str(tmp_path / "b.jsonl"), "--max-batch", "4"]) == 0
    assert main(base + ["--output", str(tmp_path / "one.jsonl"), "--max-batch", "1"]) == 0
    batched = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    alone = [json.loads(x) for x in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert [r["id"] for r in batched] == list(range(len(docs)))
    for a, b in zip(alone, batched):
        assert (a["text"], a["status"], a["n_attempts"]) == (b["text"], b["status"], b["n_attempts"])
        assert [x["token_ids"] for x in a["attempts"]] == [x["token_ids"] for x in b["attempts"]]
    sampled = []
    for k in range(2):
        capsys.readouterr()
        assert main(["generate", "--head", setup.head_dir, "--prompt", "Hello", "--quiet", "--temp", "1.5",
                     "--top-p", "0.9", "--top-k", "40", "--min-p", "0.01", "--seed", "4"]) == 0
        sampled.append(json.loads(capsys.readouterr().out)["answer"])
    assert sampled[0] == sampled[1]
    for bad in (["--top-p", "0"], ["--temp", "-1"], ["--top-k", "-2"], ["--max-batch", "0"]):
        assert main(["generate", "--head", setup.head_dir, "--prompt", "x", "--quiet"] + bad) == 2
