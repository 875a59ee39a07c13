"""The estimator's default settings, in ONE place (no heavy imports: the CLI reads them for ``--help``).

:class:`sdm_mlx.estimator.SDMEstimator` takes its keyword defaults from :data:`ESTIMATOR_DEFAULTS`;
``sdm-mlx train`` / ``demo`` take theirs from here too.  :data:`PAPER_SETTINGS` are the paper's exact
Alg. 1 settings, one flag away (``--paper``).  Why the defaults differ from the paper — the sweep,
its table and the reasoning — is in ``docs/defaults.md`` (``tools/sweep_defaults.py`` reproduces it).
"""

from __future__ import annotations

#: The paper's Alg. 1 settings: J = 10 rounds of 50 epochs, Adam lr 1e-5, batch 50, M = 1000, no early stop.
PAPER_SETTINGS = {
    "iterations": 10,
    "epochs": 50,
    "exemplar_dim": 1000,
    "batch_size": 50,
    "learning_rate": 1e-5,
    "patience": None,
}

#: The package defaults (see docs/defaults.md for the evidence).
ESTIMATOR_DEFAULTS = {
    "alpha": 0.95,
    "iterations": 10,
    "epochs": 50,  #: a cap: convergence-aware stopping ends a round earlier
    "exemplar_dim": 1000,
    "batch_size": 50,
    "learning_rate": 1e-4,
    "patience": 5,  #: stop a round after this many epochs without a better balanced median q (None: never)
    "k": None,
    "normalize": True,
    "stratified": True,
    "index_backend": "exact",
    "rescaler_max_epochs": 1000,
    "rescaler_patience": 10,
    "rescaler_learning_rate": 1e-4,
    "rescaler_engine": "numpy",
    "n_exemplars": 5,
    "seed": 0,
}
