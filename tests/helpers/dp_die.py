"""``sdm-mlx`` with a rank that dies: rank ``DP_DIE_RANK`` (default 1) exits with code 3 when epoch 1 starts.

Run like ``python -m sdm_mlx`` (arguments are the CLI's) on every rank; used by
tests/network/test_data_parallel.py to check that the surviving rank stops with a clear error.
"""

import os
import sys

from sdm_mlx.cli import main
from sdm_mlx.network import trainer

if int(os.environ.get("MLX_RANK", "0")) == int(os.environ.get("DP_DIE_RANK", "1")):

    def _die(*args, **kwargs):
        os._exit(3)

    trainer.SDMNetworkTrainer.run_epoch = _die

sys.exit(main(sys.argv[1:]))
