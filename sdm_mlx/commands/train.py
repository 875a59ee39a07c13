"""sdm-mlx train: fit an SDM estimator on JSONL rows and save the artifact."""

from __future__ import annotations

from contextlib import contextmanager

from ..estimator.config import EstimatorConfig
from ._common import add_estimator_arguments, estimator_from_args, mode_help, training_report
from ..errors import InputError

HELP = "Train and calibrate an SDM estimator (Alg. 1-3) on JSONL rows; save a model directory."


#: The settings classes whose fields are this verb's options and YAML keys (cli.py type-checks --config with them).
SETTINGS = (EstimatorConfig,)


#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("train", "output")


def jsonl_num_classes(args, train, cal) -> int:
    """C for JSONL labels, which are class indices 0..C−1: ``--num-classes`` or the largest label + 1
    (so a model's class i is always label i, as the predict output and ``--class-names`` assume)."""
    import numpy as np

    if args.num_classes is not None:
        return args.num_classes
    labels = np.concatenate([train.y] + ([] if cal is None else [cal.y]))
    found = np.unique(labels)
    if found.size and found.min() >= 0 and found.size < found.max() + 1:  # negatives: validation names them
        missing = sorted(set(range(int(found.max()) + 1)) - set(found.tolist()))
        shown = found.tolist()[:10]
        raise InputError(f"labels must be class indices 0..C-1 (start at 0, no gaps); found the values {shown}, "
                         f"so class(es) {missing[:10]} have no rows. Relabel (e.g. {shown[0]} -> 0, {shown[-1]} -> "
                         f"{min(len(found), 10) - 1}), or pass --num-classes if a class truly has no rows")
    return 1 + int(np.max(labels, initial=0))


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
    p.add_argument("--class-names", nargs="+", default=None,
                   help="names of the classes 0..C-1, in class order; rows may then give a label as its name "
                        "(a string label is read as the index of its name)")
    p.add_argument("--report", default=None, help="training report JSON (default: OUTPUT/training_report.json)")
    p.add_argument("--paper", action="store_true",
                   help="the paper's exact Alg. 1 settings: J=10 rounds of 50 epochs, lr 1e-5, batch 50, M=1000, "
                        "no early stopping (explicit flags still win)")
    p.add_argument("--restart", action="store_true",
                   help="ignore the checkpoint OUTPUT.partial of an interrupted run and start over")
    add_estimator_arguments(p)
    from ..estimator.config import PAPER_SETTINGS

    mode_help(p, {"paper": PAPER_SETTINGS})


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


def llm_rows(path) -> bool:
    """True when the first row of ``path`` was written by ``sdm-mlx embed`` (LLM hidden-state features)."""
    import json

    from ..storage.datasets import LLM_FEATURES

    if path == "-":
        return False
    with open(path, encoding="utf-8-sig") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line).get("embedding_source") == LLM_FEATURES
                except (ValueError, AttributeError):
                    return False
    return False


def default_normalize(args, train) -> None:
    """DESIGN #2: without --normalize (CLI or YAML), features written by ``sdm-mlx embed`` get the per-dimension
    normalisation, every other feature the scalar one (the estimator's default)."""
    from ..runtime.callbacks import log

    if "normalize" in vars(args) or train.features not in ("embedding", "embedding+attributes"):
        return
    if llm_rows(args.train):
        args.normalize = "per-dimension"
        log("normalize: per-dimension (the rows hold LLM hidden states written by sdm-mlx embed; DESIGN #2; "
            "--normalize scalar for the paper's scalar statistics)", not args.quiet)


def run(args) -> int:
    """Train under the lock of ``--output`` (one run per output at a time; see :func:`output_lock`)."""
    from ..runtime.distributed import is_distributed, is_primary, launched_rank
    from ..storage.artifact import check_artifact_output

    if launched_rank() is not None and is_distributed() and not is_primary():
        return _run(args)  # under mlx.launch every rank runs this command; rank 0 alone writes (and locks)
    check_artifact_output(args.output, args.overwrite, _inputs(args))  # the plain refusals first (again under the lock)
    with output_lock(args.output):
        return _run(args)


def _inputs(args) -> list:
    return [("--train", args.train), ("--calibration", args.calibration)]


