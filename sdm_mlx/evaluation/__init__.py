"""Evaluation (layer 5): the metrics (:mod:`.metrics`), ``sdm-mlx evaluate``'s report over a model's
predictions (:mod:`.evaluate`) and its files (:mod:`.report`), the figures (:mod:`.plots`), and the baselines
the paper compares against (:mod:`.baselines` over :mod:`.baseline_core` and split-conformal
:mod:`.conformal`).

May import: layers 0-4 (up to :mod:`sdm_mlx.estimator`).  Nothing is imported until used (PEP 562).
"""

from .._lazy import lazy_exports

_EXPORTS = {"evaluate": "evaluate", "index_conditional_report": "metrics"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
