"""Datasets: JSONL reading/validation and the embedded factcheck data.

JSONL rows: ``id`` (required, unique), ``label`` (int 0..C−1, or a class name when the class names are
given: ``train --class-names``, a model's stored names; required for training, calibration and evaluation), ``embedding`` and/or ``attributes``
(lists of floats), optional ``document``.  Feature selection (``features``):
``"embedding"``, ``"attributes"``, ``"embedding+attributes"`` (concatenated,
embedding first) or ``"auto"`` (whichever the file has; both ⇒ concatenated, unless the
model was trained on one of them: ``prefer``).  Every problem raises
:class:`~sdm_mlx.errors.InputError` (a ``ValueError``) naming the file and line.
Reading goes through :func:`sdm_mlx.storage.files.iter_jsonl` (``-`` = stdin, UTF-8 BOM accepted).
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

from ..errors import InputError
from ..validation import features, label_indices
from .files import is_stream, iter_jsonl  # noqa: F401  (the one JSONL reader; re-exported for callers of sdm_mlx.storage.datasets)

#: ``embedding_source`` of rows that ``sdm-mlx embed`` writes: LLM hidden states, which ``sdm-mlx train``
#: normalises per dimension unless told otherwise (DESIGN #2).
LLM_FEATURES = "llm-hidden-states"

FEATURE_CHOICES = ("auto", "embedding", "attributes", "embedding+attributes")


@dataclass
class Dataset:
    """Features ``X`` [N, D] float32, labels ``y`` [N] int64 (or None), ids and documents."""

    ids: list
    X: np.ndarray
    y: np.ndarray | None = None
    documents: list = field(default_factory=list)
    source: str = ""
    features: str | None = None  #: the row field(s) the features came from ("embedding", "attributes", both)
    #: the pooled parts of an LLM's states the embeddings concatenate, as the rows' ``feature_parts`` record them
    #: (``sdm-mlx embed`` and the pipeline write it; None: not recorded)
    feature_parts: tuple | None = None

    def __post_init__(self):
        if not self.documents:
            self.documents = [None] * len(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def to_dicts(self, field: str | None = None) -> list[dict]:
        """The rows as the JSONL dicts ``sdm-mlx`` reads: ``id``, ``label`` (when ``y`` is set), the features
        under ``field`` (default: the field they were read from, else ``"embedding"``) and ``document`` (when
        set)."""
        field = field or (self.features if self.features in ("embedding", "attributes") else None)
        if field is None and self.features == "embedding+attributes":
            raise InputError("these features concatenate 'embedding' and 'attributes': give field='embedding' or "
                             "field='attributes' to write them under one field")
        field = field or "embedding"
        if field not in ("embedding", "attributes"):
            raise InputError(f"field must be 'embedding' or 'attributes', got {field!r}")
        labels = None if self.y is None else np.asarray(self.y).tolist()
        rows = []
        for i, (rid, x, doc) in enumerate(zip(self.ids, np.asarray(self.X, dtype=np.float32).tolist(),
                                              self.documents)):
            row = {"id": rid}
            if labels is not None:
                row["label"] = int(labels[i])
            row[field] = x
            if doc is not None:
                row["document"] = doc
            if self.feature_parts is not None and field == "embedding":
                row["feature_parts"] = list(self.feature_parts)
            rows.append(row)
        return rows

    def to_jsonl(self, path, field: str | None = None) -> int:
        """Write the rows to ``path`` as JSONL for ``sdm-mlx train`` / ``predict`` / ``evaluate`` (see
        :meth:`to_dicts`; ``-`` = stdout; the file is replaced atomically); returns the row count.
        ``read_jsonl(path)`` gives the same ids, labels, features (float32) and documents back."""
        from .files import make_parent, write_jsonl

        if os.fspath(path) != "-":
            make_parent(os.fspath(path))
        return write_jsonl(path, self.to_dicts(field))

    def subset(self, index) -> "Dataset":
        index = np.asarray(index, dtype=np.int64)
        return Dataset(
            ids=[self.ids[i] for i in index],
            X=self.X[index],
            y=None if self.y is None else self.y[index],
            documents=[self.documents[i] for i in index],
            source=self.source,
            features=self.features,
            feature_parts=self.feature_parts,
        )

    @staticmethod
    def concat(parts: list["Dataset"]) -> "Dataset":
        return Dataset(
            ids=[i for p in parts for i in p.ids],
            X=np.concatenate([p.X for p in parts]),
            y=None if any(p.y is None for p in parts) else np.concatenate([p.y for p in parts]),
            documents=[d for p in parts for d in p.documents],
            source="+".join(p.source for p in parts),
            features=parts[0].features if len({p.features for p in parts}) == 1 else None,
            feature_parts=parts[0].feature_parts if len({p.feature_parts for p in parts}) == 1 else None,
        )


def resolve_features(row: dict, features: str, prefer: str | None = None) -> str:
    """The concrete feature field(s) of ``row`` for a ``features`` choice; ``auto`` takes ``prefer`` (the
    field a model was trained on) when the row has it, else whatever the row has (both ⇒ concatenated)."""
    if features != "auto":
        return features
    if prefer and prefer != "auto" and all(name in row for name in prefer.split("+")):
        return prefer
    has_e, has_a = "embedding" in row, "attributes" in row
    return "embedding+attributes" if has_e and has_a else "embedding" if has_e else "attributes"


def _row_features(row: dict, features: str, where: str) -> list:
    parts = []
    for name in features.split("+"):
        if name not in row:
            raise InputError(f"{where}: missing field {name!r} (features={features!r})")
        value = row[name]
        if not isinstance(value, list) or not value:
            raise InputError(f"{where}: field {name!r} must be a non-empty list of numbers")
        parts.extend(value)
    return parts


def label_index(lab, where: str, label_names=None, names_from: str = "--class-names") -> int:
    """The class index of a row's ``label``: an integer as it is, a string through ``label_names`` (the class
    names in class order: ``--class-names`` of ``train``, or a model's stored names, ``names_from`` says which).
    A string without names, or not among them, is an error naming the way out."""
    if isinstance(lab, int) and not isinstance(lab, bool):
        return lab
    if isinstance(lab, str):
        names = [str(n) for n in label_names] if label_names else []
        if lab in names:
            return names.index(lab)
        if names:
            raise InputError(f"{where}: label {lab!r} is not one of the class names of {names_from} "
                             f"({', '.join(map(repr, names[:10]))}); relabel the row, or give every label "
                             f"string in {names_from}")
        raise InputError(f"{where}: label {lab!r} is a string, and labels are class indices 0..C-1 without class "
                         f"names: {_NAMES_WAY_OUT.get(names_from, _NAMES_WAY_OUT['--class-names']).format(lab=lab)}")
    raise InputError(f"{where}: label must be an integer class index (or a class name), got {lab!r}")


#: how to give string labels their class indices, by where the names would come from
_NAMES_WAY_OUT = {
    "--class-names": "pass the label strings in class order with --class-names (e.g. --class-names {lab} OTHER: "
                     "{lab!r} -> 0, 'OTHER' -> 1), or relabel the rows with 0..C-1",
    "the model": "this model was trained without class names, so relabel the rows with its class indices "
                 "0..C-1 (or train with --class-names NAME ... to read string labels)",
}


def parse_rows(rows, source: str, features: str = "auto", require_labels: bool = True,
               prefer: str | None = None, *, label_names=None, names_from: str = "--class-names") -> Dataset:
    """Build a validated :class:`Dataset` from an iterable of (line_number, dict); see the module docstring.

    ``label_names``: class names in class order; a string label is the index of its name (:func:`label_index`)."""
    if features not in FEATURE_CHOICES:
        raise InputError(f"features must be one of {FEATURE_CHOICES}, got {features!r}")
    ids, feats, labels, docs, seen = [], [], [], [], {}
    width, used, parts = None, None, False
    for line_no, row in rows:
        where = f"{source}:{line_no}"
        if not isinstance(row, dict):
            raise InputError(f"{where}: each line must be a JSON object")
        if "id" not in row:
            raise InputError(f"{where}: missing field 'id'")
        rid = row["id"]
        key = json.dumps(rid, sort_keys=True)
        if key in seen:
            raise InputError(f"{where}: duplicate id {rid!r} (first seen on line {seen[key]})")
        seen[key] = line_no
        field_ = resolve_features(row, features, prefer)
        if used is None:
            used = field_
        elif field_ != used:
            raise InputError(f"{where}: this row's features come from {field_!r}, earlier rows' from {used!r}; "
                             "give every row the same fields or pass --features")
        vec = _row_features(row, field_, where)
        row_parts = _recorded_parts(row, where)
        if parts is False:
            parts = row_parts
        elif row_parts != parts:
            raise InputError(f"{where}: this row records feature_parts {row_parts}, earlier rows {parts}: rows pooled "
                             "differently cannot share one model; embed them again with the same parts")
        if width is None:
            width = len(vec)
        elif len(vec) != width:
            raise InputError(f"{where}: feature vector has {len(vec)} values, earlier rows have {width}")
        raw = np.asarray(vec)
        if raw.dtype.kind not in "iuf" or raw.ndim != 1:
            raise InputError(f"{where}: features must be flat lists of numbers (id {rid!r})")
        arr = raw.astype(np.float32)
        if not np.isfinite(arr).all():
            raise InputError(f"{where}: features contain NaN or Inf (id {rid!r})")
        if require_labels or "label" in row:
            if "label" not in row:
                raise InputError(f"{where}: missing field 'label'")
            labels.append(label_index(row["label"], where, label_names, names_from))
        ids.append(rid)
        feats.append(arr)
        docs.append(row.get("document"))
    if not ids:
        raise InputError(f"{source}: no rows")
    if labels and len(labels) != len(ids):
        raise InputError(f"{source}: some rows have a 'label' and others do not")
    return Dataset(
        ids=ids,
        X=np.stack(feats),
        y=np.asarray(labels, dtype=np.int64) if labels else None,
        documents=docs,
        source=source,
        features=used,
        feature_parts=parts if used == "embedding" else None,
    )


def _recorded_parts(row: dict, where: str) -> tuple | None:
    """The row's ``feature_parts`` (a list of part names, e.g. ``["mean", "last"]``) as a tuple; None if absent.
    The names are checked where a model takes them (``SDMEstimator.fit``)."""
    parts = row.get("feature_parts")
    if parts is None:
        return None
    if not isinstance(parts, list) or not parts or not all(isinstance(p, str) for p in parts):
        raise InputError(f"{where}: feature_parts must be a list of part names such as [\"mean\", \"last\"], "
                         f"got {parts!r}")
    return tuple(parts)


def read_objects(path, unique_ids: bool = False) -> list[tuple[int, dict]]:
    """``(line_number, row)`` for each non-blank line of a JSONL file; every row must be a JSON object.

    ``unique_ids``: every row must also have an ``id``, and no id may repeat.
    """
    rows, seen = [], {}
    where = "<stdin>" if os.fspath(path) == "-" else os.fspath(path)
    for line_no, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise InputError(f"{where}:{line_no}: each line must be a JSON object")
        if unique_ids:
            if "id" not in row:
                raise InputError(f"{where}:{line_no}: missing field 'id'")
            key = id_key(row["id"])
            if key in seen:
                raise InputError(f"{where}:{line_no}: duplicate id {row['id']!r} (first seen on line {seen[key]})")
            seen[key] = line_no
        rows.append((line_no, row))
    return rows


def id_key(value) -> str:
    """A hashable key for a JSON id of any type."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def scan_resumable_output(path, is_complete_row, log) -> set[str]:
    """Ids (as :func:`id_key`) already written to an append-mode JSONL output, for resuming a run.

    ``is_complete_row(row)`` says whether a parsed row is a finished result.  A partially
    written last line (no trailing newline: an interrupted run) is truncated away with a
    message through ``log``; any other bad line is an error naming its line number.
    """
    done: set[str] = set()
    if not os.path.exists(path) or is_stream(path):  # devices, FIFOs, stdout: nothing to resume from
        return done

    def parse(line: bytes):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return row if isinstance(row, dict) and "id" in row and is_complete_row(row) else None

    with open(path, "rb") as f:
        data = f.read()
    *complete, tail = data.split(b"\n")
    for line_no, line in enumerate(complete, 1):
        if not line.strip():
            continue
        row = parse(line)
        if row is None:
            raise InputError(f"{path}: existing output line {line_no} is not a complete result row; fix or remove it")
        done.add(id_key(row["id"]))
    if tail.strip():
        row = parse(tail)
        if row is None:
            with open(path, "r+b") as f:
                f.truncate(len(data) - len(tail))
            log(f"{path}: removed a partially written last line (line {len(complete) + 1}, {len(tail)} bytes) "
                "left by an interrupted run")
        else:
            done.add(id_key(row["id"]))
            with open(path, "ab") as f:
                f.write(b"\n")
    return done


