"""The paper's primitives (layer 2): the SDM activation and its loss (:mod:`.activation`), the exemplar
adaptor that gives z' and h' (:mod:`.adaptor`), the batch-invariant products it runs on
(:mod:`.exact_product`) and the distance quantiles d (:mod:`.distance`).  Each function cites its equation in
``docs/paper-map.md``.

May import: layer 0 (:mod:`sdm_mlx.errors`, :mod:`sdm_mlx.validation`, :mod:`sdm_mlx.runtime`) and layer 1
(:mod:`sdm_mlx.storage`).  Nothing is imported until used (PEP 562).
"""

from .._lazy import lazy_exports

_EXPORTS = {"sdm": "activation", "log_sdm": "activation", "sdm_nll_loss": "activation",
            "ExemplarAdaptor": "adaptor", "distance_ecdfs": "distance", "distance_quantile": "distance"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
