"""sdm_mlx/network/decode_journal.py: the finished decodings of one pass, read back only for the same key."""

import numpy as np

from sdm_mlx.decoding.decode_types import Decoded
from sdm_mlx.network.decode_journal import DecodeJournal, prompt_key


def _decoded(i, features=True):
    return Decoded(prompt_ids=[1, 2, i], token_ids=[5, i], text=f"answer {i}", stop_reason="delimiter", seconds=0.5,
                   features=np.full((1, 4), i, dtype=np.float32) if features else None,
                   feature_info={"n_kept": 4 + i, "delimiter_index": 3, "missing_delimiter": False,
                                 "truncated": False})


def test_chunks_are_read_back_for_the_same_key_and_dropped_for_another(tmp_path):
    key = {"purpose": "calibration-epoch0", "head": 1.5}
    j = DecodeJournal(str(tmp_path / "j"), key)
    assert j.done() == {}
    j.add([prompt_key([1, 2, 0]), prompt_key([1, 2, 1])], [_decoded(0), _decoded(1)])
    j.add([prompt_key([1, 2, 2])], [_decoded(2)])
    got = DecodeJournal(str(tmp_path / "j"), dict(key)).done()
    assert sorted(got) == sorted(prompt_key([1, 2, i]) for i in range(3))
    d = got[prompt_key([1, 2, 2])]
    assert (d.text, d.token_ids, d.prompt_ids, d.stop_reason, d.feature_info["n_kept"]) == \
        ("answer 2", [5, 2], [1, 2, 2], "delimiter", 6)
    np.testing.assert_array_equal(d.features, np.full((1, 4), 2, dtype=np.float32))
    # another head: the journal is not mixed in, it is discarded
    assert DecodeJournal(str(tmp_path / "j"), {**key, "head": 1.6}).done() == {}
    assert not (tmp_path / "j").exists()


def test_a_damaged_chunk_is_decoded_again_and_features_may_be_absent(tmp_path):
    j = DecodeJournal(str(tmp_path / "j"), {"purpose": "p"})
    j.add([prompt_key([1, 2, 0])], [_decoded(0, features=False)])
    j.add([prompt_key([1, 2, 1])], [_decoded(1, features=False)])
    (tmp_path / "j" / "chunk_000000.npz").write_bytes(b"damaged")
    got = j.done()
    assert list(got) == [prompt_key([1, 2, 1])] and got[prompt_key([1, 2, 1])].features is None