def pending_rows(rows, output_path, is_complete_row, log) -> list[tuple[int, dict]]:
    """The ``(line, row)`` pairs whose id is not yet finished in a resumable output file.

    See :func:`scan_resumable_output`; logs a "resuming" line when earlier results exist.
    """
    done = scan_resumable_output(output_path, is_complete_row, log)
    todo = [(n, r) for n, r in rows if id_key(r["id"]) not in done]
    if done:
        log(f"resuming: {len(rows) - len(todo)} of {len(rows)} ids already in {output_path}")
    return todo


def read_jsonl(path, features: str = "auto", require_labels: bool = True, prefer: str | None = None, *,
               label_names=None, names_from: str = "--class-names") -> Dataset:
    """Read and validate a JSONL file of rows (``-`` = stdin; see the module docstring); string labels are read
    through ``label_names`` (:func:`label_index`)."""
    source = "<stdin>" if os.fspath(path) == "-" else os.fspath(path)
    return parse_rows(iter_jsonl(path), source, features, require_labels, prefer, label_names=label_names,
                      names_from=names_from)


def check_model_width(ds: Dataset, input_dim: int, trained_on: str | None, path) -> None:
    """A dataset read for a model must have the model's feature field and width; the error names the file,
    the field(s) used and the field the model was trained on (stored in the model), and suggests ``--features``.

    Features under another field than the model's are refused even at the same width (``embedding`` rows for a
    model trained on ``attributes`` would be scored as if they were attributes)."""
    recorded = trained_on not in (None, "auto")
    if recorded and ds.features is not None and ds.features != trained_on:
        raise InputError(f"{path}: features come from the field {ds.features!r} ({ds.X.shape[1]} values), but the "
                         f"model was trained on {trained_on!r} and expects {input_dim}; give the rows a "
                         f"{trained_on!r} field and choose it with --features {trained_on}, or train a model on "
                         f"{ds.features!r}")
    if ds.X.shape[1] == input_dim:
        return
    trained = f"trained on {trained_on!r}" if trained_on else "trained on an unrecorded field"
    raise InputError(f"{path}: features from {ds.features!r} have dimension {ds.X.shape[1]}, but the model "
                     f"({trained}) expects {input_dim}; choose the field with --features "
                     "(embedding, attributes or embedding+attributes)")


