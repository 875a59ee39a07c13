"""sdm-mlx train: fit an SDM estimator on JSONL rows and save the artifact."""

from __future__ import annotations

from ..defaults import EstimatorConfig

HELP = "Train and calibrate an SDM estimator (Alg. 1-3) on JSONL rows; save a model directory."


#: The settings classes whose fields are this verb's options and YAML keys (cli.py type-checks --config with them).
SETTINGS = (EstimatorConfig,)


#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("train", "output")


def mode_help(parser, modes: dict) -> None:
    """Append each mode's value to the help of the options it changes: "(default: X; --paper Y)"."""
    for action in parser._actions:
        if action.help and any(action.dest in values for values in modes.values()):
            extra = "".join(f"; --{m} {'off' if v.get(action.dest) is None else v[action.dest]}"
                            for m, v in modes.items() if action.dest in v)
            action.help = action.help[:-1] + extra + ")" if action.help.endswith(")") else action.help + extra


def add_estimator_arguments(p) -> None:
    """Estimator settings shared by `train` and `demo`, generated from :class:`sdm_mlx.defaults.EstimatorConfig`."""
    import argparse

    from ..settings import add_arguments

    g = add_arguments(p, EstimatorConfig, title="estimator")
    g.add_argument("--unstratified", dest="stratified", action="store_false", default=argparse.SUPPRESS,
                   help="same as --no-stratified")
    g.add_argument("--quiet", action="store_true", help="no progress on stderr")


def estimator_config(args, base: dict | None = None):
    """The :class:`EstimatorConfig` of ``args`` (CLI and YAML) over ``base`` (a mode such as --paper) over
    the defaults; ``--patience 0`` means off."""
    import dataclasses

    from ..settings import SettingsError, resolve

    cfg = resolve(EstimatorConfig, args, base)
    if cfg.patience is not None and cfg.patience < 0:
        raise SettingsError(f"--patience: expected an integer >= 0 (0 = run every epoch), got {cfg.patience}")
    return cfg if cfg.patience != 0 else dataclasses.replace(cfg, patience=None)


def paper_base(args) -> dict:
    """The --paper overrides when --paper is on (explicit flags and YAML still win)."""
    from ..defaults import PAPER_SETTINGS

    return dict(PAPER_SETTINGS) if getattr(args, "paper", False) else {}


def estimator_from_args(args, class_names=None, base: dict | None = None):
    """An :class:`SDMEstimator` from the resolved settings (``base`` default: --paper's overrides)."""
    from dataclasses import asdict

    from ..estimator import SDMEstimator

    cfg = estimator_config(args, paper_base(args) if base is None else base)
    return SDMEstimator(**asdict(cfg), verbose=not args.quiet, class_names=class_names)


def jsonl_num_classes(args, train, cal) -> int:
    """C for JSONL labels, which are class indices 0..C−1: ``--num-classes`` or the largest label + 1
    (so a model's class i is always label i, as the predict output and ``--class-names`` assume)."""
    import numpy as np

    if args.num_classes is not None:
        return args.num_classes
    labels = [train.y] + ([] if cal is None else [cal.y])
    return 1 + max(int(np.max(y, initial=0)) for y in labels)


def add_arguments(p) -> None:
    p.add_argument("--train",
                   help="training JSONL (id, label, embedding and/or attributes, optional document)")
    p.add_argument("--calibration", default=None, help="calibration JSONL (pooled with --train, as in the paper)")
    p.add_argument("--output",
                   help="model directory to write (new or empty; an existing model only with --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing sdm_mlx model at --output (atomically); other directories are never "
                        "replaced")
    p.add_argument(
        "--features", choices=["auto", "embedding", "attributes", "embedding+attributes"], default="auto",
        help="which row fields form the feature vector",
    )
    p.add_argument("--num-classes", type=int, default=None, help="C (default: max label + 1)")
    p.add_argument("--class-names", nargs="+", default=None, help="display names of the classes 0..C-1")
    p.add_argument("--report", default=None, help="training report JSON (default: OUTPUT/training_report.json)")
    p.add_argument("--paper", action="store_true",
                   help="the paper's exact Alg. 1 settings: J=10 rounds of 50 epochs, lr 1e-5, batch 50, M=1000, "
                        "no early stopping (explicit flags still win)")
    p.add_argument("--restart", action="store_true",
                   help="ignore the checkpoint OUTPUT.partial of an interrupted run and start over")
    add_estimator_arguments(p)
    from ..defaults import PAPER_SETTINGS

    mode_help(p, {"paper": PAPER_SETTINGS})


