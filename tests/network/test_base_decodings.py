"""sdm_mlx/network/base_decodings.py: the base model's given decodings stand in for Alg. 4's passes at the base head.

On the tiny Phi-3: a file written from the model's own greedy decodings is read back by prompt, sliced to the
parts a pass pools, and ``greedy_generate`` with them in front of its journal decodes only the prompts they do not
hold; a file whose
decodings are not the model's is refused (a near tie in one of the prompts checked is not)."""

import numpy as np
import pytest

from sdm_mlx.decoding.decode_types import Decoded
from sdm_mlx.errors import InputError
from sdm_mlx.llm.embed import chat_text, load_model
from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS
from sdm_mlx.network import DecodeSettings, SDMHeads, greedy_generate
from sdm_mlx.network.base_decodings import BaseDecodings, save_base_decodings
from sdm_mlx.network.decode_journal import GivenDecodings

DOCS = ["A warm and funny film with a wonderful cast.", "The plot is dull and the acting is wooden.",
        "Boring, too long, and badly written.", "I loved every minute of this movie!"]
SETTINGS = DecodeSettings(max_new_tokens=6, batch_size=4, feature_parts=("mean", "last"))


@pytest.fixture(scope="module")
def decoded(tiny_phi3_path):
    model, tok = load_model(tiny_phi3_path)
    heads = SDMHeads(model)
    prompts = [chat_text(tok, d, system=PAPER_SYSTEM, prompt_template=PRESETS["sentiment"]["prompt_template"])
               for d in DOCS]
    return heads, tok, prompts, greedy_generate(heads, tok, prompts, SETTINGS)


def _save(path, prompts, gens, parts=("mean", "last")):
    save_base_decodings(str(path), prompts, [g.text for g in gens],
                        np.concatenate([g.features for g in gens]), parts)
    return str(path)


def test_given_decodings_are_not_decoded_again_and_keep_their_text_and_features(decoded, tmp_path, monkeypatch):
    from sdm_mlx.decoding.batching import DecodeEngine

    heads, tok, prompts, gens = decoded
    # the first two prompts, the first one twice: a repeated prompt keeps its first decoding
    path = _save(tmp_path / "base.npz", prompts[:2] + prompts[:1], gens[:2] + gens[:1])
    base = BaseDecodings(path, tok)
    assert len(base) == 2 and base.feature_parts == ("mean", "last")
    last = base.decodings(("last",))
    width = gens[0].features.shape[1]
    for g in gens[:2]:
        (d,) = [v for v in last.values() if v.prompt_ids == g.prompt_ids]
        np.testing.assert_array_equal(d.features, g.features[:, width // 2:])  # the last state's half
        assert d.text == g.text and d.stop_reason == "given"

    ran = []
    real = DecodeEngine.run
    monkeypatch.setattr(DecodeEngine, "run", lambda self, reqs, **kw: ran.extend(reqs) or real(self, reqs, **kw))
    known = base.decodings(SETTINGS.feature_parts)
    out = greedy_generate(heads, tok, prompts, SETTINGS, journal=GivenDecodings(known))
    assert sorted(r.prompt_ids for r in ran) == sorted(g.prompt_ids for g in gens[2:])  # only the two not given
    for g, o in zip(gens[:2], out[:2]):
        assert o.stop_reason == "given" and o.text == g.text
        np.testing.assert_array_equal(o.features, g.features)
    assert all(o.stop_reason != "given" and o.features.shape == (1, width) for o in out[2:])


def test_a_file_of_another_model_is_refused_and_one_near_tie_is_not(decoded, tmp_path):
    heads, tok, prompts, gens = decoded
    base = BaseDecodings(_save(tmp_path / "base.npz", prompts, gens), tok)
    given = list(base.decodings(SETTINGS.feature_parts).values())
    by_prompt = {tuple(g.prompt_ids): g for g in gens}
    again = [by_prompt[tuple(d.prompt_ids)] for d in given]
    assert base.check_against(again, given) == 0  # the model's own decodings

    def other(g, text=None, scale=1.0):
        return Decoded(prompt_ids=g.prompt_ids, token_ids=g.token_ids, text=g.text if text is None else text,
                       stop_reason=g.stop_reason, seconds=0.0, features=g.features * scale)

    assert base.check_against([other(again[0], text="x")] + again[1:], given) == 1  # one of four on a near tie
    with pytest.raises(InputError, match="does not hold this model's greedy decodings.*2 of 4 differ"):
        base.check_against([other(g, text="x") for g in again[:2]] + again[2:], given)
    with pytest.raises(InputError, match="4 of 4 differ"):  # the same texts, another model's states
        base.check_against([other(g, scale=1.5) for g in again], given)


def test_bad_files_and_missing_parts_name_the_fix(decoded, tmp_path):
    heads, tok, prompts, gens = decoded
    base = BaseDecodings(_save(tmp_path / "base.npz", prompts, gens), tok)
    with pytest.raises(InputError, match="record the features mean,last, not max,last.*every part"):
        base.decodings(("max", "last"))
    (tmp_path / "damaged.npz").write_bytes(b"not an npz")
    with pytest.raises(InputError, match="not a readable .npz.*remove base_decodings"):
        BaseDecodings(str(tmp_path / "damaged.npz"), tok)
    np.savez(tmp_path / "partial.npz", prompts=np.array(prompts), texts=np.array([g.text for g in gens]))
    with pytest.raises(InputError, match=r"lacks the array\(s\) \['features', 'feature_parts'\]"):
        BaseDecodings(str(tmp_path / "partial.npz"), tok)
    with pytest.raises(InputError, match="4 prompts, 3 texts"):
        save_base_decodings(str(tmp_path / "x.npz"), prompts, [g.text for g in gens[:3]],
                            np.concatenate([g.features for g in gens]), ("mean", "last"))
