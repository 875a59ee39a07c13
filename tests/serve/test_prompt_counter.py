"""PromptCounter runs its calls on one thread of its own (sdm_mlx.serve.limits): what the tokenizers library
keeps of the words it encoded grows with the threads that encode, so counting on the event loop's pool of
workers grew the server's heap."""

import asyncio
import threading
import time
import types

from sdm_mlx.serve.limits import PromptCounter


def _counter() -> PromptCounter:
    return PromptCounter(types.SimpleNamespace(tokenizer=None))


def test_concurrent_calls_run_on_one_thread_off_the_event_loop():
    counter = _counter()

    def where() -> int:
        time.sleep(0.005)  # overlapping calls: a pool would spread them over its workers
        return threading.get_ident()

    async def main():
        loop_thread = threading.get_ident()
        idents = await asyncio.gather(*(counter.off_loop(where) for _ in range(24)))
        return loop_thread, set(idents)

    loop_thread, idents = asyncio.run(main())
    assert len(idents) == 1 and loop_thread not in idents


def test_off_loop_returns_the_result_and_raises_the_error_of_the_call():
    counter = _counter()

    def fail():
        raise ValueError("bad template")

    async def main():
        ok = await counter.off_loop(lambda a, b: a + b, 2, 3)
        try:
            await counter.off_loop(fail)
        except ValueError as e:
            return ok, str(e)

    assert asyncio.run(main()) == (5, "bad template")


# ---------------------------------------------------------------------------------- refused by its length alone
class CountingTokenizer:
    """A tokenizer that counts its ``encode`` calls (everything else is the wrapped tokenizer's)."""

    def __init__(self, tokenizer):
        self.__dict__.update(inner=tokenizer, encoded=0)

    def encode(self, *args, **kwargs):
        self.encoded += 1
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)


def _hf(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _counting_counter(path, limit):
    from sdm_mlx.verified.prompts import PromptBuilder

    tok = _hf(path)
    prompts = PromptBuilder(tok, system=None, prompt_template=None, use_chat_template=True)
    counter = PromptCounter(types.SimpleNamespace(tokenizer=tok, prompts=prompts),
                            limit=limit)
    counter.tokenizer = CountingTokenizer(counter.tokenizer)
    return counter


def test_a_prompt_over_the_limit_by_its_length_alone_is_never_tokenised(tiny_phi3_path):
    """8.5 MB of text (before: 13.8 s and hundreds of MB to tokenise, to learn it is too long) is refused from its
    length: the tokenizer's encode is never called.  A prompt the floor cannot refuse is counted exactly."""
    import pytest

    from sdm_mlx.serve.limits import PromptTooLong

    counter = _counting_counter(tiny_phi3_path, limit=300)
    huge = [{"role": "user", "content": "word " * 1_700_000}]
    for call in (lambda: counter.count(huge, None), lambda: counter.prompt_ids(huge, None),
                 lambda: counter.count(None, "x" * 10_000_000), lambda: counter.count(None, "hi", "word " * 10_000)):
        with pytest.raises(PromptTooLong, match=r"^prompt too long \(at least \d+ tokens by its length alone, "
                                                r"limit 300\)$") as e:
            call()
        assert e.value.at_least > 300
    assert counter.tokenizer.encoded == 0
    over = counter.count(None, "y " * 400)  # 401 word starts: at least 201 tokens; exactly 801 > 300
    assert over > 300 and counter.tokenizer.encoded == 1
    assert counter.count(None, "a short prompt") < 300 and counter.tokenizer.encoded == 2


def test_without_a_limit_nothing_is_refused_by_length(tiny_phi3_path):
    counter = _counting_counter(tiny_phi3_path, limit=None)
    assert counter.floor is None and counter.count(None, "word " * 2000) > 2000 and counter.tokenizer.encoded == 1


def test_the_floor_never_exceeds_the_exact_count(tiny_phi3_path, tiny_qwen2_path, tiny_llama_path):
    """The floor is a proof: on 1,500 texts mixing words, runs of spaces, tabs and newlines, a literal ▁ and Ġ,
    no-break spaces, combining marks, Hangul jamo, emoji and special-token text, it is never above the exact
    count, on a SentencePiece-like and two byte-level BPE tokenizers; and it refuses "word " * 52000 by far."""
    import random

    from sdm_mlx.serve.limits import TokenFloor

    pieces = [" ", "  ", "\t", "\n", "\r\n", "\u2581", " \u2581", "\u0120", "\xa0", " \xa0", "e\u0301",
              "\u1100\u1161\u11a8", "\U0001F600", "\u6f22", "word", "hallucinations", "<|endoftext|>", "<|user|>",
              "<s>", "=" * 40, " " * 200, "a", " the", '{"correctness": true}', "\x00", "\ufb01", "\u0130", "123456",
              ".", ",", "'s"]
    rng = random.Random(0)
    for path in (tiny_phi3_path, tiny_qwen2_path, tiny_llama_path):
        tok = _hf(path)
        floor = TokenFloor.of(tok)
        assert floor is not None, path
        for i in range(500):  # short texts test the word-start bound at its tightest (" the": 1 token)
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3 if i % 2 else 60)))
            assert floor(text) <= len(tok.encode(text, add_special_tokens=False)), (path, text)
        assert floor("word " * 52000) >= 26000


def test_no_floor_for_a_tokenizer_that_drops_characters():
    """A pre-tokenizer that removes whitespace (BERT's), or a normalizer that strips text: a long text may be few
    tokens, so such prompts are only counted exactly."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sdm_mlx.serve.limits import TokenFloor

    def fast(pre=None, norm=None, unk="[UNK]", fuse_unk=False):
        tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "[UNK]": 2}, merges=[], unk_token=unk, fuse_unk=fuse_unk))
        tok.pre_tokenizer, tok.normalizer = pre, norm
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    assert TokenFloor.of(fast()) is not None
    assert len(fast().encode("\u6f22" * 40, add_special_tokens=False)) == 40  # one unknown token each
    assert len(fast(fuse_unk=True).encode("\u6f22" * 40, add_special_tokens=False)) == 1
    assert TokenFloor.of(fast(fuse_unk=True)) is None
    assert len(fast(unk=None).encode("\u6f22" * 40, add_special_tokens=False)) == 0  # dropped
    assert TokenFloor.of(fast(unk=None)) is None
    assert TokenFloor.of(fast(pre=pre_tokenizers.Whitespace())) is None
    assert TokenFloor.of(fast(norm=normalizers.Strip())) is None
    assert TokenFloor.of(fast(norm=normalizers.StripAccents())) is None
    assert TokenFloor.of(types.SimpleNamespace()) is None  # not a fast tokenizer
