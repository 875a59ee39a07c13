"""sdm_mlx: Similarity-Distance-Magnitude activations, calibration and networks in MLX.

The public names below are imported on first use (PEP 562), so ``import sdm_mlx`` and
``sdm-mlx --help`` stay instant and do not load MLX; importing the package does load a fast
BLAS for MLX on Linux first (see :mod:`sdm_mlx.runtime.blas`).
"""

__version__ = "0.1.0"

from .runtime.blas import preload_openblas  # noqa: E402

preload_openblas()  # Linux: a fast BLAS for MLX, loaded before mlx.core (see sdm_mlx/runtime/blas.py)

#: public name -> the module that defines it
_EXPORTS = {
    "sdm": "core.activation", "log_sdm": "core.activation", "sdm_nll_loss": "core.activation",
    "ExemplarAdaptor": "core.adaptor",
    "Dataset": "storage.datasets", "load_factcheck": "storage.datasets", "read_jsonl": "storage.datasets",
    "distance_ecdfs": "core.distance", "distance_quantile": "core.distance",
    "Predictions": "results", "Estimate": "results", "Variant": "results", "SDMEstimator": "estimator",
    "Calibration": "calibration",
    "ExactIndex": "index", "HnswIndex": "index", "make_index": "index", "similarity_from_neighbours": "index",
    "SDMError": "errors", "InputError": "errors", "OutputError": "errors", "ArtifactError": "errors",
    "NotFittedError": "errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sdm_mlx' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
