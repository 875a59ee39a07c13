"""Verdict pages: one self-contained HTML page per estimate, and an index page (DESIGN #25).

A page shows the input (the document, or the prompt and the answer of a verified generation), the
decision and the α regions, p̂_lower with its centroid and upper companions, q, d and the rejection reason
in words, the nearest training exemplars with their document text, label and prediction (marked correct /
wrong), and an inline SVG of the row's q~ against the calibration thresholds and of p̂_lower against ψ.

Self-contained: inline CSS and SVG, no script, no external resource; a Content-Security-Policy meta tag
forbids scripts and remote loads even if a browser were to find one.  Every user string goes through
:func:`esc` (HTML-escaped, quotes included); text blocks carry ``dir="auto"`` so right-to-left text reads
right.  Rows are plain dicts in the JSON row schema of ``sdm-mlx predict`` (or a verifier's verdict record),
so the same renderer serves ``predict --html``, ``evaluate --html`` and the server's verdict pages.
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
_STYLE = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:60rem;padding:1rem;
color:#1b1b1b;background:#fff}
h1{font-size:1.4rem;margin:.2rem 0 .8rem}h2{font-size:1.1rem;margin:1.2rem 0 .4rem;border-bottom:1px solid #ddd}
.text{white-space:pre-wrap;overflow-wrap:anywhere;word-break:break-word;background:#f6f6f6;border:1px solid #e2e2e2;
padding:.5rem .7rem;border-radius:4px;max-height:24rem;overflow-y:auto}
table{border-collapse:collapse;width:100%;table-layout:fixed}td,th{border:1px solid #ddd;padding:.25rem .45rem;
text-align:left;vertical-align:top;overflow-wrap:anywhere;word-break:break-word}th{background:#f0f0f0}
.decision{display:inline-block;padding:.15rem .6rem;border-radius:4px;font-weight:700;color:#fff}
.allow{background:#1a7f37}.review{background:#9a6700}.reject{background:#cf222e}
.ok{color:#1a7f37;font-weight:600}.bad{color:#cf222e;font-weight:600}.muted{color:#666}
svg{max-width:100%;height:auto}.ladder{display:flex;flex-wrap:wrap;gap:.25rem}
.level{white-space:nowrap;border:1px solid #ddd;border-radius:3px;padding:.1rem .35rem;font-size:.85rem}
.level.in{background:#dafbe1;color:#1a7f37;font-weight:600}.level.out{color:#888}
"""


def esc(value) -> str:
    """HTML-escaped text of any value (quotes too); None → an em dash."""
    return "—" if value is None else html.escape(str(value), quote=True)


