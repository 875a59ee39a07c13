"""Alg. 4's selection (``alg:sdm-network-training``, DESIGN #20): the calibration count of a head, summed over the
ranks, and the strict rule that keeps an epoch.  :mod:`.trainer` runs it before training and after every epoch."""

from __future__ import annotations

import dataclasses

import time
from typing import Sequence

import numpy as np

from ..errors import SDMError
from ..llm.pooling import verifier_parts
from ..runtime.callbacks import progress_bar as Progress
from .data_parallel import DataParallel
from .generation import DecodeSettings, generation_features, greedy_generate, parse_task_prediction
from .heads import SDMHeads


class VerifierAdmitsNothing(SDMError):
    """The verification layer admits no calibration row: Alg. 4's selection count cannot leave 0."""

    @classmethod
    def of(cls, diag: dict, epochs: int, verifier_path: str) -> "VerifierAdmitsNothing":
        """The error for the admission diagnosis ``diag`` (:mod:`sdm_mlx.calibration.diagnosis`) of a run of
        ``epochs`` epochs whose verification layer is saved in ``verifier_path``."""
        from ..calibration.diagnosis import diagnosis_message

        return cls(
            f"the verification layer admits no calibration row at alpha' = {diag['alpha']:g}, so Alg. 4 could not "
            f"select any epoch (its calibration count stays 0): stopped before the {epochs} epoch(s). The "
            f"verification layer is saved in {verifier_path} (reuse it with --verifier).\n"
            f"{diagnosis_message(diag)}\n(--no-require-admission runs the epochs anyway)")


def count_verified(heads: SDMHeads, tokenizer, verifier, rows: Sequence[dict], completions,
                   settings: DecodeSettings | None = None, *, verbose: bool = False, journal=None) -> dict:
    """Alg. 4's selection metric over ``rows`` (the calibration split): greedy joint decoding of each
    ``prompt``, verification of the generated output, and the count of documents admitted by p̂_lower
    with prediction 1 AND (where the row has a ``task_label`` and ``completions`` are known) a task
    answer parsed from the generated JSON equal to it.  Parse failures count as wrong.
    ``completions``: one list for all rows, or ``{task name: list}`` looked up by each row's ``task``;
    ``settings``: how the prompts are decoded (None: :class:`~sdm_mlx.network.generation.DecodeSettings`' defaults);
    ``journal``: a :class:`~sdm_mlx.network.decode_journal.DecodeJournal` that keeps the decodings as they finish
    (or a :class:`~sdm_mlx.network.decode_journal.GivenDecodings` in front of one; with
    ``settings.keep_decisions`` it keeps their decision states too).
    """
    t0 = time.perf_counter()
    # the features pooled as the verification layer was trained
    settings = dataclasses.replace(settings or DecodeSettings(), feature_parts=verifier_parts(verifier))
    with Progress(len(rows), "generate (calibration)", unit="doc", enabled=verbose) as bar:
        gens = greedy_generate(heads, tokenizer, [r["prompt"] for r in rows], settings=settings, features=True,
                               progress=bar.update, journal=journal)
    pred = verifier.estimate(generation_features(gens), ids=[r["id"] for r in rows], n_exemplars=0)
    admitted = np.asarray(pred.admitted, dtype=bool)
    verified = admitted & (np.asarray(pred.prediction) == 1)
    per_row = [(completions.get(r.get("task")) if isinstance(completions, dict) else completions) for r in rows]
    task_pred = np.array([parse_task_prediction(g.text, c) if c else -1 for g, c in zip(gens, per_row)],
                         dtype=np.int64)
    # the task restriction applies where a task label exists and answers can be parsed (completions known)
    has_task = np.array([r.get("task_label") is not None and bool(c) for r, c in zip(rows, per_row)], dtype=bool)
    task_true = np.array([int(r["task_label"]) if r.get("task_label") is not None else -2 for r in rows])
    correct = np.where(has_task, task_pred == task_true, True)
    return {
        "count": int((verified & correct).sum()),
        "admitted_pred1": int(verified.sum()),
        "admitted": int(admitted.sum()),
        "task_correct": int((correct & has_task).sum()),
        "parse_failures": int((task_pred[has_task] < 0).sum()),
        "documents": len(rows),
        "given": sum(g.stop_reason == "given" for g in gens),  # decodings taken from the base decodings
        "replayed": sum(g.stop_reason == "replayed" for g in gens),  # base decodings this head makes again
        "seconds": time.perf_counter() - t0,
        "example": gens[0].text if gens else None,
    }


def select_improved(count: int, best: int) -> bool:
    """DESIGN #20: a new epoch replaces the kept network only if its count is strictly greater."""
    return int(count) > int(best)


def sum_counts(dp: DataParallel, counts: dict | None) -> dict:
    """Alg. 4's selection count and its parts summed over ranks (``seconds``: the slowest rank's)."""
    keys = ("count", "admitted_pred1", "admitted", "task_correct", "parse_failures", "documents", "given", "replayed")
    local = np.array([counts[k] if counts else 0 for k in keys], dtype=np.int64)
    total = dp.all_sum(local)
    out = {k: int(v) for k, v in zip(keys, total)}
    out["seconds"] = float(dp.all_max(np.array([counts["seconds"] if counts else 0.0], dtype=np.float32))[0])
    out["example"] = counts["example"] if counts else None
    return out


def head_label(epoch: int) -> str:
    return "the untrained base head (epoch 0)" if epoch == 0 else f"the head of epoch {epoch}"
