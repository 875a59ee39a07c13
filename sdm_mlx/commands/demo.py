"""``sdm-mlx demo``: the paper's factcheck experiment end to end on the embedded data.

Trains an SDM estimator on the pooled topic statements (train + calibration, re-split J times),
then evaluates it against the baselines (NoReject, Softmax, temperature scaling, APS, RAPS over
the same adaptor logits) on

* ``heldout_topics``: held-out statements of the training topics (in distribution), and
* ``generated``: the 245 LLM-generated statements (distribution shift; the paper's test set),

printing one table per set.  Everything lands in ``--output`` (default ``runs/demo``, whose outputs a new
run replaces: running the README's Quick start again works as the first time): the model,
``report.json``, ``label_errors.jsonl``, plots (with matplotlib) and the three splits as JSONL
so the same evaluation can be re-run with ``sdm-mlx train`` / ``sdm-mlx evaluate``.

Settings: the defaults are reduced so the demo finishes in minutes on 2 CPU cores (J = 5 rounds of
20 epochs, M = 1000; measured times: docs/demo.md); ``--paper`` uses the paper's
J = 10, 50 epochs, M = 1000 (``--iterations 10 --epochs 50 --exemplar-dim 1000``); ``--quick`` is a
smoke run (J = 2, 4 epochs, M = 256, rescaler <= 40 epochs; 52 s at load average 16) whose numbers mean little.
"""

from __future__ import annotations

import os

from ..estimator.config import ESTIMATOR_DEFAULTS, PAPER_SETTINGS, EstimatorConfig
from ._common import add_conformal_argument, add_estimator_arguments, estimator_config, mode_help
from ..errors import InputError

#: The settings classes whose fields are this verb's options and YAML keys.
SETTINGS = (EstimatorConfig,)

HELP = "Train and evaluate on the embedded factcheck data (in-distribution and shifted): the paper's point in minutes."

#: Where the demo writes without --output: the demo's own directory, whose outputs a rerun replaces (so the README's
#: Quick start can be run again as it is).
DEFAULT_OUTPUT = os.path.join("runs", "demo")

#: How to ask for the paper's settings (printed and recorded in the report).
PAPER_FLAGS = "--paper (= --iterations 10 --epochs 50 --exemplar-dim 1000 --learning-rate 1e-5 --patience 0)"

#: Settings per mode for the options whose default depends on the mode (the learning rate and
#: convergence-aware stopping follow the estimator defaults, sdm_mlx/estimator/config.py; --paper is the paper's).
_DEFAULT_TRAINING = {k: ESTIMATOR_DEFAULTS[k] for k in ("learning_rate", "patience", "batch_size")}
MODES = {
    "default": {"iterations": 5, "epochs": 20, "exemplar_dim": 1000, "rescaler_max_epochs": 1000, **_DEFAULT_TRAINING},
    "quick": {"iterations": 2, "epochs": 4, "exemplar_dim": 256, "rescaler_max_epochs": 40, **_DEFAULT_TRAINING},
    "paper": {**PAPER_SETTINGS, "rescaler_max_epochs": 1000},
}


def add_arguments(p) -> None:
    p.add_argument("--output", default=None,
                   help=f"directory for the model, report, label errors, plots and data (default: {DEFAULT_OUTPUT}, "
                        "where a new demo run replaces the outputs of the previous one; a directory given here must be "
                        "new or empty, or an earlier demo run's with --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the outputs of an earlier demo run in --output (a directory that sdm-mlx did not "
                        "create is never written into)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="smoke run in seconds (J=%d, %d epochs, M=%d, rescaler <= %d epochs); not meaningful numbers"
                           % tuple(MODES["quick"][k] for k in ("iterations", "epochs", "exemplar_dim",
                                                              "rescaler_max_epochs")))
    mode.add_argument("--paper", action="store_true",
                      help="the paper's settings: J=10, 50 epochs, M=1000, lr 1e-5, no early stopping "
                           "(310 s once on 2 CPU cores, load not recorded: docs/demo.md)")
    p.add_argument("--heldout-fraction", type=float, default=0.15,
                   help="share of each topic's statements held out as the in-distribution test set")
    p.add_argument("--alphas", type=float, nargs="+", default=None, help="alpha' sweep for the curves")
    p.add_argument("--no-plots", action="store_true", help="do not draw plots even if matplotlib is installed")
    add_conformal_argument(p)
    add_estimator_arguments(p)
    _demo_defaults_in_help(p)


def _demo_defaults_in_help(p) -> None:
    """The mode-dependent options show the demo's own default and each mode's value."""
    for action in p._actions:
        if action.dest in MODES["default"] and action.help:
            action.help = action.help.split(" (default")[0] + " (default: {})".format(
                "off" if MODES["default"][action.dest] is None else MODES["default"][action.dest])
    mode_help(p, {m: MODES[m] for m in ("quick", "paper")})


def settings(args) -> dict:
    """The effective values of the mode-dependent options (explicit flags and YAML win over the mode)."""
    mode = "quick" if args.quick else "paper" if args.paper else "default"
    cfg = estimator_config(args, {k: v for k, v in MODES[mode].items()})
    return {"mode": mode, **{key: getattr(cfg, key) for key in MODES[mode]}}


