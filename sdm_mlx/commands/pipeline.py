"""``sdm-mlx pipeline -c RECIPE.yaml``: run a recipe's stages, each resumable and skipped when its output exists.

Stages: data -> answers (the model's own answers) -> forced (constructed negatives) -> verifiers -> evaluate ->
network (Alg. 4) -> network_answers -> table.  See :mod:`sdm_mlx.pipeline` (the recipe schema:
:mod:`sdm_mlx.pipeline.recipe`; the run directory: :mod:`sdm_mlx.pipeline.layout`).  Progress goes to stderr,
results to files in the recipe's ``output``; at the end the markdown table is printed on stdout.

    sdm-mlx pipeline -c recipes/qwen15_universal_cpu.yaml
    sdm-mlx pipeline -c recipes/qwen15_universal_cpu.yaml --only table
    sdm-mlx pipeline -c recipes/qwen15_universal_cpu.yaml --model ~/models/qwen --wrap "nice -n 5"

The model: ``--model``, else the recipe's ``model``, else ``$SDM_MLX_MODEL``, else the test LLM that
``tools/fetch_test_llm.py`` writes (``$SDM_MLX_TEST_LLM``, or ``qwen2.5-coder-1.5b-instruct-float32`` under
``$SDM_MLX_TEST_LLM_CACHE`` or ``~/.cache/sdm_mlx/test_llm``).
"""

from __future__ import annotations

HELP = "run a recipe (data, own answers, constructed negatives, verifiers, Alg. 4, tables), resumable by stage"

#: ``-c/--config`` names the recipe (its own schema), not a YAML file of this verb's options
CONFIG_IS_RECIPE = True

#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("config",)

STAGE_NAMES = ("data", "answers", "forced", "verifiers", "evaluate", "network", "network_answers", "table")


def add_arguments(p) -> None:
    for action in p._actions:
        if action.dest == "config":
            action.help = ("the recipe YAML: model, output, tasks, verifier and network sections "
                           "(schema: docs/verified-generation-real.md, sdm_mlx/pipeline/recipe.py)")
    p.add_argument("--only", default=None, metavar="STAGE[,STAGE]",
                   help=f"run only these stages, in pipeline order (each still skipped when done; table always "
                        f"runs): {', '.join(STAGE_NAMES)}")
    p.add_argument("-m", "--model", default=None,
                   help="the model (mlx-lm directory or hub id), overriding the recipe's; default: the recipe's "
                        "model, else $SDM_MLX_MODEL, else the test LLM of tools/fetch_test_llm.py "
                        "($SDM_MLX_TEST_LLM_CACHE or ~/.cache/sdm_mlx/test_llm)")
    p.add_argument("-o", "--output", default=None, help="the run directory, overriding the recipe's output")
    p.add_argument("--wrap", default=None, metavar="PREFIX",
                   help="a command prefix for the stages that load the model, one string (e.g. 'nice -n 5')")
    p.add_argument("--list", action="store_true",
                   help="print the recipe's stages and whether each is done, then stop (nothing runs)")


def run(args) -> int:
    import sys

    from ..errors import CLIError
    from ..pipeline.layout import Layout
    from ..pipeline.recipe import load_recipe
    from ..pipeline.runner import run_pipeline
    from ..pipeline.stages import active_stages, is_done

    recipe = load_recipe(args.config, model=args.model, output=args.output)
    only = None
    if args.only:
        only = [s.strip() for s in args.only.replace(" ", ",").split(",") if s.strip()]
        if not only:
            raise CLIError("--only needs stage names, e.g. --only table or --only answers,forced")
    if args.list:
        layout = Layout(recipe.output)
        for stage in active_stages(recipe):
            done = stage != "table" and is_done(stage, recipe, layout)
            print(f"{stage}\t{'done' if done else 'to run'}", file=sys.stdout)
        return 0
    return run_pipeline(recipe, only=only, wrap=args.wrap or "")
