"""``sdm-mlx serve`` honours the other sampling fields ``mlx_lm.server`` honours, through the official ``openai``
client: ``logit_bias``, ``presence_penalty`` / ``frequency_penalty`` (and their windows), XTC; the ``developer``
role; an empty ``tools``.  Out-of-range values and a bias on a token outside the vocabulary are 400s naming the
field.  The server decodes jointly with the tiny network's positive head (tests/serve/conftest.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")

from verified_lab import reviews  # noqa: E402  (tests/helpers/)


def _ask(client, doc: str, **extra):
    kw = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": doc}], max_tokens=16,
              logprobs=True, extra_body={"sdm": {"on_reject": "return"}, **extra.pop("extra_body", {})})
    return client.chat.completions.create(**{**kw, **extra})


def _text(response) -> str:
    return response.choices[0].message.content


@pytest.fixture(scope="module")
def tokenizer(setup):
    from sdm_mlx.llm.model import load_tokenizer

    return load_tokenizer(setup.model_path)


def _word(tokenizer, avoid: str) -> int:
    """A token that is a plain word of 3+ letters not in ``avoid`` (and decodes to itself when repeated)."""
    return next(t for t in range(5, 5000) if len(w := tokenizer.decode([t]).strip()) >= 3 and w.isalpha()
                and w not in avoid and tokenizer.decode([t] * 3) == tokenizer.decode([t]) * 3)


def test_logit_bias_forces_a_token_and_forbids_one(setup, client, tokenizer):
    doc = reviews(1, seed=61)[0][0]
    plain = _text(_ask(client, doc))
    forced = _word(tokenizer, plain + doc)
    r = _ask(client, doc, logit_bias={str(forced): 100})
    assert _text(r) == tokenizer.decode([forced] * 16) and r.usage.completion_tokens == 16
    starts = [t for t in range(tokenizer.vocab_size) if (d := tokenizer.decode([t])) and plain.startswith(d)]
    assert 0 < len(starts) <= 300
    assert not _text(_ask(client, doc, logit_bias={str(t): -100 for t in starts})).startswith(plain[:1])


def test_presence_and_frequency_penalties_stop_a_forced_token_repeating(setup, client, tokenizer):
    doc = reviews(1, seed=62)[0][0]
    plain = _text(_ask(client, doc))
    forced = _word(tokenizer, plain + doc)
    word = tokenizer.decode([forced])
    bias = {"logit_bias": {str(forced): 100}}
    once = _text(_ask(client, doc, presence_penalty=1000.0, **bias))
    assert once.startswith(word) and once.count(word.strip()) == 1  # present once: penalised from then on
    some = _text(_ask(client, doc, frequency_penalty=30.0, **bias))
    assert some.startswith(word * 2) and some.count(word.strip()) < 16  # each occurrence costs 30
    assert _text(_ask(client, doc, frequency_penalty=0.0, presence_penalty=0.0)) == plain  # 0 changes nothing


def test_seeded_xtc_draws_repeat(setup, client):
    doc = reviews(1, seed=63)[0][0]
    kw = dict(temperature=1.0, seed=5, extra_body={"xtc_probability": 0.5, "xtc_threshold": 0.05})
    first = _ask(client, doc, **kw).choices[0].message.content
    assert _ask(client, doc, **kw).choices[0].message.content == first


def test_developer_role_is_a_system_message(setup, client):
    doc = reviews(1, seed=64)[0][0]
    as_dev = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=12, extra_body={"sdm": {"on_reject": "return"}},
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": doc}])
    as_sys = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=12, extra_body={"sdm": {"on_reject": "return"}},
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": doc}])
    assert as_dev.choices[0].message.content == as_sys.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a superscript digit: isdigit() but not an int
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"3": True}}, "logit_bias"),
    ({"logit_bias": [3]}, "logit_bias"),
    ({"logit_bias": {"3": 250}}, "logit_bias"),
    ({"xtc_threshold": 0.7}, "xtc_threshold"),
    ({"seed": 2**64}, "seed"),  # beyond mx.random.key's uint64: was a 500
    ({"seed": 10**30}, "seed"),
    ({"presence_context_size": -1}, "presence_context_size"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_values_are_400s_naming_the_field(setup, client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, "Hello", extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_an_empty_tools_list_and_a_zero_repetition_penalty_change_nothing(setup, client):
    doc = reviews(1, seed=65)[0][0]
    plain = _text(_ask(client, doc))
    assert _text(_ask(client, doc, tools=[], response_format={"type": "text"},
                      extra_body={"repetition_penalty": 0})) == plain  # mlx_lm.server: 0 is off


def test_chat_template_kwargs_reach_the_template(setup, client, tokenizer):
    from sdm_mlx.verified.prompts import PromptBuilder

    import copy

    themed = copy.deepcopy(tokenizer)
    themed.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                            "{% if style is defined %}<{{ style }}>{% endif %}<assistant>")
    builder = PromptBuilder(themed, system=None, prompt_template=None, use_chat_template=True)
    chat = [{"role": "user", "content": "hi"}]
    assert builder.prompt_text(chat) == "<user>hi<assistant>"
    assert builder.prompt_text(chat, template_kwargs={"style": "terse"}) == "<user>hi<terse><assistant>"
    doc = reviews(1, seed=66)[0][0]  # the served model's template ignores a variable it does not use
    assert _text(_ask(client, doc, extra_body={"chat_template_kwargs": {"enable_thinking": False}})) == \
        _text(_ask(client, doc))


@pytest.mark.parametrize("value", [["x"], {"tokenize": True}, {"chat_template": "{{ 1 }}"}, {"not a name": 1}])
def test_bad_chat_template_kwargs_are_400s(setup, client, value):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, "Hello", extra_body={"chat_template_kwargs": value})
    assert e.value.body["param"] == "chat_template_kwargs", e.value.body


def test_server_sampling_flags_and_template_args_are_the_defaults_a_request_overrides(setup, client):
    """``serve --temp 2 --seed S`` samples the requests that send no temperature (as mlx_lm.server's --temp);
    a request's own fields win; ``--chat-template-args`` reach every prompt (a variable the template ignores)."""
    import signal

    from server_process import ServerProcess, sdm_mlx
    from verified_lab import OOD_PROMPT

    greedy = _text(_ask(client, OOD_PROMPT))
    seed = next(s for s in range(3, 40) if _text(_ask(client, OOD_PROMPT, temperature=2, seed=s)) != greedy)
    srv = ServerProcess(sdm_mlx("serve", "--head", setup.head_dir, "--port", 0, "--quiet", "--temp", "2",
                                "--seed", seed, "--chat-template-args", '{"style": "terse"}'))
    try:
        hot = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        assert _text(_ask(hot, OOD_PROMPT)) == _text(_ask(client, OOD_PROMPT, temperature=2, seed=seed))
        assert _text(_ask(hot, OOD_PROMPT, temperature=0)) == greedy
        assert _text(_ask(hot, OOD_PROMPT, seed=seed + 1)) == _text(_ask(client, OOD_PROMPT, temperature=2,
                                                                         seed=seed + 1))
        assert srv.stop(signal.SIGTERM) == 0
    finally:
        srv.kill()


def test_template_args_of_every_prompt_and_a_request_s_own(tokenizer):
    import copy

    from sdm_mlx.errors import InputError
    from sdm_mlx.verified.config import GenerationConfig
    from sdm_mlx.verified.prompts import PromptBuilder

    themed = copy.deepcopy(tokenizer)
    themed.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                            "{% if style is defined %}<{{ style }}>{% endif %}<assistant>")
    kwargs = GenerationConfig(chat_template_args='{"style": "terse"}').template_kwargs()
    builder = PromptBuilder(themed, system=None, prompt_template=None, use_chat_template=True, template_kwargs=kwargs)
    assert builder.document_text("hi") == "<user>hi<terse><assistant>"  # generate --prompt
    assert builder.prompt_text([{"role": "user", "content": "hi"}], template_kwargs={"style": "long"}) == \
        "<user>hi<long><assistant>"  # a server request's chat_template_kwargs win
    for bad in ("[1]", "{", '{"tokenize": true}'):
        with pytest.raises(InputError, match="chat_template_args"):
            GenerationConfig(chat_template_args=bad).validate()


