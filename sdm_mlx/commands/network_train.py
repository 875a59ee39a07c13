"""``sdm-mlx network-train``: train an SDM network (Alg. 4) on an mlx-lm model — only the LM head is trained.

See :mod:`sdm_mlx.network.trainer`.  Typical use with a recipe::

    sdm-mlx network-train -c recipes/phi35_sentiment.yaml

Writes ``<output>/network/`` (positive head + config + verification layer;
load with ``sdm_mlx.network.load_network``), ``<output>/verifier/``,
``<output>/metrics.json`` (per-epoch loss, β range, calibration count,
times, tokens/s), ``<output>/verification_rows.jsonl`` and ``<output>/resume/``
(the state after the last finished epoch: the same command continues an
interrupted run, ``--restart`` starts over; :mod:`sdm_mlx.network.resume`).
Progress goes to stderr; a one-line JSON summary goes to stdout.
"""

from __future__ import annotations

import json

from ..errors import CLIError
from ..network.config import NetworkConfig

HELP = "train an SDM network (duplicated LM head, verification layer, Alg. 4) on an mlx-lm model"


#: The settings classes whose fields are this verb's options and YAML keys.
SETTINGS = (NetworkConfig,)


def add_arguments(p) -> None:
    """Options generated from :class:`sdm_mlx.network.config.NetworkConfig`, plus old spellings."""
    import argparse

    from ..settings import add_arguments as add_settings

    groups = {
        "model and data": ("model", "output_dir", "data", "verification_data", "base_decodings", "completions",
                           "preset", "system",
                           "prompt_template", "use_chat_template", "delimiter", "max_length", "negatives_seed",
                           "answers", "overwrite", "restart"),
        "next-token training of W_pos": ("epochs", "beta_min", "beta_max", "learning_rate", "batch_size",
                                         "max_new_tokens", "generation_batch_size", "embed_batch_size",
                                         "checkpoint_minutes", "train_step", "compile_step", "reference_head", "seed",
                                         "distributed_timeout"),
        "verification layer (SDM estimator)": tuple(f for f in NetworkConfig.__dataclass_fields__
                                                    if f in ("verifier", "alpha", "require_admission")
                                                    or f.startswith("verifier_")),
    }
    for title, names in groups.items():
        add_settings(p, NetworkConfig, title=title, only=names)
    g = p.add_argument_group("other spellings")
    g.add_argument("--tasks", default=argparse.SUPPRESS,
                   help="instead of --data: several tasks trained together (universal verification), a JSON list "
                        "of mappings {name, data, preset | completions + prompt_template} (a YAML list in --config)")
    for flag, dest in (("--no-chat-template", "use_chat_template"), ("--ignore-chat-template", "use_chat_template"),
                       ("--no-compile", "compile_step")):
        g.add_argument(flag, dest=dest, action="store_false", default=argparse.SUPPRESS,
                       help=f"same as --no-{dest.replace('_', '-')}")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def _tasks(args):
    """--tasks as given in YAML (a list) or on the command line (JSON text)."""
    tasks = getattr(args, "tasks", None)
    if isinstance(tasks, str):
        try:
            tasks = json.loads(tasks)
        except json.JSONDecodeError as e:
            raise CLIError(f"--tasks is not valid JSON: {e}") from None
    return tasks


def network_config(args) -> NetworkConfig:
    """The :class:`NetworkConfig` of ``args`` (CLI > YAML > defaults), checked."""
    from ..settings import resolve

    config = resolve(NetworkConfig, args, tasks=_tasks(args), verbose=not args.quiet)
    if config.system == "":
        config.system = None
    tasks_as_inputs = None if config.verification_data else config.tasks  # with verification rows: completions
    if sum(bool(x) for x in (config.data, config.verification_data, tasks_as_inputs)) != 1:
        raise CLIError("give exactly one of --data (task JSONL), --verification-data (verification rows) "
                       "and --tasks (several tasks)")
    if config.data and not config.completions and not config.preset:
        raise CLIError("--data needs --completions (one per task label) and --prompt-template, or --preset")
    if config.data and config.completions and not config.preset and not config.prompt_template:
        raise CLIError("--prompt-template (with a {document} slot) is needed with custom --completions")
    try:
        config.validate()
    except ValueError as e:
        raise CLIError(str(e)) from None
    return config


def run(args) -> int:
    from ..runtime.distributed import DistributedError
    from ..storage.files import dumps
    from ..network.data_parallel import DataParallel
    from ..network.trainer import train_network
    from ..runtime.allocator import keep_freed_buffers_after_load

    keep_freed_buffers_after_load()  # batch work: sdm_mlx.runtime.allocator
    config = network_config(args)
    dp = DataParallel(timeout=config.distributed_timeout)  # under mlx.launch: this rank; else a group of one
    try:
        result = train_network(config, dp=dp)
    except DistributedError as e:  # a collective failed: another rank died or was stopped
        raise CLIError(f"{e}. The run directory keeps what rank 0 wrote last (not marked finished); the same "
                       "command continues after its last finished epoch") from None
    if not dp.writer:
        return 0  # rank 0 alone reports
    summary = {
        "network": result.network_path, "verifier": result.verifier_path, "metrics": result.metrics_path,
        "selected_epoch": result.selected_epoch, "best_count": result.best_count,
        "initial_count": result.initial_count,
        "epochs": [{"epoch": e["epoch"], "loss": e["loss"], "count": e["count"], "beta_first": e["beta_first"],
                    "beta_last": e["beta_last"], "tokens_per_s": e["tokens_per_s"],
                    "seconds": e["epoch_seconds"]} for e in result.history],
    }
    print(dumps(summary), flush=True)
    return 0
