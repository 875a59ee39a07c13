"""Durable updates of a saved model: load the estimator, change it, save it back atomically under a lock.

It sits above :class:`~sdm_mlx.estimator.SDMEstimator` (it loads and saves one), so it lives apart from
:mod:`.feedback`, which the estimator itself imports; ``sdm-mlx add-support`` and the server call it.
"""

from __future__ import annotations

import logging
import os

from ..errors import ArtifactError, InputError, SDMError
from ..storage.artifact import artifact_kind, artifact_lock, owner_cannot_write  # noqa: F401  (artifact_lock re-exported)
from .feedback import PersistError, _check_unlabelled, feedback_class, summary
from .sdm_estimator import SDMEstimator


def update_model(path, change):
    """Load the saved estimator at ``path``, apply ``change(est)`` and save it back in place atomically.

    The writer protocol of :mod:`sdm_mlx.storage.artifact`: under the directory's lock the current version is
    loaded (so rows another process added are kept), changed, written to a temporary sibling directory,
    fsynced and published by one atomic exchange; a crash at any point leaves either the previous or
    the new model, and a concurrent reader sees one of the two.  Returns ``(est, change(est))``.
    """
    if artifact_kind(os.fspath(path)) is None:
        SDMEstimator.load(path)  # not a model: the clear "no model artifact at ..." error before any lock file
    if owner_cannot_write(os.path.realpath(os.fspath(path))):
        raise ArtifactError(f"cannot write {os.fspath(path)}: the directory is write-protected (its permissions do "
                            f"not allow writing); make it writable (chmod u+w {os.fspath(path)}) to update it")
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


def apply_verdict_feedback(gen, prompt_ids, answer_ids, verdict_id: str, label, *, source: str,
                           persist_path=None) -> dict:
    """Add a verdict's feature row, labelled by the user, to the support set of ``gen``'s verifier.

    The row is recomputed from the verdict's prompt and answer token ids (the verifier's own features)
    and added under the id ``feedback-<verdict_id>`` (so a verdict takes one label).  With
    ``persist_path`` the writer protocol of :func:`update_model` applies it to the version on disk (rows
    other writers added there are kept) and the served verifier becomes that version; without, only the
    in-memory support set changes.  A storage failure raises :class:`PersistError` and changes nothing.
    """
    est, verifier = gen.estimator, gen.verifier
    cls = feedback_class(label, verifier.verified_label, est.num_classes_)
    X, _ = verifier.features(list(prompt_ids), list(answer_ids))
    rid = f"feedback-{verdict_id}"
    _check_unlabelled(est, rid, verdict_id)
    if persist_path:
        def change(disk_est):
            _check_unlabelled(disk_est, rid, verdict_id)
            return disk_est.add_support(X, disk_est.classes_[[cls]], ids=[rid], source=source)[0]

        try:
            est, entry = update_model(persist_path, change)
        except InputError:
            raise
        except (SDMError, OSError) as e:
            logging.getLogger("sdm_mlx.estimator.feedback").error("feedback %s not persisted: %s", verdict_id, e)
            raise PersistError("the feedback could not be saved to the verifier directory (see the server log); "
                               "nothing was recorded") from None
        gen.estimator = verifier.estimator = est  # serve the version on disk from now on
    else:
        entry = est.add_support(X, est.classes_[[cls]], ids=[rid], source=source)[0]
    s = summary(est)
    return {"verdict_id": verdict_id, "support_id": rid, "label": entry["label"],
            "predicted_label": entry["predicted_label"], "persisted": bool(persist_path),
            "support_rows": s["support_rows"], "added_rows": s["added_rows"],
            "retrain_recommended": s["retrain_recommended"]}