def num(value, spec: str = ".4f") -> str:
    """A number for display ("—" for None / NaN)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return format(value, spec) if isinstance(value, float) else esc(value)


@dataclass(frozen=True)
class PageContext:
    """What a page needs besides the row: the model's calibration at α' and its grid and policy."""

    alpha: float
    grid: tuple = ()
    allow: float | None = None
    review: float | None = None
    psi: tuple = ()  #: ψ per class at α'
    min_valid: float | None = None  #: the model's min valid q~ at α' (None: none)
    robust_min_valid: float | None = None  #: the Cauchy robust min valid q~ at α' (None: none)
    class_names: tuple | None = None
    documents: Callable = field(default=lambda _id: None)  #: support id → kept document text or None

    def class_name(self, c) -> str:
        if c is None:
            return "—"
        c = int(c)
        return f"{c} ({self.class_names[c]})" if self.class_names and 0 <= c < len(self.class_names) else str(c)


def context_of(est) -> PageContext:
    """The :class:`PageContext` of a fitted :class:`~sdm_mlx.estimator.SDMEstimator`."""
    cal, nested = est.calibration_, est.nested_

    def finite(x):
        return float(x) if math.isfinite(x) else None

    names = tuple(str(n) for n in est.class_names) if est.class_names else None
    return PageContext(alpha=float(est.alpha), grid=tuple(nested.grid), allow=nested.policy.allow,
                       review=nested.policy.review, psi=tuple(float(p) for p in cal.psi),
                       min_valid=finite(cal.min_valid), robust_min_valid=finite(cal.robust_min_valid),
                       class_names=names, documents=est.exemplar_document)


def _page(title: str, body: str) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{_CSP}\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{esc(title)}</title><style>{_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n")


def _text_block(label: str, text) -> str:
    return f"<h2>{esc(label)}</h2><div class=\"text\" dir=\"auto\">{esc(text) if text else '<span class=muted>(none)</span>'}</div>"


def _decision(row: dict, ctx: PageContext) -> str:
    decision = row.get("decision") or ("allow" if row.get("admitted") else "reject")
    lower, centroid = row.get("alpha_region_lower"), row.get("alpha_region_centroid")
    policy = "" if ctx.allow is None else (f"policy: allow when the α region is ≥ {ctx.allow:g}, review when ≥ "
                                           f"{ctx.review:g}, otherwise reject")
    region = (f"α region (lower): <b>{num(lower, 'g')}</b> · α region (centroid): {num(centroid, 'g')} "
              f"<span class=muted>(largest level of the grid whose region holds this row; — = none)</span>")
    return (f"<p><span class=\"decision {esc(decision)}\" id=\"decision\">{esc(decision.upper())}</span> "
            f"{'admitted' if row.get('admitted') else 'rejected'} at the model's α' = {ctx.alpha:g}</p>"
            f"<p>{region}</p><p class=muted>{esc(policy)}</p>")


def _reason(row: dict, ctx: PageContext) -> str:
    """The reason in words (:func:`sdm_mlx.calibration.reasons.reason_text`), with the row's and the model's figures."""
    from ..calibration.reasons import reason_text

    reason = row.get("rejection_reason")
    thresholds = {"min_valid": ctx.min_valid, "robust_min_valid": ctx.robust_min_valid, "psi": ctx.psi or None,
                  "alpha": ctx.alpha}
    text = esc(reason_text(reason, row, thresholds))
    return text if not reason else f"{text} <span class=muted>({esc(reason)})</span>"


def _statistics(row: dict, ctx: PageContext) -> str:
    cells = [("p̂_lower", num(row.get("p_lower"))), ("p_centroid", num(row.get("p_centroid"))),
             ("p_upper", num(row.get("p_upper"))), ("q (similarity)", num(row.get("q"))),
             ("d (distance quantile)", num(row.get("d"))), ("d0 (squared L2)", num(row.get("d0"))),
             ("q~ lower", num(row.get("q_tilde_lower"))), ("q~ centroid", num(row.get("q_tilde")))]
    head = "".join(f"<th>{esc(k)}</th>" for k, _ in cells)
    vals = "".join(f"<td>{v}</td>" for _, v in cells)
    return (f"<h2>Estimate</h2><table><tr>{head}</tr><tr>{vals}</tr></table>"
            f"<p>Reason: {_reason(row, ctx)}</p>")


def _prediction(row: dict, ctx: PageContext) -> str:
    pred, label = row.get("prediction"), row.get("label")
    mark = ""
    if label is not None and pred is not None:
        mark = " <span class=ok>correct</span>" if int(label) == int(pred) else " <span class=bad>wrong</span>"
    return (f"<p>Prediction: <b>{esc(ctx.class_name(pred))}</b>"
            f"{'' if label is None else ' · label: ' + esc(ctx.class_name(label))}{mark}</p>")


def _exemplars(row: dict, ctx: PageContext) -> str:
    ex = row.get("exemplars") or []
    if not ex:
        return "<h2>Nearest training exemplars</h2><p class=muted>none returned</p>"
    lines = ["<h2>Nearest training exemplars</h2><table><tr><th style=\"width:3rem\">#</th><th>document</th>"
             "<th style=\"width:9rem\">label</th><th style=\"width:11rem\">prediction</th>"
             "<th style=\"width:7rem\">squared L2</th></tr>"]
    for k, e in enumerate(ex, 1):
        doc = ctx.documents(e.get("id"))
        text = esc(doc) if doc else "<span class=muted>(document not kept)</span>"
        right = e.get("label") == e.get("predicted_label")
        mark = "<span class=ok>correct</span>" if right else "<span class=bad>wrong</span>"
        lines.append(f"<tr><td>{k}</td><td dir=\"auto\"><div class=muted>id {esc(e.get('id'))}</div>{text}</td>"
                     f"<td>{esc(ctx.class_name(e.get('label')))}</td>"
                     f"<td>{esc(ctx.class_name(e.get('predicted_label')))} {mark}</td>"
                     f"<td>{num(e.get('squared_distance'), '.3f')}</td></tr>")
    return "".join(lines) + "</table>"


def _axis_x(value: float, top: float, x0: float = 20, width: float = 440) -> float:
    return x0 + width * min(max(value, 0.0), top) / top


def calibration_svg(row: dict, ctx: PageContext) -> str:
    """Inline SVG: the row's q~ (lower, centroid) against the model's and the robust min valid q~, and p̂_lower
    against ψ of the predicted class and α'."""
    q_low, q_cen = row.get("q_tilde_lower") or 0.0, row.get("q_tilde") or 0.0
    marks = [m for m in (ctx.min_valid, ctx.robust_min_valid) if m is not None]
    top = max([q_low, q_cen, *marks, 1.0]) * 1.15
    parts = ["<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 480 180\" width=\"640\" height=\"240\" "
             "role=\"img\" aria-label=\"calibration picture\" font-size=\"11\" font-family=\"sans-serif\">",
             "<text x=\"20\" y=\"14\">q~ (soft similarity bin)</text>",
             "<line x1=\"20\" y1=\"45\" x2=\"460\" y2=\"45\" stroke=\"#888\"/>"]
    for value, colour, name, y in ((ctx.min_valid, "#9a6700", "min valid", 30),
                                   (ctx.robust_min_valid, "#cf222e", "robust min", 72)):
        if value is not None:
            x = _axis_x(value, top)
            parts.append(f"<line x1=\"{x:.1f}\" y1=\"24\" x2=\"{x:.1f}\" y2=\"62\" stroke=\"{colour}\" "
                         f"stroke-dasharray=\"4 2\"/><text x=\"{x:.1f}\" y=\"{y}\" fill=\"{colour}\" "
                         f"text-anchor=\"middle\">{name} {value:.2f}</text>")
    for value, colour, name in ((q_cen, "#0969da", "centroid"), (q_low, "#1b1b1b", "lower")):
        x = _axis_x(value, top)
        parts.append(f"<circle cx=\"{x:.1f}\" cy=\"45\" r=\"5\" fill=\"{colour}\"><title>{name} q~ {value:.3f}"
                     "</title></circle>")
    parts.append(f"<text x=\"20\" y=\"90\">q~ lower {q_low:.3f} (black), centroid {q_cen:.3f} (blue)</text>")
    parts.append(_p_axis(row, ctx))
    return "".join(parts) + "</svg>"


