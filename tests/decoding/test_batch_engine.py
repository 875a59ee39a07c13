"""The batched decoding engine: a request's answer and verdict do not depend on the batch it runs in.

Every request is decoded alone (a batch of one, no prompt cache) and in running batches of 2, 4, 8
and 16 rows that it joins and leaves at token boundaries (including requests submitted while others
are mid-decoding, and a prompt cache shared across requests); tokens and stop reasons must be
identical and the verifier features within 1e-5.  The batched products round differently from a batch of one
(~1e-6), so two answers may go different ways at a near tie of the two best tokens: that alone is accepted, and
the row is compared no further (tests/helpers/greedy_margins.py).  Seeded sampling reproduces the same text alone and
in a batch.  The verdicts of ``VerifiedGenerator.generate_many`` equal one-at-a-time ``generate``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from verified_lab import SYSTEM, TEMPLATE, reviews  # noqa: E402  (tests/helpers/; the setup fixture: conftest.py)
from verified_lab import verified_generator as _generator  # noqa: E402
from greedy_margins import assert_same_greedy, step_margins  # noqa: E402

from sdm_mlx.llm import embed as E  # noqa: E402


def _prompts(tok, n=16, seed=3):
    docs = [d for d, _ in reviews(n, seed=seed)]
    return [E.encode(tok, E.chat_text(tok, d, system=SYSTEM, prompt_template=TEMPLATE)) for d in docs]


def _engine(model, tok, heads, max_batch, prefix_cache=False):
    from sdm_mlx.decoding import DecodeEngine

    return DecodeEngine(model, tok, heads=heads, max_batch=max_batch, prefix_cache=prefix_cache)


def _requests(prompts, sampling=None, max_tokens=16):
    from sdm_mlx.decoding import DecodeRequest, SamplingParams

    sampling = sampling or SamplingParams()
    return [DecodeRequest(p, max_tokens, sampling, features=True) for p in prompts]


def _assert_same(alone, batched, model, heads=None, tol=1e-5):
    """Every batched answer is its answer alone (the same tokens, stop, text, and features within ``tol``), or
    went another way at a near tie (:func:`assert_same_greedy`); at least one row is compared to its end."""
    assert len(alone) == len(batched)
    diverged = 0
    for a, b in zip(alone, batched):
        if assert_same_greedy(model, a.prompt_ids, a.token_ids, b.token_ids, heads):
            diverged += 1
            continue
        assert a.stop_reason == b.stop_reason and a.text == b.text
        assert a.feature_info == b.feature_info
        np.testing.assert_allclose(b.features, a.features, rtol=tol, atol=tol)
    assert diverged < len(alone), "every row went another way at a near tie: nothing was compared"


@pytest.mark.parametrize("joint", [False, True])
def test_answers_do_not_depend_on_the_batch(setup, joint):  # noqa: F811
    from sdm_mlx.decoding import PrefixCache

    gen = _generator(setup)
    model, tok, heads = gen.model, gen.tokenizer, (gen.heads if joint else None)
    prompts = _prompts(tok)
    alone = [_engine(model, tok, heads, 1).run(_requests([p]))[0] for p in prompts]
    assert len({a.stop_reason for a in alone}) >= 1 and any(a.token_ids for a in alone)
    for size in (2, 4, 8, 16):
        _assert_same(alone, _engine(model, tok, heads, size).run(_requests(prompts)), model, heads)
    # with a shared prompt cache: the template prefix is prefilled once, the answers stay the same
    cache = PrefixCache()
    cached = _engine(model, tok, heads, 16, prefix_cache=cache).run(_requests(prompts))
    _assert_same(alone, cached, model, heads)
    assert cache.hits >= len(prompts) - 2 and sum(d.cached_prompt_tokens > 0 for d in cached) >= len(prompts) - 2


def test_another_token_where_the_best_one_led_clearly_fails_the_comparison(setup):  # noqa: F811
    """The near-tie allowance of _assert_same can fail: a token changed where the reference's best token led by
    more than rounding is reported, the same answer is not, and an answer cut short is judged at its last step."""
    gen = _generator(setup)
    a = _engine(gen.model, gen.tokenizer, gen.heads, 1).run(_requests(_prompts(gen.tokenizer, 1)))[0]
    margins = step_margins(gen.model, a.prompt_ids, a.token_ids, gen.heads)
    assert len(margins) == len(a.token_ids) + 1
    k = int(np.argmax(margins[: len(a.token_ids)]))  # the step with the clearest winner
    changed = list(a.token_ids)
    changed[k] = (changed[k] + 1) % gen.heads.vocab_size
    assert not assert_same_greedy(gen.model, a.prompt_ids, a.token_ids, list(a.token_ids), gen.heads)
    with pytest.raises(AssertionError, match="not rounding"):
        assert_same_greedy(gen.model, a.prompt_ids, a.token_ids, changed, gen.heads)
    with pytest.raises(AssertionError, match="not rounding"):
        assert_same_greedy(gen.model, a.prompt_ids, a.token_ids, changed[:k], gen.heads)


def test_requests_join_a_running_batch(setup):  # noqa: F811
    """Requests submitted while others decode join at the next token boundary; nothing changes for anyone."""
    gen = _generator(setup)
    prompts = _prompts(gen.tokenizer, 12, seed=5)
    alone = [_engine(gen.model, gen.tokenizer, gen.heads, 1).run(_requests([p]))[0] for p in prompts]
    eng = _engine(gen.model, gen.tokenizer, gen.heads, 8)
    reqs = _requests(prompts)
    got, k, sizes = {}, 0, set()
    while k < len(reqs) or eng.busy:
        if k < len(reqs):  # one new request per step
            eng.submit(reqs[k])
            k += 1
        for req, dec in eng.step():
            got[id(req)] = dec
        sizes.add(len(eng.rows))
    assert max(sizes) > 2  # really batched
    _assert_same(alone, [got[id(r)] for r in reqs], gen.model, gen.heads)


def test_cancel_stops_one_row_only(setup):  # noqa: F811
    gen = _generator(setup)
    prompts = _prompts(gen.tokenizer, 4, seed=7)
    reqs = _requests(prompts, max_tokens=20)
    for r in reqs:
        r.stop_at_delimiter = False
    steps = [0]
    reqs[1].cancel = lambda: steps[0] >= 3
    eng = _engine(gen.model, gen.tokenizer, gen.heads, 4)
    for r in reqs:
        eng.submit(r)
    done = {}
    while eng.busy:
        for req, dec in eng.step():
            done[id(req)] = dec
        steps[0] += 1
    out = [done[id(r)] for r in reqs]
    assert out[1].stop_reason == "cancelled" and len(out[1].token_ids) <= 4
    alone = _engine(gen.model, gen.tokenizer, gen.heads, 1).run([reqs[0]])[0]
    assert out[0].stop_reason != "cancelled"
    assert_same_greedy(gen.model, alone.prompt_ids, alone.token_ids, out[0].token_ids, gen.heads)


@pytest.mark.parametrize("joint", [False, True])
def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(setup, joint):  # noqa: F811
    from sdm_mlx.decoding import DecodeRequest, SamplingParams

    gen = _generator(setup)
    heads = gen.heads if joint else None
    prompts = _prompts(gen.tokenizer, 6, seed=9)
    s = SamplingParams(temperature=1.2, top_p=0.95, top_k=50, min_p=0.01, seed=11, repetition_penalty=1.1)
    one = _engine(gen.model, gen.tokenizer, heads, 1).run([DecodeRequest(prompts[0], 12, s)])[0]
    mixed = [DecodeRequest(prompts[0], 12, s)] + [DecodeRequest(p, 12) for p in prompts[1:]]  # greedy neighbours
    batch = _engine(gen.model, gen.tokenizer, heads, 6).run(mixed)
    assert batch[0].token_ids == one.token_ids
    hot = [DecodeRequest(prompts[0], 12, SamplingParams(temperature=2.0, seed=k)) for k in range(8)]
    greedy = _engine(gen.model, gen.tokenizer, heads, 1).run([DecodeRequest(prompts[0], 12)])[0]
    draws = _engine(gen.model, gen.tokenizer, heads, 8).run(hot)
    assert any(d.token_ids != greedy.token_ids for d in draws)  # the draw is random, the seed fixes it


def test_logprobs_report_the_emitted_token(setup):  # noqa: F811
    from sdm_mlx.decoding import DecodeRequest, SamplingParams

    gen = _generator(setup)
    p = _prompts(gen.tokenizer, 1)[0]
    dec = _engine(gen.model, gen.tokenizer, gen.heads, 1).run(
        [DecodeRequest(p, 8, SamplingParams(logprobs=True, top_logprobs=3))])[0]
    assert len(dec.logprobs) == len(dec.token_ids)
    for t, lp in zip(dec.token_ids, dec.logprobs):
        assert lp["id"] == t and lp["logprob"] <= 1e-6 and len(lp["top_logprobs"]) == 3
        assert lp["top_logprobs"][0]["logprob"] >= lp["logprob"] - 1e-6  # greedy: the emitted token is the best


def test_prefix_cache_is_bounded_in_bytes(setup):  # noqa: F811
    from sdm_mlx.decoding import PrefixCache

    gen = _generator(setup)
    prompts = _prompts(gen.tokenizer, 8)
    big = PrefixCache()
    _engine(gen.model, gen.tokenizer, None, 4, prefix_cache=big).run(_requests(prompts))
    entry = big.nbytes / max(1, len(big))
    small = PrefixCache(max_bytes=int(entry * 1.5))
    _engine(gen.model, gen.tokenizer, None, 4, prefix_cache=small).run(_requests(prompts))
    assert 0 < small.nbytes <= small.max_bytes and len(small) == 1 and small.hits > 0


def _distances(attempt) -> list:
    return [e["squared_distance"] for e in attempt.verdict.exemplars or []]


def test_generate_many_verdicts_equal_one_at_a_time(setup):  # noqa: F811
    """Mixed policies in one batch; every result equals the same request run alone.

    The batch rounds the features differently from a request alone (the exemplar distances agree within 1e-5, never
    bit for bit here).  A verdict is a step function of the features: where p̂_lower moved by more than 1e-5 the
    features crossed a step, the verdict may go either way and the re-ask follows it, so that result is compared no
    further (as in tests/serve/test_serve_many.py)."""
    gen = _generator(setup, on_reject="reask", max_attempts=2)
    docs = [setup.verified_doc, "Hello", "Boring, too long, and badly written."] + \
        [d for d, _ in reviews(5, seed=21)]
    alone = [gen.generate(d, id=i) for i, d in enumerate(docs)]
    many = gen.generate_many(docs, list(range(len(docs))))
    assert any(r.verified for r in many) and any(len(r.attempts) > 1 for r in many)  # re-asks ran in the batch
    compared = 0
    for a, b in zip(alone, many):
        assert a.id == b.id
        for x, y in zip(a.attempts, b.attempts):
            dx, dy = _distances(x), _distances(y)
            assert len(dx) == len(dy) and all(abs(u - v) <= 1e-5 * max(1.0, abs(u)) for u, v in zip(dx, dy))
            assert x.token_ids == y.token_ids
            px, py = x.verdict.p_lower, y.verdict.p_lower
            if (px is None) != (py is None) or (px is not None and abs(px - py) > 1e-5):
                break  # across a step of p̂_lower: see the docstring
            assert x.verdict.verified == y.verdict.verified
        else:
            compared += 1
            assert (a.text, a.status, a.reason, a.stopped, len(a.attempts)) == \
                (b.text, b.status, b.reason, b.stopped, len(b.attempts))
    assert compared >= len(docs) // 2, f"only {compared} of {len(docs)} results were compared to their end"


def _brute_force_cost(width, pass_cost):
    """The least ``Σ (pass_cost + max width × rows)`` over every cut of the sorted widths (2^(n-1) cut sets)."""
    import itertools

    n, best = len(width), None
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        cost = sum(pass_cost + width[b - 1] * (b - a) for a, b in zip(bounds, bounds[1:]))
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("pass_cost", [0, 5, 48, 10_000])
def test_length_chunks_cover_every_row_once_at_least_cost(pass_cost):
    from sdm_mlx.decoding.batch_plan import length_chunks

    rng = np.random.default_rng(pass_cost)
    for n in (1, 2, 5, 9):
        lengths = [int(x) for x in rng.integers(1, 60, size=n)]
        chunks = length_chunks(lengths, pass_cost=pass_cost)
        assert sorted(i for c in chunks for i in c) == list(range(n))
        flat = [lengths[i] for c in chunks for i in c]
        assert flat == sorted(lengths)  # sorted passes, so each pads only up to its own longest row
        cost = sum(pass_cost + max(lengths[i] for i in c) * len(c) for c in chunks)
        assert cost == _brute_force_cost(sorted(lengths), pass_cost)
    assert length_chunks([]) == []
    assert len(length_chunks([3, 40, 4, 41], pass_cost=10_000)) == 1  # a pass dearer than any padding: one pass
    assert len(length_chunks([3, 40, 4, 41], pass_cost=0)) == 4  # free passes: no padding at all


def test_prefill_split_into_many_passes_changes_nothing(setup, monkeypatch):  # noqa: F811
    """The engine's right-padded prefill passes, cut as finely as possible, give the answers of one request alone."""
    from sdm_mlx.decoding import PrefixCache, batch_plan

    gen = _generator(setup)
    model, tok = gen.model, gen.tokenizer
    prompts = _prompts(tok, 10, seed=7)
    alone = [_engine(model, tok, gen.heads, 1).run(_requests([p]))[0] for p in prompts]
    passes = []
    real = batch_plan.length_chunks

    def finest(lengths):
        chunks = real(lengths, pass_cost=0)
        passes.append(len(chunks))
        return chunks

    monkeypatch.setattr(batch_plan, "length_chunks", finest)
    _assert_same(alone, _engine(model, tok, gen.heads, 10).run(_requests(prompts)), model, gen.heads)
    _assert_same(alone, _engine(model, tok, gen.heads, 10, prefix_cache=PrefixCache()).run(_requests(prompts)), model,
                 gen.heads)
    assert max(passes) > 1


