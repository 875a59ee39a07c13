"""Why a row is not admitted, in words: the one source of the rejection reasons' text.

Each reason of :data:`~sdm_mlx.calibration.conditional.REJECTION_REASONS` (and the two that verified
generation adds, ``parse_failure`` and ``predicted_unverified``) has a :class:`ReasonText`: the condition that
failed, in the estimator's symbols (``docs/paper-map.md``: q, d, the soft bin q̃ = v_ŷ · ln(2+q) of
``equation:softqbin``, Alg. 3's min valid q̃ and thresholds ψ), what it means, and what would change the verdict.
:func:`reason_text` adds a row's own numbers (q, d, d0, q̃_lower, p̂_lower; the model's thresholds when given), so
a sentence names the cause that holds for that row.  The verdict pages (``evaluation/verdict_html.py``), the
evaluation report and the demo's reason list (``evaluation/report.py``) and the MCP tool's ``why``
(``serve/mcp.py``) all read this table.

The conditions, in the order ``estimate`` tests them (the first that fails is the reason; the module docstring
of :mod:`sdm_mlx.calibration` has the same list):

1. ``no_valid_threshold``     the model's own min valid q̃ is +inf (Alg. 3 found none at α')
2. ``no_robust_threshold``    the Cauchy robust min valid q̃ over the J rounds is +inf
3. ``ood_distance``           d = 0, so the SDM output is uniform and ŷ is not its unique argmax
4. ``argmax_flip``            the SDM output, or the rescaled output o (centroid or lower), has no unique argmax ŷ
5. ``ood_similarity``         floor(q̃_lower) ≤ 0, i.e. q̃_lower = v_lower,ŷ · ln(2+q) < 1
6. ``below_model_min_qbin``   q̃_lower < the model's min valid q̃ (Alg. 3)
7. ``below_robust_min_qbin``  q̃_lower < the robust (Cauchy) min valid q̃
8. ``below_threshold_psi``    {c : o_lower,c ≥ ψ_c} ≠ {ŷ} (p̂_lower is o_lower,ŷ after the Cauchy offset)

Pure Python (no NumPy, no MLX): ``--help`` and the report may import it cheaply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class ReasonText:
    """The words of one reason: the failed ``condition`` (symbols), its ``meaning`` and what would ``change`` it."""

    condition: str
    meaning: str
    change: str

    @property
    def line(self) -> str:
        """One line for a table of reasons: the condition, then what would change the verdict."""
        return f"{self.condition}; what would change it: {self.change}"

    @property
    def plain_line(self) -> str:
        """:attr:`line` in the ASCII spelling of terminal reports (q~, psi, alpha', <=)."""
        return plain(self.line)


#: the ASCII spelling of the symbols, as terminal reports write them (q~, psi, alpha')
_PLAIN = {"q̃": "q~", "p̂": "p^", "ŷ": "y^", "ψ": "psi", "α": "alpha", "ε": "eps", "≤": "<=", "≥": ">=",
          "≠": "!=", "·": "*", "⊥": "_|_"}


def plain(text: str) -> str:
    """``text`` with the symbols spelled in ASCII (:data:`_PLAIN`)."""
    for symbol, ascii_ in _PLAIN.items():
        text = text.replace(symbol, ascii_)
    return text


#: reason -> its words; None is an admitted row (no reason)
REASONS: dict[str | None, ReasonText] = {
    None: ReasonText(
        "admitted", "every condition of the index-conditional estimator holds: p̂_lower is reported, not ⊥",
        "a q̃_lower below the min valid q̃ or a p̂_lower below ψ (e.g. at a higher α') would reject it"),
    "no_valid_threshold": ReasonText(
        "min valid q̃ = +inf (Alg. 3 found no threshold at α')",
        "the model admits nothing: at no soft bin q̃ do the calibration rows reach α' in every class, so no row "
        "of any input can be admitted",
        "nothing about this row; a lower α' (recalibrate), more calibration rows per class or a better-trained "
        "model (sdm-mlx inspect shows the diagnosis)"),
    "no_robust_threshold": ReasonText(
        "robust min valid q̃ = +inf (the Cauchy estimate over the J rounds, DESIGN #15)",
        "the model admits nothing: enough of the J rounds found no min valid q̃ that their spread (MAD) is "
        "infinite",
        "nothing about this row; a lower α', or rounds that each find a threshold (more calibration rows, "
        "longer training)"),
    "ood_distance": ReasonText(
        "d = 0 (out of distribution by distance)",
        "the row's nearest training exemplar is farther away (d0) than that of every calibration row of some "
        "class, so d = 0, the SDM output is uniform and the prediction is not its unique argmax",
        "only a row nearer the training data, or support rows added near it (add-support, feedback); a different α' does not"),
    "argmax_flip": ReasonText(
        "no unique argmax at ŷ (the SDM output, or the rescaled output o of the centroid or lower estimate)",
        "the calibrated output does not single out the predicted class ŷ = argmax z': a tie in the SDM output, or "
        "o = softmax(W''v · ln(2+q̃)) puts its maximum on another class",
        "a prediction the calibration agrees with: a larger logit margin for ŷ, or a row nearer training rows "
        "of that class"),
    "ood_similarity": ReasonText(
        "floor(q̃_lower) ≤ 0, i.e. q̃_lower = v_lower,ŷ · ln(2+q) < 1 (out of distribution by the soft bin)",
        "the soft bin q̃ combines q with v, the rank of the row's SDM output for ŷ among the calibration rows "
        "of class ŷ (lowered by the DKW margin ε); together they stay below 1",
        "a higher rank v (a nearer row, i.e. a larger d, or a larger logit margin raises the SDM output for ŷ; "
        "more calibration rows, or a lower α', shrink the DKW margin ε), or a larger q"),
    "below_model_min_qbin": ReasonText(
        "q̃_lower < the model's min valid q̃ (Alg. 3)",
        "the lower soft bin is positive but below the smallest q̃ at which the calibration rows reach α' in "
        "every class",
        "a higher q̃_lower (a larger q, or a larger d or logit margin, which raise v), or a lower α' (the "
        "threshold falls with α')"),
    "below_robust_min_qbin": ReasonText(
        "q̃_lower < the robust (Cauchy) min valid q̃ over the J rounds",
        "the lower soft bin clears the model's own min valid q̃ but not the Cauchy robust one, which adds the "
        "rounds' spread",
        "a higher q̃_lower (a larger q, d or logit margin), or a lower α'"),
    "below_threshold_psi": ReasonText(
        "{c : o_lower,c ≥ ψ_c} ≠ {ŷ} (Alg. 3's class thresholds ψ)",
        "p̂_lower (o_lower,ŷ after the Cauchy offset) is below ψ of the predicted class, or another class "
        "clears its ψ too",
        "a higher p̂_lower (a higher q̃ shrinks the offset and the DKW margin), or a lower α' (ψ falls with "
        "α')"),
    "parse_failure": ReasonText(
        "the answer does not parse",
        "the answer has no closing delimiter or no parseable JSON object, so there is nothing to verify",
        "an answer in the expected JSON form (a larger max_tokens, if it was cut off)"),
    "predicted_unverified": ReasonText(
        "admitted, predicted wrong",
        "the estimator admits the row, and its calibrated prediction is that the answer is wrong",
        "only a different answer: the estimator's verdict clears every condition"),
}


def reason_words(reason: str | None) -> ReasonText:
    """The :class:`ReasonText` of ``reason`` ("" and None: admitted); an unknown reason gets a neutral text."""
    found = REASONS.get(reason or None)
    if found is None:
        return ReasonText(str(reason), f"rejected: {reason}", "see the estimator's conditions in docs/paper-map.md")
    return found


def _num(row: Mapping[str, Any] | None, key: str) -> float | None:
    value = None if row is None else row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _numbers(reason: str | None, row: Mapping[str, Any] | None, thresholds: Mapping[str, Any] | None) -> str:
    """The row's own figures behind ``reason`` (empty when the row lacks them)."""
    q, d, d0 = _num(row, "q"), _num(row, "d"), _num(row, "d0")
    q_low, p_low = _num(row, "q_tilde_lower"), _num(row, "p_lower")
    th = thresholds or {}
    if reason == "ood_distance" and d is not None:
        return f"d = {d:.3g}" + ("" if d0 is None else f", d0 = {d0:.4g}")
    if reason == "ood_similarity" and q is not None:
        base = math.log(2.0 + q)
        if base < 1.0:
            return (f"q = {q:.0f}: no nearest training row shares the prediction correctly, so q̃ ≤ ln 2 < 1 "
                    "whatever v; only a row with q ≥ 1 can pass")
        need = f"q = {q:.0f} gives ln(2+q) = {base:.3g}, so q̃_lower ≥ 1 needs v_lower ≥ {1.0 / base:.3g}"
        if d is not None and d < 0.5:
            need += (f"; d = {d:.3g}: the nearest training exemplar is farther than for {1.0 - d:.0%} of the "
                     "calibration rows of some class, which flattens the SDM output")
        elif d is not None:
            need += f"; d = {d:.3g} is not small, so the low rank comes from a small logit margin for ŷ"
        return need
    if reason in ("below_model_min_qbin", "below_robust_min_qbin") and q_low is not None:
        key = "min_valid" if reason == "below_model_min_qbin" else "robust_min_valid"
        limit = _num(th, key)
        return f"q̃_lower = {q_low:.3g}" + ("" if limit is None else f" < {limit:.3g}")
    if reason == "below_threshold_psi" and p_low is not None:
        psi, pred = th.get("psi"), row.get("prediction") if row else None
        if psi is not None and isinstance(pred, int) and 0 <= pred < len(psi):
            rel = "<" if p_low < psi[pred] else "≥"
            return f"p̂_lower = {p_low:.3g} {rel} ψ_ŷ = {psi[pred]:.3g}" + (
                "" if rel == "<" else " (another class clears its ψ too)")
        return f"p̂_lower = {p_low:.3g}"
    if reason in ("no_valid_threshold", "no_robust_threshold") and _num(th, "alpha") is not None:
        return f"α' = {_num(th, 'alpha'):g}"
    return ""


def reason_text(reason: str | None, row: Mapping[str, Any] | None = None,
                thresholds: Mapping[str, Any] | None = None) -> str:
    """One paragraph for ``reason``: the failed condition, what it means, the row's own figures (from ``row``, a
    JSON row or verdict record: q, d, d0, q_tilde_lower, p_lower, prediction; ``thresholds``: optional
    ``min_valid``, ``robust_min_valid``, ``psi`` (per class) and ``alpha`` of the model), and what would change
    the verdict."""
    words = reason_words(reason)
    figures = _numbers(reason or None, row, thresholds)
    head = words.condition if reason else "admitted"
    return f"{head}: {words.meaning}" + (f" ({figures})" if figures else "") + f". What would change the verdict: {words.change}."
