"""sdm-mlx add-support: feedback without retraining — append labelled rows to a saved model's support set."""

from __future__ import annotations

HELP = ("Add labelled rows to a trained model's support set (or --undo them) without retraining; the model "
        "directory is updated in place, atomically, with an update log.")


#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("model",)


def add_arguments(p) -> None:
    p.add_argument("--model", help="model directory written by `sdm-mlx train` (updated in place, atomically)")
    p.add_argument("--input", default=None,
                   help="JSONL rows to add: id, label and the features (embedding and/or attributes); '-' = stdin")
    p.add_argument("--undo", nargs="+", default=None, metavar="ID",
                   help="remove rows added earlier, by id (training rows cannot be removed)")
    p.add_argument("--source", default="cli", help="who sent the rows, recorded in the update log")
    p.add_argument("--features", choices=["auto", "embedding", "attributes", "embedding+attributes"], default="auto",
                   help="row field(s) to use; auto = the field the model was trained on when the row has it")


def _undo_ids(est, tokens: list) -> list:
    """The model's ids for command-line tokens (a token "7" also matches the integer id 7)."""
    import json

    from ..storage.datasets import id_key

    n_train = est.feedback_state_.n_training
    added = {id_key(i): i for i in est.support_ids_[n_train:]}
    out = []
    for t in tokens:
        candidates = [t]
        try:
            value = json.loads(t)
            if isinstance(value, int) and not isinstance(value, bool):
                candidates.append(value)
        except ValueError:
            pass
        out.append(next((added[id_key(c)] for c in candidates if id_key(c) in added), t))
    return out


def run(args) -> int:
    import sys

    from ..storage.datasets import check_model_width, read_jsonl
    from ..errors import CLIError
    from ..estimator.feedback import summary
    from ..estimator.updates import update_model
    from ..storage.files import refuse_inputs_inside

    if (args.input is None) == (args.undo is None):
        raise CLIError("give exactly one of --input rows.jsonl (add rows) or --undo ID [ID ...] (remove rows)")
    if args.input is not None and args.input != "-":
        refuse_inputs_inside("--model", args.model, [("--input", args.input)])

    def change(est):
        if args.undo is not None:
            return est.remove_support(_undo_ids(est, args.undo), source=args.source)
        trained_on = est.feature_field_
        data = read_jsonl(args.input, args.features, require_labels=True, prefer=trained_on,
                          label_names=est.class_names, names_from="the model")
        check_model_width(data, est.input_dim_, trained_on, args.input)
        return est.add_support(data.X, data.y, ids=data.ids, source=args.source)

    est, entries = update_model(args.model, change)
    s = summary(est)
    if args.undo is not None:
        print(f"removed {len(entries)} row(s) from {args.model}", file=sys.stdout)
    else:
        disagree = sum(e["label"] != e["predicted_label"] for e in entries)
        print(f"added {len(entries)} row(s) to {args.model} ({disagree} labelled differently from the model's "
              "prediction: they lower q of their neighbours)", file=sys.stdout)
    print(f"support: {s['support_rows']} rows ({s['training_support_rows']} from training, {s['added_rows']} added)",
          file=sys.stdout)
    if s["retrain_recommended"]:
        print(f"sdm-mlx add-support: note: {s['recommendation']}", file=sys.stderr)
    return 0
