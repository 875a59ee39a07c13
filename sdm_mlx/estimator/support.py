"""The support set of a fitted :class:`~sdm_mlx.estimator.sdm_estimator.SDMEstimator`: its index and the mask of
the neighbours that count towards q (``equation:q``), feedback rows added and removed without retraining (:mod:`.feedback` says what that changes), and the kept document texts of
support rows.  A mixin over the estimator's support arrays, index and forward map."""

from __future__ import annotations

import numpy as np

from .. import validation
from ..errors import InputError
from ..index import good_neighbours_by_class
from ..storage.datasets import id_key
from .feedback import FeedbackState, label_indices_for, log_entries, new_ids


class SupportEdits:
    """The support index and its good-neighbour mask, support-set updates (``add_support``, ``remove_support``,
    ``feedback_state_``) and kept documents."""

    @property
    def index_(self):
        """The support index (exact or HNSW) over the support set's exemplar coordinates."""
        self._check_fitted()
        return self._index

    def _good(self) -> np.ndarray:
        """[C, N_support] bool: support j counts towards q of class c iff label_j == pred_j == c.  The mask kept
        by :meth:`_keep_good` while the support arrays are the same objects (fit, load and feedback replace
        them, never change them in place); else computed (prediction does not change the estimator)."""
        labels, predictions, C = self.support_labels_, self.support_predictions_, self.num_classes_
        kept = self.__dict__.get("_good_mask")
        if kept is not None and kept[0] is labels and kept[1] is predictions and kept[2] == C:
            return kept[3]
        return good_neighbours_by_class(labels, predictions, C)

    def _keep_good(self) -> None:
        """Keep :meth:`_good`'s mask (read-only) for the current support arrays: rebuilt per call it cost a
        single-row prediction ~15 µs; called where the support set is set (fit, load, feedback)."""
        labels, predictions, C = self.support_labels_, self.support_predictions_, self.num_classes_
        good = good_neighbours_by_class(labels, predictions, C)
        good.flags.writeable = False
        self._good_mask = (labels, predictions, C, good)

    def keep_documents(self, ids, documents) -> int:
        """Keep the texts of the support rows among ``ids`` (None: no text), to show exemplars with their
        document (``sdm-mlx predict --html``); saved with the model.  Returns how many were kept."""
        if len(ids) != len(documents):
            raise InputError(f"got {len(documents)} documents for {len(ids)} ids")
        self._check_fitted()
        support = {id_key(i) for i in self.support_ids_}
        kept = {id_key(i): str(d) for i, d in zip(ids, documents) if d is not None and id_key(i) in support}
        self.support_documents_ = {**getattr(self, "support_documents_", {}), **kept}
        return len(kept)

    def exemplar_document(self, support_id):
        """The kept document text of a support row (None: not kept)."""
        return getattr(self, "support_documents_", {}).get(id_key(support_id))

    @property
    def feedback_state_(self) -> FeedbackState:
        """Training-support size and update log of the current support set (reset by a new fit)."""
        self._check_fitted()
        state = self.__dict__.get("_feedback")
        if state is None or state.support_ids is not self.support_ids_:
            state = self._feedback = FeedbackState(self.support_ids_, len(self.support_ids_))
        return state

    def _taken_ids(self) -> set:
        taken = self.__dict__.get("_taken")
        if taken is None or taken[0] is not self.support_ids_:
            keys = {id_key(i) for i in self.support_ids_} | {id_key(i) for i in self.calibration_ids_}
            taken = self._taken = (self.support_ids_, keys)
        return taken[1]

    def add_support(self, X, y, ids=None, source: str = "api") -> list[dict]:
        """Append labelled rows to the support set without retraining; returns their update-log entries.

        Each row's exemplar coordinates h' and prediction ŷ come from the batch-invariant forward
        that computed the training support's; (h', label, ŷ, id) is appended to the support set and
        its index (exact: rows appended; hnsw: ``add_items``, no rebuild).  A row counts towards q of
        class c iff label = ŷ = c, as every training support row does.

        Changes for later queries: q (``equation:q``, counted over the enlarged support; the cap k is
        kept), d0 and therefore d (d0's quantile against the FIXED calibration eCDFs), and the
        returned nearest exemplars.  Unchanged: the adaptor and z', the calibration eCDFs of d0,
        the rescaler W'', Alg. 3's ψ and min valid q~, the Cauchy robust threshold and offsets —
        q and d are defined over the training support, the calibration statistics over the
        calibration split, which feedback does not change (see :mod:`sdm_mlx.estimator.feedback`).

        ``ids`` (default: fresh ``feedback-<hex>`` ids) must be unique and must not be support or
        calibration ids of this model; ``source`` names who sent the rows (api, cli, server, mcp...).
        """
        state = self.feedback_state_
        X = validation.features(X, "added support rows", dim=self.input_dim_, model=type(self).__name__)
        y = label_indices_for(y, X.shape[0], self.classes_, "added support labels")
        if not isinstance(source, str) or not source.strip():
            raise InputError("source must be a non-empty string")
        taken = self._taken_ids()
        ids = new_ids(ids, X.shape[0], taken, "added support ids")
        z, h = self._forward_map(X)
        pred = z.argmax(axis=1).astype(np.int64)
        if self._index is not None:
            self._index.append(h)
        self.support_vectors_ = np.concatenate([self.support_vectors_, h.astype(self.support_vectors_.dtype)])
        self.support_labels_ = np.concatenate([self.support_labels_, y])
        self.support_predictions_ = np.concatenate([self.support_predictions_, pred])
        self.support_ids_ = self.support_ids_ + ids
        self._keep_good()
        state.support_ids = self.support_ids_
        taken.update(id_key(i) for i in ids)
        self._taken = (self.support_ids_, taken)
        entries = log_entries("add", ids, y, pred, source)
        state.log.extend(entries)
        return entries

    def remove_support(self, ids, source: str = "api") -> list[dict]:
        """Undo :meth:`add_support` for rows by id; returns the update-log entries.

        Only rows added by feedback can be removed: the training support is the set the calibration
        split was measured against.  Removing every added row restores the training support, and
        with it every prediction, bit for bit (exact index)."""
        state = self.feedback_state_
        n_train = state.n_training
        added = {id_key(i): p for p, i in enumerate(self.support_ids_[n_train:], n_train)}
        positions, seen = [], set()
        for rid in list(ids):
            key = id_key(rid)
            if key in seen:
                raise InputError(f"id {rid!r} is given twice")
            seen.add(key)
            if key in added:
                positions.append(added[key])
            elif key in self._taken_ids():
                raise InputError(f"id {rid!r} is a training support or calibration row; only rows added by "
                                 "feedback (add_support) can be removed")
            else:
                raise InputError(f"id {rid!r} is not a support row of this model")
        if not positions:
            raise InputError("no ids to remove")
        positions = np.asarray(positions, dtype=np.int64)
        removed = [(self.support_ids_[p], self.support_labels_[p], self.support_predictions_[p]) for p in positions]
        if self._index is not None:
            self._index.remove(positions)
        keep = np.ones(len(self.support_ids_), dtype=bool)
        keep[positions] = False
        self.support_vectors_ = self.support_vectors_[keep]
        self.support_labels_ = self.support_labels_[keep]
        self.support_predictions_ = self.support_predictions_[keep]
        self.support_ids_ = [i for i, k in zip(self.support_ids_, keep) if k]
        self._keep_good()
        state.support_ids = self.support_ids_
        self.__dict__.pop("_taken", None)
        entries = log_entries("remove", *map(list, zip(*removed)), source)
        state.log.extend(entries)
        return entries
