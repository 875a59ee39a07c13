"""``sdm-mlx network-train``: train an SDM network (Alg. 4) on an mlx-lm model — only the LM head is trained.

See :mod:`sdm_mlx.network.trainer`.  Typical use with a recipe::

    sdm-mlx network-train --config recipes/phi35_sentiment.yaml

Writes ``<output-dir>/network/`` (positive head + config + verification layer;
load with ``sdm_mlx.network.load_network``), ``<output-dir>/verifier/``,
``<output-dir>/metrics.json`` (per-epoch loss, β range, calibration count,
times, tokens/s) and ``<output-dir>/verification_rows.jsonl``.  Progress goes to
stderr; a one-line JSON summary goes to stdout.
"""

from __future__ import annotations

import json
import sys

from ..cli import CLIError, require

HELP = "train an SDM network (duplicated LM head, verification layer, Alg. 4) on an mlx-lm model"


def add_arguments(p) -> None:
    from ..defaults import ESTIMATOR_DEFAULTS as D

    g = p.add_argument_group("model and data")
    g.add_argument("--model", help="base model: mlx-lm directory or hub id (e.g. mlx-community/Phi-3.5-mini-instruct-4bit)")
    g.add_argument("--data", help="task JSONL with id, label (task label 0..C-1), document")
    g.add_argument("--verification-data", default=None,
                   help="instead of --data: verification rows JSONL (id, prompt, completion, label, [task_label]), "
                        "e.g. from make-verification-data")
    g.add_argument("--tasks", default=None,
                   help="instead of --data: several tasks trained together (universal verification), a YAML list "
                        "of mappings {name, data, preset | completions + prompt_template} (JSON on the CLI)")
    g.add_argument("--completions", nargs="+", default=None,
                   help="one completion per task label, in label order (default: the --preset's)")
    g.add_argument("--preset", choices=["factcheck", "sentiment"], default=None,
                   help="the paper's completions and instruction")
    g.add_argument("--system", default="You are a helpful AI assistant.", help="system message ('' for none)")
    g.add_argument("--prompt-template", default=None, help="user message with a {document} slot (default: the preset's)")
    g.add_argument("--no-chat-template", action="store_true", help="raw text prompts (base models without a chat template)")
    g.add_argument("--delimiter", default="}", help="closing delimiter of the answer")
    g.add_argument("--max-length", type=int, default=500, help="token positions kept for features and targets")
    g.add_argument("--negatives-seed", type=int, default=0, help="seed of the constructed-negative assignment")
    g.add_argument("--output-dir", help="output directory (new or empty; an earlier network-train run's directory "
                                        "only with --overwrite)")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the outputs of an earlier network-train run in --output-dir (a directory that "
                        "sdm-mlx did not create is never written into)")
    t = p.add_argument_group("next-token training of W_pos")
    t.add_argument("--epochs", type=int, default=5)
    t.add_argument("--beta-min", type=float, default=0.0, help="β at the first mini-batch of every epoch")
    t.add_argument("--beta-max", type=float, default=0.1, help="β approached at the end of every epoch")
    t.add_argument("--learning-rate", type=float, default=1e-5, help="Adam learning rate for W_pos")
    t.add_argument("--batch-size", type=int, default=50, help="tokens per mini-batch")
    t.add_argument("--max-new-tokens", type=int, default=32, help="greedy decoding limit")
    t.add_argument("--generation-batch-size", type=int, default=8, help="prompts decoded together")
    t.add_argument("--embed-batch-size", type=int, default=8, help="documents per forward pass for features")
    t.add_argument("--no-compile", action="store_true",
                   help="run the training step eagerly (MLX's fused CPU kernels were slower for Phi-3.5-sized "
                        "heads on a Linux CPU; keep compilation on Apple silicon)")
    t.add_argument("--reference-head", choices=["model", "float32"], default="model",
                   help="z_ref = z_neg from the model's own (possibly quantised) head, or from a frozen float32 "
                        "copy (+|V|*D*4 bytes; much faster on Linux CPUs for quantised models)")
    t.add_argument("--seed", type=int, default=0)
    v = p.add_argument_group("verification layer (SDM estimator)")
    v.add_argument("--verifier", default=None, help="reuse an already trained verification layer (directory)")
    v.add_argument("--alpha", type=float, default=D["alpha"])
    v.add_argument("--verifier-iterations", type=int, default=D["iterations"], help="J")
    v.add_argument("--verifier-epochs", type=int, default=D["epochs"],
                   help=f"cap; rounds stop after {D['patience']} epochs without a better balanced median q")
    v.add_argument("--verifier-exemplar-dim", type=int, default=D["exemplar_dim"])
    v.add_argument("--verifier-batch-size", type=int, default=D["batch_size"])
    v.add_argument("--verifier-learning-rate", type=float, default=D["learning_rate"])
    v.add_argument("--verifier-rescaler-max-epochs", type=int, default=D["rescaler_max_epochs"])
    p.add_argument("--quiet", action="store_true", help="no progress output")


def run(args) -> int:
    require(args, "model", "output_dir")
    tasks = args.tasks
    if isinstance(tasks, str):
        try:
            tasks = json.loads(tasks)
        except json.JSONDecodeError as e:
            raise CLIError(f"--tasks is not valid JSON: {e}") from None
    if sum(bool(x) for x in (args.data, args.verification_data, tasks)) != 1:
        raise CLIError("give exactly one of --data (task JSONL), --verification-data (verification rows) "
                       "and --tasks (several tasks)")
    completions = args.completions
    if isinstance(completions, str):
        completions = [completions]
    if args.data and not completions and not args.preset:
        raise CLIError("--data needs --completions (one per task label) and --prompt-template, or --preset")
    if args.data and completions and not args.preset and not args.prompt_template:
        raise CLIError("--prompt-template (with a {document} slot) is needed with custom --completions")

    from ..io import dumps
    from ..network.trainer import NetworkConfig, train_network

    config = NetworkConfig(
        model=args.model, output_dir=args.output_dir, data=args.data, verification_data=args.verification_data,
        tasks=tasks,
        completions=completions, preset=args.preset, system=args.system or None,
        prompt_template=args.prompt_template, use_chat_template=not args.no_chat_template,
        delimiter=args.delimiter, max_length=args.max_length, negatives_seed=args.negatives_seed,
        epochs=args.epochs, beta_min=args.beta_min, beta_max=args.beta_max, learning_rate=args.learning_rate,
        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        generation_batch_size=args.generation_batch_size, embed_batch_size=args.embed_batch_size,
        compile_step=not args.no_compile, reference_head=args.reference_head,
        verifier=args.verifier, alpha=args.alpha, verifier_iterations=args.verifier_iterations,
        verifier_epochs=args.verifier_epochs, verifier_exemplar_dim=args.verifier_exemplar_dim,
        verifier_batch_size=args.verifier_batch_size, verifier_learning_rate=args.verifier_learning_rate,
        verifier_rescaler_max_epochs=args.verifier_rescaler_max_epochs, seed=args.seed, verbose=not args.quiet,
        overwrite=bool(args.overwrite),
    )
    try:
        config.validate()
    except ValueError as e:
        raise CLIError(str(e)) from None
    result = train_network(config)
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


if __name__ == "__main__":  # pragma: no cover
    from ..cli import main

    sys.exit(main(["network-train", *sys.argv[1:]]))
