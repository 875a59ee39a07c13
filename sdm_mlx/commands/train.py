"""sdm-mlx train: fit an SDM estimator on JSONL rows and save the artifact."""

from __future__ import annotations

HELP = "Train and calibrate an SDM estimator (Alg. 1-3) on JSONL rows; save a model directory."


#: Options whose value ``--paper`` changes (their CLI default is None = "the mode's value").
PAPER_KEYS = ("iterations", "epochs", "exemplar_dim", "batch_size", "learning_rate", "patience")


def _patience(text: str):
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (0 = run every epoch), got {value}")
    return value


def add_estimator_arguments(p) -> None:
    """Estimator settings shared by `train` and `demo`; defaults from :mod:`sdm_mlx.defaults` (one place)."""
    from ..defaults import ESTIMATOR_DEFAULTS as D
    from ..defaults import PAPER_SETTINGS as P

    def both(key):
        paper = "off" if P[key] is None else P[key]
        mine = "off" if D[key] is None else D[key]
        return f" (default {mine}; --paper {paper})%(default).0s"

    g = p.add_argument_group("estimator")
    g.add_argument("--alpha", type=float, default=D["alpha"], help="target conditional accuracy α'")
    g.add_argument("--iterations", type=int, default=None,
                   help="J: rounds over re-splits of train+calibration" + both("iterations"))
    g.add_argument("--epochs", type=int, default=None,
                   help="epochs per round; a cap when --patience is on" + both("epochs"))
    g.add_argument("--patience", type=_patience, default=None,
                   help="convergence-aware stopping: end a round after this many epochs without a better balanced "
                        "median calibration q; 0 = run every epoch" + both("patience"))
    g.add_argument("--exemplar-dim", type=int, default=None, help="M: exemplar vector width" + both("exemplar_dim"))
    g.add_argument("--batch-size", type=int, default=None, help="Adam batch size" + both("batch_size"))
    g.add_argument("--learning-rate", type=float, default=None,
                   help="Adam learning rate of the adaptor" + both("learning_rate"))
    g.add_argument("--k", type=int, default=None, help="neighbours scanned for q (default: largest class count)")
    g.add_argument("--no-normalize", action="store_true", help="disable the scalar input normalisation")
    g.add_argument("--unstratified", action="store_true", help="split rounds without stratifying by label")
    g.add_argument("--index", choices=["exact", "hnsw"], default=D["index_backend"], help="support index backend")
    g.add_argument("--rescaler-max-epochs", type=int, default=D["rescaler_max_epochs"])
    g.add_argument("--rescaler-patience", type=int, default=D["rescaler_patience"])
    g.add_argument("--rescaler-learning-rate", type=float, default=D["rescaler_learning_rate"])
    g.add_argument("--rescaler-engine", choices=["numpy", "mlx"], default=D["rescaler_engine"],
                   help="numpy: host loop (fast); mlx: compiled MLX step (same math, ~10x slower on CPU)")
    g.add_argument("--n-exemplars", type=int, default=D["n_exemplars"],
                   help="nearest training exemplars reported per row")
    g.add_argument("--seed", type=int, default=D["seed"])
    g.add_argument("--quiet", action="store_true", help="no progress on stderr")


def resolved_settings(args) -> dict:
    """The effective values of the ``--paper``-dependent options: explicit flags win, then the mode."""
    from ..defaults import ESTIMATOR_DEFAULTS, PAPER_SETTINGS

    base = PAPER_SETTINGS if getattr(args, "paper", False) else ESTIMATOR_DEFAULTS
    out = {}
    for key in PAPER_KEYS:
        given = getattr(args, key, None)
        out[key] = base[key] if given is None else given
    if out["patience"] == 0:
        out["patience"] = None
    return out


def estimator_from_args(args, class_names=None):
    from ..estimator import SDMEstimator

    return SDMEstimator(
        alpha=args.alpha, k=args.k, normalize=not args.no_normalize,
        stratified=not args.unstratified, index_backend=args.index, rescaler_max_epochs=args.rescaler_max_epochs,
        rescaler_patience=args.rescaler_patience, rescaler_learning_rate=args.rescaler_learning_rate,
        rescaler_engine=args.rescaler_engine, n_exemplars=args.n_exemplars, seed=args.seed,
        verbose=not args.quiet, class_names=class_names, **resolved_settings(args),
    )


def jsonl_num_classes(args, train, cal) -> int:
    """C for JSONL labels, which are class indices 0..C−1: ``--num-classes`` or the largest label + 1
    (so a model's class i is always label i, as the predict output and ``--class-names`` assume)."""
    import numpy as np

    if args.num_classes is not None:
        return args.num_classes
    labels = [train.y] + ([] if cal is None else [cal.y])
    return 1 + max(int(np.max(y, initial=0)) for y in labels)


def add_arguments(p) -> None:
    p.add_argument("--train", help="training JSONL (id, label, embedding and/or attributes, optional document)")
    p.add_argument("--calibration", default=None, help="calibration JSONL (pooled with --train, as in the paper)")
    p.add_argument("--output", help="model directory to write (new or empty; an existing model only with --overwrite)")
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
    from ..cli import require
    from ..data import read_jsonl
    from ..io import refuse_same_files, write_json
    from ..progress import log

    require(args, "train", "output")
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
