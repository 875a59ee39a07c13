"""sdm-mlx predict: per-row SDM estimates (p_lower or ⊥) for a JSONL file."""

from __future__ import annotations

HELP = "Predict with a trained SDM estimator: one JSON result per input row (ids preserved)."


#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("model", "input")


def add_arguments(p) -> None:
    p.add_argument("--model", help="model directory written by `sdm-mlx train`")
    p.add_argument("--input", help="JSONL rows (id, embedding and/or attributes; label optional); '-' = stdin")
    p.add_argument("--output", default="-",
                   help="JSONL results ('-' = stdout); a file is replaced atomically, a symlink written through, "
                        "a device/FIFO streamed; must not be the --input")
    p.add_argument("--features", choices=["auto", "embedding", "attributes", "embedding+attributes"], default="auto",
                   help="row field(s) to use; auto = the field the model was trained on when the row has it")
    p.add_argument("--n-exemplars", type=int, default=None, help="nearest training exemplars per row (default: model's)")
    p.add_argument("--summary", default=None, help="also write a JSON summary (counts, admitted fraction) here")
    p.add_argument("--html", default=None, metavar="DIR",
                   help="also write one self-contained HTML verdict page per row (DIR/rows/) and DIR/index.html "
                        "sorted by p_lower (no script, no network)")
    import argparse

    p.add_argument("--shard-index", action=argparse.BooleanOptionalAction, default=None,
                   help="under mlx.launch, split the exact support index over the ranks (default: the model's "
                        "shard_index setting; docs/distributed.md)")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.add_argument("--chunk-rows", type=int, default=8192,
                   help="rows scored and written per chunk (bounds the working memory; answers do not depend on it)")


def run(args) -> int:
    import sys
    from collections import Counter

    from ..estimator.chunking import read_jsonl_chunks
    from ..errors import InputError
    from ..estimator import SDMEstimator
    from ..storage.files import refuse_same_files, write_json, write_jsonl
    from ..runtime.distributed import is_primary, launched_rank

    from ..storage.files import refuse_inputs_inside

    refuse_same_files([("--output", args.output), ("--summary", args.summary)],
                      [("--input", args.input), ("--model", args.model)])
    if args.html:
        refuse_inputs_inside("--html", args.html, [("--input", args.input), ("--model", args.model)])
    if args.chunk_rows < 1:
        raise InputError(f"--chunk-rows must be ≥ 1, got {args.chunk_rows}")
    est = SDMEstimator.load(args.model, shard_index=args.shard_index)  # the index is built once, as asked
    # the input is read, scored and written chunk by chunk (bounded memory: sdm_mlx.estimator.chunking)
    chunks = read_jsonl_chunks(args.input, args.features, est.feature_field_, args.chunk_rows,
                               label_names=est.class_names)
    kept = {"admitted": 0, "labelled": 0, "correct": 0, "admitted_correct": 0, "reasons": Counter(),
            "decisions": Counter()}

    writer = launched_rank() is None or is_primary()  # under mlx.launch rank 0 alone writes the results
    pages = None
    if args.html and writer:
        from ..evaluation.verdict_html import PageWriter, context_of

        pages = PageWriter(args.html, context_of(est))
    rows = _scored_rows(args, est, chunks, kept, show=writer and not args.quiet, pages=pages)
    if not writer:  # every rank scores every chunk: the sharded index's collectives run in step
        for _ in rows:
            pass
        return 0
    summary = _summary(write_jsonl(args.output, rows), kept, est.alpha)
    if args.summary:
        write_json(args.summary, summary)
    if pages is not None:
        print(f"html: {pages.finish(f'Verdicts: {args.input}')} ({len(pages.hrefs)} row pages)", file=sys.stderr)
    print(
        f"{summary['rows']} rows, {summary['admitted']} admitted ({summary['admitted_fraction']:.1%}) at "
        f"alpha={est.alpha}" + (f", output: {args.output}" if args.output != "-" else ""),
        file=sys.stderr,
    )
    return 0


def _scored_rows(args, est, chunks, kept: dict, *, show: bool, pages=None):
    """Yield one result dict per input row, chunk by chunk; ``kept`` collects what the summary needs;
    ``pages`` (a :class:`~sdm_mlx.evaluation.verdict_html.PageWriter`) gets each row's verdict page."""
    from ..runtime.callbacks import progress_bar
    from ..estimator.chunking import estimate_read_chunks

    # rows and rows/s without a total: the input is read once, as it is scored (a pipe or a file alike)
    with progress_bar(None, "predict", unit="rows", enabled=show) as bar:
        for data, pred in estimate_read_chunks(est, chunks, args.input, args.n_exemplars):
            _count(kept, pred, data.y)
            labels = data.y.tolist() if data.y is not None else None
            for i, row in enumerate(pred.to_dicts()):
                if labels is not None:
                    row["label"] = labels[i]
                if pages is not None:
                    pages.add(row, data.documents[i])
                yield row
            bar.update(len(pred))


def _count(kept: dict, pred, y) -> None:
    """Add one chunk's counts to ``kept`` (the summary needs counts only: memory stays bounded)."""
    kept["admitted"] += int(pred.admitted.sum())
    kept["decisions"].update(pred.estimate.decision.tolist())
    kept["reasons"].update(r for r in pred.rejection_reason.tolist() if r)
    if y is not None:
        right = pred.prediction == y
        kept["labelled"] += len(y)
        kept["correct"] += int(right.sum())
        kept["admitted_correct"] += int(right[pred.admitted].sum())


def _summary(n_rows: int, kept: dict, alpha: float) -> dict:
    """The ``--summary`` counts: rows, admitted (fraction), rejection reasons, accuracies when labelled."""
    summary = {
        "rows": n_rows,
        "admitted": kept["admitted"],
        "admitted_fraction": kept["admitted"] / n_rows,
        "rejection_reasons": dict(kept["reasons"]),
        "decisions": {d: kept["decisions"].get(d, 0) for d in ("allow", "review", "reject")},
        "alpha": alpha,
    }
    if kept["labelled"]:
        summary["accuracy"] = kept["correct"] / kept["labelled"]
        summary["admitted_accuracy"] = kept["admitted_correct"] / kept["admitted"] if kept["admitted"] else None
    return summary
