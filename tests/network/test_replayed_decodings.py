"""Replaying the base model's decodings under a trained head (sdm_mlx/network/base_decodings.py, Replay).

On the tiny Phi-3: the answers stage's decodings keep their decision states (sdm_mlx/pipeline/decisions.py); a
head whose picks from them are the same tokens gets exactly the decoding ``greedy_generate`` makes with it (text,
stop, features), and only those prompts; a head that changes a prompt's answer leaves it to be decoded; other
decode settings replay nothing.  The decision states are one per token, plus one for a stop on end-of-sequence."""

import numpy as np
import pytest

from sdm_mlx.decoding import DecodeEngine, DecodeRequest, PrefixCache
from sdm_mlx.llm.embed import chat_text, encode, eos_token_ids, load_model
from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS
from sdm_mlx.network import DecodeSettings, SDMHeads, greedy_generate
from sdm_mlx.network.base_decodings import BaseDecodings, save_base_decodings
from sdm_mlx.network.decode_journal import GivenDecodings
from sdm_mlx.pipeline.decisions import DecisionStore, decode_settings

DOCS = ["A warm and funny film with a wonderful cast.", "The plot is dull and the acting is wooden.",
        "Boring, too long, and badly written.", "I loved every minute of this movie!", "Fine.",
        "An uneven, sometimes tedious, often touching film.", "Not worth the ticket.", "A masterpiece of tension."]
MAX_NEW = 6
SETTINGS = DecodeSettings(max_new_tokens=MAX_NEW, batch_size=4, feature_parts=("mean", "last"))


@pytest.fixture(scope="module")
def recorded(tiny_phi3_path, tmp_path_factory):
    """The answers stage's way: plain greedy decoding by the engine, decisions kept in a store, then a base-decodings
    file with the replay arrays."""
    model, tok = load_model(tiny_phi3_path)
    prompts = [chat_text(tok, d, system=PAPER_SYSTEM, prompt_template=PRESETS["sentiment"]["prompt_template"])
               for d in DOCS]
    engine = DecodeEngine(model, tok, max_batch=3, prefix_cache=PrefixCache())
    ids = [f"row-{k}" for k in range(len(prompts))]
    store = DecisionStore(str(tmp_path_factory.mktemp("answers") / "pool.jsonl"), decode_settings(engine, MAX_NEW))
    decs = []
    for a in range(0, len(prompts), 3):  # three batches, three chunks
        part = engine.run([DecodeRequest(encode(tok, p), MAX_NEW, features=True, feature_parts=("mean", "last"),
                                         keep_decisions=True) for p in prompts[a:a + 3]])
        store.add(ids[a:a + 3], part)
        decs += part
    kept = store.read()
    path = str(tmp_path_factory.mktemp("base") / "base.npz")
    save_base_decodings(path, prompts, [d.text for d in decs], np.concatenate([d.features for d in decs]),
                        ("mean", "last"), replay={"token_ids": [kept[i][0] for i in ids],
                                                  "stop_reasons": [kept[i][1] for i in ids],
                                                  "decisions": [kept[i][2] for i in ids], "settings": store.settings})
    return model, tok, prompts, decs, BaseDecodings(path, tok)


def test_decisions_are_the_states_that_picked_each_token(recorded):
    model, tok, prompts, decs, _ = recorded
    heads = SDMHeads(model)
    eos = eos_token_ids(tok)
    import mlx.core as mx

    for d in decs:
        n = len(d.token_ids) + (d.stop_reason == "eos")
        assert d.decisions.shape == (n, heads.hidden_size) and d.decisions.dtype == np.float32
        picks = np.array(heads.next_tokens(mx.array(d.decisions))).tolist()
        assert picks[:len(d.token_ids)] == list(d.token_ids)
        if d.stop_reason == "eos":
            assert picks[-1] in eos
    assert {d.stop_reason for d in decs} <= {"delimiter", "eos", "max_tokens"}
    assert DecodeEngine(model, tok).run([DecodeRequest(encode(tok, prompts[0]), 3)])[0].decisions is None


def test_the_base_head_replays_every_decoding_as_greedy_generate_makes_it(recorded):
    model, tok, prompts, decs, base = recorded
    heads = SDMHeads(model)
    assert base.replayable == len(prompts)
    replayed = base.replayed(heads, SETTINGS)
    assert len(replayed) == len(prompts)
    out = greedy_generate(heads, tok, prompts, SETTINGS, journal=GivenDecodings(replayed))
    fresh = greedy_generate(heads, tok, prompts, SETTINGS)
    for o, f in zip(out, fresh):
        assert o.stop_reason == "replayed" and o.text == f.text and list(o.token_ids) == list(f.token_ids)
        np.testing.assert_allclose(o.features, f.features, rtol=1e-4, atol=1e-5)


