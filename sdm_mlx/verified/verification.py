"""Verification of one generated answer by the SDM verification layer (an :class:`~sdm_mlx.estimator.SDMEstimator`).

Features: the prompt's token ids followed by the generated token ids are run
through the frozen trunk once, exactly as :mod:`sdm_mlx.llm.embed` does for a
force-decoded prompt + completion (:func:`~sdm_mlx.llm.embed.document_features`
on token ids, completion span = the generated tokens): ``concat(mean(h_0 ..
h_{n-1}), h_{n-1})`` where ``h_{n-1}`` is the state that predicts the token
holding the answer's last closing delimiter, capped at ``max_length``
positions; without a delimiter (a parse failure) only the prompt positions
are pooled.  The generated ids are used as generated (not re-tokenised text).

Verdict (the verification label convention: 1 = correct completion):
``verified`` iff the answer parses (a closing delimiter and, with
``require_json``, a JSON object) **and** the index-conditional estimate is
admitted (p̂_lower, not ⊥) **and** the verification prediction ŷ is 1.
Otherwise ``reason`` is the first failing condition:

* ``"parse_failure"`` — no closing delimiter / no JSON object in the answer;
* an estimator rejection (:data:`sdm_mlx.calibration.REJECTION_REASONS`):
  ``"ood_distance"``, ``"ood_similarity"``, ``"argmax_flip"``,
  ``"below_model_min_qbin"``, ``"below_robust_min_qbin"``,
  ``"below_threshold_psi"``, ``"no_valid_threshold"``, ``"no_robust_threshold"``;
* ``"predicted_unverified"`` — admitted, but the verifier predicts the answer is
  incorrect (ŷ ≠ 1).

The nearest training exemplars (id, label, predicted label, squared distance)
are returned as evidence in every case.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from ..llm import embed as _embed
from ..storage.files import finite_or_none, strict
from ..network.generation import first_json_object
from ..results import VERDICT_FLOAT_KEYS, VERDICT_KEYS
from ..errors import InputError

PARSE_FAILURE = "parse_failure"
PREDICTED_UNVERIFIED = "predicted_unverified"
#: Fields of the estimator's per-row result copied into a verdict's ``verifier`` record (derived from the
#: result dataclasses: the fields marked ``verdict`` in :mod:`sdm_mlx.results`).
VERIFIER_FIELDS = VERDICT_KEYS


@dataclass
class VerifyItem:
    """One answer to verify: prompt and answer token ids, the answer text, an id, optional pooled features."""

    prompt_ids: list
    answer_ids: list
    text: str
    id: object = None
    features: tuple | None = None  # (X [1, 2D], info) pooled from the decoding of exactly prompt + answer


@dataclass
class Verdict:
    """The verification of one answer (see the module docstring)."""

    verified: bool
    reason: str | None
    p_lower: float | None
    parsed: dict | None
    exemplars: list = field(default_factory=list)
    verifier: dict = field(default_factory=dict)
    feature_seconds: float = 0.0
    estimate_seconds: float = 0.0
    row: dict = field(default_factory=dict)  # the estimator's full per-row output (JSON-safe), for explanations

    @property
    def seconds(self) -> float:
        return self.feature_seconds + self.estimate_seconds


class AnswerVerifier:
    """``verifier(prompt_ids, answer_ids, text, id=None) -> Verdict`` with a fitted binary ``SDMEstimator``."""

    def __init__(self, model, tokenizer, estimator, *, delimiter: str = _embed.DEFAULT_DELIMITER,
                 max_length: int = _embed.DEFAULT_MAX_LENGTH, n_exemplars: int = 5, require_json: bool = True,
                 verified_label: int = 1):
        if not estimator.is_fitted:
            raise InputError("the verification layer is not fitted")
        from ..llm.model import model_dims
        from ..llm.pooling import verifier_parts

        _, hidden = model_dims(model)
        self.feature_parts = verifier_parts(estimator)  #: the pooled parts the layer was trained on
        width = len(self.feature_parts) * hidden
        if estimator.input_dim_ != width:
            raise InputError(
                f"the verification layer expects {estimator.input_dim_}-dim features but this model gives "
                f"{len(self.feature_parts)} x {hidden} = {width} ({' ⊕ '.join(self.feature_parts)}): it was trained on "
                "another model's features"
            )
        if not 0 <= verified_label < estimator.num_classes_:
            raise InputError(f"verified_label {verified_label} is not a class of the verification layer")
        self.model, self.tokenizer, self.estimator = model, tokenizer, estimator
        self.delimiter, self.max_length = delimiter, int(max_length)
        self.n_exemplars, self.require_json, self.verified_label = int(n_exemplars), require_json, verified_label

    def features(self, prompt_ids: Sequence[int], answer_ids: Sequence[int]):
        """``(embedding [1, len(feature_parts)·D] float32, Features)`` of prompt + answer tokens (embed.py's
        construction)."""
        feats = self.features_batch([(prompt_ids, answer_ids)])
        return feats.embeddings, feats

    def features_batch(self, pairs: Sequence[tuple]):
        """:class:`~sdm_mlx.llm.embed.Features` of each ``(prompt ids, answer ids)`` pair, in one batched pass."""
        docs = [[int(t) for t in p] + [int(t) for t in a] for p, a in pairs]
        return _embed.document_features(
            self.model, self.tokenizer, docs, [(len(p), None) for p, _ in pairs], position="delimiter",
            delimiter=self.delimiter, max_length=self.max_length, batch_size=8, on_missing="prompt",
            parts=self.feature_parts,
        )

    def __call__(self, prompt_ids, answer_ids, text: str, id=None, features=None) -> Verdict:
        """Verify ``answer_ids`` after ``prompt_ids``.  ``features``: ``(X [1, 2D], info)`` already pooled from
        the decoding of exactly this prompt + answer (``Decoded.features`` / ``feature_info``); then the
        feature pass is skipped."""
        return self.verify_many([VerifyItem(list(prompt_ids), list(answer_ids), text, id, features)])[0]

    def verify_many(self, items: Sequence["VerifyItem"]) -> list:
        """The :class:`Verdict` of every item: one batched feature pass for the items without features, one
        batched estimate for all (the estimate is per row: a verdict does not depend on the other items)."""
        import numpy as np

        t0 = time.perf_counter()
        need = [i for i, it in enumerate(items) if it.features is None or it.features[0] is None]
        pooled = {i: (np.asarray(it.features[0], dtype=np.float32).reshape(1, -1), it.features[1])
                  for i, it in enumerate(items) if i not in need}
        if need:
            feats = self.features_batch([(items[i].prompt_ids, items[i].answer_ids) for i in need])
            for k, i in enumerate(need):
                info = {f: getattr(feats, f)[k] for f in ("n_kept", "delimiter_index", "missing_delimiter",
                                                          "truncated")}
                pooled[i] = (feats.embeddings[k : k + 1], info)
        t1 = time.perf_counter()
        X = np.concatenate([pooled[i][0] for i in range(len(items))], axis=0)
        rows = self.estimator.estimate(X, ids=[it.id for it in items], n_exemplars=self.n_exemplars).to_dicts()
        t2 = time.perf_counter()
        return [self._verdict(row, it.text, pooled[i][1], t1 - t0, t2 - t1) for i, (row, it) in
                enumerate(zip(rows, items))]

    def _verdict(self, row: dict, text: str, info: dict, feature_seconds: float, estimate_seconds: float):
        parsed = first_json_object(text)
        missing = bool(info["missing_delimiter"])
        record = {k: row[k] for k in VERIFIER_FIELDS}
        for k in VERDICT_FLOAT_KEYS:
            record[k] = finite_or_none(record[k])
        record.update(n_kept=int(info["n_kept"]), delimiter_index=int(info["delimiter_index"]),
                      missing_delimiter=missing, truncated=bool(info["truncated"]))
        if missing or (self.require_json and parsed is None):
            reason = PARSE_FAILURE
        elif not row["admitted"]:
            reason = row["rejection_reason"]
        elif row["prediction"] != self.verified_label:
            reason = PREDICTED_UNVERIFIED
        else:
            reason = None
        return Verdict(
            verified=reason is None, reason=reason, p_lower=record["p_lower"], parsed=parsed,
            exemplars=row["exemplars"], verifier=record, feature_seconds=feature_seconds,
            estimate_seconds=estimate_seconds,
            row=strict(row),
        )

