"""Optional evaluation plots (PNG files).  matplotlib is an optional dependency
(``pip install 'sdm_mlx[plots]'``): it is imported only when a plot is drawn, and figures are
rendered with the non-interactive Agg canvas directly (no pyplot, so no global backend
state is touched)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
from ..errors import InputError

__all__ = ["plots_available", "plot_admitted_vs_accuracy", "plot_qbin_histogram"]

_INSTALL_HINT = "plotting needs matplotlib; install it with: pip install 'sdm_mlx[plots]'"


def plots_available() -> bool:
    """True iff matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except Exception:
        return False
    return True


def _new_figure(figsize):
    """A matplotlib Figure attached to an Agg canvas (lazy import)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path) -> str:
    """Render ``fig`` as PNG and write it with :func:`sdm_mlx.storage.files.atomic_write` (mode 0644, never a temp name)."""
    from ..storage.files import atomic_write

    path = os.fspath(path)
    fig.tight_layout()
    with atomic_write(path, binary=True) as f:
        fig.savefig(f, dpi=120, format="png")
    return path


def _accuracy_value(v) -> float | None:
    """Reduce the accuracy element of a curve point to one number (or None = N/A):
    a number, a report dict from :func:`sdm_mlx.evaluation.metrics.index_conditional_report`
    (its ``min_conditional_accuracy``), or a sequence of conditional accuracies (their
    minimum, ignoring None)."""
    if v is None:
        return None
    if isinstance(v, Mapping):
        return _accuracy_value(v.get("min_conditional_accuracy"))
    if isinstance(v, (Sequence, np.ndarray)) and not isinstance(v, (str, bytes)):
        vals = [float(x) for x in v if x is not None and not math.isnan(float(x))]
        return min(vals) if vals else None
    f = float(v)
    return None if math.isnan(f) else f


def _plot_curve(ax_frac, ax_alpha, name: str, pts: list, color: str, annotate_alpha: bool) -> None:
    """One estimator's ``(alpha, admitted fraction, accuracy or None)`` points on both panels."""
    ok = [(a, f, acc) for a, f, acc in pts if acc is not None]
    na = [(a, f) for a, f, acc in pts if acc is None]
    if ok:
        ax_frac.plot([f for _, f, _ in ok], [acc for _, _, acc in ok], "o-", color=color, label=name, markersize=4)
        ax_alpha.plot([a for a, _, _ in ok], [acc for _, _, acc in ok], "o-", color=color, label=name, markersize=4)
        if annotate_alpha:
            for a, f, acc in ok:
                ax_frac.annotate(f"{a:g}", (f, acc), textcoords="offset points", xytext=(3, 3), fontsize=6,
                                 color=color)
    if na:
        ax_frac.plot([f for _, f in na], [1.0] * len(na), "o", mfc="none", color=color, markersize=5,
                     label=None if ok else name)
        ax_alpha.plot([a for a, _ in na], [1.0] * len(na), "o", mfc="none", color=color, markersize=5,
                      label=None if ok else name)


def plot_admitted_vs_accuracy(curves: Mapping[str, Sequence[tuple]], path, *,
                              title: str | None = None, annotate_alpha: bool = True) -> str:
    """Admitted fraction vs (minimum) conditional accuracy per estimator across α'.

    Args:
        curves: ``{estimator: [(alpha, admitted_fraction, accuracy), ...]}`` where
            ``accuracy`` is the min class-/prediction-conditional accuracy (a float, or None
            when nothing is admitted), a sequence of the conditional accuracies (min taken),
            or a metrics report dict (``min_conditional_accuracy`` used) -- e.g. built with
            :func:`sdm_mlx.evaluation.metrics.curve_point`.
        path: output PNG path (parent directories are created).
        title: optional figure title.
        annotate_alpha: label each point with its α'.

    Left panel: x = admitted fraction, y = min conditional accuracy (points with nothing
    admitted are drawn as hollow markers at y = 1, the "N/A" convention).  Right panel: the
    same accuracy against α' with the y = α' target line (points under it violate
    index-conditional calibration).

    Returns:
        ``path`` as a string.
    """
    fig = _new_figure((11.0, 4.6))
    ax_frac, ax_alpha = fig.subplots(1, 2)
    all_alphas = []
    for i, (name, points) in enumerate(curves.items()):
        pts = sorted(((float(a), float(f), _accuracy_value(acc)) for a, f, acc in points),
                     key=lambda t: t[0])
        if not pts:
            continue
        all_alphas += [a for a, _, _ in pts]
        _plot_curve(ax_frac, ax_alpha, str(name), pts, f"C{i % 10}", annotate_alpha)
    if all_alphas:
        lo, hi = min(all_alphas), max(all_alphas)
        ax_alpha.plot([lo, hi], [lo, hi], "k--", linewidth=0.8, label="target y = alpha'")
    ax_frac.set_xlabel("admitted fraction |admitted| / N")
    ax_frac.set_ylabel("min conditional accuracy (admitted)")
    ax_frac.set_xlim(-0.02, 1.02)
    ax_alpha.set_xlabel("alpha'")
    ax_alpha.set_ylabel("min conditional accuracy (admitted)")
    for ax in (ax_frac, ax_alpha):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax_frac.set_title("hollow = nothing admitted (N/A)", fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_qbin_histogram(hard_bins_admitted, hard_bins_rejected, path, *,
                        title: str | None = None, density: bool = False) -> str:
    """Distribution of hard q-bins (integer ⌊q̃⌋) of admitted vs rejected rows, as side-by-side
    bars per bin.

    Args:
        hard_bins_admitted: hard bins of the admitted rows (integers >= 0).
        hard_bins_rejected: hard bins of the rejected rows.
        path: output PNG path (parent directories are created).
        title: optional axes title.
        density: plot each group's proportion instead of counts.

    Returns:
        ``path`` as a string.
    """
    adm = np.asarray(hard_bins_admitted, dtype=np.float64).reshape(-1)
    rej = np.asarray(hard_bins_rejected, dtype=np.float64).reshape(-1)
    adm, rej = adm[np.isfinite(adm)].astype(np.int64), rej[np.isfinite(rej)].astype(np.int64)
    if (adm.size and adm.min() < 0) or (rej.size and rej.min() < 0):
        raise InputError("hard bins must be non-negative integers")
    top = int(max(adm.max() if adm.size else 0, rej.max() if rej.size else 0))
    bins = np.arange(top + 1)
    c_adm = np.bincount(adm, minlength=top + 1).astype(np.float64)
    c_rej = np.bincount(rej, minlength=top + 1).astype(np.float64)
    if density:
        c_adm = c_adm / max(c_adm.sum(), 1.0)
        c_rej = c_rej / max(c_rej.sum(), 1.0)
    fig = _new_figure((max(6.0, 0.35 * (top + 1) + 2.0), 4.0))
    ax = fig.subplots()
    width = 0.4
    ax.bar(bins - width / 2, c_adm, width=width, label=f"admitted (n={adm.size})", color="C2")
    ax.bar(bins + width / 2, c_rej, width=width, label=f"rejected (n={rej.size})", color="C3")
    ax.set_xticks(bins)
    ax.set_xlabel("hard q-bin")
    ax.set_ylabel("proportion" if density else "count")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    if title:
        ax.set_title(title)
    return _save(fig, path)
