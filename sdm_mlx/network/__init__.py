"""SDM networks on mlx-lm models (paper §"From SDM Calibration to SDM Networks"; DESIGN #17-21).

Only the LM head is duplicated and trained (the trunk stays frozen):

* :mod:`.heads`      — :class:`SDMHeads` (frozen reference/negative head + float32 ``W_pos``), joint argmax
* :mod:`.loss`       — the next-token loss with the masked, rescaled L2 regulariser and the β schedule
* :mod:`.generation` — greedy joint decoding with verifier features, task-answer parsing
* :mod:`.trainer`    — Alg. 4 (:func:`train_network`)
* :mod:`.artifact`   — atomic save / load of the positive head + verification layer
* :mod:`.config`     — :class:`NetworkConfig` (the ``network-train`` settings)
* :mod:`.step`, :mod:`.training_data`, :mod:`.data_parallel` — one training step, the task data, ranks

May import: layers 0-5 (up to :mod:`sdm_mlx.estimator`; the verification layer is an
:class:`~sdm_mlx.estimator.SDMEstimator`) and mlx-lm.  Nothing is imported until used (PEP 562), so
``NetworkConfig`` is read at ``sdm-mlx --help`` without MLX.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "NetworkArtifactError": "artifact", "SDMNetwork": "artifact", "load_network": "artifact",
    "save_network": "artifact", "greedy_generate": "generation", "DecodeSettings": "generation",
    "parse_task_prediction": "generation", "HeadShapeError": "heads", "SDMHeads": "heads", "joint_argmax": "heads",
    "beta_schedule": "loss", "network_loss": "loss", "regularization_mask": "loss", "NetworkConfig": "config",
    "NetworkTrainResult": "trainer", "SDMNetworkTrainer": "trainer", "train_network": "trainer",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
