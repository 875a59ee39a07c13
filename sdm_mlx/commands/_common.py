"""CLI pieces shared by several verbs (no heavy imports: ``--help`` stays instant); verbs import these,
never each other or the dispatcher.

The options of ``generate``, ``chat``, ``serve`` and ``mcp`` that configure the verified generator are
generated from :class:`sdm_mlx.verified.config.GenerationConfig` (defaults and help text live there);
:func:`generation_config` resolves them (CLI > YAML > defaults) and :func:`build_generator` builds the
generator from the result.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..estimator.config import EstimatorConfig
from ..errors import CLIError
from ..verified.config import GenerationConfig

#: The settings classes whose fields are the generation verbs' options and YAML keys.
SETTINGS = (GenerationConfig,)

MODEL_FIELDS = ("model", "verifier", "head", "system", "prompt_template", "use_chat_template", "chat_template_args",
                "max_tokens", "delimiter", "max_length", "n_exemplars", "require_json", "prompt_cache_bytes")
POLICY_FIELDS = ("on_reject", "max_attempts", "reask_fallback", "reask_template")


#: what a verb that loads a model and its verifier cannot run without (shown by --help; :func:`generation_config`)
REQUIRED_MODEL = ("Required: --head DIR (an SDM network: it names its base model and holds its verifier), or "
                  "-m/--model MODEL with --verifier DIR (on the command line or in --config).")


def add_generation_arguments(p, *, policy: bool = True, per_request: bool = False) -> None:
    """The generator's options (model, verifier, head, prompts; with ``policy`` the reject policy —
    ``per_request``: the server's default, which a request overrides) and mlx-lm's/older spellings."""
    from ..settings import add_arguments as add_settings

    p.description = (p.description or "").rstrip(".") + ". " + REQUIRED_MODEL
    add_settings(p, GenerationConfig, title="model, verifier and prompts", only=MODEL_FIELDS)
    if policy:
        note = " (a request overrides --on-reject / --max-attempts with sdm.on_reject / sdm.max_attempts)"
        add_settings(p, GenerationConfig, title="rejected answers" + (note if per_request else ""),
                     only=POLICY_FIELDS)
    g = p.add_argument_group("other spellings")
    g.add_argument("--ignore-chat-template", dest="use_chat_template", action="store_false",
                   default=argparse.SUPPRESS, help="mlx-lm's name of --no-chat-template")
    g.add_argument("--allow-non-json", dest="require_json", action="store_false", default=argparse.SUPPRESS,
                   help="same as --no-require-json")


def generation_config(args) -> GenerationConfig:
    """The :class:`GenerationConfig` of parsed options (CLIError naming the option on a bad one)."""
    from ..settings import field_flags, resolve

    cfg = resolve(GenerationConfig, args)
    if not cfg.model and not cfg.head:
        raise CLIError("missing required option(s): --model (or --head naming its base model)")
    if not cfg.verifier and not cfg.head:
        raise CLIError("missing required option(s): --verifier (or --head holding one)")
    try:
        cfg.validate()
    except ValueError as e:
        message = str(e)
        for f in GenerationConfig.__dataclass_fields__.values():
            if message.startswith(f.name + " "):
                message = field_flags(f)[0] + message[len(f.name):]
        raise CLIError(message) from None
    return cfg


def build_generator(args, **options):
    """A :class:`~sdm_mlx.verified.VerifiedGenerator` from parsed options (``options``: e.g. ``max_batch``)."""
    cfg = generation_config(args)
    from ..verified import VerifiedGenerator

    from ..verified.sources import ModelSources

    return VerifiedGenerator.from_config(ModelSources.read(cfg), **options)


def add_stream_arguments(p) -> None:
    """``--stream`` and ``--quiet`` of ``generate`` and ``chat``."""
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="stream tokens (default: on for a single prompt / chat, off for --input batches)")
    p.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def verdict_line(att) -> str:
    """A short human-readable verdict for one attempt."""
    v = att.verdict
    p = "n/a" if v.p_lower is None else f"{v.p_lower:.3f}"
    if v.verified:
        return f"[verified: p_lower={p}, {att.tokens} tokens, {att.seconds:.2f}s]"
    return f"[rejected: {v.reason}, p_lower={p}, {att.tokens} tokens, {att.seconds:.2f}s]"


def add_server_arguments(p) -> None:
    """The verdict store and feedback options shared by ``serve`` and ``mcp``."""
    p.add_argument("--max-verdicts", type=int, default=1000, help="verdicts kept in memory by id (oldest dropped)")
    p.add_argument("--persist-feedback", action="store_true",
                   help="write every feedback label into the verifier directory too (atomically, with its update "
                        "log); default: feedback lives in memory until the server stops")


def verifier_directory(sources) -> str:
    """The verifier directory in use (:attr:`~sdm_mlx.verified.sources.ModelSources.verifier`, absolute)."""
    if sources.verifier is None:
        raise CLIError("--persist-feedback needs --verifier or --head (the directory to write feedback into)")
    return os.path.abspath(sources.verifier)


def load_engine(args):
    """Validate the options and load the :class:`~sdm_mlx.serve.engine.Engine` of ``serve`` / ``mcp``."""
    cfg = generation_config(args)
    if args.max_verdicts < 1:
        raise CLIError("--max-verdicts must be >= 1")
    for name in ("verifier", "head"):
        path = getattr(cfg, name)
        if path and not os.path.isdir(path):
            raise CLIError(f"--{name} {path}: no such directory")
    from ..runtime.allocator import freeze_loaded_objects, limit_arenas, limit_buffer_cache
    from ..serve.engine import Engine
    from ..verified import VerifiedGenerator

    limit_arenas()  # before the server's threads allocate (sdm_mlx.runtime.allocator)
    limit_buffer_cache()  # glibc, not MLX's cache, reuses a server's freed buffers (sdm_mlx.runtime.allocator)

    from ..verified.sources import ModelSources

    sources = ModelSources.read(cfg)  # the one read of the head's config on serve's walk
    name, aliases = sources.names(getattr(args, "served_model_name", None))
    persist = verifier_directory(sources) if getattr(args, "persist_feedback", False) else None
    engine = Engine(lambda: VerifiedGenerator.from_config(sources), name, aliases=aliases,
                    max_verdicts=args.max_verdicts, persist_feedback=persist)
    freeze_loaded_objects()  # full collections walk only what requests create (sdm_mlx.runtime.allocator)
    return engine


def say_to_stderr(prefix: str, quiet: bool):
    """A ``say(message)`` printing ``<prefix>: message`` on stderr (nothing when ``quiet``)."""
    def say(message: str) -> None:
        if not quiet:
            print(f"{prefix}: {message}", file=sys.stderr, flush=True)
    return say


# --------------------------------------------------------------------------- the estimator verbs


def mode_help(parser, modes: dict) -> None:
    """Append each mode's value to the help of the options it changes: "(default: X; --paper Y)"."""
    for action in parser._actions:
        if action.help and any(action.dest in values for values in modes.values()):
            extra = "".join(f"; --{m} {'off' if v.get(action.dest) is None else v[action.dest]}"
                            for m, v in modes.items() if action.dest in v)
            action.help = action.help[:-1] + extra + ")" if action.help.endswith(")") else action.help + extra

