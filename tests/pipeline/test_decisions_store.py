"""sdm_mlx/pipeline/decisions.py: what the answers stage keeps beside its rows, as files a later stage reads back.

Round trips of the decision store and the forced-features store; a store written under other settings is not read
as this one; a decoding written again (a stopped batch decoded again) replaces the earlier one; the pair key keeps
prompt and completion apart."""

import numpy as np

from sdm_mlx.decoding.decode_types import Decoded
from sdm_mlx.pipeline.decisions import DecisionStore, ForcedFeatures, pair_key

SETTINGS = {"max_new_tokens": 8, "delimiter": "}", "stop_at_delimiter": True, "max_length": 500}


def _dec(tokens, reason="delimiter", width=4, value=1.0):
    n = len(tokens) + (reason == "eos")
    return Decoded(prompt_ids=[1, 2], token_ids=list(tokens), text="t", stop_reason=reason, seconds=0.0,
                   decisions=np.full((n, width), value, np.float32))


def test_decisions_round_trip_and_a_later_decoding_replaces_an_earlier_one(tmp_path):
    out = str(tmp_path / "pool.jsonl")
    assert DecisionStore.open(out) is None  # nothing kept yet
    store = DecisionStore(out, SETTINGS)
    store.add(["a", "b", "c"], [_dec([5, 6]), _dec([7], "eos"), Decoded([1], [], "", "stop", 0.0)])  # c: none
    store.add(["a"], [_dec([9, 9, 9], value=2.0)])
    again = DecisionStore.open(out)
    assert again.settings == SETTINGS
    kept = again.read()
    assert set(kept) == {"a", "b"}  # a stop-cut decoding keeps no decisions
    tokens, reason, states = kept["a"]
    assert tokens == [9, 9, 9] and reason == "delimiter" and states.shape == (3, 4) and states[0, 0] == 2.0
    assert kept["b"][1] == "eos" and kept["b"][2].shape == (2, 4)  # one more state: the end-of-sequence pick
    assert set(again.read({"b"})) == {"b"}


def test_a_store_of_other_settings_is_replaced_not_mixed_in(tmp_path):
    out = str(tmp_path / "pool.jsonl")
    DecisionStore(out, SETTINGS).add(["a"], [_dec([5])])
    other = DecisionStore(out, {**SETTINGS, "max_new_tokens": 16})
    assert other.read() == {}  # another key: not this store's decodings
    other.add(["b"], [_dec([6])])
    assert set(DecisionStore.open(out).read()) == {"b"} and DecisionStore.open(out).settings["max_new_tokens"] == 16


def test_forced_features_round_trip_keyed_by_prompt_and_completion(tmp_path):
    out = str(tmp_path / "pool.jsonl")
    store = ForcedFeatures(out, ("max", "mean", "last"))
    store.add([pair_key("p", "c1"), pair_key("p", "c2")], np.arange(12, dtype=np.float32).reshape(2, 6))
    store.add([], np.zeros((0, 6)))  # nothing to keep: no chunk
    got = ForcedFeatures(out, ("max", "mean", "last")).read()
    assert set(got) == {pair_key("p", "c1"), pair_key("p", "c2")}
    np.testing.assert_array_equal(got[pair_key("p", "c2")], np.arange(6, 12))
    assert ForcedFeatures(out, ("mean", "last")).read() == {}  # other parts: not these features
    assert pair_key("ab", "c") != pair_key("a", "bc")
