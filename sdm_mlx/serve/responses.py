"""Response bodies of ``sdm-mlx serve`` in the OpenAI wire format, plus the verdict's summary headers.

Non-streaming chat / text completions are ``chat.completion`` / ``text_completion``
objects whose single choice carries the extra ``verification`` object (stock
clients ignore unknown fields).  Streams are ``chat.completion.chunk`` /
``text_completion`` chunks as server-sent events; the last chunk before
``data: [DONE]`` holds ``finish_reason`` and ``verification`` (and, with
``stream_options.include_usage``, one more chunk with empty ``choices`` holds
``usage``).

``logprobs`` (when the request asks for them) describe exactly the generated
text the client is shown: a response's (or a text chunk's) logprobs list the
tokens whose text it carries, so their ``bytes`` join to its content.  An
abstention shows the server's text, not a generated answer: its logprobs are
empty, and the withheld answer's tokens appear in no logprobs (see
docs/serving.md).
"""

from __future__ import annotations

import json
import time
import uuid

#: Decoder stop reasons -> OpenAI finish reasons.
FINISH = {"delimiter": "stop", "eos": "stop", "stop": "stop", "max_tokens": "length"}


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def finish_reason(result) -> str:
    return FINISH.get(result.attempts[-1].stop_reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(kind: str, cid: str, model: str, result, verification: dict, prompt_tokens: int) -> dict:
    """A non-streaming ``chat.completion`` (``kind="chat"``) or ``text_completion`` (``"text"``)."""
    choice = {"index": 0, "finish_reason": finish_reason(result), "verification": verification}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice["text"] = result.text
    choice["logprobs"] = shown_logprobs(kind, result)
    return {"id": cid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "system_fingerprint": None, "choices": [choice],
            "usage": usage(prompt_tokens, result.tokens)}


def _entry(r: dict) -> dict:
    return {"token": r["token"], "logprob": r["logprob"], "bytes": list(r["token"].encode("utf-8"))}


def shown_logprobs(kind: str, result):
    """``choices[0].logprobs`` of a completion's shown text: the final attempt's tokens (None unless the request
    asked for them); none for an abstention, whose text is the server's and whose answer is withheld."""
    records = result.attempts[-1].logprobs
    if records is None:
        return None
    return logprobs_body(kind, [] if result.status == "abstained" else records)


def logprobs_body(kind: str, records: list | None):
    """``choices[0].logprobs`` of generated tokens' records (None: the request did not ask for them).

    Chat: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``; text: ``{tokens, token_logprobs,
    top_logprobs}``.  A record's ``token`` is the text the token adds to the answer, so the tokens join to it.
    """
    if records is None:
        return None
    if kind == "chat":
        return {"content": [dict(_entry(r), top_logprobs=[_entry(t) for t in r.get("top_logprobs", [])])
                            for r in records]}
    return {"tokens": [r["token"] for r in records], "token_logprobs": [r["logprob"] for r in records],
            "top_logprobs": [{t["token"]: t["logprob"] for t in r.get("top_logprobs", [])} for r in records]}


def chunk(kind: str, cid: str, model: str, text: str | None = None, *, role: bool = False,
          finish: str | None = None, verification: dict | None = None, logprobs: dict | None = None) -> dict:
    """One stream chunk: a text delta (with the ``logprobs`` of its tokens), the opening role delta (chat), or
    the final chunk with the verdict."""
    choice: dict = {"index": 0, "finish_reason": finish}
    if kind == "chat":
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = logprobs
    if verification is not None:
        choice["verification"] = verification
    return {"id": cid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "system_fingerprint": None, "choices": [choice]}


def usage_chunk(kind: str, cid: str, model: str, usage_: dict) -> dict:
    return {"id": cid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "system_fingerprint": None, "choices": [],
            "usage": usage_}


def sse(obj) -> str:
    """One server-sent event (``data: <json>``)."""
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


DONE = "data: [DONE]\n\n"


def verdict_headers(v: dict) -> dict:
    """``X-SDM-*`` headers summarising a ``verification`` object (non-streaming responses)."""
    h = {
        "X-SDM-Verified": str(bool(v["verified"])).lower(),
        "X-SDM-Admitted": str(bool(v["admitted"])).lower(),
        "X-SDM-P-Lower": "null" if v["p_lower"] is None else f"{v['p_lower']:.6g}",
        "X-SDM-Rejection-Reason": v["rejection_reason"] or "none",
        "X-SDM-Verdict-Id": v["verdict_id"],
    }
    if "status" in v:
        h["X-SDM-Status"] = v["status"]
        h["X-SDM-Attempts"] = str(v["n_attempts"])
    return h


def models_body(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "sdm-mlx"}]}
