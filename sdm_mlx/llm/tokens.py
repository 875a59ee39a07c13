"""Text and tokens for the LLM features: mlx-lm's prompt encoding, chat templating (with template
variables) and the position of the closing delimiter of an answer (re-exported by :mod:`sdm_mlx.llm.embed`)."""

from __future__ import annotations

from typing import Sequence
from ..errors import InputError

DEFAULT_DELIMITER = "}"  #: closing delimiter of a verification unit (the final brace of a JSON answer)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as mlx-lm's ``generate`` encodes a string prompt.

    Special tokens (e.g. BOS) are added unless the text already starts with the
    tokenizer's BOS token (chat templates that emit BOS themselves).
    """
    bos = getattr(tokenizer, "bos_token", None)
    add = bos is None or not text.startswith(bos)
    return list(tokenizer.encode(text, add_special_tokens=add))


#: ``apply_chat_template``'s own arguments: not template variables, refused as template kwargs
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(value, name: str = "chat_template_kwargs") -> dict | None:
    """``value`` as chat-template variables (a dict with identifier keys that are not
    :data:`TEMPLATE_ARGUMENTS`; None or empty: None); :class:`~sdm_mlx.errors.InputError` naming ``name``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InputError(f"{name} must be an object of chat-template variables, e.g. {{\"enable_thinking\": false}}")
    reserved = sorted(set(value) & TEMPLATE_ARGUMENTS)
    if reserved:
        raise InputError(f"{name} may not set {', '.join(reserved)} (arguments of apply_chat_template, not "
                         "template variables)")
    if not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise InputError(f"{name} keys must be identifiers (template variable names)")
    return dict(value) or None


def render_chat(tokenizer, messages: list, template_kwargs: dict | None = None, *,
                add_generation_prompt: bool = True) -> str:
    """``messages`` through the tokenizer's chat template (every prompt's templating goes through here);
    ``template_kwargs`` are the template's variables.  A template that fails on them raises
    :class:`~sdm_mlx.errors.InputError`."""
    if not template_kwargs:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
    except Exception as e:  # the template's own error (jinja, a value of a type it does not expect)
        raise InputError(f"the chat template failed with these chat_template_kwargs: {type(e).__name__}: "
                         f"{str(e)[:200]}") from None


def chat_text(
    tokenizer,
    document: str,
    system: str | None = None,
    prompt_template: str | None = None,
    completion: str | None = None,
    use_chat_template: bool = True,
    *,
    template_kwargs: dict | None = None,
) -> str:
    """The chat-templated text for ``document``.

    The user turn is ``prompt_template`` with its ``{document}`` slot replaced by
    the document (plain substring replacement, so JSON braces elsewhere in the
    template are kept verbatim), or the document itself.  Without
    ``completion`` the text ends with the generation prompt (e.g.
    ``<|assistant|>\\n``); with it, the assistant turn holds the completion and
    the template's closing tokens follow.  ``use_chat_template=False`` returns
    ``[system + "\\n"] + user [+ completion]`` for base models.
    """
    if prompt_template is not None:
        if "{document}" not in prompt_template:
            raise InputError("prompt template must contain a {document} slot")
        user = prompt_template.replace("{document}", document)
    else:
        user = document
    if not use_chat_template:
        return (system + "\n" if system else "") + user + (completion or "")
    if not getattr(tokenizer, "has_chat_template", getattr(tokenizer, "chat_template", None) is not None):
        raise InputError("the tokenizer has no chat template (use use_chat_template=False / --no-chat-template)")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    if completion is not None:
        messages.append({"role": "assistant", "content": completion})
    return render_chat(tokenizer, messages, template_kwargs, add_generation_prompt=completion is None)


def prompt_tail(tokenizer) -> str | None:
    """What the chat template writes after the user's message when prompting the assistant, or None.

    The end of the user turn plus the generation prompt, e.g.
    ``"<|im_end|>\\n<|im_start|>assistant\\n"`` (ChatML: Qwen) or
    ``"<|end|>\\n<|assistant|>\\n"`` (Phi-3.5).  Every prompt built by
    :func:`chat_text` ends with it.  None when the tokenizer has no chat
    template or it cannot be rendered.
    """
    if not getattr(tokenizer, "has_chat_template", getattr(tokenizer, "chat_template", None) is not None):
        return None
    mark = "SDMMLXUSERTEXT"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001  (a template that cannot render this is not ours to judge)
        return None
    k = text.rfind(mark)
    if k < 0:
        return None
    return text[k + len(mark):] or None


def eos_token_ids(tokenizer) -> set:
    """End-of-sequence token ids of an (mlx-lm wrapped) tokenizer: its ``eos_token_ids`` and ``eos_token_id``."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    eid = getattr(tokenizer, "eos_token_id", None)
    if eid is not None:
        ids.add(int(eid))
    return ids


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids))


def _first_token_reaching(tokenizer, ids: Sequence[int], count: int, delimiter: str) -> int | None:
    """Smallest ``i`` with ``decode(ids[:i+1]).count(delimiter) >= count`` (binary search; counts grow with i)."""
    lo, hi = 0, len(ids) - 1
    if hi < 0 or _decode(tokenizer, ids).count(delimiter) < count:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if _decode(tokenizer, ids[: mid + 1]).count(delimiter) >= count:
            hi = mid
        else:
            lo = mid + 1
    return lo


def delimiter_token_index(
    tokenizer, token_ids: Sequence[int], start: int = 0, end: int | None = None, delimiter: str = DEFAULT_DELIMITER
) -> int | None:
    """Index (into ``token_ids``) of the token containing the last ``delimiter`` of ``decode(token_ids[start:end])``.

    Used for generated / already-tokenised completions.  ``None`` if the span
    holds no delimiter.  Works by incremental decoding of prefixes of the span
    (robust to SentencePiece space handling and multi-character tokens such
    as ``"}``).
    """
    span = list(token_ids[start:end])
    n = _decode(tokenizer, span).count(delimiter)
    if n == 0:
        return None
    i = _first_token_reaching(tokenizer, span, n, delimiter)
    return None if i is None else start + i


def delimiter_token_index_in_text(
    tokenizer,
    text: str,
    token_ids: Sequence[int],
    completion_span: tuple[int, int | None] | None = None,
    delimiter: str = DEFAULT_DELIMITER,
) -> int | None:
    """Index of the token of ``token_ids = encode(text)`` containing the last ``delimiter`` of ``text[a:b]``.

    ``completion_span = (a, b)`` are character offsets into ``text`` (``b=None``:
    to the end; ``None``: the whole text).  If that delimiter is the k-th
    occurrence in ``text``, the answer is the first token whose decoded prefix
    contains k occurrences, so characters after ``b`` (template suffixes) and
    before ``a`` (e.g. ``{"sentiment": str}`` in the instructions) are handled.
    """
    a, b = (0, None) if completion_span is None else completion_span
    b = len(text) if b is None else b
    rel = text[a:b].rfind(delimiter)
    if rel < 0:
        return None
    k = text[: a + rel + len(delimiter)].count(delimiter)
    return _first_token_reaching(tokenizer, list(token_ids), k, delimiter)
