"""sdm-mlx train: fit an SDM estimator on JSONL rows and save the artifact."""

from __future__ import annotations

HELP = "Train and calibrate an SDM estimator (Alg. 1-3) on JSONL rows; save a model directory."


def add_estimator_arguments(p) -> None:
    """Estimator settings shared by `train` and `demo` (paper defaults)."""
    g = p.add_argument_group("estimator")
    g.add_argument("--alpha", type=float, default=0.95, help="target conditional accuracy α'")
    g.add_argument("--iterations", type=int, default=10, help="J: rounds over re-splits of train+calibration")
    g.add_argument("--epochs", type=int, default=50, help="epochs per round")
    g.add_argument("--exemplar-dim", type=int, default=1000, help="M: exemplar vector width")
    g.add_argument("--batch-size", type=int, default=50)
    g.add_argument("--learning-rate", type=float, default=1e-5)
    g.add_argument("--k", type=int, default=None, help="neighbours scanned for q (default: largest class count)")
    g.add_argument("--no-normalize", action="store_true", help="disable the scalar input normalisation")
    g.add_argument("--unstratified", action="store_true", help="split rounds without stratifying by label")
    g.add_argument("--index", choices=["exact", "hnsw"], default="exact", help="support index backend")
    g.add_argument("--rescaler-max-epochs", type=int, default=1000)
    g.add_argument("--rescaler-patience", type=int, default=10)
    g.add_argument("--rescaler-learning-rate", type=float, default=1e-4)
    g.add_argument("--rescaler-engine", choices=["numpy", "mlx"], default="numpy",
                   help="numpy: host loop (fast); mlx: compiled MLX step (same math, ~10x slower on CPU)")
    g.add_argument("--n-exemplars", type=int, default=5, help="nearest training exemplars reported per row")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quiet", action="store_true", help="no progress on stderr")


def estimator_from_args(args, class_names=None):
    from ..estimator import SDMEstimator

    return SDMEstimator(
        alpha=args.alpha, iterations=args.iterations, epochs=args.epochs, exemplar_dim=args.exemplar_dim,
        batch_size=args.batch_size, learning_rate=args.learning_rate, k=args.k, normalize=not args.no_normalize,
        stratified=not args.unstratified, index_backend=args.index, rescaler_max_epochs=args.rescaler_max_epochs,
        rescaler_patience=args.rescaler_patience, rescaler_learning_rate=args.rescaler_learning_rate,
        rescaler_engine=args.rescaler_engine, n_exemplars=args.n_exemplars, seed=args.seed,
        verbose=not args.quiet, class_names=class_names,
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
    add_estimator_arguments(p)


def training_report(est, seconds: float) -> dict:
    from ..estimator import ROBUST_INF_REASON
    from ..io import put_float

    report = {
        "seconds": round(seconds, 3),
        "num_classes": est.num_classes_,
        "input_dim": est.input_dim_,
        "support_size": len(est.support_ids_),
        "calibration_size": len(est.calibration_ids_),
        "k": est.k_,
        "best_round": est.best_round_,
        "rounds": est.round_summaries_,
        "best_round_history": est.history_,
        "alpha": est.alpha,
        "psi": est.calibration_.psi.tolist(),
        "params": est.get_params(),
    }
    # +inf thresholds are stored as null with the reason (strict JSON)
    put_float(report, "min_valid_qbin", est.calibration_.min_valid,
              "no valid threshold: Alg. 3 found no q~ where psi_c >= alpha for every class in the best round")
    put_float(report, "robust_min_valid_qbin", est.robust_min_valid_, ROBUST_INF_REASON)
    return report


def run(args) -> int:
    import os
    import sys
    import time

    from ..artifact import check_artifact_output
    from ..cli import require
    from ..data import read_jsonl
    from ..io import refuse_same_files, write_json

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
    t0 = time.perf_counter()
    est.fit(
        train.X, train.y, None if cal is None else cal.X, None if cal is None else cal.y,
        ids_train=train.ids, ids_cal=None if cal is None else cal.ids, num_classes=jsonl_num_classes(args, train, cal),
    )
    seconds = time.perf_counter() - t0
    est.feature_field_ = train.features
    est.save(args.output, overwrite=args.overwrite)
    report = training_report(est, seconds)
    report_path = args.report or os.path.join(args.output, "training_report.json")
    write_json(report_path, report)
    print(
        f"trained in {seconds:.1f}s: {report['support_size']} support / {report['calibration_size']} calibration rows, "
        f"best round {est.best_round_ + 1}, min valid q~ {est.calibration_.min_valid:.3f}, "
        f"robust min valid q~ {est.robust_min_valid_:.3f}\nmodel: {args.output}\nreport: {report_path}",
        file=sys.stdout,
    )
    return 0
