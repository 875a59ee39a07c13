"""sdm_mlx.llm.embed and `sdm-mlx embed` on tiny local mlx-lm models (no network)."""

import json

import mlx.core as mx
import numpy as np
import pytest

from sdm_mlx.llm import embed as E
from sdm_mlx.cli import main

SYSTEM = "You are a helpful AI assistant."
TEMPLATE = 'Classify the sentiment of the following movie review. Respond using the following JSON: {"sentiment": str}. REVIEW: {document}'
DOCS = [
    "A warm and funny film with a wonderful cast.",
    "Boring.",
    "The plot is dull and the acting is wooden, and the worst film I have seen this year.",
    "I loved every minute of this movie!",
    "An instant classic.",
]
COMPLETIONS = ['{"sentiment": "positive"}', '{"sentiment": "negative"}', '{"correctness": true}',
               '{"correctness": false}', '{"sentiment": "positive"}']


@pytest.fixture(scope="module")
def phi3(tiny_phi3_path):
    return E.load_model(tiny_phi3_path)


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_path):
    return E.load_model(tiny_qwen2_path)


@pytest.fixture(params=["phi3", "qwen2"])
def lm(request):
    return request.getfixturevalue(request.param)


def prompts(tok):
    return [E.chat_text(tok, d, system=SYSTEM, prompt_template=TEMPLATE) for d in DOCS]


def test_hidden_states_are_the_lm_head_input(phi3, qwen2, tiny_llama_path):
    llama = E.load_model(tiny_llama_path)
    for (model, tok), tied in ((phi3, False), (qwen2, True), (llama, False)):
        ids = E.encode(tok, E.chat_text(tok, DOCS[0], completion=COMPLETIONS[0]))
        h = E.hidden_states(model, [ids])
        assert h.dtype == mx.float32 and h.shape == (1, len(ids), 64)
        np.testing.assert_allclose(np.array(E.logits_from_hidden(model, h)), np.array(model(mx.array([ids]))), atol=1e-5)
        w = E.lm_head_weight(model)
        assert w.shape == (model.args.vocab_size, 64)
        assert (getattr(model, "lm_head", None) is None) == tied
        if tied:
            np.testing.assert_array_equal(np.array(w), np.array(model.model.embed_tokens.weight))
    # llama's tokenizer prepends BOS; a chat text is encoded with exactly one
    tok = llama[1]
    assert E.encode(tok, "hello")[0] == tok.bos_token_id
    assert E.encode(tok, "<s>hello").count(tok.bos_token_id) == 1


def test_batching_and_padding_do_not_change_features(lm):
    model, tok = lm
    ps = prompts(tok)
    one = E.prompt_completion_features(model, tok, ps, COMPLETIONS, batch_size=1)
    four = E.prompt_completion_features(model, tok, ps, COMPLETIONS, batch_size=4)
    rev = E.prompt_completion_features(model, tok, ps[::-1], COMPLETIONS[::-1], batch_size=5)
    assert one.embeddings.dtype == np.float32 and one.embeddings.shape == (5, 128)
    assert len(set(one.n_kept.tolist())) > 1  # really padded
    np.testing.assert_allclose(four.embeddings, one.embeddings, atol=1e-5)
    np.testing.assert_allclose(rev.embeddings[::-1], one.embeddings, atol=1e-5)
    # and equal to pooling an unpadded single forward pass by hand
    for i in (0, 2):
        ids = E.encode(tok, ps[i] + COMPLETIONS[i])
        n = int(one.n_kept[i])
        h = np.array(E.hidden_states(model, [ids]))[0]
        manual = np.concatenate([h[:n].mean(0), h[n - 1]])
        np.testing.assert_allclose(one.embeddings[i], manual, atol=1e-5)
        np.testing.assert_allclose(E.pool_hidden(h, n), manual, atol=1e-6)


@pytest.mark.parametrize("completion, token", [('{"sentiment": "positive"}', '"}'), ('{"correctness": true}', "}"),
                                               ('{"correctness": false}', "}")])
