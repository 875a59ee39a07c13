"""Array checks and the Similarity q shared by every index backend (a leaf: the backends import it, it
imports none of them)."""

from __future__ import annotations

import numpy as np

from ..errors import InputError


def good_neighbours_by_class(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """[C, N_support] bool: support j counts towards q of class c iff label_j == pred_j == c."""
    labels = np.asarray(labels)
    predictions = np.asarray(predictions)
    correct = labels == predictions
    return np.stack([correct & (predictions == c) for c in range(num_classes)])


def similarity_from_neighbours(neighbour_idx: np.ndarray, y_hat: np.ndarray, good_by_class: np.ndarray) -> np.ndarray:
    """q from sorted neighbour lists (``equation:q``): length of the leading run of good neighbours.

    ``neighbour_idx`` is [N, k] sorted nearest first; entries < 0 are padding (end the run).
    """
    neighbour_idx = np.asarray(neighbour_idx)
    if neighbour_idx.shape[1] == 0:
        return np.zeros(neighbour_idx.shape[0], dtype=np.int64)
    valid = neighbour_idx >= 0
    good = good_by_class[np.asarray(y_hat)[:, None], np.where(valid, neighbour_idx, 0)] & valid
    return np.cumprod(good, axis=1).sum(axis=1).astype(np.int64)


def _as_float32_matrix(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 2:
        raise InputError(f"{name} must be a 2-D array [rows, dim], got shape {a.shape}")
    if not np.isfinite(a).all():
        raise InputError(f"{name} contains NaN or Inf values")
    return a


def _kept(positions, size: int) -> np.ndarray:
    """[size] bool mask without ``positions`` (unique, in 1..size−1: row 0 anchors the index)."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if pos.size and (pos.min() < 1 or pos.max() >= size):
        raise InputError(f"support positions to remove must lie in 1..{size - 1}")
    if np.unique(pos).size != pos.size:
        raise InputError("support positions to remove must be unique")
    keep = np.ones(size, dtype=bool)
    keep[pos] = False
    return keep


def _exclusion(exclude, n_queries: int) -> np.ndarray | None:
    if exclude is None:
        return None
    ex = np.asarray(exclude, dtype=np.int64).reshape(-1)
    if ex.shape[0] != n_queries:
        raise InputError(f"exclude must hold one support index per query ({n_queries}), got {ex.shape[0]}")
    return ex


def check_predictions(queries: np.ndarray, y_hat, good_by_class, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(ŷ [N] int64, good_by_class [C, size] bool) checked against the N checked ``queries``."""
    y_hat = np.asarray(y_hat, dtype=np.int64).reshape(-1)
    if y_hat.shape[0] != queries.shape[0]:
        raise InputError("y_hat must hold one prediction per query")
    good_np = np.asarray(good_by_class, dtype=bool)
    if good_np.ndim != 2 or good_np.shape[1] != size:
        raise InputError(f"good_by_class must be [C, {size}], got {good_np.shape}")
    if y_hat.size and (y_hat.min() < 0 or y_hat.max() >= good_np.shape[0]):
        raise InputError(f"y_hat must lie in 0..{good_np.shape[0] - 1}")
    return y_hat, good_np