def test_a_head_that_changes_answers_replays_only_the_unchanged_ones(recorded, monkeypatch):
    import mlx.core as mx

    model, tok, prompts, decs, base = recorded
    heads = SDMHeads(model)
    # W_pos = the base head plus noise, the smallest noise (of a doubling series) that changes some answers, not all
    w0 = np.array(heads.pos.weight)
    noise = np.random.default_rng(0).standard_normal(w0.shape).astype(np.float32) * float(np.abs(w0).mean())
    for scale in 2.0 ** np.arange(-4, 6):
        heads.pos.weight = mx.array(w0 + scale * noise)
        fresh = greedy_generate(heads, tok, prompts, SETTINGS)
        same = {k for k, (f, d) in enumerate(zip(fresh, decs)) if list(f.token_ids) == list(d.token_ids)
                and f.stop_reason == d.stop_reason}
        if 0 < len(same) < len(prompts):
            break
    assert 0 < len(same) < len(prompts)  # the test's head changes some answers and keeps others
    replayed = base.replayed(heads, SETTINGS)
    keys = {tuple(d.prompt_ids) for d in replayed.values()}
    assert keys == {tuple(decs[k].prompt_ids) for k in same}

    ran = []
    real = DecodeEngine.run
    monkeypatch.setattr(DecodeEngine, "run", lambda self, reqs, **kw: ran.extend(reqs) or real(self, reqs, **kw))
    out = greedy_generate(heads, tok, prompts, SETTINGS, journal=GivenDecodings(replayed))
    assert len(ran) == len(prompts) - len(same)  # only the changed answers are decoded
    for o, f in zip(out, fresh):
        assert o.text == f.text


def test_other_settings_or_a_file_without_decisions_replay_nothing(recorded, tmp_path):
    model, tok, prompts, decs, base = recorded
    heads = SDMHeads(model)
    for other in (DecodeSettings(max_new_tokens=MAX_NEW + 4, batch_size=4, feature_parts=("mean", "last")),
                  DecodeSettings(max_new_tokens=MAX_NEW, delimiter="]", feature_parts=("mean", "last"))):
        longer = base.replayed(heads, other)
        # a longer budget still replays the decodings that stopped on their own, never one cut at max_tokens
        assert all(d.stop_reason == "replayed" for d in longer.values())
        cut = {tuple(d.prompt_ids) for d in decs if d.stop_reason == "max_tokens"}
        assert not cut & {tuple(d.prompt_ids) for d in longer.values()}
        if other.delimiter != SETTINGS.delimiter:
            assert longer == {}
    plain = str(tmp_path / "plain.npz")
    save_base_decodings(plain, prompts, [d.text for d in decs], np.concatenate([d.features for d in decs]),
                        ("mean", "last"))
    assert BaseDecodings(plain, tok).replayable == 0 and BaseDecodings(plain, tok).replayed(heads, SETTINGS) == {}
    only = {k: v for k, v in base.replayed(heads, SETTINGS, keys=set()).items()}
    assert only == {}


def test_a_run_keeps_its_own_base_decodings_through_its_journals(recorded, tmp_path):
    """network-train without a base-decodings file (sdm_mlx/network/own_decodings.py): a pass at the base head
    journals its decodings with their decision states, and the run keeps them in its own file, one decoding per
    prompt across passes; that file replays them as the answers stage's does, and one of another model or
    setting is not used."""
    from sdm_mlx.network.decode_journal import DecodeJournal, prompt_key
    from sdm_mlx.network.own_decodings import OwnDecodings

    model, tok, prompts, decs, base = recorded
    heads = SDMHeads(model)
    journal = DecodeJournal(str(tmp_path / "journal"), {"purpose": "calibration-epoch0"})
    journal.add([prompt_key(d.prompt_ids) for d in decs[:5]], decs[:5])
    back = journal.done()
    for d in decs[:5]:
        got = back[prompt_key(d.prompt_ids)]
        np.testing.assert_array_equal(got.decisions, d.decisions)
        assert list(got.token_ids) == list(d.token_ids) and got.stop_reason == d.stop_reason

    source = {"model": "tiny", "settings": {"max_new_tokens": MAX_NEW}}
    own = OwnDecodings(str(tmp_path), 0, source, tok)
    assert own.load() is None
    first = own.keep(list(back.values()), ("mean", "last"), SETTINGS)  # the count's pass, from its journal
    kept = own.keep(decs[3:] + decs[3:4], ("mean", "last"), SETTINGS)  # the next pass: three prompts again
    assert len(first) == 5 and len(kept) == len(prompts) == kept.replayable
    replayed = kept.replayed(heads, SETTINGS)
    assert len(replayed) == len(prompts)  # the base head makes every kept decoding again
    for d in decs:
        r = replayed[prompt_key(d.prompt_ids)]
        assert r.text == d.text
        np.testing.assert_allclose(r.features, d.features, rtol=1e-6)
    assert OwnDecodings(str(tmp_path), 0, {**source, "model": "another"}, tok).load() is None
    assert OwnDecodings(str(tmp_path), 1, source, tok).load() is None  # each rank its own file
    # the same arrays in memory, without a file, replay the same decodings
    from sdm_mlx.network.base_decodings import decoded_arrays

    arrays = decoded_arrays(decs, ("mean", "last"), {"max_new_tokens": MAX_NEW, "delimiter": SETTINGS.delimiter,
                                                     "stop_at_delimiter": True, "max_length": SETTINGS.max_length}, tok)
    assert set(BaseDecodings.from_arrays(arrays, tok).replayed(heads, SETTINGS)) == set(replayed)
