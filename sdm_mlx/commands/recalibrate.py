"""sdm-mlx recalibrate: a new α' for a trained model without retraining the adaptor."""

from __future__ import annotations

HELP = "Re-threshold a trained SDM estimator at a new alpha (Alg. 3 + Cauchy offsets), no retraining."


#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("model", "alpha")


def add_arguments(p) -> None:
    p.add_argument("--model", help="model directory written by `sdm-mlx train`")
    p.add_argument("--alpha", type=float, help="the new target conditional accuracy α'")
    p.add_argument("--output", default=None,
                   help="where to write the recalibrated model (new or empty directory; default: the --model "
                        "directory itself, which needs --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing sdm_mlx model at the output (atomically); other directories are never "
                        "replaced")


def run(args) -> int:
    import sys

    from ..storage.artifact import check_artifact_output
    from ..estimator import SDMEstimator

    out = args.output or args.model
    check_artifact_output(out, args.overwrite)
    est = SDMEstimator.load(args.model)
    est.verbose = False
    old = est.alpha
    est.recalibrate(args.alpha)
    est.save(out, overwrite=args.overwrite)
    print(
        f"alpha {old} -> {est.alpha}: min valid q~ {est.calibration_.min_valid:.3f}, psi "
        f"{[round(float(x), 4) for x in est.calibration_.psi]}, robust min valid q~ {est.robust_min_valid_:.3f}\n"
        f"model: {out}",
        file=sys.stdout,
    )
    return 0
