"""The stages of ``sdm-mlx pipeline``, each skipped when its output exists and is current.

=================  =============================================================================================
``data``           the task rows per split (:mod:`.task_data`, :mod:`.samplers`, or the recipe's own JSONL files)
``answers``        the model's own greedy answers with the features of their decoding (:mod:`.answers`);
                   resumes row by row
``forced``         the paper's force-decoded rows of the pool prompts, half constructed negatives, in the model's own
                   answer form (the rows of ``sdm-mlx make-verification-data --model --completions``, then their
                   features); resumes row by row; only when a verifier row set uses them
``verifiers``      the universal verifier per row set and encoding, and per-task ones (:mod:`.verifiers`)
``evaluate``       every verifier's verdict on the held-out and shift own answers
``network``        Alg. 4 (``sdm-mlx network-train``) on the primary verifier's rows and split
``network_answers`` ``sdm-mlx generate --head`` with the kept network over the held-out and shift rows (nothing to
                   decode when Alg. 4 kept epoch 0, the base head: the table repeats the base verdicts)
``table``          ``table.json``, ``table.md``, ``verdicts.jsonl``, risk–coverage plots (:mod:`.table`); always runs
=================  =============================================================================================

Each stage runs in its own process (``python -m sdm_mlx.pipeline.stages RUN_DIR STAGE``, started by
:mod:`.runner`, which measures it): the model is loaded by one stage at a time and its memory is returned when the
stage ends.  A stage reads the resolved recipe ``RUN_DIR/recipe.json`` and writes its counters to
``RUN_DIR/logs/<stage>.result.json``; progress goes to stderr.  Exit status: 0 done, 2 a problem with the input
(the message names it), 1 a bug.

This module is the stages' table and their process entry; the stages live in their groups' modules:
:mod:`.row_stages` (data, answers, forced), :mod:`.verifier_stages` (verifiers, evaluate), :mod:`.network_stages`
(network, network_answers), over the helpers they share (:mod:`.stage_io`).
"""

from __future__ import annotations

import os
import sys
import time

from ..errors import InputError, SDMError
from .layout import Layout
from .network_stages import network_answers_done, network_done, run_network, run_network_answers
from .recipe import Recipe
from .row_stages import answers_done, data_done, forced_done, run_answers, run_data, run_forced
from .stage_io import log, read_json
from .verifier_stages import evaluate_done, run_evaluate, run_verifiers, verifiers_done
from .verifiers import needs_forced

STAGES = ("data", "answers", "forced", "verifiers", "evaluate", "network", "network_answers", "table")
#: stages that load the model (the verb's --wrap prefixes them)
MODEL_STAGES = ("answers", "forced", "network", "network_answers")


def active_stages(recipe: Recipe) -> list[str]:
    """The recipe's stages in order (``forced`` only when a row set uses forced rows, the network stages only
    with a network section)."""
    out = []
    for s in STAGES:
        if s == "forced" and not needs_forced(recipe):
            continue
        if s in ("network", "network_answers") and recipe.network is None:
            continue
        out.append(s)
    return out


# -- table ----------------------------------------------------------------------------------------------------------

def run_table(recipe: Recipe, layout: Layout) -> dict:
    from .table import build_table

    index = read_json(layout.verifiers_index) or {}
    table = build_table(recipe, layout, index, read_json(layout.stages) or {})
    log(f"[table] {layout.table_md}, {layout.table_json}, {layout.verdicts}")
    return {"rows": sum(s["n"] for splits in table["base"].values() for s in splits.values())}


RUN = {"data": run_data, "answers": run_answers, "forced": run_forced, "verifiers": run_verifiers,
       "evaluate": run_evaluate, "network": run_network, "network_answers": run_network_answers, "table": run_table}
DONE = {"data": data_done, "answers": answers_done, "forced": forced_done, "verifiers": verifiers_done,
        "evaluate": evaluate_done, "network": network_done, "network_answers": network_answers_done,
        "table": lambda recipe, layout: False}


def is_done(stage: str, recipe: Recipe, layout: Layout) -> bool:
    try:
        return bool(DONE[stage](recipe, layout))
    except (InputError, OSError, ValueError, KeyError):
        return False


def load_run_recipe(run_dir: str) -> Recipe:
    path = Layout(run_dir).recipe
    data = read_json(path)
    if data is None:
        raise InputError(f"{path} is missing or not JSON: start the run with sdm-mlx pipeline -c RECIPE")
    return Recipe.from_dict(data)


def main(argv=None) -> int:
    """``python -m sdm_mlx.pipeline.stages RUN_DIR STAGE``: one stage, its counters to logs/<stage>.result.json."""
    from ..storage.files import make_dirs, write_json

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[1] not in STAGES:
        print(f"usage: python -m sdm_mlx.pipeline.stages RUN_DIR STAGE (one of {', '.join(STAGES)})", file=sys.stderr)
        return 2
    run_dir, stage = argv
    layout = Layout(run_dir)
    t0 = time.time()
    try:
        recipe = load_run_recipe(run_dir)
        stats = RUN[stage](recipe, layout) or {}
    except KeyboardInterrupt:
        log(f"[{stage}] interrupted: the finished rows are kept; run the same command again to continue")
        return 130
    except (SDMError, OSError) as e:
        if os.environ.get("SDM_MLX_DEBUG"):
            raise
        from ..storage.files import describe_os_error

        message = str(e) if isinstance(e, SDMError) else f"cannot read or write {describe_os_error(e)}"
        log(f"sdm-mlx pipeline: error: [{stage}] {message}")
        return 2
    make_dirs(layout.logs)
    write_json(layout.result(stage), {"stage": stage, "seconds": round(time.time() - t0, 3), **stats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
