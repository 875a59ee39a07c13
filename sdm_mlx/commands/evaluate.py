"""``sdm-mlx evaluate``: index-conditional evaluation of a trained SDM estimator against the baselines.

Example::

    sdm-mlx train --train pooled.jsonl --output model
    sdm-mlx evaluate --model model --input test.jsonl --input shifted.jsonl \\
        --report report.json --plots plots/ --label-errors label_errors.jsonl

One table per input on stdout (SDM p_lower / p_centroid / p_upper and the baselines NoReject,
Softmax, temperature scaling, APS, RAPS over the same adaptor logits), the JSON report
(schema: :mod:`sdm_mlx.evaluation.evaluate`), optional PNG plots (needs matplotlib) and the admitted rows
whose label differs from the prediction (possible annotation errors), most confident first.
The baselines are fitted on the model's calibration split: its logits and labels are stored in
the model directory; for older models pass ``--calibration-data`` (the JSONL the model was
trained on) to recompute them.
"""

from __future__ import annotations

import os

from ._common import add_conformal_argument, emit

HELP = "Evaluate a trained SDM estimator and the baselines on labelled JSONL files (index-conditional tables)."

FEATURE_CHOICES = ["auto", "embedding", "attributes", "embedding+attributes"]


#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("model", "input")


def add_arguments(p) -> None:
    p.add_argument("--model", help="model directory written by `sdm-mlx train`")
    p.add_argument("--input", action="append", default=None,
                   help="labelled JSONL to evaluate (repeat for several sets, e.g. in-distribution and shifted); "
                        "the set is named after the file")
    p.add_argument("--calibration-data", default=None,
                   help="the pooled training JSONL the model was trained on: recompute the calibration logits for "
                        "the baselines from the model's calibration ids (default: the logits stored in the model)")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.add_argument("--plots", default=None,
                   help="directory for PNG plots (needs matplotlib: pip install 'sdm_mlx[plots]'); created if missing, "
                        "only the plot files are (re)written")
    p.add_argument("--label-errors", default=None,
                   help="JSONL of admitted rows whose label differs from the prediction, by p_lower descending")
    p.add_argument("--html", default=None, metavar="DIR",
                   help="also write a self-contained HTML verdict page per evaluated row and an index per input with "
                        "its admission ladder (no script, no network)")
    p.add_argument("--alpha", type=float, default=None, help="evaluate at this alpha' (default: the model's)")
    p.add_argument("--alphas", type=float, nargs="+", default=None,
                   help="alpha' sweep for the curves (default: 0.6 0.7 0.8 0.85 0.9 0.95 0.97 0.99 where valid)")
    p.add_argument("--baselines", nargs="*", default=["no_reject", "softmax", "temperature", "aps", "raps"],
                   choices=["no_reject", "softmax", "temperature", "aps", "raps"], help="baselines to compare")
    add_conformal_argument(p)
    p.add_argument("--features", choices=FEATURE_CHOICES, default="auto", help="which row fields form the features")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def dataset_names(paths) -> list[str]:
    """Unique display names from file names (``test.jsonl`` -> ``test``; duplicates get ``_2``, ``_3``)."""
    names, seen = [], {}
    for path in paths:
        base = os.path.basename(os.fspath(path))
        for ext in (".jsonl", ".json", ".txt"):
            if base.endswith(ext):
                base = base[: -len(ext)]
                break
        base = base or "input"
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


def calibration_logits(est, calibration_data: str | None, features: str, callback):
    """(z_cal, y_cal) for the baselines, or (None, None) with a note on stderr."""
    from ..runtime.callbacks import note

    if calibration_data:
        from ..storage.datasets import read_jsonl
        from ..evaluation.evaluate import calibration_from_data

        callback.message(f"recomputing the calibration logits from {calibration_data} ...")
        return calibration_from_data(est, read_jsonl(calibration_data, features, prefer=est.feature_field_,
                                                     label_names=est.class_names, names_from="the model"))
    z = getattr(est, "calibration_logits_", None)
    y = getattr(est, "calibration_labels_", None)
    if z is not None and y is not None:
        return z, y
    note("note: this model does not store its calibration logits; temperature, aps and raps are skipped "
         "(pass --calibration-data with the training JSONL to include them)")
    return None, None


def run(args) -> int:
    from ..storage.datasets import check_model_width, read_jsonl
    from ..estimator import SDMEstimator
    from ..storage.files import refuse_same_files
    from ..runtime.callbacks import cli_callback
    from ..estimator.chunking import estimate_read
    from ..evaluation.evaluate import baseline_options, evaluate

    inputs = [args.input] if isinstance(args.input, str) else list(args.input)
    in_flags = [("--input", inputs), ("--calibration-data", args.calibration_data), ("--model", args.model)]
    refuse_same_files([("--report", args.report), ("--label-errors", args.label_errors)], in_flags)
    if args.html:
        from ..storage.files import refuse_inputs_inside

        refuse_inputs_inside("--html", args.html, in_flags)
    callback = cli_callback(args.quiet)
    est = SDMEstimator.load(args.model)
    est.verbose = False
    if args.alpha is not None:
        est.recalibrate(args.alpha)
    datasets = {}
    for name, path in zip(dataset_names(inputs), inputs):
        ds = read_jsonl(path, args.features, require_labels=True, prefer=est.feature_field_,
                        label_names=est.class_names, names_from="the model")
        check_model_width(ds, est.input_dim_, est.feature_field_, path)
        datasets[name] = ds
        callback.message(f"{name}: {len(ds)} rows from {path}")
    z_cal, y_cal = calibration_logits(est, args.calibration_data, args.features, callback)
    n_exemplars = est.n_exemplars if args.html else 0  # the reader validated the features: not again
    predictions = {name: estimate_read(est, ds, n_exemplars) for name, ds in datasets.items()}
    report = evaluate(est, datasets, z_cal, y_cal, alphas=args.alphas, baselines=args.baselines,
                      predictions=predictions, callback=callback, options=baseline_options(args.conformal))
    report["model_path"] = os.fspath(args.model)
    report["inputs"] = dict(zip(datasets, inputs))
    emit(report, args, datasets, predictions, est.class_names)
    if args.html:
        from ..runtime.callbacks import note
        from ..evaluation.report import write_html
        from ..evaluation.verdict_html import context_of

        note(f"html: {write_html(report, args.html, datasets, predictions, context_of(est))[0]}")
    return 0
