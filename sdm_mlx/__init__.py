"""sdm_mlx: Similarity-Distance-Magnitude activations, calibration and networks in MLX."""

__version__ = "0.1.0"

from .blas import preload_openblas  # noqa: E402

preload_openblas()  # Linux: a fast BLAS for MLX, loaded before mlx.core (see sdm_mlx/blas.py)

from .activation import log_sdm, sdm, sdm_nll_loss  # noqa: E402
from .adaptor import ExemplarAdaptor  # noqa: E402
from .data import Dataset, load_factcheck, read_jsonl  # noqa: E402
from .distance import distance_ecdfs, distance_quantile  # noqa: E402
from .errors import ArtifactError, InputError, OutputError, SDMError  # noqa: E402
from .estimator import Predictions, SDMEstimator  # noqa: E402
from .index import ExactIndex, HnswIndex, make_index, similarity_from_neighbours  # noqa: E402

__all__ = [
    "sdm", "log_sdm", "sdm_nll_loss", "ExemplarAdaptor", "Dataset", "load_factcheck", "read_jsonl",
    "distance_ecdfs", "distance_quantile", "Predictions", "SDMEstimator", "ExactIndex", "HnswIndex",
    "make_index", "similarity_from_neighbours", "SDMError", "InputError", "OutputError", "ArtifactError",
]
