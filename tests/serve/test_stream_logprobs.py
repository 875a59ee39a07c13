"""Streamed ``logprobs`` of ``sdm-mlx serve``, through the official ``openai`` client.

A streamed completion that asks for ``logprobs`` / ``top_logprobs`` carries, in every text chunk, the
logprobs of exactly the tokens whose text that chunk releases: their ``bytes`` join to the chunk's text,
all chunks' tokens join to the streamed answer, and they equal the non-streamed response's logprobs for
the same greedy request (floats within 1e-5) — for chat (``choices[0].logprobs.content``) and text
completions (``{tokens, token_logprobs, top_logprobs}``, also with the legacy integer ``logprobs``).
Verified decoding withholds text until its verdict (policies ``abstain`` / ``reask``): the one released
chunk carries the shown answer's logprobs, and an abstention carries none, streamed or not, so the
withheld answer's tokens never reach the client.  Without ``logprobs`` every chunk says ``"logprobs": null``.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("openai")

from verified_lab import OOD_PROMPT  # noqa: E402  (tests/helpers/; the setup fixture: conftest.py)

TIMEOUT = 120
TOL = 1e-5
RAW_PROMPT = "Classify the sentiment of this review as JSON. REVIEW: A warm and funny film.\nANSWER: "


# the server and client fixtures: tests/serve/conftest.py


def _model(client) -> str:
    return client.models.list().data[0].id


def _entries(content) -> list:
    """Chat logprobs entries as plain tuples: (token, bytes, logprob, [(token, bytes, logprob), ...])."""
    return [(e.token, list(e.bytes), e.logprob, [(t.token, list(t.bytes), t.logprob) for t in e.top_logprobs])
            for e in content]


def _same_entries(a: list, b: list) -> None:
    assert [(t, by, [(x, y) for x, y, _ in top]) for t, by, _, top in a] == \
           [(t, by, [(x, y) for x, y, _ in top]) for t, by, _, top in b]
    for (_, _, la, ta), (_, _, lb, tb) in zip(a, b):
        assert abs(la - lb) <= TOL and all(abs(x[2] - y[2]) <= TOL for x, y in zip(ta, tb))


def _chat_stream(client, doc: str, policy: str, **extra) -> tuple[str, list, list, dict]:
    """``(text, logprob entries, [(chunk text, chunk entries)], verification)`` of a streamed chat completion."""
    text, entries, chunks, verification = "", [], [], None
    for ch in client.chat.completions.create(
            model=_model(client), messages=[{"role": "user", "content": doc}], max_tokens=24, stream=True,
            extra_body={"sdm": {"on_reject": policy, "max_attempts": 2}}, **extra):
        c = ch.choices[0]
        verification = (c.model_extra or {}).get("verification") or verification
        if c.delta.content:
            got = _entries(c.logprobs.content)
            text += c.delta.content
            entries += got
            chunks.append((c.delta.content, got))
        else:
            assert c.logprobs is None  # the role chunk and the final chunk describe no tokens
    return text, entries, chunks, verification


def _chat_whole(client, doc: str, policy: str, **extra):
    r = client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": doc}], max_tokens=24,
        extra_body={"sdm": {"on_reject": policy, "max_attempts": 2}}, **extra)
    return r.choices[0].message.content, _entries(r.choices[0].logprobs.content), r


def _joined(entries: list) -> str:
    return bytes(b for _, by, _, _ in entries for b in by).decode("utf-8")


@pytest.mark.parametrize("doc", ["verified", OOD_PROMPT, "Hello"])
def test_live_chat_chunks_carry_the_logprobs_of_their_tokens(setup, client, doc):  # noqa: F811
    doc = setup.verified_doc if doc == "verified" else doc
    text, entries, chunks, verification = _chat_stream(client, doc, "return", logprobs=True, top_logprobs=2)
    assert text and len(chunks) >= 1 and verification["status"] in ("verified", "unverified")
    for chunk_text, chunk_entries in chunks:  # each chunk: exactly the tokens whose text it releases
        assert _joined(chunk_entries) == chunk_text
        assert all(len(top) == 2 for *_, top in chunk_entries)
    assert _joined(entries) == text == "".join(t for t, *_ in entries)
    whole, whole_entries, r = _chat_whole(client, doc, "return", logprobs=True, top_logprobs=2)
    assert whole == text and len(whole_entries) == r.usage.completion_tokens
    _same_entries(entries, whole_entries)


def test_a_stop_string_cut_keeps_streamed_and_whole_logprobs_equal(setup, client):  # noqa: F811
    full, entries, _, _ = _chat_stream(client, OOD_PROMPT, "return", logprobs=True)
    stop = full[len(full) // 2:][:2]
    assert stop.strip(), full
    text, entries, chunks, _ = _chat_stream(client, OOD_PROMPT, "return", logprobs=True, stop=[stop])
    whole, whole_entries, _ = _chat_whole(client, OOD_PROMPT, "return", logprobs=True, stop=[stop])
    assert text == whole == full[: full.index(stop)]
    _same_entries(entries, whole_entries)
    for chunk_text, chunk_entries in chunks[:-1]:  # only the chunk ending at the stop may cut a token
        assert _joined(chunk_entries) == chunk_text
    assert text.startswith(_joined(entries))


@pytest.mark.parametrize("policy", ["abstain", "reask"])
def test_withheld_text_leaks_no_logprobs(setup, client, policy):  # noqa: F811
    shown = []
    for doc in (setup.verified_doc, OOD_PROMPT):
        text, entries, chunks, verification = _chat_stream(client, doc, policy, logprobs=True, top_logprobs=2)
        whole, whole_entries, r = _chat_whole(client, doc, policy, logprobs=True, top_logprobs=2)
        assert text == whole and len(chunks) == 1  # released after the verdict, in one chunk
        _same_entries(entries, whole_entries)
        if verification["status"] == "abstained":
            assert text.startswith("NOT VERIFIED") and entries == []  # nothing of the withheld answer
            assert verification["attempts"][-1]["tokens"] > 0 and r.choices[0].logprobs.content == []
        else:
            assert _joined(entries) == text and len(entries) == verification["attempts"][-1]["tokens"]
        shown.append(verification["status"])
    assert shown[0] == "verified" and (policy == "reask" or shown[1] == "abstained"), shown


def _text_stream(client, prompt: str, policy: str, **extra) -> tuple[str, list, list]:
    text, entries, chunks = "", [], []
    for ch in client.completions.create(model=_model(client), prompt=prompt, max_tokens=24, stream=True,
                                        extra_body={"sdm": {"on_reject": policy}, **extra.pop("extra_body", {})},
                                        **extra):
        c = ch.choices[0]
        if c.text:
            lp = c.logprobs
            got = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
            text += c.text
            entries += got
            chunks.append((c.text, got))
        else:
            assert c.logprobs is None
    return text, entries, chunks


def _same_text_entries(a: list, b: list) -> None:
    assert [(t, sorted(top)) for t, _, top in a] == [(t, sorted(top)) for t, _, top in b]
    for (_, la, ta), (_, lb, tb) in zip(a, b):
        assert abs(la - lb) <= TOL and all(abs(ta[k] - tb[k]) <= TOL for k in ta)


@pytest.mark.parametrize("prompt", [RAW_PROMPT, OOD_PROMPT])
def test_live_text_completion_chunks_carry_the_logprobs_of_their_tokens(client, prompt):
    text, entries, chunks = _text_stream(client, prompt, "return", logprobs=True, extra_body={"top_logprobs": 2})
    assert text and chunks
    for chunk_text, chunk_entries in chunks:
        assert "".join(t for t, _, _ in chunk_entries) == chunk_text
    r = client.completions.create(model=_model(client), prompt=prompt, max_tokens=24, logprobs=2,
                                  extra_body={"sdm": {"on_reject": "return"}})  # the legacy integer form
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text == "".join(lp.tokens)
    _same_text_entries(entries, list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)))
    assert all(len(top) <= 2 for _, _, top in entries)


def _raw_events(server, route: str, body: dict) -> list:
    req = urllib.request.Request(server.url + route, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        lines = r.read().decode("utf-8").splitlines()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


@pytest.mark.parametrize("policy", ["return", "abstain"])
@pytest.mark.parametrize("route,field", [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
def test_chunks_say_logprobs_null_when_not_asked(setup, server, route, field, policy):  # noqa: F811
    value = [{"role": "user", "content": setup.verified_doc}] if field == "messages" else RAW_PROMPT
    events = _raw_events(server, route, {field: value, "max_tokens": 16, "stream": True,
                                         "sdm": {"on_reject": policy}})
    choices = [c for e in events for c in e["choices"]]
    assert len(choices) >= 2 and all("logprobs" in c and c["logprobs"] is None for c in choices)


@pytest.mark.parametrize("arch", ["phi3", "qwen2", "llama"])
def test_engine_token_stream_equals_the_decoded_answer(arch, request):
    """In the decoding engine, on the three tokenizer kinds (SentencePiece with byte fallback, byte-level BPE
    with and without BOS), random models emitting partial characters and byte-token runs: the streamed text
    is the decoded answer, each release carries exactly its tokens, and the records equal unstreamed ones."""
    from mlx_lm import load

    from sdm_mlx.decoding import DecodeEngine, DecodeRequest, SamplingParams
    from sdm_mlx.llm import embed as E

    model, tok = load(str(request.getfixturevalue(f"tiny_{arch}_path")))
    prompt = E.encode(tok, E.chat_text(tok, "A warm film, é ü 日本.", system="Be brief.", prompt_template="{document}"))
    for stop in ((), ("e", "xx")):
        for sampling in (SamplingParams(logprobs=True, top_logprobs=2),
                         SamplingParams(temperature=1.5, seed=3, logprobs=True)):
            released = []
            engine = DecodeEngine(model, tok, max_batch=2, prefix_cache=False)
            streamed, whole = engine.run([
                DecodeRequest(prompt, 40, sampling, stop, stop_at_delimiter=False,
                              on_tokens=lambda text, lps: released.append((text, lps))),
                DecodeRequest(prompt, 40, sampling, stop, stop_at_delimiter=False)])
            assert "".join(t for t, _ in released) == streamed.text == whole.text
            assert [r for _, lps in released for r in lps] == streamed.logprobs
            pairs = [[(r["id"], r["token"]) for r in d.logprobs] for d in (streamed, whole)]
            assert pairs[0] == pairs[1]
            assert [r["id"] for r in whole.logprobs] == whole.token_ids
            for text, lps in (released if not stop else released[:-1]):
                assert "".join(r["token"] for r in lps) == text
            if streamed.stop_reason != "stop":
                assert "".join(r["token"] for r in whole.logprobs) == whole.text
