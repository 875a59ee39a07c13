"""Wire format of ``sdm-mlx serve``: request validation and OpenAI-style error objects.

Requests are parsed by hand (not by a schema library) so that every problem
becomes an OpenAI error object naming the offending field in ``param``::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Accepted fields (as ``mlx_lm.server`` / the OpenAI API where they apply):

=====================  ===========================================================
``model``              optional; must be the served model's id (else 404)
``messages``           chat: list of ``{"role": system|developer|user|assistant, "content": str
                       or [{"type": "text", "text": str}, ...]}`` (``developer`` is the
                       OpenAI API's newer name for ``system`` and is rendered as one)
``prompt``             completions: a string (or a list holding one string)
``max_tokens``         int >= 1 (``max_completion_tokens`` is an alias); default: the server's
``temperature``        number in [0, 2] (0 = greedy, the default; with a head: sampled from the
                       joint neg+pos SDM output, see docs/verified-generation.md)
``top_p``, ``top_k``,   nucleus (0, 1], top-k (0: off), min-p [0, 1] filters, as mlx_lm.server
``min_p``
``seed``               int >= 0: the request's own random stream (same seed, same text)
``repetition_penalty`` number >= 0 (0: off), multiplicative, over the last ``repetition_context_size``
                       tokens (default 20; 0: all), as mlx_lm.server
``presence_penalty``,  numbers, additive: subtracted once (presence) or once per occurrence
``frequency_penalty``  (frequency) from the logits of the last ``presence_context_size`` /
                       ``frequency_context_size`` tokens (default 20; 0: all)
``logit_bias``         ``{"token id": bias in [-100, 100]}`` added to the logits
``xtc_probability``,   XTC on draws (temperature > 0): with this probability the tokens above
``xtc_threshold``      the threshold ([0, 0.5], default 0.1) but the least likely are removed
``logprobs``,          bool; 0..20 alternatives per token (``choices[0].logprobs``, and each
``top_logprobs``       streamed chunk's for its tokens); completions also take the legacy
                       integer ``logprobs`` (that many alternatives)
``stop``               a string or a list of up to 4 non-empty strings
``stream``             bool; ``stream_options.include_usage`` adds usage to the last chunk
``chat_template_kwargs`` chat: an object of variables for the model's chat template (e.g.
                       ``{"enable_thinking": false}``), as mlx_lm.server; the names of
                       ``apply_chat_template``'s own arguments are refused
``response_format``    ``{"type": "text"}`` only (the default; no constrained decoding)
``n``                  1 only; ``user`` is accepted and not used; ``tools`` only empty (no tool
                       calling: a verified answer is text)
``sdm``                ``{"on_reject": "abstain"|"reask"|"return", "max_attempts": int >= 1}``
=====================  ===========================================================

Any other field is rejected (400) rather than silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..decoding.sampling import GREEDY, MAX_LOGIT_BIAS, MAX_SEED, SamplingParams
from ..errors import InputError
from ..verified.config import ON_REJECT
from ..llm.tokens import check_template_kwargs

ROLES = ("system", "developer", "user", "assistant")
MAX_STOP = 4
#: longest stop string accepted (a stop string's length is text held back while streaming)
MAX_STOP_CHARS = 256
#: most attempts a request may ask for (``sdm.max_attempts``)
MAX_ATTEMPTS_LIMIT = 16
#: deepest JSON nesting accepted in a request body (the valid requests need 4 levels)
MAX_DEPTH = 32
SAMPLING_FIELDS = {"top_p", "top_k", "min_p", "seed", "repetition_penalty", "repetition_context_size",
                   "presence_penalty", "presence_context_size", "frequency_penalty", "frequency_context_size",
                   "logit_bias", "xtc_probability", "xtc_threshold", "logprobs", "top_logprobs"}
_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "stop", "stream", "stream_options", "n",
           "user", "seed", "sdm", "response_format"} | SAMPLING_FIELDS
CHAT_FIELDS = _COMMON | {"messages", "tools", "chat_template_kwargs"}
TEXT_FIELDS = _COMMON | {"prompt"}
VERIFY_FIELDS = {"model", "messages", "prompt", "completion", "user"}


class APIError(Exception):
    """An HTTP error with an OpenAI-style body (``status``, ``message``, ``type``, ``param``, ``code``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": _printable(self.message), "type": self.type, "param": _printable(self.param),
                          "code": self.code}}