@contextmanager
def output_lock(output):
    """The exclusive lock of ``--output`` for the whole run, taken before anything is read: a second ``train`` on
    the same output stops at once (exit 2, naming the process that holds it) instead of resuming the first run's
    checkpoint ``OUTPUT.partial`` while that run still writes it.  The lock file is removed when the run ends."""
    import os

    from ..errors import OutputError
    from ..storage.locks import Busy, artifact_lock
    from ..storage.files import describe_os_error, make_dirs

    try:
        make_dirs(os.path.dirname(os.path.realpath(output)))  # (the model is saved there at the end in any case)
    except OSError as e:
        raise OutputError(f"cannot create the directory of --output {describe_os_error(e, output)}") from None
    try:
        with artifact_lock(output, OutputError, wait=False):  # (nothing in the run waits for this lock: no Busy)
            yield
    except Busy as e:
        raise OutputError(f"--output {output} is in use by {e.holder or 'another sdm-mlx process'}: another run is "
                          "training into it now (with its checkpoint OUTPUT.partial); wait for it to finish, or "
                          "choose another --output") from None


def _run(args) -> int:
    import os
    import sys
    import time

    from ..storage.artifact import check_artifact_output
    from ..estimator.checkpoint import checkpoint_rounds, remove_checkpoint
    from ..runtime.distributed import is_distributed, is_primary, launched_rank
    from ..storage.datasets import read_jsonl
    from ..storage.files import refuse_same_files, write_json
    from ..runtime.callbacks import log

    inputs = _inputs(args)
    refuse_same_files([("--report", args.report)], inputs)
    check_artifact_output(args.output, args.overwrite, inputs)
    train = read_jsonl(args.train, args.features, label_names=args.class_names)  # string labels: their index there
    cal = read_jsonl(args.calibration, args.features, prefer=train.features,
                     label_names=args.class_names) if args.calibration else None
    if cal is not None and cal.X.shape[1] != train.X.shape[1]:
        raise InputError(
            f"{args.calibration}: feature width {cal.X.shape[1]} differs from {args.train} ({train.X.shape[1]})"
        )
    default_normalize(args, train)
    est = estimator_from_args(args, args.class_names)
    checkpoint = os.path.abspath(args.output).rstrip(os.sep) + ".partial"
    if args.restart:
        remove_checkpoint(checkpoint)
    distributed_run = launched_rank() is not None and is_distributed()
    if distributed_run:  # the ranks would resume from different (or shared) checkpoints: none under mlx.launch
        checkpoint = None
        if not est.shard_index:
            log("under mlx.launch without --shard-index: every rank holds the whole support index "
                "(docs/distributed.md)", not args.quiet)
    t0 = time.perf_counter()
    try:
        est.fit(
            train.X, train.y, None if cal is None else cal.X, None if cal is None else cal.y,
            ids_train=train.ids, ids_cal=None if cal is None else cal.ids,
            num_classes=jsonl_num_classes(args, train, cal), checkpoint=checkpoint, feature_field=train.features,
            feature_parts=train.feature_parts,
        )
    except KeyboardInterrupt:
        done = checkpoint_rounds(checkpoint) if checkpoint else 0
        log(f"interrupted: {done} finished round(s) are kept in {checkpoint}; run the same command again to "
            "resume (--restart to start over)" if done else "interrupted before the first round finished", True)
        raise
    seconds = time.perf_counter() - t0
    kept = est.keep_documents(train.ids + ([] if cal is None else cal.ids),
                              train.documents + ([] if cal is None else cal.documents))
    if kept:
        log(f"kept the documents of {kept} support rows (shown with the exemplars: predict --html)", not args.quiet)
    if distributed_run and not is_primary():
        return 0  # rank 0 alone writes the model and the report
    est.save(args.output, overwrite=args.overwrite)
    if checkpoint:
        remove_checkpoint(checkpoint)
    report = training_report(est, seconds, getattr(est, "resumed_rounds_", 0))
    report_path = args.report or os.path.join(args.output, "training_report.json")
    write_json(report_path, report)
    print(f"{summary_line(report)}\nmodel: {args.output}\nreport: {report_path}", file=sys.stdout)
    return 0
