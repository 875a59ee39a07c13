"""``sdm-mlx mcp``: an MCP server (official ``mcp`` SDK, stdio transport) exposing SDM verification to assistants.

Tools:

* ``verify(question, answer)`` — force-decodes ``answer`` after ``question``
  (templated as a one-user-message chat, exactly as ``sdm-mlx serve`` templates
  a chat) and returns the verdict: ``verdict_id``, ``verified``, ``admitted``,
  ``p_lower`` (p̂_lower of the predicted class, null when rejected as ⊥),
  ``prediction``, ``rejection_reason`` with ``why`` (the failed condition in words, with the row's own
  q, d, q̃ and what would change the verdict: :mod:`sdm_mlx.calibration.reasons`), and the
  nearest training exemplars as short text lines;
* ``add_feedback(verdict_id, label)`` — the user's verdict on an answer (``true``
  right, ``false`` wrong, or a class index): the verdict's feature row joins the
  verifier's support set at once, without retraining (:mod:`sdm_mlx.estimator.feedback`);
* ``explain(verdict_id)`` — the full per-row quantities of that verdict: the
  estimator's row (q, d0, d, logits, SDM output, q̃ and its bins, n̂, offset,
  p̂_lower / centroid / upper), the features' bookkeeping (kept positions,
  delimiter index, truncation), the exemplars, the prompt and answer tokens;
  with ``html="content"`` or ``"path"`` also the verdict's self-contained HTML page (or its file).

Verdicts are kept in memory by id (``--max-verdicts``, oldest dropped).  All
model work runs on the engine's single thread (:mod:`sdm_mlx.serve.engine`).
Feedback changes the in-memory support set; it is written to the verifier
directory only when the server was started with ``--persist-feedback``.

Every call is answered (:func:`run_stdio`): a line the SDK cannot parse — a lone
surrogate escape, nesting deeper than its parser allows, not JSON — gets a tool
error (``tools/call``) or a JSON-RPC error carrying the request's id, instead of
being dropped while the client waits.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from contextlib import asynccontextmanager
from typing import Any

from .engine import Engine

def exemplar_lines(exemplars: list) -> list:
    """Nearest exemplars as short text: ``id=... label=... predicted=... d²=...``."""
    out = []
    for e in exemplars:
        d2 = e.get("squared_distance")
        out.append(f"id={e.get('id')} label={e.get('label')} predicted={e.get('predicted_label')}"
                   + ("" if d2 is None else f" d²={d2:.4g}"))
    return out


def thresholds_of(estimator) -> dict:
    """The verifier's thresholds at its α' that a reason's text quotes (min valid q̃, robust, ψ per class)."""
    cal = estimator.calibration_
    return {"min_valid": float(cal.min_valid), "robust_min_valid": float(cal.robust_min_valid),
            "psi": [float(p) for p in cal.psi], "alpha": float(estimator.alpha)}


def figures_of(engine: Engine, verification: dict) -> tuple[dict | None, dict]:
    """(the verifier's row of a stored verdict, the verifier's thresholds): what :func:`why` quotes."""
    record = engine.verdicts.get(verification["verdict_id"]) or {}  # (dropped at once by --max-verdicts 1)
    return record.get("verifier"), thresholds_of(engine.gen.estimator)


def why(verification: dict, row: dict | None = None, thresholds: dict | None = None) -> str:
    """The ``why`` of a verdict: its reason in words with the row's own figures (``row``: the verifier's row of
    the verdict, q, d, q̃_lower, p̂_lower, ...) and what would change it (:func:`sdm_mlx.calibration.reasons.reason_text`,
    the text of the verdict page and of the evaluation reports too)."""
    from ..calibration.reasons import reason_text

    reason = verification.get("rejection_reason")
    text = reason_text(reason, {**verification, **(row or {})}, thresholds)
    return ("verified: " + text) if reason is None and verification.get("verified") else text


def verify_summary(verification: dict, row: dict | None = None, thresholds: dict | None = None) -> dict[str, Any]:
    """The ``verify`` tool result of a verdict (see the module docstring); ``row`` and ``thresholds`` as :func:`why`."""
    reason = verification["rejection_reason"]
    return {
        "verdict_id": verification["verdict_id"], "verified": verification["verified"],
        "admitted": verification["admitted"], "p_lower": verification["p_lower"],
        "prediction": verification["prediction"], "rejection_reason": reason,
        "why": why(verification, row, thresholds), "exemplars": exemplar_lines(verification["exemplars"]),
    }


