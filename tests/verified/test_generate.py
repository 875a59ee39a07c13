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
import sys

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from sdm_mlx.llm import embed as E  # noqa: E402
from sdm_mlx.cli import main  # noqa: E402

from verified_lab import verified_generator as _generator  # noqa: E402
from verified_lab import OOD_PROMPT, SYSTEM, TEMPLATE  # noqa: E402  (tests/helpers/; the setup fixture: conftest.py)
from greedy_margins import assert_same_greedy  # noqa: E402


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("fixture_name", ["tiny_phi3_path", "tiny_qwen2_path"])
def test_plain_greedy_equals_mlx_lm(fixture_name, request):
    import mlx_lm

    from greedy_decoder import GreedyDecoder

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
        if assert_same_greedy(model, E.encode(tok, prompt), got.token_ids, ref):
            continue  # another way at a near tie: mlx-lm's decoding rounds differently (tests/helpers/greedy_margins.py)
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
    from greedy_decoder import GreedyDecoder

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
    assert (gen.settings.system, gen.settings.prompt_template, gen.settings.max_tokens) == (SYSTEM, TEMPLATE, 24)  # head settings
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
    assert len(r.attempts) == 1 and r.attempts[0].verdict.verifier["admitted"] and r.attempts[0].verdict.verifier["prediction"] == 1
    assert r.exemplars and {"id", "label", "predicted_label", "squared_distance"} <= set(r.exemplars[0])
    d = json.loads(json.dumps(r.to_dict()))  # JSON-serialisable
    assert d["id"] == "v1" and d["n_attempts"] == 1 and d["attempts"][0]["tokens"] == r.tokens > 0
    assert d["decoding"] == "joint"
    assert gen.tokenizer.decode(r.attempts[0].token_ids) == r.answer
    again = gen.verify(setup.verified_doc, r.attempts[0].token_ids)
    assert again.verified and again.p_lower == pytest.approx(r.p_lower, abs=1e-6)


def test_generation_features_match_force_decoded_text(setup):
    """The verifier input of a generated answer = embed.py's force-decoded prompt + completion features."""
    from greedy_decoder import GreedyDecoder

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
    assert not r.attempts[0].verdict.verifier["admitted"]  # the verification layer itself rejects it
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
    assert all(a.seconds > 0 and a.verdict.reason for a in r.attempts)


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


def _cli(*args, timeout=180):
    import os
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "sdm_mlx", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_cli_temp_and_seed_as_mlx_lm_spells_them(setup, capsys):
    """``--temp`` (mlx-lm's spelling; ``--temperature`` too) samples with plain decoding, ``--seed`` repeats a
    sample; with ``--head`` the draw is from the joint neg+pos SDM output, and a bad value is a usage error."""
    base = ["generate", "--model", setup.model_path, "--verifier", setup.verifier_dir, "--prompt", "Hello",
            "--max-tokens", "12", "--on-reject", "return", "--quiet", "--system", SYSTEM,
            "--prompt-template", TEMPLATE]
    hot = _cli(*base, "--temp", "5", "--seed", "3")  # as a user types it
    assert hot.returncode == 0, hot.stderr
    texts = [json.loads(hot.stdout)["text"]]
    for extra in ([], ["--temperature", "5", "--seed", "3"]):  # in-process: the same entry point, no start-up
        assert main(base + extra) == 0
        texts.append(json.loads(capsys.readouterr().out)["text"])
    assert texts[2] == texts[0]  # same seed, same sample (across processes)
    assert texts[1] != texts[0]  # temperature 5 over a random tiny model's vocabulary does not pick the argmax
    joint = base[:1] + ["--head", setup.head_dir, "--verifier", setup.verifier_dir, "--prompt", "Hello",
                        "--max-tokens", "12", "--on-reject", "return", "--quiet"]
    drawn = []
    for _ in range(2):
        assert main(joint + ["--temp", "0.7", "--seed", "11"]) == 0
        drawn.append(json.loads(capsys.readouterr().out)["text"])
    assert drawn[0] == drawn[1]  # seeded joint sampling repeats
    xtc = []
    for _ in range(2):  # mlx-lm's XTC flags; the seed also drives XTC's coin
        assert main(base + ["--temp", "1", "--seed", "4", "--xtc-probability", "0.5", "--xtc-threshold", "0.01"]) == 0
        xtc.append(json.loads(capsys.readouterr().out)["text"])
    assert xtc[0] == xtc[1]
    assert main(base + ["--temp", "-1"]) == 2  # exit 2 before the model loads
    assert "temp" in capsys.readouterr().err
    assert main(base + ["--xtc-threshold", "0.7"]) == 2
    assert "xtc_threshold must be a number in [0, 0.5]" in capsys.readouterr().err


def test_cli_prompt_from_standard_input_as_mlx_lm_generate_reads_it(setup, capsys, monkeypatch):
    """``--prompt -`` reads the prompt from stdin: the same result as the prompt given inline; empty stdin: exit 2."""
    import io

    base = ["generate", "--model", setup.model_path, "--verifier", setup.verifier_dir, "--max-tokens", "12",
            "--on-reject", "return", "--quiet", "--system", SYSTEM, "--prompt-template", TEMPLATE]
    assert main(base + ["--prompt", setup.verified_doc]) == 0
    inline = json.loads(capsys.readouterr().out)
    monkeypatch.setattr("sys.stdin", io.StringIO(setup.verified_doc))
    assert main(base + ["--prompt", "-"]) == 0
    piped = json.loads(capsys.readouterr().out)
    assert (piped["text"], piped["verified"]) == (inline["text"], inline["verified"])
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    assert main(base + ["--prompt", "-"]) == 2
    assert "standard input held no prompt" in capsys.readouterr().err


def test_cli_unknown_flag_is_reported_against_the_verb_with_a_suggestion():
    r = _cli("generate", "--tmep", "0.7", "--prompt", "x")
    assert r.returncode == 2
    assert "usage: sdm-mlx generate" in r.stderr and "sdm-mlx generate: error: unrecognized arguments: --tmep" \
        in r.stderr and "did you mean --temp" in r.stderr, r.stderr
    r = _cli("predict", "--modle", "m", "--input", "x.jsonl")
    assert r.returncode == 2 and "usage: sdm-mlx predict" in r.stderr and "did you mean --model?" in r.stderr
    with pytest.raises(SystemExit) as exit_:  # in-process: argparse exits with the verb's usage
        main(["predict", "--model", "m", "--zzz"])
    assert exit_.value.code == 2


def test_chat_takes_the_same_sampling_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["chat", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--temp TEMP, --temperature TEMP" in out and "--seed SEED" in out


def test_cli_head_on_another_base_model_is_a_user_error(setup, tiny_qwen2_path):
    """HeadShapeError (a head trained on another base model) is the user's mistake: exit 2, not "internal error"."""
    r = _cli("generate", "--head", setup.head_dir, "--model", tiny_qwen2_path, "--prompt", "x")
    assert r.returncode == 2, r.stderr
    assert "wrong base model" in r.stderr and "internal error" not in r.stderr


# --------------------------------------------------------------------------- verifier features from the decoding


@pytest.mark.parametrize("joint", [False, True])
def test_decoding_features_equal_the_feature_pass(setup, joint):
    """``GreedyDecoder(features=True)``: the pooled decoding states = a separate force-decoded feature pass."""
    from sdm_mlx.llm.embed import trunk
    from greedy_decoder import GreedyDecoder

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
