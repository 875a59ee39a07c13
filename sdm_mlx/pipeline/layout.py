"""Where a pipeline run keeps its files (``OUT`` = the recipe's ``output``)::

    OUT/recipe.json                       the resolved recipe of the last invocation (model path, sizes, settings)
    OUT/stages.json                       per stage, every run: wall time, CPU time, peak RSS, rows/s, tokens/s
    OUT/logs/                             the stages' sub-command output and results
    OUT/data/<task>_<split>.jsonl         task rows {id, label, document, split}; split in pool | heldout | shift
    OUT/answers/<task>_<split>.jsonl      the model's own answers with the features of their decoding
    OUT/forced/<task>_completions.json    the completions of the constructed negatives (the model's answer form)
    OUT/forced/<task>_pool.rows.jsonl     the rows of sdm-mlx make-verification-data (half constructed negatives)
    OUT/forced/<task>_pool.jsonl          the same rows with their force-decoded features
    OUT/verifiers/<name>/                 SDM verifiers (SDMEstimator.save); index.json describes each
    OUT/evaluate/<name>.jsonl             each verifier's verdict on every held-out / shift own answer
    OUT/network/rows.jsonl                Alg. 4's verification rows (the primary verifier's rows, with prompts)
    OUT/network/network_train.yaml        the sdm-mlx network-train config the stage runs
    OUT/network/run/                      sdm-mlx network-train's output (network/, verifier/, metrics.json, ...)
    OUT/network/prompts.jsonl             the held-out and shift rows of every task as prompts (ids <task>/<id>)
    OUT/network/answers.jsonl             sdm-mlx generate --head's answers and verdicts to them
    OUT/table.json, OUT/table.md          the tables; OUT/plots/<task>_risk_coverage.png (with matplotlib)
    OUT/verdicts.jsonl                    one row per (task, split, id, stage): the checkable verdicts
"""

from __future__ import annotations

import os


class Layout:
    """The paths of one run directory."""

    def __init__(self, out: str):
        self.out = os.path.abspath(out)

    def _p(self, *parts: str) -> str:
        return os.path.join(self.out, *parts)

    # bookkeeping
    recipe = property(lambda self: self._p("recipe.json"))
    stages = property(lambda self: self._p("stages.json"))
    logs = property(lambda self: self._p("logs"))
    lock = property(lambda self: self._p(".pipeline.lock"))

    def log(self, name: str) -> str:
        return self._p("logs", f"{name}.log")

    def result(self, stage: str) -> str:
        return self._p("logs", f"{stage}.result.json")

    # rows
    def data(self, task: str, split: str) -> str:
        return self._p("data", f"{task}_{split}.jsonl")

    def answers(self, task: str, split: str) -> str:
        return self._p("answers", f"{task}_{split}.jsonl")

    def forced_completions(self, task: str) -> str:
        return self._p("forced", f"{task}_completions.json")

    def forced_rows(self, task: str) -> str:
        return self._p("forced", f"{task}_pool.rows.jsonl")

    def forced(self, task: str) -> str:
        return self._p("forced", f"{task}_pool.jsonl")

    # verifiers
    verifiers = property(lambda self: self._p("verifiers"))
    verifiers_index = property(lambda self: self._p("verifiers", "index.json"))

    def verifier(self, name: str) -> str:
        return self._p("verifiers", name)

    evaluate_index = property(lambda self: self._p("evaluate", "index.json"))

    def evaluate(self, name: str) -> str:
        return self._p("evaluate", f"{name}.jsonl")

    # Alg. 4
    network_rows = property(lambda self: self._p("network", "rows.jsonl"))
    network_config = property(lambda self: self._p("network", "network_train.yaml"))
    network_base_decodings = property(lambda self: self._p("network", "base_decodings.npz"))
    network_run = property(lambda self: self._p("network", "run"))
    network_metrics = property(lambda self: self._p("network", "run", "metrics.json"))
    network_marker = property(lambda self: self._p("network", "done.json"))
    network_answers_marker = property(lambda self: self._p("network", "answers.done.json"))

    network_replayed = property(lambda self: self._p("network", "answers.replayed.json"))
    network_prompts = property(lambda self: self._p("network", "prompts.jsonl"))
    network_answers = property(lambda self: self._p("network", "answers.jsonl"))

    # results
    table_json = property(lambda self: self._p("table.json"))
    table_md = property(lambda self: self._p("table.md"))
    verdicts = property(lambda self: self._p("verdicts.jsonl"))

    def plot(self, task: str) -> str:
        return self._p("plots", f"{task}_risk_coverage.png")