@pytest.fixture(scope="module")
def sliding_window_model(tmp_path_factory):
    """A tiny gemma3_text: its own cache types (a 6-token rotating window on every other layer, ``make_cache``)."""
    from tiny_models import make_tiny_model

    from sdm_mlx.llm.model import load_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3_text"))


def test_models_with_their_own_caches_decode_in_batches(sliding_window_model):
    """Rotating (sliding-window) caches merge into mlx-lm's batch caches: rows join and leave the running batch
    and every answer equals the request decoded alone, which equals mlx-lm's own ``generate_step``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from sdm_mlx.decoding import DecodeEngine, DecodeRequest, SamplingParams, decodes_in_batches

    model, tok = sliding_window_model
    assert hasattr(model, "make_cache") and decodes_in_batches(model)
    texts = ["the film is warm and funny", "dull", "a long and boring wooden film that drags on and on for hours",
             "great", "lovely moving sharp", "awful weak", "sharp but long", "a lovely, moving and warm film"]
    prompts = [E.encode(tok, E.chat_text(tok, t)) for t in texts]
    assert max(len(p) for p in prompts) > 6  # longer than the window: the rotating caches wrap

    def requests():  # staggered lengths: rows leave and new ones join a running batch
        return [DecodeRequest(p, 4 + 3 * (i % 4), SamplingParams(), features=True, stop_at_delimiter=False)
                for i, p in enumerate(prompts)]

    alone = [DecodeEngine(model, tok, max_batch=1).run([r])[0] for r in requests()]
    for a, p in zip(alone, prompts):
        n = len(a.token_ids)
        ref = [int(t) for (t, _), _ in zip(generate_step(mx.array(p), model, max_tokens=n), range(n))]
        assert_same_greedy(model, p, a.token_ids, ref[: len(a.token_ids)])
    for size in (2, 3, 8):
        eng = DecodeEngine(model, tok, max_batch=size)
        assert eng.max_batch == size and eng.prefix_cache is None
        _assert_same(alone, eng.run(requests()), model)
    # joint neg+pos decoding (Alg. 4's and verified generation's) on the same caches
    from sdm_mlx.network.heads import SDMHeads

    heads = SDMHeads(model)
    joint_alone = [DecodeEngine(model, tok, heads=heads, max_batch=1).run([r])[0] for r in requests()]
    _assert_same(joint_alone, DecodeEngine(model, tok, heads=heads, max_batch=4).run(requests()), model, heads)


def test_caches_that_do_not_merge_decode_one_row_at_a_time():
    from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, RotatingKVCache

    from sdm_mlx.decoding import decodes_in_batches

    class Model:
        def __init__(self, caches):
            self.caches = caches

        def make_cache(self):
            return self.caches

    assert decodes_in_batches(object())  # no make_cache: plain KV caches
    assert decodes_in_batches(Model([KVCache(), RotatingKVCache(max_size=4)]))
    assert decodes_in_batches(Model([CacheList(KVCache(), RotatingKVCache(max_size=4))]))
    assert not decodes_in_batches(Model([KVCache(), QuantizedKVCache()]))
    assert not decodes_in_batches(Model([CacheList(KVCache(), QuantizedKVCache())]))


def test_a_make_cache_of_plain_kv_caches_keeps_the_prompt_cache(tiny_llama_path):
    """mlx-lm's Llama (and Mistral) define ``make_cache`` for optional sliding-window layers; without such
    layers it makes plain ``KVCache`` objects, so the engine prefills in batch passes with the prompt cache (the
    shared prefix prefilled once), and the answers equal those of a prompt-cache-less engine and of mlx-lm."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from sdm_mlx.decoding import DecodeEngine, DecodeRequest, SamplingParams
    from sdm_mlx.decoding.batch_plan import plain_kv_caches

    model, tok = load(str(tiny_llama_path))
    assert hasattr(model, "make_cache") and plain_kv_caches(model)
    texts = ["the film is warm and funny", "dull", "a long and boring film", "great", "lovely moving sharp"]
    prompts = [E.encode(tok, E.chat_text(tok, t, system="You judge films. Answer in JSON.")) for t in texts]

    def requests():
        return [DecodeRequest(p, 6, SamplingParams(), features=True, stop_at_delimiter=False) for p in prompts]

    cached = DecodeEngine(model, tok, max_batch=4)
    assert cached.batchable and cached.prefix_cache is not None
    with_cache = cached.run(requests())
    assert cached.prefix_cache.hits >= 1  # the shared system message and template head, prefilled once
    _assert_same(DecodeEngine(model, tok, max_batch=1, prefix_cache=False).run(requests()), with_cache, model)
    for d, p in zip(with_cache, prompts):
        ref = [int(t) for (t, _), _ in zip(generate_step(mx.array(p), model, max_tokens=6), range(6))]
        assert_same_greedy(model, p, d.token_ids, ref[: len(d.token_ids)])