def check_labels(y: np.ndarray, num_classes: int, name: str) -> None:
    """Labels must be integers in 0..C−1 (:func:`sdm_mlx.validation.label_indices`)."""
    label_indices(y, f"{name}: labels", num_classes)


check_features = features  # the one feature validator (sdm_mlx.validation.features)


# --------------------------------------------------------------------------------------------
# The embedded factcheck data (real Mixtral-8x7B-Instruct features; see data/FACTCHECK_README.md)
# --------------------------------------------------------------------------------------------
FACTCHECK_ZIP = "saplma_true_false_data_with_mixtral_instruct_v0.1.zip"
FACTCHECK_TOPICS = ("animals", "cities", "companies", "elements", "facts", "inventions")
FACTCHECK_SHIFTED = ("generated",)
FACTCHECK_CITATION = (
    "Azaria & Mitchell (2023), 'The Internal State of an LLM Knows When It's Lying'; features from "
    "ReexpressAI/Example_Data (tutorial7_factcheck), Apache-2.0."
)
FACTCHECK_CLASS_NAMES = ("false", "true")


def load_factcheck(topics=FACTCHECK_TOPICS) -> Dataset:
    """The embedded true/false statements with 32 Mixtral-8x7B attributes (label 1 = true).

    ``topics``: any of ``FACTCHECK_TOPICS`` (the paper's training/calibration pool) and
    ``"generated"`` (245 LLM-generated statements: the shifted test set).
    """
    if isinstance(topics, str):
        topics = (topics,)
    unknown = set(topics) - set(FACTCHECK_TOPICS + FACTCHECK_SHIFTED)
    if unknown:
        raise InputError(f"unknown factcheck topic(s) {sorted(unknown)}")
    blob = resources.files("sdm_mlx").joinpath("data", FACTCHECK_ZIP).read_bytes()
    parts = []
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        for topic in topics:
            name = f"{topic}_true_false.csv.attributes.jsonl"
            with zf.open(name) as fh:
                text = io.TextIOWrapper(fh, encoding="utf-8")
                parts.append(parse_rows(iter_jsonl(text, f"{FACTCHECK_ZIP}/{name}"), topic, "attributes"))
    return Dataset.concat(parts)


def stratified_split(y: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Split row indices per class: ``floor(n_c·fraction)`` of each class to the first part."""
    y = np.asarray(y)
    first, second = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        cut = int(np.floor(idx.size * fraction))
        first.append(idx[:cut])
        second.append(idx[cut:])
    return np.sort(np.concatenate(first)), np.sort(np.concatenate(second))


def factcheck_splits(heldout_fraction: float = 0.15, seed: int = 0) -> tuple[Dataset, Dataset, Dataset]:
    """(pool for train+calibration, held-out topic statements, shifted ``generated`` statements)."""
    topics = load_factcheck(FACTCHECK_TOPICS)
    heldout_idx, pool_idx = stratified_split(topics.y, heldout_fraction, np.random.default_rng(seed))
    return topics.subset(pool_idx), topics.subset(heldout_idx), load_factcheck("generated")