def _p_axis(row: dict, ctx: PageContext) -> str:
    """The p̂_lower bar on [0, 1] with ψ of the predicted class and α'."""
    p = row.get("p_lower") or 0.0
    pred = row.get("prediction")
    psi = ctx.psi[int(pred)] if pred is not None and int(pred) < len(ctx.psi) else None
    out = ["<text x=\"20\" y=\"112\">p̂_lower of the predicted class against its threshold ψ</text>",
           "<rect x=\"20\" y=\"120\" width=\"440\" height=\"14\" fill=\"#eee\"/>",
           f"<rect x=\"20\" y=\"120\" width=\"{440 * min(max(p, 0.0), 1.0):.1f}\" height=\"14\" fill=\"#0969da\"/>"]
    for value, colour, name, y in ((psi, "#cf222e", "ψ", 152), (ctx.alpha, "#1a7f37", "α'", 168)):
        if value is not None:
            x = 20 + 440 * value
            out.append(f"<line x1=\"{x:.1f}\" y1=\"116\" x2=\"{x:.1f}\" y2=\"{y - 10}\" stroke=\"{colour}\"/>"
                       f"<text x=\"{x:.1f}\" y=\"{y}\" fill=\"{colour}\" text-anchor=\"end\">{name} "
                       f"{value:.3f}</text>")
    out.append(f"<text x=\"20\" y=\"152\">p̂_lower {p:.3f}</text>")
    return "".join(out)


def _ladder(row: dict, ctx: PageContext) -> str:
    """The grid levels, marked where the row is admitted (its lower region ≥ the level)."""
    if not ctx.grid:
        return ""
    region = row.get("alpha_region_lower")
    cells = "".join(f"<span class=\"level {'in' if region is not None and region >= a else 'out'}\">{a:g}"
                    f"{' ✓' if region is not None and region >= a else ''}</span>" for a in ctx.grid)
    return (f"<h2>Admitted at each level (lower estimator; nested: admitted at α iff its region ≥ α)</h2>"
            f"<div class=ladder>{cells}</div>")


def render_page(row: dict, ctx: PageContext, *, document=None, prompt=None, answer=None,
                index_href: str | None = None) -> str:
    """The verdict page of one row (``document`` for classification; ``prompt`` and ``answer`` for a
    verified generation)."""
    title = f"Verdict {row.get('id')}"
    parts = [f"<p><a href=\"{esc(index_href)}\">← all rows</a></p>" if index_href else "",
             f"<h1>Verdict for <span dir=\"auto\">{esc(row.get('id'))}</span></h1>", _decision(row, ctx)]
    if prompt is not None or answer is not None:
        parts += [_text_block("Prompt", prompt), _text_block("Answer", answer)]
    else:
        parts.append(_text_block("Document", document))
    parts += [_prediction(row, ctx), _statistics(row, ctx), "<h2>Calibration picture</h2>",
              calibration_svg(row, ctx), _ladder(row, ctx), _exemplars(row, ctx)]
    return _page(title, "\n".join(p for p in parts if p))


