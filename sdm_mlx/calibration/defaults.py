"""Alg. 2's rescaler defaults (DESIGN #10), declared once: :func:`~sdm_mlx.calibration.rescaler.train_rescaler`
uses them, and :class:`~sdm_mlx.estimator.config.EstimatorConfig` shows them as the ``rescaler_*`` settings.
Imports nothing (read at ``sdm-mlx --help``)."""

DEFAULT_LEARNING_RATE = 1e-4
DEFAULT_MAX_EPOCHS = 1000
DEFAULT_PATIENCE = 10
DEFAULT_ENGINE = "numpy"
DEFAULT_BETAS = (0.9, 0.999)
DEFAULT_EPS = 1e-8