def settings_line(cfg: dict, alpha: float) -> str:
    """Which settings this demo run uses, and why they differ from ``sdm-mlx train``'s defaults."""
    used = (f"J={cfg['iterations']} rounds of {'up to ' if cfg.get('patience') else ''}{cfg['epochs']} epochs, "
            f"M={cfg['exemplar_dim']}, learning rate {cfg['learning_rate']:g}, alpha'={alpha:g}")
    train = ESTIMATOR_DEFAULTS
    why = {
        "default": f"the demo's settings; `sdm-mlx train` defaults to J={train['iterations']} rounds of up to "
                   f"{train['epochs']} epochs: the demo runs fewer so that it ends in minutes on 2 CPU cores; "
                   "--paper runs the paper's settings",
        "quick": "a smoke run: too few rounds and epochs for meaningful numbers",
        "paper": "the paper's settings (Alg. 1: J=10 rounds of 50 epochs, lr 1e-5, no early stopping)",
    }[cfg["mode"]]
    return f"settings: {used} ({why})"


def _write_splits(splits: dict, out: str) -> dict:
    """The three splits as JSONL under ``out/data`` (id, label, attributes, document: the input of ``sdm-mlx
    train`` / ``predict`` / ``evaluate``, README "Your own data in three commands"); their paths."""
    paths = {}
    for name, ds in splits.items():
        paths[name] = os.path.join(out, "data", f"{name}.jsonl")
        ds.to_jsonl(paths[name], field="attributes")
    return paths


def _fit(est, pool, out: str, cfg: dict, callback) -> tuple[str, float]:
    """Train on the pool and save the model under ``out/model``; ``(model directory, seconds)``."""
    import time

    callback.message(f"training, {settings_line(cfg, est.alpha)} ...")
    t0 = time.perf_counter()
    est.fit(pool.X, pool.y, ids_train=pool.ids, callback=callback, feature_field="attributes")
    seconds = time.perf_counter() - t0
    model_dir = os.path.join(out, "model")
    est.save(model_dir, overwrite=True)  # inside our own run directory (checked by the caller)
    est.verbose = False
    return model_dir, seconds


def _plots_dir(args, out: str) -> str | None:
    from ..runtime.callbacks import note
    from ..evaluation.plots import plots_available

    if args.no_plots:
        return None
    if not plots_available():
        note("note: matplotlib is not installed, so no plots (pip install 'sdm_mlx[plots]')")
        return None
    return os.path.join(out, "plots")


def run(args) -> int:
    import sys
    import time
    from types import SimpleNamespace

    from ..storage.artifact import prepare_run_directory
    from ..runtime.callbacks import cli_callback
    from ..storage.datasets import FACTCHECK_CITATION, FACTCHECK_CLASS_NAMES, factcheck_splits
    from ..evaluation.evaluate import baseline_options, evaluate, predict_datasets
    from ._common import emit, estimator_from_args, training_report

    if not 0.0 < args.heldout_fraction < 1.0:
        raise InputError(f"--heldout-fraction must be in (0, 1), got {args.heldout_fraction}")
    t_start, callback, cfg = time.perf_counter(), cli_callback(args.quiet), settings(args)
    est = estimator_from_args(args, list(FACTCHECK_CLASS_NAMES), base=MODES[cfg["mode"]])
    out = args.output or DEFAULT_OUTPUT
    rerun = args.output is None and os.path.isdir(out) and bool(os.listdir(out))
    prepare_run_directory(out, "demo", args.overwrite or rerun)  # (a foreign runs/demo is still refused)
    if rerun:
        callback.message(f"replacing the outputs of the previous demo run in {out} (give --output DIR to keep them)")
    pool, heldout, generated = factcheck_splits(args.heldout_fraction, seed=est.seed)
    callback.message(f"factcheck data ({FACTCHECK_CITATION})")
    callback.message(f"  pool (train + calibration): {len(pool)} statements of 6 topics; held-out topic statements: "
                     f"{len(heldout)}; generated (shifted): {len(generated)}; features: {pool.X.shape[1]} Mixtral "
                     "attributes")
    paths = _write_splits({"pool": pool, "heldout_topics": heldout, "generated": generated}, out)
    model_dir, fit_seconds = _fit(est, pool, out, cfg, callback)
    t1 = time.perf_counter()
    datasets = {"heldout_topics": heldout, "generated": generated}
    predictions = predict_datasets(est, datasets)
    report = evaluate(est, datasets, est.calibration_logits_, est.calibration_labels_, alphas=args.alphas,
                      predictions=predictions, callback=callback, options=baseline_options(args.conformal))
    report["demo"] = {
        "settings": {**cfg, "alpha": est.alpha, "seed": est.seed, "heldout_fraction": args.heldout_fraction,
                     "conformal": args.conformal},
        "paper_settings": PAPER_FLAGS,
        "data": {"citation": FACTCHECK_CITATION, "pool": len(pool), "heldout_topics": len(heldout),
                 "generated": len(generated), "files": paths},
        "training": training_report(est, fit_seconds),
        "seconds": {"fit": round(fit_seconds, 2), "evaluate": round(time.perf_counter() - t1, 2)},
    }
    files = SimpleNamespace(report=os.path.join(out, "report.json"),
                            label_errors=os.path.join(out, "label_errors.jsonl"), plots=_plots_dir(args, out))
    report["demo"]["seconds"]["total"] = round(time.perf_counter() - t_start, 2)
    print(f"factcheck demo, {settings_line(cfg, est.alpha)}\n", file=sys.stdout)
    emit(report, files, datasets, predictions, est.class_names)
    print(f"\nfactcheck demo ({cfg['mode']} settings, above) in {time.perf_counter() - t_start:.0f}s (training "
          f"{fit_seconds:.0f}s). Paper settings: {PAPER_FLAGS}.\nmodel: {model_dir}\nreport: {files.report}\n"
          f"label errors: {files.label_errors}\nre-run the evaluation: sdm-mlx evaluate --model {model_dir} "
          f"--input {paths['heldout_topics']} --input {paths['generated']}", file=sys.stdout)
    return 0
