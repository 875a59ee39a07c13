"""Bounded-memory prediction: ``SDMEstimator.estimate`` over many rows, one chunk of rows at a time.

Every per-row result is a function of that row and the model alone (batch invariance: docs/how-it-works.md),
so scoring N rows in chunks of ``chunk_rows`` gives the same answers, bit for bit, as one call.
What a chunk costs is bounded independently of N:

* the adaptor forward holds ``chunk_rows × D`` float64 values (x_norm and its two integer slices:
  ≈ 24 · chunk_rows · D bytes, in products of at most :data:`~sdm_mlx.core.exact_product.CHUNK_ROWS` rows);
* the exact index holds one block of query × support distances at a time
  (:data:`~sdm_mlx.index.exact.DISTANCE_BLOCK_BYTES`, 256 MiB by default: the block has
  ``min(4096, budget / (4 N_s))`` query rows) and its temporaries (the host copy, screening keys,
  masks and bands: about 5 blocks at most), plus the float64 re-ranking chunk
  (``ExactIndex.RERANK_BYTES``, 64 MiB);
* the calibration math holds O(chunk_rows · C) values.

So a prediction of N rows needs the inputs, the support set, O(chunk_rows · (D + 3 budgets)) of
working memory, and the outputs, O(N · (C + n_exemplars)) — about (12 C + 12 n + 100) bytes a row in
arrays — which :func:`iter_estimates` lets a caller stream to disk instead.

Each path chunks once: ``SDMEstimator.estimate`` / ``iter_estimate`` split an array with :func:`chunk_bounds`
and validate each chunk; ``sdm-mlx predict`` reads the file in chunks (:func:`read_jsonl_chunks`, which
validates the rows) and scores each one as it was read (:func:`estimate_read_chunks`); ``sdm-mlx evaluate``
reads whole files and scores them with :func:`estimate_read`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np

from ..errors import InputError
from ..runtime.callbacks import progress_bar
from ..results import Estimate, Predictions, Variant

#: Rows scored per chunk by ``SDMEstimator.estimate`` / ``sdm-mlx predict``.
PREDICT_CHUNK_ROWS = 8192


def chunk_bounds(n: int, chunk_rows: int = PREDICT_CHUNK_ROWS):
    """(start, stop) of consecutive chunks covering rows 0..n−1."""
    if chunk_rows < 1:
        raise InputError(f"chunk_rows must be ≥ 1, got {chunk_rows}")
    return [(s, min(s + chunk_rows, n)) for s in range(0, n, chunk_rows)]


def iter_estimates(score_chunk, X, ids=None, chunk_rows: int = PREDICT_CHUNK_ROWS, progress: bool = False,
                   desc: str = "predict"):
    """Yield ``score_chunk(X[a:b], ids[a:b])`` (a :class:`Predictions`) for consecutive chunks of rows.

    ``progress`` draws a bar with rows/s and ETA on stderr (:func:`~sdm_mlx.runtime.callbacks.progress_bar`).
    """
    n = len(X)
    ids = ids if ids is not None else range(n)  # a range: no O(N) list when streaming
    if len(ids) != n:
        raise InputError(f"got {len(ids)} ids for {n} rows")
    with progress_bar(n, desc, unit="rows", enabled=progress) as bar:
        for a, b in chunk_bounds(n, chunk_rows):
            try:
                pred = score_chunk(X[a:b], ids[a:b])
            except InputError as e:
                raise InputError(f"rows {a}..{b - 1}: {e}") from None
            bar.update(b - a)
            yield pred


def _concat_fields(cls, parts: list, skip: dict):
    """One instance of dataclass ``cls`` whose array fields are the row-wise concatenation of ``parts``."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            values[f.name] = skip[f.name](parts)
            continue
        first = getattr(parts[0], f.name)
        if isinstance(first, np.ndarray):
            values[f.name] = np.concatenate([getattr(p, f.name) for p in parts])
        else:
            values[f.name] = first
    return cls(**values)


def _concat_estimates(parts: list[Estimate]) -> Estimate:
    variants = {name: (lambda ps, name=name: _concat_fields(Variant, [getattr(p, name) for p in ps], {}))
                for name in ("lower", "centroid", "upper")}
    return _concat_fields(Estimate, parts, variants)