def add_estimator_arguments(p) -> None:
    """Estimator settings shared by `train` and `demo`, generated from :class:`sdm_mlx.estimator.config.EstimatorConfig`."""
    import argparse

    from ..settings import add_arguments

    g = add_arguments(p, EstimatorConfig, title="estimator")
    g.add_argument("--unstratified", dest="stratified", action="store_false", default=argparse.SUPPRESS,
                   help="same as --no-stratified")
    g.add_argument("--no-normalize", dest="normalize", action="store_const", const="none", default=argparse.SUPPRESS,
                   help="same as --normalize none")
    g.add_argument("--quiet", action="store_true", help="no progress on stderr")

def estimator_config(args, base: dict | None = None):
    """The :class:`EstimatorConfig` of ``args`` (CLI and YAML) over ``base`` (a mode such as --paper) over
    the defaults; ``--patience 0`` means off."""
    import dataclasses

    from ..estimator.config import patience_setting
    from ..settings import SettingsError, resolve

    cfg = resolve(EstimatorConfig, args, base)
    try:
        return dataclasses.replace(cfg, patience=patience_setting(cfg.patience))
    except SettingsError as e:
        raise SettingsError(f"--{e}") from None

def paper_base(args) -> dict:
    """The --paper overrides when --paper is on (explicit flags and YAML still win)."""
    from ..estimator.config import PAPER_SETTINGS

    return dict(PAPER_SETTINGS) if getattr(args, "paper", False) else {}

def estimator_from_args(args, class_names=None, base: dict | None = None):
    """An :class:`SDMEstimator` from the resolved settings (``base`` default: --paper's overrides)."""
    from dataclasses import asdict

    from ..estimator import SDMEstimator

    cfg = estimator_config(args, paper_base(args) if base is None else base)
    return SDMEstimator(**asdict(cfg), verbose=not args.quiet, class_names=class_names)

def training_report(est, seconds: float, resumed_rounds: int = 0) -> dict:
    """What training learned: per-round trajectories, the selected round/epoch, adaptor movement, admission."""
    from ..estimator.persistence import ROBUST_INF_REASON
    from ..storage.files import put_float

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

def add_conformal_argument(p) -> None:
    p.add_argument("--conformal", choices=["randomized", "deterministic"], default="randomized",
                   help="APS/RAPS variant: randomized over temperature-scaled softmax (the RAPS reference code "
                        "the paper compared against) or deterministic over plain softmax")

def emit(report: dict, args, datasets: dict, predictions: dict, class_names) -> None:
    """Write the report, label errors and plots requested in ``args``; print the tables on stdout."""
    import sys

    from ..evaluation.evaluate import format_evaluation, label_error_records, write_plots
    from ..runtime.callbacks import note
    from ..storage.files import write_json, write_jsonl

    print(format_evaluation(report), file=sys.stdout, flush=True)
    if getattr(args, "label_errors", None):
        rows = label_error_records(datasets, predictions, class_names)
        write_jsonl(args.label_errors, rows)
        note(f"label errors: {len(rows)} admitted rows with label != prediction -> {args.label_errors}")
    if getattr(args, "plots", None):
        try:
            paths = write_plots(report, args.plots)
        except ImportError as e:
            note(f"note: no plots written ({e}); the rest of the report is unaffected")
        else:
            note(f"plots: {', '.join(paths)}")
    if getattr(args, "report", None):
        write_json(args.report, report)
        note(f"report: {args.report}")
