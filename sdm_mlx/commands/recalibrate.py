"""sdm-mlx recalibrate: a new α' for a trained model without retraining the adaptor."""

from __future__ import annotations

HELP = ("Re-threshold a trained SDM estimator at a new alpha and / or alpha grid (Alg. 3 + Cauchy offsets), "
        "no retraining.")


#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("model",)


def level_or_default(text: str):
    """An α level, or ``default`` (return the setting to its default); anything else is a usage error."""
    import argparse

    if text == "default":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1) or 'default', got {text!r}") from None


def add_arguments(p) -> None:
    p.add_argument("--model", help="model directory written by `sdm-mlx train`")
    p.add_argument("--alpha", type=float, default=None, help="the new target conditional accuracy α' (default: keep)")
    p.add_argument("--alpha-grid", type=level_or_default, nargs="+", default=None,
                   help="the new levels of the nested calibration, any resolution (α' is always added; default: "
                        "keep the model's; 'default': 0.99 0.98 ... 0.80; DESIGN #25)")
    p.add_argument("--alpha-allow", type=level_or_default, default=None,
                   help="decision policy: allow a row whose α region is ≥ this (default: keep; 'default': α')")
    p.add_argument("--alpha-review", type=level_or_default, default=None,
                   help="decision policy: review a row whose α region is ≥ this (default: keep; 'default': the "
                        "grid's lowest level)")
    p.add_argument("--output", default=None,
                   help="where to write the recalibrated model (new or empty directory; default: the --model "
                        "directory itself, which needs --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing sdm_mlx model at the output (atomically); other directories are never "
                        "replaced")


def run(args) -> int:
    import sys

    from ..errors import CLIError
    from ..storage.artifact import check_artifact_output
    from ..estimator import SDMEstimator

    if all(getattr(args, k) is None for k in ("alpha", "alpha_grid", "alpha_allow", "alpha_review")):
        raise CLIError("nothing to change: give --alpha and / or --alpha-grid, --alpha-allow, --alpha-review")
    out = args.output or args.model
    check_artifact_output(out, args.overwrite)
    est = SDMEstimator.load(args.model)
    est.verbose = False
    old = est.alpha
    grid = args.alpha_grid
    if grid is not None and "default" in grid:
        if len(grid) > 1:
            raise CLIError("--alpha-grid takes levels or the single word 'default', not both")
        grid = "default"
    est.recalibrate(args.alpha, alpha_grid=grid, alpha_allow=args.alpha_allow, alpha_review=args.alpha_review)
    est.save(out, overwrite=args.overwrite)
    policy = est.nested_.policy
    print(
        f"alpha {old} -> {est.alpha}: min valid q~ {est.calibration_.min_valid:.3f}, psi "
        f"{[round(float(x), 4) for x in est.calibration_.psi]}, robust min valid q~ {est.robust_min_valid_:.3f}\n"
        f"alpha grid ({len(est.nested_.grid)} levels): {' '.join(f'{a:g}' for a in est.nested_.grid)}; "
        f"allow >= {policy.allow:g}, review >= {policy.review:g}\n"
        f"model: {out}",
        file=sys.stdout,
    )
    return 0
