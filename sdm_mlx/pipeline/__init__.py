"""Recipes of the real-LLM experiments, run by ``sdm-mlx pipeline -c RECIPE.yaml``: their data (:mod:`.task_data`,
:mod:`.samplers`), the model's own answers and force-decoded rows (:mod:`.answers`), the recipe (:mod:`.recipe`),
the run directory (:mod:`.layout`), the stages (:mod:`.stages`), their driver (:mod:`.runner`), the verifiers
(:mod:`.verifiers`) and the tables (:mod:`.table`).

May import: every layer below the CLI (foundation up to :mod:`sdm_mlx.serve`); never :mod:`sdm_mlx.cli` or
:mod:`sdm_mlx.commands`.  Nothing is imported at load time: import the submodules.
"""