def _printable(text: str | None) -> str | None:
    """``text`` encodable as UTF-8 (a client's lone surrogate echoed in a message becomes ``\\udXXX``)."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class GenerationRequest:
    """A validated chat or text completion request."""

    kind: str                       # "chat" | "text"
    messages: list | None = None    # chat
    prompt: str | None = None       # text
    model: str | None = None
    max_tokens: int | None = None
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    on_reject: str | None = None
    max_attempts: int | None = None
    chat_template_kwargs: dict | None = None  #: variables for the chat template (chat requests)
    prompt_ids: list | None = None  #: the prompt's token ids, once the server has made them
    sampling: SamplingParams = field(default_factory=SamplingParams)  #: temperature, top_p, …, seed, logprobs

    @property
    def temperature(self) -> float:
        return self.sampling.temperature


@dataclass
class VerifyRequest:
    """A validated ``/v1/verify`` request: ``messages`` or ``prompt``, and the ``completion`` to verify."""

    completion: str
    messages: list | None = None
    prompt: str | None = None
    model: str | None = None


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object (400 ``invalid_json`` otherwise: not UTF-8, not JSON, nested
    deeper than :data:`MAX_DEPTH`, or holding a string that is not Unicode text — a lone surrogate)."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise bad(f"request body is not UTF-8 (invalid byte at position {e.start})", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise bad(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                  code="invalid_json") from None
    except RecursionError:
        raise bad(f"request body is nested too deeply (more than {MAX_DEPTH} levels)", code="invalid_json") from None
    except ValueError as e:  # e.g. an integer literal beyond Python's digit limit
        raise bad(f"request body is not acceptable JSON: {str(e)[:120]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object", code="invalid_json")
    check_values(body)
    return body


def _no_constant(name: str):
    raise bad(f"request body is not valid JSON: {name} is not a JSON number (RFC 8259)", code="invalid_json")


def check_values(body: dict) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` and strings with lone surrogates (iteratively: no recursion)."""
    stack = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad(f"request body is nested too deeply (more than {MAX_DEPTH} levels at {where or 'the top'})",
                      param=_top(where), code="invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            path = f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else str(key))
            for text in ((key, item) if isinstance(key, str) else (item,)):
                if isinstance(text, str) and not _is_text(text):
                    raise bad(f"{path} holds a lone surrogate (\\ud800-\\udfff escape): not Unicode text",
                              param=path, code="invalid_json")
            if isinstance(item, (dict, list)):
                stack.append((item, path, depth + 1))


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _top(where: str) -> str | None:
    return where.split("[", 1)[0].split(".", 1)[0] or None


def shown(v, limit: int = 60) -> str:
    """A short JSON rendering of a client's value for an error message (never long, never recursive)."""
    if isinstance(v, (dict, list)):
        return f"a JSON {'object' if isinstance(v, dict) else 'array'}"
    try:
        text = json.dumps(v, ensure_ascii=True)
    except ValueError:
        return "a number too large to show"
    return text if len(text) <= limit else text[:limit] + "…"


def _check_fields(body: dict, allowed: set) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        names = ", ".join(shown(k, 40) for k in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise bad(f"unsupported field(s): {names} (supported: {', '.join(sorted(allowed))})",
                  param=unknown[0][:80], code="unsupported_field")


def _int(body: dict, key: str, minimum: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise bad(f"'{key}' must be an integer >= {minimum}, got {shown(v)}", param=key)
    return v


def _bool(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean, got {shown(v)}", param=key)
    return v


def _model(body: dict) -> str | None:
    v = body.get("model")
    if v is not None and not isinstance(v, str):
        raise bad("'model' must be a string", param="model")
    return v


def _content(content, where: str) -> str:
    """Message content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": str}}",
                          param=f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def parse_messages(value) -> list:
    """``[{"role", "content"}]`` with string contents; at least one user message."""
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with 'role' and 'content'", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {shown(role)}", param=f"{where}.role")
        if "content" not in m or m["content"] is None:
            raise bad(f"{where} has no content", param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m["content"], where)})
    if not any(m["role"] == "user" for m in out):
        raise bad("'messages' must contain a user message", param="messages")
    return out


def parse_prompt(value) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        raise bad("'prompt' must be a non-empty string (batches of prompts are not supported)", param="prompt")
    return value


def _stop(value) -> list:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOP
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} non-empty strings of at most "
                  f"{MAX_STOP_CHARS} characters", param="stop")
    return list(stops)


def _policy(value) -> tuple[str | None, int | None]:
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise bad("'sdm' must be an object {\"on_reject\": ..., \"max_attempts\": ...}", param="sdm")
    unknown = sorted(set(value) - {"on_reject", "max_attempts"})
    if unknown:
        raise bad(f"unsupported sdm option(s): {', '.join(shown(k, 40) for k in unknown[:5])} (supported: "
                  "on_reject, max_attempts)", param=f"sdm.{unknown[0][:80]}")
    on_reject = value.get("on_reject")
    if on_reject is not None and on_reject not in ON_REJECT:
        raise bad(f"sdm.on_reject must be one of {', '.join(ON_REJECT)}, got {shown(on_reject)}",
                  param="sdm.on_reject")
    max_attempts = _int(value, "max_attempts", 1)
    if max_attempts is not None and max_attempts > MAX_ATTEMPTS_LIMIT:
        raise bad(f"sdm.max_attempts must be at most {MAX_ATTEMPTS_LIMIT}, got {max_attempts}",
                  param="sdm.max_attempts")
    return on_reject, max_attempts


def parse_generation(body: dict, kind: str, defaults: SamplingParams = GREEDY) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` (``kind="chat"``) or ``/v1/completions`` (``"text"``) body; the
    sampling fields it leaves out are ``defaults``'s (the server's ``--temp``, ``--top-p`` ...)."""
    _check_fields(body, CHAT_FIELDS if kind == "chat" else TEXT_FIELDS)
    req = GenerationRequest(kind=kind, model=_model(body))
    if kind == "chat":
        req.messages = parse_messages(body.get("messages"))
    else:
        req.prompt = parse_prompt(body.get("prompt"))
    req.max_tokens = _int(body, "max_tokens", 1)
    alias = _int(body, "max_completion_tokens", 1)
    req.max_tokens = alias if req.max_tokens is None else req.max_tokens
    req.stop = _stop(body.get("stop"))
    req.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or not set(opts) <= {"include_usage"}:
            raise bad("'stream_options' must be {\"include_usage\": bool}", param="stream_options")
        req.include_usage = _bool(opts, "include_usage")
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise bad("only n = 1 is supported", param="n")
    req.chat_template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    form = body.get("response_format")
    if form is not None and form != {"type": "text"}:
        raise bad("only response_format {\"type\": \"text\"} is supported (no constrained decoding; the verifier "
                  "checks the answer the model writes)", param="response_format", code="unsupported_field")
    if body.get("tools") not in (None, []):
        raise bad("tool calling is not supported: a verified answer is text ('tools' may only be empty)",
                  param="tools", code="unsupported_field")
    req.on_reject, req.max_attempts = _policy(body.get("sdm"))
    _sampling(body, req, defaults)
    return req


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low < v if low_open else low <= v) or v > high:
        raise bad(f"'{key}' must be a number in {'(' if low_open else '['}{low}, {high}], got {json.dumps(v)}",
                  param=key)
    return float(v)


def _sampling(body: dict, req: GenerationRequest, defaults: SamplingParams) -> None:
    """The sampling fields mlx_lm.server honours (see the table above), as the request's :class:`SamplingParams`;
    a field the request leaves out (or sends as null) is the server's (``defaults``: ``serve --temp`` ...)."""
    t = body.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 2):
        raise bad(f"'temperature' must be a number in [0, 2], got {shown(t)}", param="temperature")
    top = _int(body, "top_logprobs", 0)
    if top is not None and top > 20:
        raise bad(f"'top_logprobs' must be an integer in [0, 20], got {top}", param="top_logprobs")
    legacy = body.get("logprobs")
    if req.kind == "text" and isinstance(legacy, int) and not isinstance(legacy, bool):
        if not 0 <= legacy <= 20:  # the completions API's form: logprobs = how many alternatives
            raise bad(f"'logprobs' must be a boolean or an integer in [0, 20], got {legacy}", param="logprobs")
        body = {**body, "logprobs": True, "top_logprobs": legacy if top is None else top}
        top = body["top_logprobs"]

    def given(value, name):
        return getattr(defaults, name) if value is None else value

    repetition = _number(body, "repetition_penalty", 0.0, 1e6)
    req.sampling = SamplingParams(
        temperature=given(None if t is None else float(t), "temperature"),
        top_p=given(_number(body, "top_p", 0.0, 1.0, low_open=True), "top_p"),
        top_k=given(_int(body, "top_k", 0), "top_k"),
        min_p=given(_number(body, "min_p", 0.0, 1.0), "min_p"),
        seed=given(_seed(body), "seed"),
        repetition_penalty=given(repetition, "repetition_penalty") or None,  # 0: off, as mlx_lm.server
        repetition_context_size=given(_int(body, "repetition_context_size", 0), "repetition_context_size"),
        presence_penalty=given(_number(body, "presence_penalty", -1e6, 1e6), "presence_penalty"),
        presence_context_size=given(_int(body, "presence_context_size", 0), "presence_context_size"),
        frequency_penalty=given(_number(body, "frequency_penalty", -1e6, 1e6), "frequency_penalty"),
        frequency_context_size=given(_int(body, "frequency_context_size", 0), "frequency_context_size"),
        logit_bias=_logit_bias(body.get("logit_bias")) or defaults.logit_bias,
        xtc_probability=given(_number(body, "xtc_probability", 0.0, 1.0), "xtc_probability"),
        xtc_threshold=given(_number(body, "xtc_threshold", 0.0, 0.5), "xtc_threshold"),
        logprobs=_bool(body, "logprobs") or bool(top),
        top_logprobs=top or 0,
    )


def _seed(body: dict) -> int | None:
    v = _int(body, "seed", 0)
    if v is not None and v > MAX_SEED:
        raise bad(f"'seed' must be an integer in [0, 2**64 - 1], got {shown(v)}", param="seed")
    return v


def _template_kwargs(value) -> dict | None:
    try:
        return check_template_kwargs(value)
    except InputError as e:
        raise bad(str(e), param="chat_template_kwargs") from None


#: most entries of ``logit_bias`` (the OpenAI API's limit)
MAX_LOGIT_BIAS_ENTRIES = 300


def _logit_bias(value) -> tuple:
    """``{"token id": bias}`` as sorted ``((id, bias), ...)``; ids are checked against the vocabulary later."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS_ENTRIES} \"token id\": bias entries",
                  param="logit_bias")
    out = {}
    for k, v in value.items():
        key = k.strip() if isinstance(k, str) else ""
        if not (key.isascii() and key.isdigit()) or len(key) > 9:  # "²".isdigit() but int("²") fails
            raise bad(f"'logit_bias' keys must be token ids (non-negative integers), got {shown(k)}", param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise bad(f"'logit_bias' values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {shown(v)} "
                      f"for token {key}", param="logit_bias")
        out[int(key)] = out.get(int(key), 0.0) + float(v)
    return tuple(sorted(out.items()))


def parse_verify(body: dict) -> VerifyRequest:
    """Validate a ``/v1/verify`` body: exactly one of ``messages`` / ``prompt``, and ``completion``."""
    _check_fields(body, VERIFY_FIELDS)
    if ("messages" in body) == ("prompt" in body):
        raise bad("give exactly one of 'messages' and 'prompt'", param="messages")
    completion = body.get("completion")
    if not isinstance(completion, str) or not completion:
        raise bad("'completion' must be a non-empty string (the answer to verify)", param="completion")
    req = VerifyRequest(completion=completion, model=_model(body))
    if "messages" in body:
        req.messages = parse_messages(body["messages"])
    else:
        req.prompt = parse_prompt(body["prompt"])
    return req