def test_delimiter_position(lm, completion, token):
    model, tok = lm
    prompt = E.chat_text(tok, DOCS[0], system=SYSTEM, prompt_template=TEMPLATE)
    ids = E.encode(tok, prompt + completion)
    f = E.prompt_completion_features(model, tok, [prompt], [completion])
    j = int(f.delimiter_index[0])
    assert tok.decode([ids[j]]).strip() == token  # the closing delimiter token ...
    assert int(f.n_kept[0]) == j  # ... and the last pooled state h_{j-1} predicts it
    assert not f.truncated[0] and not f.missing_delimiter[0]
    # the same answer followed by text (and a full chat suffix) still ends at that brace: not an offset from the end
    for suffix in (" Thanks.", "<|end|>\n"):
        g = E.prompt_completion_features(model, tok, [prompt], [completion + suffix])
        assert int(g.delimiter_index[0]) == j
        np.testing.assert_allclose(g.embeddings, f.embeddings, atol=1e-6)
    full = E.chat_text(tok, DOCS[0], system=SYSTEM, prompt_template=TEMPLATE, completion=completion)
    assert full.startswith(prompt + completion) and full.endswith("<|end|>\n<|endoftext|>")
    h = E.document_features(model, tok, [full], [(len(prompt), len(prompt) + len(completion))])
    assert int(h.delimiter_index[0]) == j
    np.testing.assert_allclose(h.embeddings, f.embeddings, atol=1e-6)


def test_last_of_several_delimiters_and_token_lists(lm):
    model, tok = lm
    prompt = E.chat_text(tok, DOCS[1])
    completion = '{"a": {"b": 1}, "sentiment": "negative"}'
    f = E.prompt_completion_features(model, tok, [prompt], [completion])
    ids = E.encode(tok, prompt + completion)
    j = int(f.delimiter_index[0])
    assert "}" in tok.decode([ids[j]]) and "}" not in tok.decode(ids[j + 1 :])
    assert tok.decode(ids[:j]).count("}") == prompt.count("}") + 1
    # token lists with a token span give the same result
    n_prompt = len(E.encode(tok, prompt))
    assert ids[:n_prompt] == E.encode(tok, prompt)
    g = E.document_features(model, tok, [ids], [(n_prompt, None)])
    assert int(g.delimiter_index[0]) == j
    np.testing.assert_allclose(g.embeddings, f.embeddings, atol=1e-6)


def test_position_last_and_truncation(phi3):
    model, tok = phi3
    ps = prompts(tok)
    last = E.document_features(model, tok, ps, position="last")
    np.testing.assert_array_equal(last.n_kept, [len(E.encode(tok, p)) for p in ps])
    f = E.prompt_completion_features(model, tok, ps, COMPLETIONS)
    cut = int(f.n_kept.min()) - 3
    t = E.prompt_completion_features(model, tok, ps, COMPLETIONS, max_length=cut, batch_size=2)
    assert t.truncated.all() and (t.n_kept == cut).all()
    h = np.array(E.hidden_states(model, [E.encode(tok, ps[2] + COMPLETIONS[2])]))[0]
    np.testing.assert_allclose(t.embeddings[2], E.pool_hidden(h, cut), atol=1e-5)
    assert (t.delimiter_index == f.delimiter_index).all()  # the delimiter was found, just beyond the cut


def test_missing_delimiter_policies(phi3):
    model, tok = phi3
    prompt = E.chat_text(tok, DOCS[0])
    with pytest.raises(E.DocumentError, match="no closing delimiter"):
        E.prompt_completion_features(model, tok, [prompt, prompt], ['{"x": 1}', "positive"])
    n_prompt = len(E.encode(tok, prompt))
    n_all = len(E.encode(tok, prompt + "positive"))
    p = E.prompt_completion_features(model, tok, [prompt], ["positive"], on_missing="prompt")
    assert p.missing_delimiter[0] and int(p.n_kept[0]) == n_prompt
    q = E.prompt_completion_features(model, tok, [prompt], ["positive"], on_missing="last")
    assert int(q.n_kept[0]) == n_all


