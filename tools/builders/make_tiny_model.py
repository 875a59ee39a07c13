"""Build the tiny local model + synthetic task used by ``recipes/tiny_sentiment.yaml`` (no network access).

    python tools/builders/make_tiny_model.py runs/tiny                 # -> runs/tiny/model, runs/tiny/task.jsonl

Steps: (1) a tiny random Phi-3-architecture mlx-lm model with a locally trained
tokenizer (``tools/builders/tiny_models.py``; hidden 64, 2 layers,
|V| = 616); (2) unless ``--no-instruct``, its ``lm_head`` is fitted with plain
cross-entropy on force-decoded answers of a *separate* synthetic task sample
with half of the answers wrong, so the base model answers in the task's JSON
format but only about half of the time correctly — a stand-in for an
instruction-tuned LLM that the SDM network can improve; (3) a synthetic
sentiment task JSONL (``id``, ``label``, ``document``) for ``network-train``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

MARKER = ".sdm_mlx_tiny_model"  #: marks a model directory this tool built (and may replace)


def build(out_dir: str, arch: str = "phi3", instruct: bool = True, rows: int = 1000, seed: int = 0,
          tune_steps: int = 200, quiet: bool = False) -> dict:
    """Write ``out_dir/model`` and ``out_dir/task.jsonl``; returns their paths."""
    from tiny_models import make_tiny_model  # this script's directory (and on pytest's pythonpath)
    from tiny_tasks import instruction_tune_head, save_model_copy, synthetic_sentiment_rows, write_synthetic_sentiment

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    model_dir = os.path.join(out_dir, "model")
    if os.path.lexists(model_dir) and not os.path.isfile(os.path.join(model_dir, MARKER)):
        raise SystemExit(f"make_tiny_model: {model_dir} exists and was not built by this tool; refusing to "
                         "replace it (choose another output directory)")
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        raw = make_tiny_model(tmp, arch, seed=seed)
        if instruct:
            from sdm_mlx.llm.embed import chat_text, load_model
            from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS, make_verification_rows

            model, tok = load_model(raw)
            preset = PRESETS["sentiment"]
            sample = synthetic_sentiment_rows(400, seed=seed + 1)
            ver = make_verification_rows(
                sample, preset["completions"],
                lambda d: chat_text(tok, d, system=PAPER_SYSTEM, prompt_template=preset["prompt_template"]),
                seed=seed + 1,
            )
            losses = instruction_tune_head(model, tok, [r["prompt"] for r in ver], [r["completion"] for r in ver],
                                           steps=tune_steps, seed=seed)
            if not quiet:
                print(f"lm_head fitted to the answer format (cross-entropy {losses[0]:.3f} -> {losses[-1]:.3f})",
                      file=sys.stderr)
            built = save_model_copy(model, raw, os.path.join(tmp, "built"))
        else:
            built = shutil.copytree(raw, os.path.join(tmp, "built"))
        open(os.path.join(built, MARKER), "w").close()
        shutil.rmtree(model_dir, ignore_errors=True)  # only ever a model this tool built (checked above)
        os.rename(built, model_dir)
    task = write_synthetic_sentiment(os.path.join(out_dir, "task.jsonl"), n=rows, seed=seed)
    if not quiet:
        print(f"model: {model_dir}\ntask data: {task} ({rows} rows)", file=sys.stderr)
    return {"model": model_dir, "task": task}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="output directory (model/ and task.jsonl are written there)")
    ap.add_argument("--arch", default="phi3", choices=["phi3", "llama"], help="architecture (untied lm_head)")
    ap.add_argument("--no-instruct", action="store_true", help="keep the random lm_head (answers are noise)")
    ap.add_argument("--rows", type=int, default=1000, help="rows of the synthetic task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tune-steps", type=int, default=200, help="cross-entropy steps fitting the answer format")
    args = ap.parse_args(argv)
    build(args.out_dir, args.arch, not args.no_instruct, args.rows, args.seed, args.tune_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
