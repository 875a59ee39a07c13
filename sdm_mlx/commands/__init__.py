"""One module per ``sdm-mlx`` verb (see ``sdm_mlx.cli``)."""
