"""The 7-dimensional black-box LLM attribute vector of the paper's GPT-4o / MMLU experiment.

The LLM answers a multiple-choice question with structured output against the
JSON Schema of the paper's Listing "JSON Schema for Structured Outputs" (keys
``answer_letter`` (string), ``confidence_in_answer_letter`` (number),
``short_explanation_for_answer_confidence`` (string)) and returns the top-1 log
probability of every output token.  The vector is (paper, appendix "Black-box
LLM APIs")::

    h = [ p(answer_letter), p(confidence_in_answer_letter), p(short_explanation_for_answer_confidence),
          s_A, s_B, s_C, s_D ]                                                           in R^7

* ``p(key)``: the mean over the tokens of that key's value of the top-1 token
  probability ``exp(logprob)`` ("average of the exponentiated log
  probabilities").  A token belongs to a value if its characters overlap the
  value's characters; for strings the surrounding quotes are excluded (an
  empty string uses the quote tokens), so usually ``p(answer_letter)`` is the
  probability of the single letter token, occasionally averaged with extra
  tokens such as ``$``.  The number's tokens (``0``, ``.``, ``9``) are
  treated alike.
* ``s``: a soft one-hot of length 4 whose entry for the answer letter is the
  verbalised confidence (the parsed number), the others 0.
* A full refusal (``refusal`` set) gives the zero vector.

Input JSONL, one row per question (hand-written example:
``tests/data/api_answers_example.jsonl``)::

    {"id": "q1", "label": "B",                       # int 0..3 or a letter; optional for unlabelled rows
     "response": "{\\"answer_letter\\": \\"B\\", ...}",  # the generated JSON text (message content)
     "logprobs": [{"token": "{\\"", "logprob": -1e-05}, {"token": "answer", "logprob": 0.0}, ...],
     "refusal": null}                                 # optional; non-empty string / true = refusal

``logprobs`` is the list of per-token objects of the OpenAI chat-completions
API (``choices[0].logprobs.content``; the enclosing ``{"content": [...]}`` object
is accepted too).  Each needs ``token`` and ``logprob``; when ``bytes`` is
present it is used to align tokens that split a UTF-8 character.  The tokens
must concatenate to ``response`` (if ``response`` is absent, their
concatenation is the response).

Output rows keep every input field, with ``label`` as an int, and add the
vector in field ``attributes`` by default (the research code's field for this
vector; ``sdm-mlx train --features auto`` uses it, or concatenates it after an
``embedding`` from ``sdm-mlx embed`` of another model when both are present),
the parsed ``predicted_label`` (-1 if none), ``letter_probability`` and
``verbalized_confidence`` (the paper's two baseline estimators).
"""

from __future__ import annotations

import json
import math

from ..errors import InputError

KEYS = ("answer_letter", "confidence_in_answer_letter", "short_explanation_for_answer_confidence")
LETTERS = "ABCD"
_STRIP = " \t\n\r$()[]{}*.:'\"`"


class APIFeatureError(InputError):
    """A malformed answer row (the message names the problem); a user error (``SDMError``, ``ValueError``)."""


def value_spans(text: str) -> dict[str, tuple[int, int, object]]:
    """``key -> (start, end, value)`` character spans of the values of a top-level JSON object."""
    dec = json.JSONDecoder()
    ws = " \t\n\r"
    i = 0
    n = len(text)

    def skip(k):
        while k < n and text[k] in ws:
            k += 1
        return k

    i = skip(i)
    if i >= n or text[i] != "{":
        raise APIFeatureError("response is not a JSON object")
    out = {}
    i = skip(i + 1)
    if i < n and text[i] == "}":
        return out
    while True:
        if i >= n or text[i] != '"':
            raise APIFeatureError(f"response is not valid JSON (expected a key at character {i})")
        try:
            key, i = json.decoder.scanstring(text, i + 1)
            i = skip(i)
            if i >= n or text[i] != ":":
                raise APIFeatureError(f"response is not valid JSON (expected ':' at character {i})")
            i = skip(i + 1)
            value, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise APIFeatureError(f"response is not valid JSON ({e.msg} at character {e.pos})") from None
        out[key] = (i, end, value)
        i = skip(end)
        if i < n and text[i] == ",":
            i = skip(i + 1)
            continue
        if i < n and text[i] == "}":
            return out
        raise APIFeatureError(f"response is not valid JSON (expected ',' or '}}' at character {i})")


def _token_list(logprobs) -> list[dict]:
    if isinstance(logprobs, dict) and "content" in logprobs:
        logprobs = logprobs["content"]
    if not isinstance(logprobs, list) or not logprobs:
        raise APIFeatureError("'logprobs' must be a non-empty list of {token, logprob} objects")
    for k, t in enumerate(logprobs):
        if not isinstance(t, dict) or "token" not in t or "logprob" not in t:
            raise APIFeatureError(f"logprobs entry {k} needs 'token' and 'logprob'")
        if not isinstance(t["logprob"], (int, float)) or isinstance(t["logprob"], bool):
            raise APIFeatureError(f"logprobs entry {k}: 'logprob' must be a number")
    return logprobs


