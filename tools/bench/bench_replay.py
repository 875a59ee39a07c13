"""Benchmark Alg. 4's replay of the base decodings (``sdm_mlx/network/base_decodings.py``, Replay) against decoding
the same prompts again, on a pipeline run's own answers and the decision states its answers stage kept.

    python tools/bench/bench_replay.py RUN [--task sentiment] [--split pool] [--n 128] [--repeats 2] [--json out.json]

``RUN`` is an ``sdm-mlx pipeline`` run directory whose answers stage has decoded ``--n`` rows of ``--task/--split``
(with ``answers/<task>_<split>.jsonl.decisions/``).  One process loads the recipe's model, writes those rows as a
base-decodings file with their decisions, and alternates ``--repeats`` times:

* ``decode``: :func:`~sdm_mlx.network.generation.greedy_generate` of the prompts with the SDM heads (W_pos the base
  head's copy), the recipe's batch size and token budget: what a calibration count after a W_pos step did before;
* ``replay``: :meth:`~sdm_mlx.network.base_decodings.BaseDecodings.replayed` with the same heads: the cost of a
  prompt whose answer the step did not change.

Recorded beside each measurement: the load average, the CPU's user / system / idle / steal shares (``/proc/stat``)
and RSS; in the report, the BLAS, the medians, their ratio, and whether the decodings agree with the answers stage's
(texts equal; every prompt replayed by the base head).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

import sdm_mlx  # noqa: E402,F401  (before mlx: OpenBLAS on Linux)
from bench_common import timed  # noqa: E402
from sdm_mlx.runtime.blas import describe_blas  # noqa: E402


def load_rows(run: str, task: str, split: str, n: int):
    """``(recipe, the task, the first n answered rows that have decisions, their decisions)``."""
    from sdm_mlx.errors import InputError
    from sdm_mlx.pipeline.answers import read_rows
    from sdm_mlx.pipeline.decisions import DecisionStore
    from sdm_mlx.pipeline.layout import Layout
    from sdm_mlx.pipeline.recipe import Recipe

    layout = Layout(run)
    with open(layout.recipe, encoding="utf-8") as f:
        recipe = Recipe.from_dict(json.load(f))
    t = recipe.task(task)
    store = DecisionStore.open(layout.answers(task, split))
    if store is None:
        raise InputError(f"{layout.answers(task, split)} has no decision states: run the answers stage (since they "
                         "are kept)")
    kept = store.read()
    rows = [r for r in read_rows(layout.answers(task, split)) if r["id"] in kept][:n]
    if len(rows) < n:
        raise InputError(f"only {len(rows)} answered rows of {task}/{split} have decision states; ask for fewer (--n)")
    docs = {r["id"]: r["document"] for r in read_rows(layout.data(task, split))}
    return recipe, t, rows, docs, store


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--task", default="sentiment")
    ap.add_argument("--split", default="pool")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from sdm_mlx.llm import embed as _embed
    from sdm_mlx.network import DecodeSettings, SDMHeads, greedy_generate
    from sdm_mlx.network.base_decodings import BaseDecodings, save_base_decodings

    recipe, task, rows, docs, store = load_rows(args.run, args.task, args.split, args.n)
    model, tok = _embed.load_model(recipe.model)
    heads = SDMHeads(model)
    prompts = [_embed.chat_text(tok, docs[r["id"]], system=recipe.system, prompt_template=task.template())
               for r in rows]
    parts = tuple(rows[0]["feature_parts"])
    kept = store.read({r["id"] for r in rows})
    settings = DecodeSettings(max_new_tokens=recipe.max_tokens, batch_size=recipe.generation_batch_size,
                              feature_parts=parts)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "base.npz")
        save_base_decodings(path, prompts, [r["text"] for r in rows],
                            np.array([r["embedding"] for r in rows], dtype=np.float32), parts,
                            replay={"token_ids": [kept[r["id"]][0] for r in rows],
                                    "stop_reasons": [kept[r["id"]][1] for r in rows],
                                    "decisions": [kept[r["id"]][2] for r in rows], "settings": store.settings})
        base = BaseDecodings(path, tok)
        modes = {"decode": lambda: greedy_generate(heads, tok, prompts, settings, features=True),
                 "replay": lambda: base.replayed(heads, settings)}
        measured, agree = [], {}
        for rep in range(args.repeats):
            for mode, fn in modes.items():
                out, row = timed(mode, rep, fn, len(prompts))
                if mode == "decode":
                    agree["decoded_texts_equal"] = sum(o.text == r["text"] for o, r in zip(out, rows))
                else:
                    agree["replayed"] = len(out)
                measured.append(row)
                del out
    med = {m: float(np.median([x["seconds"] for x in measured if x["mode"] == m])) for m in modes}
    states = int(sum(len(kept[r["id"]][2]) for r in rows))
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "blas": describe_blas()},
              "model": recipe.model, "task": args.task, "split": args.split, "prompts": len(prompts),
              "decision_states": states, "batch_size": settings.batch_size, "max_new_tokens": settings.max_new_tokens,
              "rows": measured, "median_s": med, "decode_over_replay": med["decode"] / med["replay"],
              "agreement": {**agree, "of": len(prompts)}}
    print(f"\n{len(prompts)} prompts, {states} decision states: decode {med['decode']:.1f} s, replay "
          f"{med['replay']:.1f} s ({report['decode_over_replay']:.1f}x); decoded texts equal to the answers stage's: "
          f"{agree.get('decoded_texts_equal')}/{len(prompts)}, replayed by the base head: {agree.get('replayed')}"
          f"/{len(prompts)}")
    if args.json:
        from sdm_mlx.storage.files import write_json

        write_json(args.json, report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
