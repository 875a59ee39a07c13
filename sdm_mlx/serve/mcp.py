"""``sdm-mlx mcp``: an MCP server (official ``mcp`` SDK, stdio transport) exposing SDM verification to assistants.

Tools:

* ``verify(question, answer)`` — force-decodes ``answer`` after ``question``
  (templated as a one-user-message chat, exactly as ``sdm-mlx serve`` templates
  a chat) and returns the verdict: ``verdict_id``, ``verified``, ``admitted``,
  ``p_lower`` (p̂_lower of the predicted class, null when rejected as ⊥),
  ``prediction``, ``rejection_reason`` with ``why`` (a sentence), and the
  nearest training exemplars as short text lines;
* ``add_feedback(verdict_id, label)`` — the user's verdict on an answer (``true``
  right, ``false`` wrong, or a class index): the verdict's feature row joins the
  verifier's support set at once, without retraining (:mod:`sdm_mlx.estimator.feedback`);
* ``explain(verdict_id)`` — the full per-row quantities of that verdict: the
  estimator's row (q, d0, d, logits, SDM output, q̃ and its bins, n̂, offset,
  p̂_lower / centroid / upper), the features' bookkeeping (kept positions,
  delimiter index, truncation), the exemplars, the prompt and answer tokens.

Verdicts are kept in memory by id (``--max-verdicts``, oldest dropped).  All
model work runs on the engine's single thread (:mod:`sdm_mlx.serve.engine`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from .engine import Engine

#: One sentence per rejection reason (``rejection_reason`` -> ``why``).
WHY = {
    None: "admitted: the answer is verified.",
    "parse_failure": "the answer has no closing delimiter / no parseable JSON object, so it cannot be verified.",
    "predicted_unverified": "admitted, but the verifier predicts the answer is incorrect.",
    "ood_distance": "out of distribution: farther from the verifier's support set than every calibration row (d = 0).",
    "ood_similarity": "out of distribution: too few nearby training rows with the same label (low similarity q).",
    "argmax_flip": "the rescaled SDM output does not keep the predicted class as its unique argmax.",
    "below_model_min_qbin": "too little similarity/distance evidence: below the model's minimum valid bin.",
    "below_robust_min_qbin": "too little evidence: below the robust (Cauchy) minimum valid bin.",
    "below_threshold_psi": "the lower probability p̂_lower falls below the calibrated threshold for the class.",
    "no_valid_threshold": "the verifier has no valid threshold for this class (calibration found none).",
    "no_robust_threshold": "the verifier has no robust threshold for this class.",
}


def exemplar_lines(exemplars: list) -> list:
    """Nearest exemplars as short text: ``id=... label=... predicted=... d²=...``."""
    out = []
    for e in exemplars:
        d2 = e.get("squared_distance")
        out.append(f"id={e.get('id')} label={e.get('label')} predicted={e.get('predicted_label')}"
                   + ("" if d2 is None else f" d²={d2:.4g}"))
    return out


def verify_summary(verification: dict) -> dict[str, Any]:
    """The ``verify`` tool result of a verdict (see the module docstring)."""
    reason = verification["rejection_reason"]
    return {
        "verdict_id": verification["verdict_id"], "verified": verification["verified"],
        "admitted": verification["admitted"], "p_lower": verification["p_lower"],
        "prediction": verification["prediction"], "rejection_reason": reason,
        "why": WHY.get(reason, f"rejected: {reason}."), "exemplars": exemplar_lines(verification["exemplars"]),
    }


def create_server(engine: Engine):
    """An ``MCPServer`` with the ``verify``, ``add_feedback`` and ``explain`` tools on ``engine``."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

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
        try:
            verification, _ = await asyncio.wrap_future(engine.submit(engine.verify_question, question, answer))
        except ValueError as e:
            raise ToolError(str(e)) from None
        return verify_summary(verification)

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
    async def explain(verdict_id: str) -> dict[str, Any]:
        """The full per-row quantities of a verdict returned by verify (q, d0, d, SDM output, bins, p_lower, ...)."""
        out = engine.explain(verdict_id)
        if out is None:
            raise ToolError(f"no verdict {verdict_id!r}: unknown, or evicted (the last "
                            f"{engine.verdicts.capacity} verdicts are kept)")
        return out

    return server