def test_generated_states_reuse(phi3):
    """Use (b): pooled states of prompt + generated tokens == force-decoded features of the same tokens."""
    model, tok = phi3
    prompt_ids = E.encode(tok, E.chat_text(tok, DOCS[3], system=SYSTEM))
    gen = E.encode(tok, '{"sentiment": "positive"}<|end|>')
    gen = gen[1:] if gen[0] == tok.bos_token_id else gen
    n, info = E.generated_n_kept(tok, len(prompt_ids), gen)
    assert "}" in tok.decode([gen[n - len(prompt_ids)]]) and info["delimiter_index"] == n
    h = np.array(E.hidden_states(model, [prompt_ids + gen]))[0]
    f = E.document_features(model, tok, [prompt_ids + gen], [(len(prompt_ids), None)])
    assert int(f.n_kept[0]) == n
    np.testing.assert_allclose(E.pool_hidden(h, n), f.embeddings[0], atol=1e-5)
    n2, info2 = E.generated_n_kept(tok, len(prompt_ids), E.encode(tok, "no json here"))
    assert n2 == len(prompt_ids) and info2["missing_delimiter"]
    n3, info3 = E.generated_n_kept(tok, len(prompt_ids), gen, max_length=10)
    assert n3 == 10 and info3["truncated"]


def test_chat_text(phi3):
    _, tok = phi3
    t = E.chat_text(tok, "DOC", system="SYS", prompt_template='Say {"x": str}. TEXT: {document}')
    assert t == '<|system|>\nSYS<|end|>\n<|user|>\nSay {"x": str}. TEXT: DOC<|end|>\n<|assistant|>\n'
    assert E.chat_text(tok, "DOC", use_chat_template=False) == "DOC"
    with pytest.raises(ValueError, match="document"):
        E.chat_text(tok, "DOC", prompt_template="no slot")
    with pytest.raises(FileNotFoundError):
        E.load_model("./no/such/model")


# ----------------------------------------------------------------------------- CLI


