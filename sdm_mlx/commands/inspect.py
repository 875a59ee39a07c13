"""sdm-mlx inspect: sizes of a saved model, the rows added by feedback since training, and retraining advice."""

from __future__ import annotations

HELP = "Show a trained model's sizes, rows added since training (by source), last update and retraining advice."


#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("model",)


def add_arguments(p) -> None:
    p.add_argument("--model", help="model directory written by `sdm-mlx train`")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _text(s: dict) -> str:
    sources = ", ".join(f"{k} {v}" for k, v in sorted(s["added_by_source"].items())) or "none"
    lines = [
        f"classes: {s['num_classes']}   input dim: {s['input_dim']}   exemplar dim (M): {s['exemplar_dim']}   "
        f"index: {s['index_backend']}   alpha: {s['alpha']}   k: {s['k']}",
        *([f"the support index stores {s['support_coordinate_dim']} coordinates per row: the distances of the "
           f"{s['exemplar_dim']}-wide exemplar vectors, exactly (a change of basis, since input dim < M)"]
          if s["support_coordinate_dim"] != s["exemplar_dim"] else []),
        f"training support: {s['training_support_rows']} rows (by class {s['training_support_by_class']})",
        f"calibration rows: {s['calibration_rows']}",
        f"support now: {s['support_rows']} rows",
        f"added since training: {s['added_rows']} rows ({s['added_fraction']:.1%} of the training support; by class "
        f"{s['added_by_class']}; by source: {sources}; {s['added_mislabelled_by_model']} labelled differently from "
        "the model's prediction)",
        f"update log: {s['updates_logged']} entries ({s['removed_rows']} removals), last update: "
        f"{s['last_update'] or 'never'}",
        ("recommendation: RETRAIN — " if s["retrain_recommended"] else "recommendation: ") + s["recommendation"],
    ]
    return "\n".join(lines)


def run(args) -> int:
    import sys

    from ..estimator import SDMEstimator
    from ..estimator.feedback import summary
    from ..storage.files import dumps

    est = SDMEstimator.load(args.model)
    s = summary(est)
    print(dumps(s, indent=1) if args.json else _text(s), file=sys.stdout)
    return 0
