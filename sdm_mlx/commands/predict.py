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
    import argparse

    p.add_argument("--shard-index", action=argparse.BooleanOptionalAction, default=None,
                   help="under mlx.launch, split the exact support index over the ranks (default: the model's "
                        "shard_index setting; docs/distributed.md)")


def run(args) -> int:
    import sys
    from collections import Counter

    from ..data import check_labels, check_model_width, read_jsonl
    from ..estimator import SDMEstimator
    from ..io import refuse_same_files, write_json, write_jsonl

    refuse_same_files([("--output", args.output), ("--summary", args.summary)],
                      [("--input", args.input), ("--model", args.model)])
    est = SDMEstimator.load(args.model)
    est.verbose = False
    if args.shard_index is not None and args.shard_index != est.shard_index:
        est.shard_index = args.shard_index
        est._prepare_predict()  # rebuild the support index sharded (or not)
    trained_on = getattr(est, "feature_field_", None)
    data = read_jsonl(args.input, args.features, require_labels=False, prefer=trained_on)
    check_model_width(data, est.input_dim_, trained_on, args.input)
    if data.y is not None:
        check_labels(data.y, est.num_classes_, args.input)
    pred = est.estimate(data.X, ids=data.ids, n_exemplars=args.n_exemplars)
    from ..distributed import is_primary, launched_rank

    if launched_rank() is not None and not is_primary():
        return 0  # under mlx.launch rank 0 alone writes the results
    rows = pred.to_dicts()
    if data.y is not None:
        for row, label in zip(rows, data.y.tolist()):
            row["label"] = label
    write_jsonl(args.output, rows)
    summary = {
        "rows": len(rows),
        "admitted": int(pred.admitted.sum()),
        "admitted_fraction": float(pred.admitted.mean()),
        "rejection_reasons": dict(Counter(r for r in pred.rejection_reason.tolist() if r)),
        "alpha": est.alpha,
    }
    if data.y is not None:
        adm = pred.admitted
        summary["accuracy"] = float((pred.prediction == data.y).mean())
        summary["admitted_accuracy"] = float((pred.prediction[adm] == data.y[adm]).mean()) if adm.any() else None
    if args.summary:
        write_json(args.summary, summary)
    print(
        f"{summary['rows']} rows, {summary['admitted']} admitted ({summary['admitted_fraction']:.1%}) at "
        f"alpha={est.alpha}" + (f", output: {args.output}" if args.output != "-" else ""),
        file=sys.stderr,
    )
    return 0
