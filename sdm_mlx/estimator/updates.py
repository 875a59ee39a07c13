"""Durable updates of a saved model: load the estimator, change it, save it back atomically under a lock.

It sits above :class:`~sdm_mlx.estimator.SDMEstimator` (it loads and saves one), so it lives apart from
:mod:`.feedback`, which the estimator itself imports; ``sdm-mlx add-support`` and the server call it.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager

from ..errors import ArtifactError
from ..storage.artifact import artifact_kind
from .sdm_estimator import SDMEstimator


@contextmanager
def artifact_lock(path):
    """An exclusive lock serialising updates of the model directory ``path`` (a hidden sibling lock file,
    ``.<name>.sdm-lock``: the directory itself is swapped by every update, so it cannot carry the lock)."""
    real = os.path.realpath(os.fspath(path))
    parent, base = os.path.split(real)
    lock = os.path.join(parent, f".{base}.sdm-lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as e:
        raise ArtifactError(f"cannot lock {path} for an update: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def update_model(path, change):
    """Load the saved estimator at ``path``, apply ``change(est)`` and save it back in place atomically.

    Durable and atomic: the new artifact (support arrays, manifest, update log) is written to a
    temporary sibling directory, fsynced and swapped in (:func:`sdm_mlx.storage.artifact.atomic_directory`), so
    a crash at any point leaves either the previous or the new model loadable.  Concurrent updates of
    the same directory are serialised (:func:`artifact_lock`).  Returns ``(est, change(est))``.
    """
    if artifact_kind(os.fspath(path)) is None:
        # not a model: raises the clear "no model artifact at ..." error before any lock file is made
        # (and repairs a save interrupted between its two renames)
        SDMEstimator.load(path)
    with artifact_lock(path):
        est = SDMEstimator.load(path)
        est.verbose = False
        result = change(est)
        est.save(path, overwrite=True)  # the user asked for this in-place replacement
    return est, result


def add_support_to_model(path, X, y, ids=None, source: str = "api"):
    """:meth:`SDMEstimator.add_support` on the saved model at ``path``, persisted atomically; returns log entries."""
    return update_model(path, lambda est: est.add_support(X, y, ids=ids, source=source))[1]


def remove_support_from_model(path, ids, source: str = "api"):
    """:meth:`SDMEstimator.remove_support` on the saved model at ``path``, persisted atomically."""
    return update_model(path, lambda est: est.remove_support(ids, source=source))[1]