def parse_letter(value, letters: str = LETTERS) -> int | None:
    """Index of the answer letter (tolerating whitespace, ``$``, brackets, a trailing dot), else None."""
    if not isinstance(value, str):
        return None
    s = value.strip(_STRIP).upper()
    return letters.index(s) if len(s) == 1 and s in letters else None


def attribute_vector(response: str | None, logprobs, letters: str = LETTERS, on_bad_letter: str = "error"):
    """``(vector, info)``: the attribute vector (length 3 + len(letters)) and the parsed values.

    ``info = {"predicted_label", "letter_probability", "verbalized_confidence"}``.
    ``on_bad_letter``: ``"error"`` or ``"zero"`` (no one-hot entry, the paper's
    "non-zero index (if any)").
    """
    tokens = _token_list(logprobs)
    pieces = [bytes(t["bytes"]) if t.get("bytes") is not None else t["token"].encode("utf-8") for t in tokens]
    joined = b"".join(pieces)
    if response is None:
        try:
            response = joined.decode("utf-8")
        except UnicodeDecodeError:
            raise APIFeatureError("the tokens' bytes are not valid UTF-8") from None
    elif joined != response.encode("utf-8"):
        raise APIFeatureError("the logprobs tokens do not concatenate to 'response'")
    starts, pos = [], 0
    for p in pieces:
        starts.append(pos)
        pos += len(p)
    probs = [math.exp(t["logprob"]) for t in tokens]

    spans = value_spans(response)
    missing = [k for k in KEYS if k not in spans]
    if missing:
        raise APIFeatureError(f"response JSON lacks key(s) {', '.join(missing)}")

    def byte_at(ci):
        return len(response[:ci].encode("utf-8"))

    means = []
    for key in KEYS:
        a, b, value = spans[key]
        if isinstance(value, str) and b - a > 2:
            a, b = a + 1, b - 1
        ba, bb = byte_at(a), byte_at(b)
        sel = [probs[k] for k in range(len(tokens)) if starts[k] < bb and starts[k] + len(pieces[k]) > ba]
        means.append(sum(sel) / len(sel) if sel else 0.0)

    conf = spans["confidence_in_answer_letter"][2]
    if isinstance(conf, str):
        try:
            conf = float(conf.strip())
        except ValueError:
            conf = None
    if isinstance(conf, bool) or not isinstance(conf, (int, float)) or not math.isfinite(conf):
        shown = spans["confidence_in_answer_letter"][2]
        raise APIFeatureError(f"confidence_in_answer_letter {shown!r} is not a number")
    letter = spans["answer_letter"][2]
    idx = parse_letter(letter, letters)
    if idx is None and on_bad_letter == "error":
        raise APIFeatureError(f"answer_letter {letter!r} is not one of {', '.join(letters)} "
                              "(use on_bad_letter='zero' / --on-bad-letter zero to keep such rows)")
    onehot = [0.0] * len(letters)
    if idx is not None:
        onehot[idx] = float(conf)
    info = {"predicted_label": -1 if idx is None else idx, "letter_probability": means[0],
            "verbalized_confidence": float(conf)}
    return means + onehot, info


def is_refusal(row: dict) -> bool:
    """A row marked as a full refusal (``refusal`` is a non-empty string or true)."""
    return bool(row.get("refusal"))


def parse_label(value, letters: str = LETTERS) -> int:
    """A task label given as an int index or a letter."""
    if isinstance(value, bool):
        raise APIFeatureError(f"label {value!r} must be an index 0..{len(letters) - 1} or a letter")
    if isinstance(value, int) and 0 <= value < len(letters):
        return value
    if isinstance(value, str) and value.strip().upper() in letters and len(value.strip()) == 1:
        return letters.index(value.strip().upper())
    raise APIFeatureError(f"label {value!r} must be an index 0..{len(letters) - 1} or one of {', '.join(letters)}")


def feature_row(row: dict, field: str = "attributes", letters: str = LETTERS, on_bad_letter: str = "error") -> dict:
    """One output row (see the module docstring)."""
    if "id" not in row:
        raise APIFeatureError("missing field 'id'")
    out = dict(row)
    if "label" in row:
        out["label"] = parse_label(row["label"], letters)
    if is_refusal(row):
        out[field] = [0.0] * (3 + len(letters))
        out.update(predicted_label=-1, letter_probability=0.0, verbalized_confidence=0.0)
        return out
    if "logprobs" not in row:
        raise APIFeatureError("missing field 'logprobs' (and the row is not marked as a refusal)")
    response = row.get("response")
    if response is not None and not isinstance(response, str):
        raise APIFeatureError("'response' must be the generated JSON text (a string)")
    vec, info = attribute_vector(response, row["logprobs"], letters, on_bad_letter)
    out[field] = vec
    out.update(info)
    return out
