"""The estimator's settings, in ONE place (no heavy imports: the CLI reads them for ``--help``).

:class:`EstimatorConfig` holds every :class:`sdm_mlx.estimator.SDMEstimator` parameter with its
default and help text; the estimator's keyword defaults, ``sdm-mlx train`` / ``demo`` options and
YAML keys are all generated from it.  :data:`PAPER_SETTINGS` are the paper's exact Alg. 1 settings,
one flag away (``--paper``).  Why the defaults differ from the paper — the sweep, its table and the
reasoning — is in ``docs/defaults.md`` (``tools/studies/sweep_defaults.py`` reproduces it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..calibration import defaults as R
from ..runtime.distributed import DISTRIBUTED_TIMEOUT, TIMEOUT_HELP
from ..settings import defaults, option


@dataclass(frozen=True)
class EstimatorConfig:
    """SDM estimator settings (Alg. 1 training, Alg. 2 rescaler, Alg. 3 calibration)."""

    alpha: float = option(0.95, "target conditional accuracy α'")
    alpha_grid: list[float] | None = option(
        None, "nested calibration: the α levels every row's α region is read on (--alpha is always added; "
              "DESIGN #25)", none_means="0.99 0.98 ... 0.80")
    alpha_allow: float | None = option(None, "decision policy: allow a row whose α region is ≥ this",
                                       none_means="--alpha")
    alpha_review: float | None = option(None, "decision policy: review a row whose α region is ≥ this (below: "
                                              "reject)", none_means="the lowest grid level")
    iterations: int = option(10, "J: rounds over re-splits of train+calibration")
    epochs: int = option(50, "epochs per round; a cap when --patience is on")
    exemplar_dim: int = option(1000, "M: exemplar vector width")
    batch_size: int = option(50, "Adam batch size")
    learning_rate: float = option(1e-4, "Adam learning rate of the adaptor")
    patience: int | None = option(
        5, "convergence-aware stopping: end a round after this many epochs without a better balanced median "
           "calibration q; 0 (or null in YAML) = run every epoch", none_means="off")
    k: int | None = option(None, "neighbours scanned for q", none_means="largest class count")
    normalize: str = option("scalar", "input normalisation (DESIGN #2), statistics fitted on the training split: "
                                      "scalar (one mean/std, the paper), per-dimension (one per feature dimension, "
                                      "for LLM hidden states), none", choices=("scalar", "per-dimension", "none"),
                            booleans=("none", "scalar"))
    stratified: bool = option(True, "split rounds stratified by label (--unstratified: as the research code)")
    index_backend: str = option("exact", "support index backend", choices=("exact", "hnsw"), aliases=("--index",))
    rescaler_max_epochs: int = option(R.DEFAULT_MAX_EPOCHS, "Alg. 2: most epochs of the rescaler W''")
    rescaler_patience: int = option(R.DEFAULT_PATIENCE, "Alg. 2: stop after this many epochs without a better loss")
    rescaler_learning_rate: float = option(R.DEFAULT_LEARNING_RATE, "Alg. 2: Adam learning rate of W''")
    rescaler_engine: str = option(R.DEFAULT_ENGINE, "numpy: host loop (fast); mlx: compiled MLX step (same math, ~10x slower "
                                           "on CPU)", choices=("numpy", "mlx"))
    n_exemplars: int = option(5, "nearest training exemplars reported per row")
    seed: int = option(0, "random seed of splits and initialisation")
    shard_index: bool = option(False, "under mlx.launch with more than one rank, split the exact support index over "
                                      "the ranks (identical results; off: every rank holds all of it; "
                                      "docs/distributed.md)")
    shard_timeout: float = option(DISTRIBUTED_TIMEOUT, "with --shard-index: " + TIMEOUT_HELP)


#: The paper's Alg. 1 settings: J = 10 rounds of 50 epochs, Adam lr 1e-5, batch 50, M = 1000, no early stop.
PAPER_SETTINGS = {
    "iterations": 10,
    "epochs": 50,
    "exemplar_dim": 1000,
    "batch_size": 50,
    "learning_rate": 1e-5,
    "patience": None,
}

#: {name: default} of :class:`EstimatorConfig` (derived; see docs/defaults.md for the evidence).
ESTIMATOR_DEFAULTS = defaults(EstimatorConfig)


def patience_setting(patience):
    """``patience`` as the estimator takes it: the settings' 0 (``--patience 0``, ``patience: 0`` in YAML and
    recipes) means off, i.e. None; a negative value is an error.  The one place that reads the settings' 0."""
    from ..settings import SettingsError

    if patience is not None and patience < 0:
        raise SettingsError(f"patience: expected an integer >= 0 (0 = run every epoch), got {patience}")
    return None if patience == 0 else patience