def _write_docs(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _rows():
    return [{"id": f"d{i}", "label": i % 2, "document": d, "completion": c, "meta": {"k": i}}
            for i, (d, c) in enumerate(zip(DOCS, COMPLETIONS))]


def _embed(model_path, inp, out, *extra):
    return main(["embed", "--model", model_path, "--input", str(inp), "--output", str(out),
                 "--completion-field", "completion", "--system", SYSTEM, "--prompt-template", TEMPLATE,
                 "--batch-size", "2", "--quiet", *extra])


def _read(path):
    return {r["id"]: r for r in map(json.loads, path.read_text(encoding="utf-8").splitlines())}


def test_cli_embed_and_resume(tmp_path, tiny_phi3_path, phi3, capsys):
    inp, out = tmp_path / "docs.jsonl", tmp_path / "feats.jsonl"
    _write_docs(inp, _rows())
    assert _embed(tiny_phi3_path, inp, out) == 0
    full = _read(out)
    assert list(full) == [f"d{i}" for i in range(5)]
    r = full["d2"]
    assert r["label"] == 0 and r["meta"] == {"k": 2} and r["completion"] == COMPLETIONS[2]
    assert len(r["embedding"]) == 128
    model, tok = phi3
    ref = E.prompt_completion_features(model, tok, prompts(tok), COMPLETIONS)
    np.testing.assert_allclose(np.array([full[f"d{i}"]["embedding"] for i in range(5)]), ref.embeddings, atol=1e-5)

    # interrupted run: two complete rows and half of the third
    lines = out.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text(lines[0] + lines[1] + lines[2][: len(lines[2]) // 2], encoding="utf-8")
    capsys.readouterr()
    assert main(["embed", "--model", tiny_phi3_path, "--input", str(inp), "--output", str(out),
                 "--completion-field", "completion", "--system", SYSTEM, "--prompt-template", TEMPLATE]) == 0
    err = capsys.readouterr().err
    assert "partially written" in err and "line 3" in err and "2 of 5" in err
    resumed = _read(out)
    assert list(resumed) == list(full)
    for k in full:
        np.testing.assert_allclose(resumed[k]["embedding"], full[k]["embedding"], atol=1e-5)
    # nothing left to do
    assert _embed(tiny_phi3_path, inp, out) == 0 and _read(out).keys() == full.keys()


def test_cli_embed_prompt_field_and_position_last(tmp_path, tiny_qwen2_path, qwen2):
    model, tok = qwen2
    rows = [{"id": i, "prompt": p} for i, p in enumerate(prompts(tok))]
    inp, out = tmp_path / "p.jsonl", tmp_path / "f.jsonl"
    _write_docs(inp, rows)
    assert main(["embed", "--model", tiny_qwen2_path, "--input", str(inp), "--output", str(out),
                 "--prompt-field", "prompt", "--max-length", "12", "--quiet"]) == 0
    got = np.array([r["embedding"] for r in _read(out).values()])
    ref = E.document_features(model, tok, [r["prompt"] for r in rows], position="last", max_length=12)
    np.testing.assert_allclose(got, ref.embeddings, atol=1e-5)


def test_cli_embed_errors(tmp_path, tiny_phi3_path, capsys):
    inp, out = tmp_path / "docs.jsonl", tmp_path / "feats.jsonl"
    inp.write_text('{"id": 1, "document": "ok", "completion": "{}"}\n{"id": 2, "document": \n', encoding="utf-8")
    assert _embed(tiny_phi3_path, inp, out) == 2
    assert ":2: malformed JSON" in capsys.readouterr().err

    _write_docs(inp, [{"id": 1, "document": "a", "completion": "{}"}, {"id": 1, "document": "b", "completion": "{}"}])
    assert _embed(tiny_phi3_path, inp, out) == 2
    assert ":2: duplicate id 1" in capsys.readouterr().err

    _write_docs(inp, [{"id": 1, "document": "a", "completion": "{}"}, {"id": 2, "text": "b", "completion": "{}"}])
    assert _embed(tiny_phi3_path, inp, out) == 2
    assert "line 2: missing or non-string field 'document'" in capsys.readouterr().err

    _write_docs(inp, [{"id": 1, "document": "a", "completion": '{"sentiment": "negative"}'},
                      {"id": "x", "document": "b", "completion": "positive"}])
    assert _embed(tiny_phi3_path, inp, out) == 2
    assert "line 2 (id 'x'): no closing delimiter" in capsys.readouterr().err

    assert main(["embed", "--model", tiny_phi3_path, "--input", str(inp), "--output", str(out),
                 "--position", "delimiter"]) == 2
    assert "--completion-field" in capsys.readouterr().err
    assert main(["embed", "--input", str(inp), "--output", str(out)]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["embed", "--model", tiny_phi3_path, "--input", str(tmp_path / "nope.jsonl"), "--output", str(out)]) == 2
    assert "input file not found" in capsys.readouterr().err

    out.write_text('{"id": 1, "embedding": [0.5]}\nnot json\n{"id": 3, "embedding": [1]}\n', encoding="utf-8")
    assert _embed(tiny_phi3_path, inp, out) == 2
    assert "existing output line 2" in capsys.readouterr().err


def test_incremental_states_with_cache_match_full_forward(qwen2):
    """Generation-time states (prompt prefill + one token at a time through a KV cache) equal the full forward."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = qwen2
    prompt_ids = E.encode(tok, E.chat_text(tok, DOCS[0]))
    gen = E.encode(tok, '{"sentiment": "positive"}')
    cache = make_prompt_cache(model)
    parts = [E.hidden_states(model, [prompt_ids], cache=cache)[0]]
    for t in gen:
        parts.append(E.hidden_states(model, [[t]], cache=cache)[0])
    inc = np.concatenate([np.array(p) for p in parts])
    full = np.array(E.hidden_states(model, [prompt_ids + gen]))[0]
    np.testing.assert_allclose(inc, full, atol=1e-5)


def test_prompt_tail_and_foreign_prompt_warning(tmp_path, tiny_phi3_path, phi3, capsys):
    """Prompts built for another chat template (e.g. Phi-3.5 rows embedded with Qwen) are named, not silently used."""
    _, tok = phi3
    assert E.prompt_tail(tok) == "<|end|>\n<|assistant|>\n"
    chatml = "<|im_start|>user\nIs water wet?<|im_end|>\n<|im_start|>assistant\n"
    rows = [{"id": "own", "prompt": prompts(tok)[0], "completion": COMPLETIONS[0]},
            {"id": "chatml", "prompt": chatml, "completion": COMPLETIONS[0]}]
    inp, out = tmp_path / "p.jsonl", tmp_path / "f.jsonl"
    _write_docs(inp, rows)
    assert main(["embed", "--model", tiny_phi3_path, "--input", str(inp), "--output", str(out),
                 "--prompt-field", "prompt", "--completion-field", "completion", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 prompt(s) in field 'prompt' do not end with this model's chat template tail " \
           "'<|end|>\\n<|assistant|>\\n' (e.g. ids 'chatml')" in err
    assert "make-verification-data --model" in err
    assert len(_read(out)) == 2  # still embedded: a warning, not an error
    # prompts of the model's own template: no warning
    out2 = tmp_path / "f2.jsonl"
    _write_docs(inp, rows[:1])
    assert main(["embed", "--model", tiny_phi3_path, "--input", str(inp), "--output", str(out2),
                 "--prompt-field", "prompt", "--completion-field", "completion", "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err


def _unshared_reference(model, seqs, first=None):
    """Features computed the way 052b975 did: every row's full (cut) sequence through the trunk on its own."""
    first = [0] * len(seqs) if first is None else first
    out = []
    for s, f in zip(seqs, first):
        h = np.array(E.hidden_states(model, [s]))[0]
        out.append(np.concatenate([h[f:].mean(0), h[-1]]))
    return np.array(out, dtype=np.float32)


def test_shared_prefix_runs_once_and_features_equal_unshared(lm, monkeypatch):
    """The common token prefix of a call is prefilled once (its keys and values broadcast over each batch); only
    each row's own tokens run, and the features equal a full forward of every row within 1e-4 relative."""
    model, tok = lm
    ps = prompts(tok)
    seqs = [E.encode(tok, p + c) for p, c in zip(ps, COMPLETIONS)]
    shared = E.common_prefix_length(seqs)
    assert shared > 10 and all(s[:shared] == seqs[0][:shared] for s in seqs)
    widths = []
    real_trunk_call = E.hidden_states

    def spy(model_, batch, cache=None, pad_id=0):
        widths.append((len(batch) if not hasattr(batch, "shape") else batch.shape[0],
                       max(map(len, batch)) if isinstance(batch, list) else batch.shape[-1], cache is not None))
        return real_trunk_call(model_, batch, cache=cache, pad_id=pad_id)

    import sdm_mlx.llm.model as M

    monkeypatch.setattr(E, "hidden_states", spy)
    monkeypatch.setattr(M, "hidden_states", spy)  # the prefix pass (run_shared_prefix lives in llm/model.py)
    f = E.prompt_completion_features(model, tok, ps, COMPLETIONS, batch_size=2)
    monkeypatch.undo()
    kept = [s[:n] for s, n in zip(seqs, f.n_kept)]
    assert widths[0] == (1, shared, True)  # the prefix, once
    assert all(c and w <= max(map(len, kept)) - shared for _, w, c in widths[1:])  # then only own tokens
    assert len(widths) == 1 + 3
    ref = _unshared_reference(model, kept)
    scale = np.abs(ref).max()
    assert np.abs(f.embeddings - ref).max() <= 1e-4 * scale
    # a call with one document runs all but its last token as the prefix: the same features
    one = E.prompt_completion_features(model, tok, ps[2:3], COMPLETIONS[2:3])
    assert np.abs(one.embeddings[0] - ref[2]).max() <= 1e-4 * scale


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_prefix_caches_equal_a_kv_cache_holding_the_prefix(arch, tiny_qwen2_path, tiny_llama_path):
    """One forward pass of right-padded own-token rows on :func:`prefix_caches` (the prefix's keys and values
    broadcast, the rows' own appended) gives the states of mlx-lm's ``KVCache`` holding the repeated prefix."""
    from mlx_lm.models.cache import KVCache

    model, tok = E.load_model({"qwen2": tiny_qwen2_path, "llama": tiny_llama_path}[arch])
    seqs = [E.encode(tok, p + c) for p, c in zip(prompts(tok), COMPLETIONS)][:3]
    shared = E.common_prefix_length(seqs)
    prefix = E.run_shared_prefix(model, seqs[0][:shared])
    own = [s[shared:] for s in seqs]
    caches = E.prefix_caches(prefix)
    got = E.hidden_states(model, own, cache=caches)
    assert all(c.offset == shared + max(map(len, own)) for c in caches)
    reference = []
    for k, v in zip(prefix.keys, prefix.values):
        c = KVCache()
        c.update_and_fetch(mx.repeat(k, len(own), axis=0), mx.repeat(v, len(own), axis=0))
        reference.append(c)
    want = E.hidden_states(model, own, cache=reference)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    assert E.prefix_caches(prefix)[0].make_mask(4) == "causal"  # mlx-lm's mask for a pass of several tokens


def test_shared_prefix_with_truncation_and_short_rows(phi3):
    """Rows cut by max_length or shorter than the common prefix keep at least one own token."""
    model, tok = phi3
    ps = prompts(tok)
    f = E.prompt_completion_features(model, tok, ps, COMPLETIONS)
    cut = int(E.common_prefix_length([E.encode(tok, p) for p in ps])) - 2
    t = E.prompt_completion_features(model, tok, ps, COMPLETIONS, max_length=cut, batch_size=3)
    seqs = [E.encode(tok, p + c)[:cut] for p, c in zip(ps, COMPLETIONS)]
    np.testing.assert_allclose(t.embeddings, _unshared_reference(model, seqs), rtol=0, atol=1e-5)
    mixed = E.document_features(model, tok, ["hi"] + [p + c for p, c in zip(ps, COMPLETIONS)], position="last")
    seqs = [E.encode(tok, "hi")] + [E.encode(tok, p + c) for p, c in zip(ps, COMPLETIONS)]
    np.testing.assert_allclose(mixed.embeddings, _unshared_reference(model, seqs), atol=1e-5)
    assert f.pooling == "all" and (f.pooled_from == 0).all()


def test_non_shared_pooling(lm):
    """pooling="non-shared": the mean leaves out the prompt prefix every row shares; the state half is unchanged."""
    model, tok = lm
    ps = prompts(tok)
    f = E.prompt_completion_features(model, tok, ps, COMPLETIONS)
    g = E.prompt_completion_features(model, tok, ps, COMPLETIONS, pooling="non-shared", batch_size=2)
    seqs = [E.encode(tok, p + c)[:n] for p, c, n in zip(ps, COMPLETIONS, f.n_kept)]
    shared = E.common_prefix_length(seqs)
    assert g.pooling == "non-shared" and g.shared_prefix == seqs[0][:shared]
    assert (g.pooled_from == shared).all()
    np.testing.assert_allclose(g.embeddings, _unshared_reference(model, seqs, [shared] * 5), atol=1e-5)
    D = f.embeddings.shape[1] // 2
    np.testing.assert_allclose(g.embeddings[:, D:], f.embeddings[:, D:], atol=1e-5)
    assert np.abs(g.embeddings[:, :D] - f.embeddings[:, :D]).max() > 1e-3
    # one document at a time, with the recorded shared prefix: the same features (batch-independent)
    for i in (0, 3):
        h = E.prompt_completion_features(model, tok, [ps[i]], [COMPLETIONS[i]], pooling="non-shared",
                                         shared_prefix=g.shared_prefix)
        np.testing.assert_allclose(h.embeddings[0], g.embeddings[i], atol=1e-5)
    with pytest.raises(E.InputError, match="pooling"):
        E.prompt_completion_features(model, tok, ps, COMPLETIONS, pooling="median")


def test_pool_states_is_the_one_pooling():
    h = np.random.default_rng(0).normal(size=(3, 7, 4)).astype(np.float32)
    out = np.array(E.pool_states(h, [7, 3, 5], [0, 1, 4]))
    for i, (n, f) in enumerate([(7, 0), (3, 1), (5, 4)]):
        np.testing.assert_allclose(out[i], np.concatenate([h[i, f:n].mean(0), h[i, n - 1]]), atol=1e-6)
        np.testing.assert_allclose(E.pool_hidden(h[i], n, f), out[i], atol=1e-6)
    with pytest.raises(E.InputError):
        E.pool_hidden(h[0], 3, 3)


def test_cli_embed_pooling_non_shared_records_its_prefix(tmp_path, tiny_phi3_path, phi3):
    """`sdm-mlx embed --pooling non-shared` (a subprocess): the shared prefix is that of the whole input, recorded
    in OUTPUT.features.json; a resumed run pools the same way; other settings on the same output are refused."""
    import subprocess
    import sys

    inp, out = tmp_path / "docs.jsonl", tmp_path / "feats.jsonl"
    _write_docs(inp, _rows())
    cmd = [sys.executable, "-m", "sdm_mlx", "embed", "--model", tiny_phi3_path, "--input", str(inp),
           "--output", str(out), "--completion-field", "completion", "--system", SYSTEM,
           "--prompt-template", TEMPLATE, "--batch-size", "2", "--quiet"]
    assert subprocess.run(cmd + ["--pooling", "non-shared"], capture_output=True, text=True).returncode == 0
    spec = json.loads((tmp_path / "feats.jsonl.features.json").read_text())
    model, tok = phi3
    ps = prompts(tok)
    ref = E.prompt_completion_features(model, tok, ps, COMPLETIONS, pooling="non-shared")
    assert spec["pooling"] == "non-shared" and spec["shared_prefix_ids"] == ref.shared_prefix
    assert spec["shared_prefix_text"] == tok.decode(ref.shared_prefix) and spec["position"] == "delimiter"
    got = _read(out)
    np.testing.assert_allclose(np.array([got[f"d{i}"]["embedding"] for i in range(5)]), ref.embeddings, atol=1e-5)
    # resume after losing the last three rows: they are pooled with the recorded (whole-input) prefix
    lines = out.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text("".join(lines[:2]), encoding="utf-8")
    assert subprocess.run(cmd + ["--pooling", "non-shared"], capture_output=True, text=True).returncode == 0
    again = _read(out)
    np.testing.assert_allclose(np.array([again[f"d{i}"]["embedding"] for i in range(5)]), ref.embeddings, atol=1e-5)
    # the same output with the paper's pooling: refused, exit 2, naming the fix
    (tmp_path / "more.jsonl").write_text(inp.read_text() + json.dumps(
        {"id": "d9", "document": "Fine.", "completion": COMPLETIONS[0]}) + "\n")
    bad = subprocess.run([c if c != str(inp) else str(tmp_path / "more.jsonl") for c in cmd] + ["--pooling", "all"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "(pooling, " in bad.stderr and "use another --output" in bad.stderr


def test_feature_parts_max_mean_last():
    """``parts`` adds the element-wise max over the mean's positions, concatenated in FEATURE_PARTS order; the
    default stays concat(mean, last) (DESIGN #21); a bad or repeated part is an InputError naming the choices."""
    h = np.random.default_rng(1).normal(size=(3, 7, 4)).astype(np.float32)
    out = np.array(E.pool_states(h, [7, 3, 5], [0, 1, 4], ("max", "mean", "last")))
    for i, (n, f) in enumerate([(7, 0), (3, 1), (5, 4)]):
        want = np.concatenate([h[i, f:n].max(0), h[i, f:n].mean(0), h[i, n - 1]])
        np.testing.assert_allclose(out[i], want, atol=1e-6)
        np.testing.assert_allclose(E.pool_hidden(h[i], n, f, parts=("max", "mean", "last")), want, atol=1e-6)
    assert E.check_feature_parts("last, max") == ("max", "last")
    for bad in ("", "median", "mean,mean", ["max", "sum"]):
        with pytest.raises(E.InputError, match="feature parts"):
            E.check_feature_parts(bad)


def test_feature_parts_through_embed_and_the_decode_engine(phi3):
    """The force-decoded path and the batched decoder's features carry the same parts: their mean+last columns
    are the default features (same computation, so equal to float32 rounding of the max's extra reduction)."""
    from sdm_mlx.decoding import DecodeEngine, DecodeRequest

    model, tok = phi3
    ps = prompts(tok)
    full = E.prompt_completion_features(model, tok, ps, COMPLETIONS, parts="max,mean,last").embeddings
    base = E.prompt_completion_features(model, tok, ps, COMPLETIONS).embeddings
    d = base.shape[1] // 2
    assert full.shape == (len(ps), 3 * d)
    np.testing.assert_allclose(full[:, d:], base, atol=1e-5)
    ids = [E.encode(tok, p) for p in ps[:3]]
    eng = DecodeEngine(model, tok, max_batch=3)
    three = eng.run([DecodeRequest(i, 4, features=True, feature_parts=("max", "mean", "last")) for i in ids])
    two = eng.run([DecodeRequest(i, 4, features=True) for i in ids])
    for a, b in zip(three, two):
        if a.token_ids == b.token_ids:  # two decodings: a greedy token may differ by float drift
            np.testing.assert_allclose(np.asarray(a.features)[0, d:], np.asarray(b.features)[0], atol=1e-5)
        assert np.asarray(a.features).shape == (1, 3 * d)
    with pytest.raises(E.InputError, match="order"):
        eng.run([DecodeRequest(ids[0], 2, features=True, feature_parts=("last", "max"))])
