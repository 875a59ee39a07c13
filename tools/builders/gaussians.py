"""Seeded synthetic multi-class Gaussian features: a learnable problem with an optional shifted copy.

Used by ``tools/studies/sweep_defaults.py`` (the evidence behind the estimator's defaults,
``docs/defaults.md``) and by the tests that check the defaults learn.

Class c has mean μ_c = ``separation`` · u_c with u_c a random unit vector in R^D
(fixed by ``seed``), and isotropic unit noise.  The *shifted* split draws from the
same classes after a covariate shift: every row moves by one common random
vector of norm ``shift`` and the noise is scaled by ``noise_scale``, so the
classes stay separable but the rows lie off the training support.
"""

from __future__ import annotations

import numpy as np


def class_means(num_classes: int, dim: int, separation: float, seed: int) -> np.ndarray:
    """[C, D] class means μ_c = separation · u_c (u_c random unit vectors)."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((num_classes, dim))
    return separation * u / np.linalg.norm(u, axis=1, keepdims=True)


def gaussian_classes(
    n: int,
    num_classes: int,
    dim: int = 32,
    separation: float = 3.0,
    seed: int = 0,
    draw_seed: int = 1,
    shift: float = 0.0,
    noise_scale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """(X float32 [n, D], y int64 [n]): balanced labels, rows x = μ_y + shift_vector + noise_scale · ε.

    ``seed`` fixes the problem (class means, shift direction); ``draw_seed`` the rows drawn from it,
    so train / test / shifted splits of one problem share ``seed`` and differ in ``draw_seed``.
    """
    if n < num_classes or num_classes < 2 or dim < 1:
        raise ValueError(f"need n >= C >= 2 and D >= 1, got n={n}, C={num_classes}, D={dim}")
    means = class_means(num_classes, dim, separation, seed)
    direction = np.random.default_rng(seed + 7919).standard_normal(dim)
    offset = shift * direction / np.linalg.norm(direction)
    rng = np.random.default_rng(draw_seed)
    y = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
    X = means[y] + offset + noise_scale * rng.standard_normal((n, dim))
    return X.astype(np.float32), y
