"""SDM networks on mlx-lm models (paper §"From SDM Calibration to SDM Networks"; DESIGN #17-21).

Only the LM head is duplicated and trained (the trunk stays frozen):

* :mod:`.heads`      — :class:`SDMHeads` (frozen reference/negative head + float32 ``W_pos``), joint argmax
* :mod:`.loss`       — the next-token loss with the masked, rescaled L2 regulariser and the β schedule
* :mod:`.generation` — greedy joint decoding with verifier features, task-answer parsing
* :mod:`.trainer`    — Alg. 4 (:func:`train_network`)
* :mod:`.artifact`   — atomic save / load of the positive head + verification layer
"""

from .artifact import NetworkArtifactError, SDMNetwork, load_network, save_network
from .generation import GeneratedOutput, greedy_generate, parse_task_prediction
from .heads import HeadShapeError, SDMHeads, joint_argmax
from .loss import beta_schedule, network_loss, regularization_mask
from .trainer import NetworkConfig, NetworkTrainResult, SDMNetworkTrainer, train_network

__all__ = [
    "GeneratedOutput", "HeadShapeError", "NetworkArtifactError", "NetworkConfig", "NetworkTrainResult",
    "SDMHeads", "SDMNetwork", "SDMNetworkTrainer", "beta_schedule", "greedy_generate", "joint_argmax",
    "load_network", "network_loss", "parse_task_prediction", "regularization_mask", "save_network",
    "train_network",
]
