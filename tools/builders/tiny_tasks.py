"""A small synthetic sentiment task for smoke tests, the tiny recipe and the benchmark (test scaffolding,
not part of the shipped package; its partner is :mod:`tiny_models`, the tiny random mlx-lm models).

Rows ``{"id", "label", "document"}`` (label 1 = positive, 0 = negative): short
"reviews" made of seeded random picks from a positive or a negative word list
plus neutral filler — words the tiny test tokenizer knows, so documents are
short in tokens.  Use with the ``sentiment`` preset (completions
``{"sentiment": "negative"}`` / ``{"sentiment": "positive"}``).
"""

from __future__ import annotations

import os

import numpy as np

POSITIVE = ["warm", "funny", "wonderful", "loved", "classic", "moving", "sharp", "beautifully"]
NEGATIVE = ["dull", "wooden", "boring", "badly", "worst", "long", "plot", "written"]
FILLER = ["the", "film", "movie", "cast", "and", "is", "a", "this", "with", "of"]


def synthetic_sentiment_rows(n: int = 1000, seed: int = 0, min_words: int = 3, max_words: int = 6,
                             filler_prob: float = 0.0) -> list[dict]:
    """``n`` balanced rows (ids ``"syn-0"`` ...), seeded; each word is a filler word with ``filler_prob``."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        label = i % 2
        words = POSITIVE if label == 1 else NEGATIVE
        k = int(rng.integers(min_words, max_words + 1))
        picks = [FILLER[int(rng.integers(len(FILLER)))] if rng.random() < filler_prob
                 else words[int(rng.integers(len(words)))] for _ in range(k)]
        picks[int(rng.integers(k))] = words[int(rng.integers(len(words)))]  # at least one sentiment word
        rows.append({"id": f"syn-{i}", "label": label, "document": " ".join(picks).capitalize() + "."})
    return rows


def write_synthetic_sentiment(path, n: int = 1000, seed: int = 0) -> str:
    """Write :func:`synthetic_sentiment_rows` as JSONL; returns the path."""
    from sdm_mlx.storage.files import write_jsonl

    path = os.fspath(path)
    write_jsonl(path, synthetic_sentiment_rows(n, seed))
    return path


def instruction_tune_head(model, tokenizer, prompts, completions, *, steps: int = 300, batch_size: int = 64,
                          learning_rate: float = 1e-2, seed: int = 0, delimiter: str = "}",
                          max_length: int = 500) -> list[float]:
    """Make a tiny random base model answer in the task's JSON format (test/recipe helper, not the SDM method).

    Plain next-token cross-entropy on the completion tokens of the force-decoded
    ``prompt + completion`` pairs, updating only the model's (untied) ``lm_head``
    in place; the trunk is untouched.  Returns the loss every 50 steps.
    """
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from sdm_mlx.network.heads import token_hidden_states
    from sdm_mlx.network.trainer import completion_token_positions

    if getattr(model, "lm_head", None) is None or hasattr(model.lm_head, "scales"):
        raise ValueError("instruction_tune_head needs an untied, non-quantised lm_head")
    seqs, poss, tgts = [], [], []
    for p, c in zip(prompts, completions):
        ids, pos, tg = completion_token_positions(tokenizer, p, c, delimiter, max_length)
        seqs.append(ids)
        poss.append(pos)
        tgts.extend(tg)
    H = mx.array(token_hidden_states(model, seqs, poss, batch_size=32))
    T = mx.array(np.asarray(tgts, dtype=np.int32))
    head = nn.Linear(H.shape[1], model.lm_head.weight.shape[0], bias=False)
    head.weight = model.lm_head.weight.astype(mx.float32)
    opt = optim.Adam(learning_rate=learning_rate)

    def loss_fn(m, h, t):
        return nn.losses.cross_entropy(m(h), t, reduction="mean")

    lg = nn.value_and_grad(head, loss_fn)
    rng = np.random.default_rng(seed)
    losses = []
    for s in range(steps):
        idx = mx.array(rng.integers(0, T.shape[0], size=min(batch_size, T.shape[0])).astype(np.int32))
        loss, grads = lg(head, H[idx], T[idx])
        opt.update(head, grads)
        mx.eval(loss, head.parameters(), opt.state)
        if s % 50 == 0 or s == steps - 1:
            losses.append(float(loss.item()))
    model.lm_head.weight = head.weight.astype(model.lm_head.weight.dtype)
    mx.eval(model.lm_head.weight)
    return losses


def save_model_copy(model, src_dir, dst_dir) -> str:
    """Copy an mlx-lm model directory's config/tokenizer files to ``dst_dir`` and save ``model``'s weights there."""
    import shutil
    from pathlib import Path

    from mlx_lm.utils import save_model

    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    save_model(dst, model)
    return str(dst)