def test_prompt_ids_made_off_the_model_thread_equal_the_engine_s(setup):
    """The server tokenizes a request's prompt once, on a private tokenizer copy; the ids equal those the model
    thread would make, with the server's chat-template variables and the request's own."""
    import types

    from sdm_mlx.llm import embed as E
    from sdm_mlx.serve.limits import PromptCounter
    from sdm_mlx.verified.generator import VerifiedGenerator

    gen = VerifiedGenerator(setup.model_path, setup.verifier_dir, head_path=setup.head_dir,
                            chat_template_args='{"style": "terse"}')
    counter = PromptCounter(types.SimpleNamespace(tokenizer=gen.tokenizer, prompts=gen.prompts))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": reviews(1, seed=68)[0][0]}]
    for messages, prompt, kwargs in ((chat, None, None), (chat, None, {"style": "long"}), (None, "raw text", None)):
        expected = E.encode(gen.tokenizer, gen.prompts.prompt_text(messages, prompt, kwargs))
        assert counter.prompt_ids(messages, prompt, kwargs) == expected
        assert counter.count(messages, prompt, "", kwargs) == len(expected)


def test_without_a_tokenizer_copy_the_model_thread_counts_the_prompt_and_extra_text_exactly(setup):
    """A tokenizer that cannot be copied: the count (prompt + an answer to verify) is made with the model's own
    tokenizer on the model thread, in tokens (it added the answer's characters before)."""
    import concurrent.futures
    import types

    from sdm_mlx.llm import embed as E
    from sdm_mlx.serve.limits import PromptCounter
    from sdm_mlx.verified.generator import VerifiedGenerator

    gen = VerifiedGenerator(setup.model_path, setup.verifier_dir, head_path=setup.head_dir)
    on_model_thread = []

    def submit(fn, *args):
        on_model_thread.append(fn)
        done = concurrent.futures.Future()
        done.set_result(fn(*args))
        return done

    counter = PromptCounter(types.SimpleNamespace(tokenizer=gen.tokenizer, prompts=gen.prompts, submit=submit))
    counter.tokenizer = None  # as when copy.deepcopy of the tokenizer failed
    chat = [{"role": "user", "content": reviews(1, seed=69)[0][0]}]
    extra = ' {"sentiment": "positive", "reason": "the acting"}'
    expected = E.encode(gen.tokenizer, gen.prompts.prompt_text(chat, None, None) + extra)
    assert counter.count(chat, None, extra) == len(expected) and len(on_model_thread) == 1
    assert counter.count(None, "raw text", extra) == len(E.encode(gen.tokenizer, "raw text" + extra))