def training_report(est, seconds: float, resumed_rounds: int = 0) -> dict:
    """What training learned: per-round trajectories, the selected round/epoch, adaptor movement, admission."""
    from ..estimator import ROBUST_INF_REASON
    from ..io import put_float

    best = est.round_summaries_[est.best_round_]
    report = {
        "seconds": round(seconds, 3),
        "num_classes": est.num_classes_,
        "input_dim": est.input_dim_,
        "support_size": len(est.support_ids_),
        "calibration_size": len(est.calibration_ids_),
        "k": est.k_,
        "best_round": est.best_round_,
        "resumed_rounds": resumed_rounds,
        "selected": {
            "round": est.best_round_, "epoch": best.get("best_epoch"), "epochs_run": best.get("epochs_run"),
            "cal_accuracy": best.get("cal_accuracy"), "balanced_median_q": best.get("metric"),
            "projection_movement": best.get("projection_movement"),
            "classifier_movement": best.get("classifier_movement"),
        },
        "rounds": est.round_summaries_,
        "best_round_history": est.history_,
        "alpha": est.alpha,
        "psi": est.calibration_.psi.tolist(),
        "admission": est.admission_,
        "params": est.get_params(),
    }
    # +inf thresholds are stored as null with the reason (strict JSON)
    put_float(report, "min_valid_qbin", est.calibration_.min_valid,
              "no valid threshold: Alg. 3 found no q~ where psi_c >= alpha for every class in the best round")
    put_float(report, "robust_min_valid_qbin", est.robust_min_valid_, ROBUST_INF_REASON)
    return report


def summary_line(report: dict) -> str:
    """One line: what was learned and whether the model can admit anything."""
    sel, adm = report["selected"], report["admission"]
    fmt = lambda x, spec: "none" if x is None else format(x, spec)  # noqa: E731
    status = "admits rows" if adm["can_admit"] else \
        "ADMITS NOTHING (" + ", ".join(c["condition"] for c in adm["failed"]) + ")"
    return (
        f"trained in {report['seconds']:.1f}s: best round {sel['round'] + 1}/{len(report['rounds'])} "
        f"(epoch {sel['epoch']} of {sel['epochs_run']}), calibration accuracy {fmt(sel['cal_accuracy'], '.3f')}, "
        f"balanced median q {fmt(sel['balanced_median_q'], '.2f')}, W_g moved {fmt(sel['projection_movement'], '.1%')} "
        f"and W' {fmt(sel['classifier_movement'], '.1%')} from init; min valid q~ {fmt(report['min_valid_qbin'], '.3f')}, "
        f"robust {fmt(report['robust_min_valid_qbin'], '.3f')}; {status}"
    )


def run(args) -> int:
    import os
    import sys
    import time

    from ..artifact import check_artifact_output
    from ..checkpoint import checkpoint_rounds, remove_checkpoint
    from ..data import read_jsonl
    from ..io import refuse_same_files, write_json
    from ..callbacks import log

    inputs = [("--train", args.train), ("--calibration", args.calibration)]
    refuse_same_files([("--report", args.report)], inputs)
    check_artifact_output(args.output, args.overwrite, inputs)
    train = read_jsonl(args.train, args.features)
    cal = read_jsonl(args.calibration, args.features, prefer=train.features) if args.calibration else None
    if cal is not None and cal.X.shape[1] != train.X.shape[1]:
        raise ValueError(
            f"{args.calibration}: feature width {cal.X.shape[1]} differs from {args.train} ({train.X.shape[1]})"
        )
    est = estimator_from_args(args, args.class_names)
    checkpoint = os.path.abspath(args.output).rstrip(os.sep) + ".partial"
    if args.restart:
        remove_checkpoint(checkpoint)
    t0 = time.perf_counter()
    try:
        est.fit(
            train.X, train.y, None if cal is None else cal.X, None if cal is None else cal.y,
            ids_train=train.ids, ids_cal=None if cal is None else cal.ids,
            num_classes=jsonl_num_classes(args, train, cal), checkpoint=checkpoint,
        )
    except KeyboardInterrupt:
        done = checkpoint_rounds(checkpoint)
        log(f"interrupted: {done} finished round(s) are kept in {checkpoint}; run the same command again to "
            "resume (--restart to start over)" if done else "interrupted before the first round finished", True)
        raise
    seconds = time.perf_counter() - t0
    est.feature_field_ = train.features
    est.save(args.output, overwrite=args.overwrite)
    remove_checkpoint(checkpoint)
    report = training_report(est, seconds, getattr(est, "resumed_rounds_", 0))
    report_path = args.report or os.path.join(args.output, "training_report.json")
    write_json(report_path, report)
    print(f"{summary_line(report)}\nmodel: {args.output}\nreport: {report_path}", file=sys.stdout)
    return 0
