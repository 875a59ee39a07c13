"""Universal verification encoding of a labelled task (paper §"Universal Verification Encoding").

From task rows ``(id, label = y_task, document)`` and one completion per task
label (``completions[c]`` is the correct answer for ``y_task = c``, e.g.
``{"correctness": false}`` / ``{"correctness": true}``), each source row is used
**exactly once**, either

* as a positive, ``label = y_verification = 1``: its own label's completion, or
* as a constructed negative, ``label = 0``: another label's completion (the
  flipped one for two classes, a seeded uniform choice among the others for
  more).

Prompts and completions are not paired (a document never appears with both).
The choice is seeded and balanced: ``floor(N/2)`` negatives overall, and within
each task label half of the rows (±1) are negatives, so ``y_task`` does not
predict ``y_verification``.  Output rows keep the source fields and hold
``id``, ``prompt`` (the chat prompt without the assistant turn, ending with the
generation prompt), ``completion``, ``document``, ``task_label`` and ``label``.
``prompt + completion`` is the force-decoded text whose features
``sdm-mlx embed --prompt-field prompt --completion-field completion`` computes.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from ..errors import InputError

PAPER_SYSTEM = "You are a helpful AI assistant."

#: The paper's two tasks (Listing "System and user messages ..." and the data-format table).
PRESETS = {
    "factcheck": {
        "completions": ['{"correctness": false}', '{"correctness": true}'],
        "prompt_template": (
            "Check the following document for hallucinations and/or factual inaccuracies. "
            'Respond using the following JSON: {"correctness": bool}. DOCUMENT: {document}'
        ),
    },
    "sentiment": {
        "completions": ['{"sentiment": "negative"}', '{"sentiment": "positive"}'],
        "prompt_template": (
            "Classify the sentiment of the following movie review. "
            'Respond using the following JSON: {"sentiment": str}. REVIEW: {document}'
        ),
    },
}


def phi3_chat_prompt(user: str, system: str | None = PAPER_SYSTEM) -> str:
    """Phi-3.5-mini-instruct's chat format with the generation prompt (used when no tokenizer is given)."""
    head = f"<|system|>\n{system}<|end|>\n" if system else ""
    return f"{head}<|user|>\n{user}<|end|>\n<|assistant|>\n"


def assign_negatives(task_labels: Sequence[int], seed: int = 0) -> np.ndarray:
    """Boolean mask of constructed negatives: ``floor(N/2)`` in total, half (±1) of each task label.

    Rows are shuffled within each task label (seeded), the groups concatenated
    in label order, and every second row of that sequence becomes a negative.
    """
    y = np.asarray(task_labels)
    rng = np.random.default_rng(seed)
    seq = np.concatenate([rng.permutation(np.flatnonzero(y == c)) for c in np.unique(y)]) if len(y) else []
    neg = np.zeros(len(y), dtype=bool)
    neg[np.asarray(seq, dtype=np.int64)[1::2]] = True
    return neg


def make_verification_rows(
    rows: Sequence[dict],
    completions: Sequence[str],
    prompt_fn: Callable[[str], str],
    seed: int = 0,
    where: Callable[[int], str] = lambda i: f"row {i + 1}",
) -> list[dict]:
    """Verification rows (see the module docstring), in input order.

    ``prompt_fn(document)`` returns the chat prompt; ``where(i)`` names row ``i``
    in error messages.  Raises ValueError for missing fields, non-integer or
    out-of-range labels and repeated ids.
    """
    n_classes = len(completions)
    if n_classes < 2:
        raise InputError("need one completion per task label (at least 2)")
    if len(set(completions)) != n_classes:
        raise InputError("the completions must be distinct")
    labels, seen = [], {}
    for i, row in enumerate(rows):
        for field in ("id", "label", "document"):
            if field not in row:
                raise InputError(f"{where(i)}: missing field {field!r}")
        lab = row["label"]
        if isinstance(lab, bool) or not isinstance(lab, int) or not 0 <= lab < n_classes:
            raise InputError(
                f"{where(i)}: label {lab!r} must be an integer task label in 0..{n_classes - 1} "
                f"(one completion per label was given)"
            )
        if not isinstance(row["document"], str):
            raise InputError(f"{where(i)}: 'document' must be a string")
        key = repr(row["id"])
        if key in seen:
            raise InputError(f"{where(i)}: id {row['id']!r} repeats {where(seen[key])}")
        seen[key] = i
        labels.append(lab)

    negative = assign_negatives(labels, seed)
    rng = np.random.default_rng([seed, 1])
    out = []
    for i, row in enumerate(rows):
        y_task = labels[i]
        if negative[i]:
            others = [c for c in range(n_classes) if c != y_task]
            shown = others[0] if len(others) == 1 else others[int(rng.integers(len(others)))]
        else:
            shown = y_task
        new = {k: v for k, v in row.items() if k not in ("label",)}
        new.update(
            id=row["id"],
            prompt=prompt_fn(row["document"]),
            completion=completions[shown],
            document=row["document"],
            task_label=y_task,
            label=0 if negative[i] else 1,
        )
        out.append(new)
    return out