def render_index(rows: Sequence[dict], hrefs: Sequence[str], ctx: PageContext, title: str = "Verdicts",
                 summary_html: str = "") -> str:
    """An index of rows sorted by p̂_lower (highest first), linking each row's page."""
    order = sorted(range(len(rows)), key=lambda i: -(rows[i].get("p_lower") or 0.0))
    lines = [f"<h1>{esc(title)}</h1><p>{len(rows)} rows, sorted by p̂_lower; α' = {ctx.alpha:g}.</p>", summary_html,
             "<table><tr><th>id</th><th>decision</th><th>α region (lower)</th><th>p̂_lower</th><th>prediction</th>"
             "<th>label</th></tr>"]
    for i in order:
        r = rows[i]
        decision = r.get("decision") or ("allow" if r.get("admitted") else "reject")
        label = r.get("label")
        lines.append(f"<tr><td dir=\"auto\"><a href=\"{esc(hrefs[i])}\">{esc(r.get('id'))}</a></td>"
                     f"<td><span class=\"decision {esc(decision)}\">{esc(decision)}</span></td>"
                     f"<td>{num(r.get('alpha_region_lower'), 'g')}</td><td>{num(r.get('p_lower'))}</td>"
                     f"<td>{esc(ctx.class_name(r.get('prediction')))}</td>"
                     f"<td>{esc(ctx.class_name(label)) if label is not None else '—'}</td></tr>")
    return _page(title, "".join(lines) + "</table>")


class PageWriter:
    """Writes ``rows/NNNNNN.html`` per row as rows arrive (streaming: only the index fields are kept) and
    ``index.html`` at :meth:`finish`; each file atomically.  File names are row numbers, never row ids
    (which are user strings)."""

    _INDEX_KEYS = ("id", "decision", "admitted", "alpha_region_lower", "p_lower", "prediction", "label")

    def __init__(self, directory, ctx: PageContext):
        from ..storage.files import make_dirs

        self.directory, self.ctx = os.fspath(directory), ctx
        make_dirs(os.path.join(self.directory, "rows"))
        self.entries: list[dict] = []
        self.hrefs: list[str] = []

    def add(self, row: dict, document=None, *, prompt=None, answer=None) -> str:
        """Write one row's page; returns its path."""
        from ..storage.files import write_text

        name = f"rows/{len(self.hrefs):06d}.html"
        path = os.path.join(self.directory, name)
        write_text(path, render_page(row, self.ctx, document=document, prompt=prompt, answer=answer,
                                     index_href="../index.html"))
        self.entries.append({k: row.get(k) for k in self._INDEX_KEYS})
        self.hrefs.append(name)
        return path

    def finish(self, title: str = "Verdicts", summary_html: str = "") -> str:
        """Write ``index.html`` (rows sorted by p̂_lower); returns its path."""
        from ..storage.files import write_text

        index = os.path.join(self.directory, "index.html")
        write_text(index, render_index(self.entries, self.hrefs, self.ctx, title, summary_html))
        return index


def verdict_page(record: dict, verdict_id: str, estimator) -> str:
    """The page of a stored verdict of ``sdm-mlx serve`` / ``mcp`` (its prompt, answer, verifier row and
    exemplars; ``estimator``: the verifier's :class:`~sdm_mlx.estimator.SDMEstimator`)."""
    row = {**(record.get("verifier") or {}), "id": verdict_id, "exemplars": record.get("exemplars") or []}
    if record.get("reason") and not row.get("rejection_reason"):
        row["rejection_reason"] = record["reason"]  # parse failure / predicted unverified: the verdict's reason
    return render_page(row, context_of(estimator), prompt=record.get("prompt"), answer=record.get("answer"))


def verdict_page_path(record: dict, verdict_id: str, estimator, directory: str) -> str:
    """Write :func:`verdict_page` to ``directory/<verdict id>.html`` (atomically); returns the path."""
    from ..storage.files import make_dirs, write_text

    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in verdict_id)
    make_dirs(directory)
    path = os.path.join(directory, f"{safe}.html")
    write_text(path, verdict_page(record, verdict_id, estimator))
    return path