def concat_predictions(parts: list[Predictions]) -> Predictions:
    """The :class:`Predictions` of all rows of ``parts`` (chunks of one model's predictions), in order."""
    if len(parts) == 1:
        return parts[0]
    return _concat_fields(Predictions, parts, {
        "ids": lambda ps: [i for p in ps for i in p.ids],
        "estimate": lambda ps: _concat_estimates([p.estimate for p in ps]),
        "support_labels": lambda ps: ps[0].support_labels,  # the model's, not per row
        "support_predictions": lambda ps: ps[0].support_predictions,
    })


def read_jsonl_chunks(path, features: str = "auto", prefer: str | None = None,
                      chunk_rows: int = PREDICT_CHUNK_ROWS, require_labels: bool = False, *, label_names=None):
    """Yield :class:`~sdm_mlx.storage.datasets.Dataset` s of consecutive chunks of ``chunk_rows`` rows of a JSONL file.

    Streaming :func:`~sdm_mlx.storage.datasets.read_jsonl`: every chunk is validated as ``read_jsonl`` validates a
    file (errors name the file and line), and across chunks the ids must stay unique (the error names
    the line an id was first seen on), the feature field and width and the presence of labels the
    same.  Memory: one chunk of rows plus the set of ids seen.  ``label_names``: a model's class names, through
    which string labels are read (:func:`~sdm_mlx.storage.datasets.label_index`).
    """
    from ..storage.datasets import parse_rows
    from ..storage.files import iter_jsonl

    source = "<stdin>" if os.fspath(path) == "-" else os.fspath(path)
    rows, seen, first = iter_jsonl(path), {}, None
    for start in itertools.count():
        batch = list(itertools.islice(rows, chunk_rows))
        if not batch:
            break
        for line_no, row in batch:
            if isinstance(row, dict) and "id" in row:
                key = json.dumps(row["id"], sort_keys=True)
                if key in seen:
                    raise InputError(f"{source}:{line_no}: duplicate id {row['id']!r} (first seen on line {seen[key]})")
                seen[key] = line_no
        ds = parse_rows(batch, source, features, require_labels, prefer, label_names=label_names,
                        names_from="the model")
        first = first or ds
        where = f"{source}:{batch[0][0]}"
        if ds.features != first.features:
            raise InputError(f"{where}: these rows' features come from {ds.features!r}, earlier rows' from "
                             f"{first.features!r}; give every row the same fields or pass --features")
        if ds.X.shape[1] != first.X.shape[1]:
            raise InputError(f"{where}: feature vectors have {ds.X.shape[1]} values, earlier rows have "
                             f"{first.X.shape[1]}")
        if (ds.y is None) != (first.y is None):
            raise InputError(f"{source}: some rows have a 'label' and others do not (line {batch[0][0]} on)")
        yield ds
    if first is None:
        raise InputError(f"{source}: no rows")


def estimate_read(est, data, n_exemplars: int | None = None) -> Predictions:
    """The :class:`Predictions` of a whole :class:`~sdm_mlx.storage.datasets.Dataset` that the JSONL reader
    validated and :func:`~sdm_mlx.storage.datasets.check_model_width` checked against ``est`` (``sdm-mlx
    evaluate``): scored in chunks of :data:`PREDICT_CHUNK_ROWS` rows, the features not validated again."""

    def score(rows, row_ids):
        return est._estimate_checked(rows, row_ids, n_exemplars=n_exemplars)

    return concat_predictions(list(iter_estimates(score, data.X, data.ids)))


def estimate_read_chunks(est, chunks, path, n_exemplars: int | None = None):
    """Yield ``(Dataset, Predictions)`` for each chunk :func:`read_jsonl_chunks` read for the fitted ``est``.

    The reader validated every row's features (finite numbers, one width: the file's boundary); here each
    chunk's feature field and width are checked against the model
    (:func:`~sdm_mlx.storage.datasets.check_model_width`) and its labels, when it has them, against the
    classes, then the chunk is scored as one batch: the features are not validated again and the chunk is
    not split again (``chunk_rows`` of the reader is the one chunk size; errors name ``path``).
    """
    from ..storage.datasets import check_labels, check_model_width

    for data in chunks:
        check_model_width(data, est.input_dim_, est.feature_field_, path)
        if data.y is not None:
            check_labels(data.y, est.num_classes_, path)
        yield data, est._estimate_checked(data.X, data.ids, n_exemplars=n_exemplars)
