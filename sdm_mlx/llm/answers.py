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


def first_json_object(text: str):
    """The first JSON object (dict) in ``text``, or None if there is none / it does not parse."""
    dec = json.JSONDecoder()
    start = text.find("{")
    while start >= 0:
        try:
            obj, _ = dec.raw_decode(text, start)
            if isinstance(obj, dict):
                return obj
        except json.JSONDecodeError:
            pass
        start = text.find("{", start + 1)
    return None
