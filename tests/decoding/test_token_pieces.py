"""TokenPieces decodes a window of the last tokens, not the whole answer, and gives the pieces that decoding the
whole answer at every token gives, on the three tokenizer kinds (SentencePiece with byte fallback, byte-level
BPE with and without BOS), with partial characters, byte-token runs and clean-up rewrites."""

import os

import numpy as np
import pytest

from sdm_mlx.decoding.streaming import TokenPieces, _is_byte_token


class WholePieces:
    """The reference: the growth of decode(all tokens) at every token (TokenPieces before the window)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.text = tokenizer, [], ""

    def add(self, token):
        self.tokens.append(int(token))
        if _is_byte_token(self.tokenizer, token):
            return ""
        return self._grow(self.tokenizer.decode(self.tokens).rstrip("\ufffd"))

    def finalize(self):
        return self._grow(self.tokenizer.decode(self.tokens)) if self.tokens else ""

    def _grow(self, decoded):
        same = len(self.text) if decoded.startswith(self.text) else len(os.path.commonprefix([self.text, decoded]))
        piece, self.text = decoded[same:], decoded
        return piece


def _sequences(tok, rng):
    """Token sequences a model could emit: real text (accents, CJK, emoji, punctuation that the clean-up
    rewrites), the same text's tokens shuffled in short runs, and random ids (partial characters)."""
    text = ("Hello , world ! It 's a test : é ü 日本語 🙂🙂 ok . Don 't stop ; go ? Yes .\n" * 6)
    ids = tok.encode(text, add_special_tokens=False)
    yield ids
    runs = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    rng.shuffle(runs)
    yield [t for r in runs for t in r]
    vocab = min(len(tok.get_vocab()), 2000)
    for _ in range(3):
        yield [int(t) for t in rng.integers(0, vocab, 200)]


@pytest.mark.parametrize("arch", ["phi3", "qwen2", "llama"])
def test_window_pieces_equal_whole_answer_pieces(arch, request):
    from mlx_lm.utils import load_tokenizer
    from pathlib import Path

    tok = load_tokenizer(Path(request.getfixturevalue(f"tiny_{arch}_path")))
    rng = np.random.default_rng(0)
    for seq in _sequences(tok, rng):
        window, whole = TokenPieces(tok), WholePieces(tok)
        for t in seq:
            assert window.add(t) == whole.add(t)
        assert window.finalize() == whole.finalize()
        assert window.text == whole.text


@pytest.mark.parametrize("arch", ["phi3", "qwen2", "llama"])
def test_each_token_decodes_a_bounded_window(arch, request):
    """A long answer (accents, CJK, emoji byte runs, clean-up): after the first tokens no decode call sees more
    than 4 * CONTEXT tokens (2 * CONTEXT + 1, cuts moved back over byte runs: two emoji here), so a token costs
    O(1), not O(n)."""
    from mlx_lm.utils import load_tokenizer
    from pathlib import Path

    tok = load_tokenizer(Path(request.getfixturevalue(f"tiny_{arch}_path")))
    seen = []
    decode = tok.decode

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids, *a, **k):
            seen.append(len(ids))
            return decode(ids, *a, **k)

    ids = next(_sequences(tok, np.random.default_rng(0)))
    pieces, whole = TokenPieces(Counting()), WholePieces(tok)
    for t in ids:
        assert pieces.add(t) == whole.add(t)
    assert pieces.finalize() == whole.finalize()
    assert len(ids) > 300 and max(seen[:-1]) <= 4 * TokenPieces.CONTEXT
