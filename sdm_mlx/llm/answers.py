"""The answer rules of the verification unit: when a generated answer is closed (:func:`is_closed`) and its first
JSON object (:func:`first_json_object`).  Pure text functions shared by decoding (``sdm_mlx.decoding``), the SDM
network (``sdm_mlx.network.generation``) and verification (``sdm_mlx.verified``).

For the delimiter ``"}"`` an answer is closed by the ``}`` that balances the first ``{`` of the text (braces inside
JSON strings ignored); for another delimiter, by its first occurrence.
"""

from __future__ import annotations

import json

from .tokens import DEFAULT_DELIMITER


def is_closed(text: str, delimiter: str = DEFAULT_DELIMITER) -> bool:
    """True once ``text`` closes its answer (see the module docstring)."""
    if delimiter != "}":
        return delimiter in text
    depth, in_str, esc, opened = 0, False, False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"' and opened:
            in_str = True
        elif ch == "{":
            depth += 1
            opened = True
        elif ch == "}":
            depth -= 1
            if depth <= 0:
                return True
    return False


def _first_json_span(text: str):
    """``(obj, start, end)`` of the first JSON object (dict) in ``text``, or None."""
    dec = json.JSONDecoder()
    start = text.find("{")
    while start >= 0:
        try:
            obj, end = dec.raw_decode(text, start)
            if isinstance(obj, dict):
                return obj, start, end
        except json.JSONDecodeError:
            pass
        start = text.find("{", start + 1)
    return None


def first_json_object(text: str):
    """The first JSON object (dict) in ``text``, or None if there is none / it does not parse."""
    found = _first_json_span(text)
    return None if found is None else found[0]


def answer_in_layout(text: str, completions, label: int) -> str | None:
    """``text`` with its JSON answer replaced by completion ``label``'s value, the model's layout kept (fence,
    spacing, key order); None when ``text`` holds no answer of the completions' form.

    The completions are one-key JSON objects of the same key (the presets': ``{"sentiment": "negative"}``,
    ``{"correctness": true}``).  Only the value that follows the key in ``text``'s first JSON object is
    rewritten, so a constructed negative (the inverted answer, force-decoded) reads as the model's own answer
    would, and its features differ from the own answer's only by the answer itself."""
    objs = [first_json_object(c) for c in completions]
    if any(o is None or len(o) != 1 for o in objs) or len({next(iter(o)) for o in objs}) != 1:
        return None
    key = next(iter(objs[0]))
    found = _first_json_span(text)
    if found is None or key not in found[0] or len(found[0]) != 1:
        return None
    _, span_start, end = found
    dec = json.JSONDecoder()
    body = text[span_start:end]
    k = body.find(json.dumps(key))
    colon = body.find(":", k + len(json.dumps(key)))
    v0 = colon + 1
    while v0 < len(body) and body[v0] in " \t\r\n":
        v0 += 1
    try:
        _, v1 = dec.raw_decode(body, v0)
    except json.JSONDecodeError:
        return None
    value = json.dumps(objs[label][key])
    return text[:span_start] + body[:v0] + value + body[v1:] + text[end:]
