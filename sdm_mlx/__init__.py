"""sdm_mlx: Similarity-Distance-Magnitude activations, calibration and networks in MLX."""

__version__ = "0.1.0"
