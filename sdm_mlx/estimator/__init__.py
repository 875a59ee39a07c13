"""The SDM estimator (layer 4): :class:`SDMEstimator` (:mod:`.sdm_estimator`) fits the adaptor, the support
index and the J calibration rounds, and predicts with p̂_lower, over its bases :mod:`.params` (the scikit-learn
parameter protocol), :mod:`.alpha_levels` (the calibration at α' and the grid's levels) and :mod:`.support` (the
support index and its feedback edits); what ``fit`` runs (:mod:`.fitting`); its parameters and their one set of
defaults (:mod:`.config`), one Alg. 1 training round (:mod:`.training`), the J rounds with their calibration
(:mod:`.rounds`), per-round checkpoints (:mod:`.checkpoint`), prediction in bounded chunks (:mod:`.chunking`),
the artifact on disk (:mod:`.persistence`), the feedback log and support edits (:mod:`.feedback`) and the
load-edit-save helpers the CLI and the server use (:mod:`.updates`).

May import: layers 0-3 (:mod:`sdm_mlx.errors`, :mod:`sdm_mlx.results`, :mod:`sdm_mlx.runtime`,
:mod:`sdm_mlx.storage`, :mod:`sdm_mlx.core`, :mod:`sdm_mlx.index`, :mod:`sdm_mlx.calibration`).  Inside the
package, :mod:`.sdm_estimator` and :mod:`.updates` sit on top: nothing else here imports them.  Nothing is
imported until used (PEP 562), so ``EstimatorConfig`` is read at ``sdm-mlx --help`` without MLX.
"""

from .._lazy import lazy_exports

_EXPORTS = {"SDMEstimator": "sdm_estimator", "EstimatorConfig": "config", "FittedState": "state"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