class VerdictPages:
    """The private temporary directory that ``explain(html="path")`` writes a server's verdict pages to: made on
    first use, removed with its pages when the process exits (a path is valid while the server runs)."""

    def __init__(self):
        self.path: str | None = None

    def directory(self) -> str:
        if self.path is None:
            import atexit
            import shutil
            import tempfile

            self.path = tempfile.mkdtemp(prefix="sdm-mlx-verdicts-")
            atexit.register(shutil.rmtree, self.path, ignore_errors=True)
        return self.path


def _page_of(engine: Engine, verdict_id: str, how: str, pages: VerdictPages) -> dict:
    """``{"html_content": page}`` or ``{"html_path": file}`` of a verdict's page (sdm_mlx.evaluation.verdict_html); the
    files go to the server's :class:`VerdictPages` directory."""
    from ..evaluation.verdict_html import verdict_page, verdict_page_path

    record, estimator = engine.verdicts.get(verdict_id), engine.estimator
    if how == "content":
        return {"html_content": verdict_page(record, verdict_id, estimator)}
    return {"html_path": verdict_page_path(record, verdict_id, estimator, pages.directory())}


def create_server(engine: Engine, max_prompt_tokens: int | None = None):
    """An ``MCPServer`` with the ``verify``, ``add_feedback`` and ``explain`` tools on ``engine``
    (``verify`` refuses question + answer longer than ``max_prompt_tokens``, default the model's context)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    from .limits import PromptCounter, PromptTooLong

    max_prompt_tokens = max_prompt_tokens or engine.context_length
    counter, pages = PromptCounter(engine, limit=max_prompt_tokens), VerdictPages()

    server = MCPServer("sdm-mlx", instructions=(
        "SDM verification of answers: call verify(question, answer) to get a calibrated verdict "
        "(p_lower, admitted, why not, nearest training exemplars) and a verdict_id; "
        "add_feedback(verdict_id, label) records whether the answer was right (true) or wrong (false) so later "
        "verdicts take it into account at once; explain(verdict_id) returns every quantity behind it."))

    @server.tool(structured_output=True)
    async def verify(question: str, answer: str) -> dict[str, Any]:
        """Verify `answer` as the model's answer to `question` with the SDM verification layer.

        Returns verdict_id, verified, admitted, p_lower, prediction, rejection_reason, why and the
        nearest training exemplars (short text).
        """
        if not question.strip() or not answer.strip():
            raise ToolError("question and answer must be non-empty strings")
        try:  # refused before any forward pass; by its length alone, before it is tokenised
            n = await counter.off_loop(counter.count, [{"role": "user", "content": question}], None, answer)
        except PromptTooLong as e:
            raise ToolError(str(e)) from None
        if n > max_prompt_tokens:
            raise ToolError(f"prompt too long ({n} tokens, limit {max_prompt_tokens})")
        try:
            verification, _ = await asyncio.wrap_future(engine.submit(engine.verify_question, question, answer))
        except ValueError as e:
            raise ToolError(str(e)) from None
        return verify_summary(verification, *figures_of(engine, verification))

    @server.tool(structured_output=True)
    async def add_feedback(verdict_id: str, label: bool | int) -> dict[str, Any]:
        """Tell the verifier whether a verified answer was right: label true (right), false (wrong) or a class index.

        The verdict's feature row joins the verifier's support set at once, without retraining: later
        verdicts near it see it in their similarity q and distance d (a wrong answer lowers q nearby).
        """
        try:
            return await asyncio.wrap_future(engine.submit(engine.add_feedback, verdict_id, label, "mcp"))
        except (ValueError, LookupError) as e:
            raise ToolError(str(e.args[0] if isinstance(e, LookupError) and e.args else e)) from None

    @server.tool(structured_output=True)
    async def explain(verdict_id: str, html: str = "none") -> dict[str, Any]:
        """The full per-row quantities of a verdict returned by verify (q, d0, d, SDM output, bins, p_lower, ...).

        html: "none" (default), "content" (add the verdict's self-contained HTML page as html_content) or
        "path" (write the page to a file and add its path as html_path; the server's temporary files are removed
        when it exits) — a page a person can look at.
        """
        if html not in ("none", "content", "path"):
            raise ToolError(f"html must be 'none', 'content' or 'path', got {html!r}")
        out = engine.explain(verdict_id)
        if out is None:
            raise ToolError(f"no verdict {verdict_id!r}: unknown, or evicted (the last "
                            f"{engine.verdicts.capacity} verdicts are kept)")
        if html != "none":
            out.update(_page_of(engine, verdict_id, html, pages))
        return out

    return server


_ID = re.compile(rb'"id"\s*:\s*(-?\d{1,15}|"(?:[^"\\]|\\.){0,200}")')


def _request_id(line: str):
    """The JSON-RPC id of a request line the SDK could not parse (None when it has none / is unreadable)."""
    try:
        message = json.loads(line)
        return message.get("id") if isinstance(message, dict) else None
    except (ValueError, RecursionError):
        m = _ID.search(line.encode("utf-8", "surrogatepass"))
        try:
            return json.loads(m.group(1)) if m else None
        except ValueError:
            return None


def _refusal(line: str, problem: str):
    """The SessionMessage answering an unparseable request line (None for a notification: no reply is due)."""
    import mcp_types as types
    from mcp.shared.message import SessionMessage

    rid = _request_id(line)
    if rid is None and '"method"' in line and '"id"' not in line:
        return None
    if isinstance(rid, bool) or not isinstance(rid, (int, str, type(None))):
        rid = None
    text = f"invalid request: {problem}"
    if '"tools/call"' in line and rid is not None:
        message = types.JSONRPCResponse(jsonrpc="2.0", id=rid, result={
            "content": [{"type": "text", "text": text}], "isError": True})
    else:
        message = types.JSONRPCError(jsonrpc="2.0", id=rid, error=types.ErrorData(
            code=types.INVALID_PARAMS if rid is not None else types.PARSE_ERROR, message=text))
    return SessionMessage(message)


def line_problem(line: str) -> str | None:
    """Why the MCP SDK would not parse this request line (None: it will)."""
    import mcp_types as types

    try:
        types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        return None
    except Exception as e:  # noqa: BLE001  (the SDK's parser raises several kinds)
        if "\\ud" in line.lower() or "surrogate" in str(e):
            return "a string holds a lone surrogate (\\ud800-\\udfff escape): not Unicode text"
        if "recursion" in str(e).lower():
            return "the message is nested too deeply"
        return f"not a valid JSON-RPC message ({str(e).splitlines()[0][:160]})"


class CheckedLines:
    """Request lines from ``source`` (an async text file); a line the SDK cannot parse is answered
    at once on ``replies`` and not passed on."""

    def __init__(self, source):
        self.source, self.replies, self.ready = source, None, asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        await self.ready.wait()
        while True:
            line = await self.source.readline()
            if not line:
                raise StopAsyncIteration
            if not line.strip():
                continue
            problem = line_problem(line)
            if problem is None:
                return line
            reply = _refusal(line, problem)
            if reply is not None:
                await self.replies.send(reply)


@asynccontextmanager
async def checked_stdio():
    """The SDK's stdio transport over this process's stdin/stdout with :class:`CheckedLines` in front;
    stray writes to file descriptor 1 go to stderr while it runs (the protocol keeps a private copy)."""
    import io

    import anyio
    from mcp.server.stdio import stdio_server

    wire = os.dup(1)
    os.dup2(2, 1)
    try:
        lines = CheckedLines(anyio.wrap_file(io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8",
                                                              errors="replace")))
        out = anyio.wrap_file(io.TextIOWrapper(os.fdopen(wire, "wb", closefd=False), encoding="utf-8"))
        async with stdio_server(stdin=lines, stdout=out) as (read_stream, write_stream):
            lines.replies = write_stream
            lines.ready.set()
            yield read_stream, write_stream
    finally:
        os.dup2(wire, 1)
        os.close(wire)


def run_stdio(server) -> None:
    """Serve ``server`` (from :func:`create_server`) on stdio until the client closes stdin."""
    import anyio

    async def main():
        async with checked_stdio() as (read_stream, write_stream):
            low = server._lowlevel_server
            await low.run(read_stream, write_stream, low.create_initialization_options())

    anyio.run(main)
