"""Verified generation on a real LLM, factcheck, resumably: every stage skips when its output exists.

Stages (the recipe ``recipes/qwen15_factcheck_verified_cpu.yaml`` holds the settings; ``--only``
runs some of them; every stage that runs is timed with ``/usr/bin/time -v``, wall time and peak
RSS land in ``OUT/stages.json``):

1. ``sample``   -- the demo's factcheck split (``tools/factcheck_sample.py``): pooled topic statements
   (training + calibration), the held-out 15 % of each topic, the shifted ``generated`` statements;
   with ``task: arithmetic`` in the recipe, computed arithmetic statements instead
   (``tools/arithmetic_sample.py``: two-digit pool and held-out, three-digit shift);
2. ``answers``  -- the model's own greedy answer to every statement, with the verifier features of that
   decoding (``tools/real_answers.py``; label 1 = the parsed answer is right; resumable row by row);
3. ``split``    -- the answer rows per split (``answers.<split>.jsonl``);
4. ``train``    -- ``sdm-mlx train`` on the pool's rows (per-dimension normalisation, DESIGN #2);
5. ``evaluate`` -- ``sdm-mlx evaluate`` on held-out topics and ``generated`` (p̂_lower vs softmax,
   temperature, APS, RAPS on the verification task "is the model's answer right");
6. ``generate`` -- ``sdm-mlx generate`` itself over the first ``generate_check`` held-out statements and
   an out-of-distribution prompt: the user's path, to set beside the table's verdicts;
7. ``forced_*`` -- the paper's force-decoded verification rows of the first ``forced_statements``
   statements (``sdm-mlx make-verification-data --model`` + ``sdm-mlx embed``: half constructed
   negatives, label = the shown answer is right), trained and evaluated like the answer rows;
8. ``network_rows``, ``network``, ``network_answers`` -- Alg. 4 (``sdm-mlx network-train``) on the pool's own-answer
   rows with the verifier of ``train`` (its split is Alg. 4's; wrong answers, corrected in the model's layout, are
   W_pos positives), ``network_epochs`` epochs with ``network_args``; then ``sdm-mlx generate --head`` with the
   kept network over the held-out and ``generated`` statements;
9. ``table``    -- the verified-generation table (``OUT/table.json``): task accuracy (unparsable =
   wrong) and admitted fraction, no-reject vs p̂_lower, per split.

    python tools/real_factcheck_pipeline.py -c recipes/qwen15_factcheck_verified_cpu.yaml
    python tools/real_factcheck_pipeline.py -c recipes/qwen15_factcheck_verified_cpu.yaml --only table

Real-model stages run the model in a subprocess (one at a time); prefix a command with e.g.
``--wrap '/work/wt/realslot nice -n 5'`` to hold a machine-wide slot.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("sample", "answers", "split", "train", "evaluate", "generate", "forced_rows", "forced_embed",
          "forced_split", "forced_train", "forced_evaluate", "network_rows", "network", "network_answers", "table")
OOD_PROMPT = "Write a haiku about the sea."
#: the recipe's ``task``: the script that writes its statements (both write the splits pool | heldout_topics | generated)
SAMPLERS = {"factcheck": "factcheck_sample.py", "arithmetic": "arithmetic_sample.py"}


def load_recipe(path: str) -> dict:
    import yaml

    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    cfg["model"] = os.path.expanduser(cfg["model"])
    if cfg.get("task", "factcheck") not in SAMPLERS:
        raise SystemExit(f"{path}: task must be one of {sorted(SAMPLERS)}, got {cfg['task']!r}")
    return cfg


class Runner:
    """Runs stage commands under ``/usr/bin/time -v``; records wall time, peak RSS and CPU share."""

    def __init__(self, out: str, wrap: list):
        self.out, self.wrap = out, wrap
        self.path = os.path.join(out, "stages.json")
        self.stats = json.load(open(self.path)) if os.path.exists(self.path) else {}

    def run(self, stage: str, cmd: list, heavy: bool = False) -> None:
        log = os.path.join(self.out, f"{stage}.log")
        timed = ["/usr/bin/time", "-v", *cmd] if os.path.exists("/usr/bin/time") else cmd
        full = (self.wrap if heavy else []) + timed
        print(f"[{stage}] {' '.join(map(str, cmd))}", file=sys.stderr, flush=True)
        t0 = time.time()
        with open(log, "w") as f:
            rc = subprocess.call(list(map(str, full)), stdout=f, stderr=subprocess.STDOUT)
        text = open(log, encoding="utf-8", errors="replace").read()
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
        cpu = re.search(r"Percent of CPU this job got: (\d+)%", text)
        entry = self.stats.setdefault(stage, {"runs": []})
        entry["runs"].append({"wall_s": round(time.time() - t0, 1), "peak_rss_gb": round(int(rss.group(1)) / 1e6, 2)
                              if rss else None, "cpu_percent": int(cpu.group(1)) if cpu else None,
                              "load_average": os.getloadavg()[0], "command": " ".join(map(str, cmd)), "rc": rc})
        with open(self.path, "w") as f:
            json.dump(self.stats, f, indent=1)
        if rc != 0:
            raise SystemExit(f"stage {stage} failed (exit {rc}); see {log}")


def count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def cli(*args) -> list:
    return [sys.executable, "-m", "sdm_mlx", *args]


def stage_commands(cfg: dict, out: str) -> dict:
    """{stage: (output that marks it done, command, uses the model)} (``table`` runs in-process)."""
    from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS

    p = lambda name: os.path.join(out, name)  # noqa: E731
    tools = os.path.join(ROOT, "tools")
    template = PRESETS["factcheck"]["prompt_template"]
    a = cfg.get("alpha", 0.95)
    first_split = (cfg.get("answer_splits") or ["pool"])[0]  # the split stage is done once its file exists
    return {
        "sample": (p("task.jsonl"), [sys.executable, os.path.join(tools, SAMPLERS[cfg.get("task", "factcheck")]), "--pool",
                                     cfg["pool"], "--heldout", cfg["heldout"], "--generated", cfg["generated"],
                                     "--seed", cfg.get("seed", 0), "-o", p("task.jsonl")], False),
        "answers": (p("answers.jsonl"), [sys.executable, os.path.join(tools, "real_answers.py"), "--model",
                                         cfg["model"], "--input", p(answer_source(cfg)), "--output", p("answers.jsonl"),
                                         "--batch-size", cfg.get("generation_batch_size", 16), "--max-tokens",
                                         cfg.get("max_tokens", 32)], True),
        "split": (p(f"answers.{first_split}.jsonl"), [sys.executable, os.path.join(tools, "factcheck_sample.py"),
                                            "--split-file", p("answers.jsonl")], False),
        "train": (p("verifier"), cli("train", "--train", p("answers.pool.jsonl"), "--output", p("verifier"),
                                     "--normalize", "per-dimension", "--alpha", a, "--class-names", "wrong",
                                     "correct", *map(str, cfg.get("train_args", []))), False),
        "evaluate": (p("evaluate.json"), cli("evaluate", "--model", p("verifier"), "--input",
                                             p("answers.heldout_topics.jsonl"), "--input", p("answers.generated.jsonl"),
                                             "--report", p("evaluate.json")), False),
        "generate": (p("generate_check.jsonl"), cli("generate", "--model", cfg["model"], "--verifier", p("verifier"),
                                                    "--system", PAPER_SYSTEM, "--prompt-template", template,
                                                    "--max-tokens", cfg.get("max_tokens", 32), "--input",
                                                    p("generate_check_prompts.jsonl"), "--output",
                                                    p("generate_check.jsonl"), "--on-reject", "return", "--quiet"),
                     True),
        "forced_rows": (p("forced.jsonl"), cli("make-verification-data", "--input", p("task_forced.jsonl"), "--output",
                                               p("forced.jsonl"), "--model", cfg["model"], "--preset", "factcheck"),
                        False),
        # sdm-mlx embed --prompt-field prompt --completion-field completion computes the same features (to ~1e-7);
        # the tool computes the shared prompt prefix once
        "forced_embed": (p("forced_emb.jsonl"), [sys.executable, os.path.join(tools, "real_answers.py"), "--forced",
                                                 "--model", cfg["model"], "--input", p("forced.jsonl"), "--output",
                                                 p("forced_emb.jsonl"), "--batch-size",
                                                 cfg.get("embed_batch_size", 16)], True),
        "forced_split": (p("forced_emb.pool.jsonl"), [sys.executable, os.path.join(tools, "factcheck_sample.py"),
                                                      "--split-file", p("forced_emb.jsonl")], False),
        "forced_train": (p("verifier_forced"), cli("train", "--train", p("forced_emb.pool.jsonl"), "--output",
                                                   p("verifier_forced"), "--alpha", a, "--class-names", "wrong",
                                                   "correct", *map(str, cfg.get("train_args", []))), False),
        "network": (p("network_run/metrics.json"), cli(
            "network-train", "--model", cfg["model"], "--verification-data", p("network_rows.jsonl"), "--verifier",
            p("verifier"), "--preset", "factcheck", "--system", PAPER_SYSTEM, "--output", p("network_run"),
            "--epochs", cfg.get("network_epochs", 1), "--max-new-tokens", cfg.get("max_tokens", 32),
            "--generation-batch-size", cfg.get("generation_batch_size", 16), "--embed-batch-size",
            cfg.get("embed_batch_size", 16), *map(str, cfg.get("network_args", []))), True),
        "network_answers": (p("network_answers.jsonl"), cli(
            "generate", "--head", p("network_run/network"), "--verifier", p("verifier"), "--system", PAPER_SYSTEM,
            "--prompt-template", template, "--max-tokens", cfg.get("max_tokens", 32), "--input",
            p("network_prompts.jsonl"), "--output", p("network_answers.jsonl"), "--on-reject", "return", "--quiet"),
            True),
        "forced_evaluate": (p("evaluate_forced.json"), cli(
            "evaluate", "--model", p("verifier_forced"), "--input", p("forced_emb.heldout_topics.jsonl"), "--input",
            p("forced_emb.generated.jsonl"), "--report", p("evaluate_forced.json")), False),
    }


def answer_source(cfg: dict) -> str:
    """The task file the ``answers`` stage decodes: every statement, or with ``answer_splits`` in the recipe only
    those splits' (e.g. the held-out and shifted statements, when the verifier is trained on force-decoded rows)."""
    return "task_answers.jsonl" if cfg.get("answer_splits") else "task.jsonl"


def write_answer_tasks(cfg: dict, out: str) -> None:
    """``task_answers.jsonl``: the sample's rows of the recipe's ``answer_splits``."""
    keep = set(cfg["answer_splits"])
    with open(os.path.join(out, "task.jsonl")) as f:
        lines = [x for x in f if x.strip() and json.loads(x)["split"] in keep]
    with open(os.path.join(out, "task_answers.jsonl"), "w") as f:
        f.writelines(lines)


def write_forced_tasks(cfg: dict, out: str) -> None:
    """The first ``forced_statements`` rows of the sample (a stratified prefix)."""
    with open(os.path.join(out, "task.jsonl")) as f:
        lines = [x for x in f if x.strip()][: cfg.get("forced_statements", 400)]
    with open(os.path.join(out, "task_forced.jsonl"), "w") as f:
        f.writelines(lines)


def write_network_rows(cfg: dict, out: str) -> None:
    """``network_rows.jsonl``: the pool's own-answer rows as network-train verification rows (the prompt the
    ``answers`` stage decoded, the model's answer as completion, label, task_label and answer_label)."""
    from sdm_mlx.llm import embed as _embed
    from sdm_mlx.llm.model import load_tokenizer
    from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS

    tok = load_tokenizer(cfg["model"])
    docs = {r["id"]: r["document"] for r in map(json.loads, open(os.path.join(out, "task.jsonl")))}
    template = PRESETS["factcheck"]["prompt_template"]
    tmp = os.path.join(out, "network_rows.jsonl.tmp")
    with open(tmp, "w") as f:
        for r in map(json.loads, open(os.path.join(out, "answers.pool.jsonl"))):
            prompt = _embed.chat_text(tok, docs[r["id"]], system=PAPER_SYSTEM, prompt_template=template)
            f.write(json.dumps({"id": r["id"], "prompt": prompt, "completion": r["text"], "label": r["label"],
                                "task_label": r["task_label"], "answer_label": r["answer_label"]}) + "\n")
    os.replace(tmp, os.path.join(out, "network_rows.jsonl"))


def write_network_prompts(out: str) -> None:
    """The held-out statements, then the ``generated`` ones, for ``generate --head`` (appended, resumable)."""
    rows = [json.loads(x) for x in open(os.path.join(out, "task.jsonl"))]
    with open(os.path.join(out, "network_prompts.jsonl"), "w") as f:
        for split in ("heldout_topics", "generated"):
            for r in rows:
                if r["split"] == split:
                    f.write(json.dumps({"id": r["id"], "document": r["document"]}) + "\n")


def network_finished(out: str, epochs: int = 1) -> bool:
    """network-train finished ``epochs`` epochs (an interrupted run, or one given more epochs in the config, is
    continued by running the stage again)."""
    path = os.path.join(out, "network_run", "metrics.json")
    if not os.path.exists(path):
        return False
    metrics = json.load(open(path))
    return bool(metrics.get("finished")) and int(metrics.get("epochs_completed", 0)) >= int(epochs)


def answers_done(out: str, name: str = "answers.jsonl", source: str = "task.jsonl") -> bool:
    return count_lines(os.path.join(out, name)) >= count_lines(os.path.join(out, source)) > 0


def write_generate_prompts(cfg: dict, out: str) -> None:
    """The first ``generate_check`` held-out statements (with their answer rows) and one OOD prompt."""
    rows = [json.loads(x) for x in open(os.path.join(out, "task.jsonl"))]
    held = [r for r in rows if r["split"] == "heldout_topics"][: cfg.get("generate_check", 24)]
    with open(os.path.join(out, "generate_check_prompts.jsonl"), "w") as f:
        for r in held:
            f.write(json.dumps({"id": r["id"], "document": r["document"]}) + "\n")
        f.write(json.dumps({"id": "ood-haiku", "document": OOD_PROMPT}) + "\n")


def verified_generation_table(out: str, verifier: str = "verifier") -> dict:
    """Per split: task accuracy and admitted fraction of the base model + SDM verifier (no-reject, p̂_lower), on
    the model's own answers and the features of their decoding (what ``generate`` verifies)."""
    from sdm_mlx import SDMEstimator

    est = SDMEstimator.load(os.path.join(out, verifier))
    table = {"alpha": est.alpha, "verifier": verifier}
    for split in ("heldout_topics", "generated", "pool"):
        path = os.path.join(out, f"answers.{split}.jsonl")
        if not os.path.exists(path):
            continue
        rows = [json.loads(x) for x in open(path)]
        X = np.array([r["embedding"] for r in rows], dtype=np.float32)
        correct = np.array([r["answer_label"] == r["task_label"] for r in rows])  # unparsable (-1) is wrong
        p = est.estimate(X)
        verified = np.asarray(p.admitted) & (np.asarray(p.prediction) == 1)
        forms = {k: sum(r["form"] == k for r in rows) for k in ("compact", "fenced", "other", "unparsable")}
        table[split] = {
            "statements": len(rows), "answer_forms": forms,
            "no_reject": {"task_accuracy": round(float(correct.mean()), 4), "admitted_fraction": 1.0},
            "p_lower": {"task_accuracy": round(float(correct[verified].mean()), 4) if verified.any() else None,
                        "admitted": int(verified.sum()), "admitted_fraction": round(float(verified.mean()), 4)},
            "verifier_accuracy": round(float(np.mean(np.asarray(p.prediction) == correct.astype(int))), 4),
        }
    check = os.path.join(out, "generate_check.jsonl")
    if os.path.exists(check) and verifier == "verifier":
        by_id = {}
        for split in ("heldout_topics",):
            for x in open(os.path.join(out, f"answers.{split}.jsonl")):
                r = json.loads(x)
                by_id[r["id"]] = r
        gen = [json.loads(x) for x in open(check)]
        pairs = [(g, by_id[g["id"]]) for g in gen if g["id"] in by_id]
        if pairs:
            Xp = np.array([r["embedding"] for _, r in pairs], dtype=np.float32)
            p = est.estimate(Xp)
            table_verified = np.asarray(p.admitted) & (np.asarray(p.prediction) == 1)
            table["generate_check"] = {
                "statements": len(pairs),
                "same_answer_text": sum(g["answer"] == r["text"] for g, r in pairs),
                "same_verdict": int(sum(bool(g["verified"]) == bool(v) for (g, _), v in zip(pairs, table_verified))),
                "verified_by_generate": sum(bool(g["verified"]) for g, _ in pairs),
                "ood": [{"status": g["status"], "reason": g.get("reason")} for g in gen if g["id"] == "ood-haiku"],
            }
    return table


def network_table(out: str) -> dict | None:
    """The SDM network after Alg. 4 (``network_run``): its selection record, and per split the task accuracy of
    ``generate --head``'s answers (unparsable = wrong) without rejection and of those it verified (p̂_lower)."""
    from sdm_mlx.llm.verification_data import PRESETS
    from sdm_mlx.network.generation import parse_task_prediction

    metrics_path = os.path.join(out, "network_run", "metrics.json")
    answers_path = os.path.join(out, "network_answers.jsonl")
    if not os.path.exists(metrics_path):
        return None
    m = json.load(open(metrics_path))
    table = {"selection": {"initial_count": m.get("initial", {}).get("count"),
                           "epochs": [{k: e.get(k) for k in ("epoch", "count", "loss", "nll", "reg", "tokens",
                                                             "seconds", "tokens_per_s", "step_ms", "epoch_seconds")}
                                      for e in m.get("epochs", [])],
                           "selected_epoch": m.get("selected_epoch"), "finished": m.get("finished")}}
    if not os.path.exists(answers_path):
        return table
    task = {r["id"]: r for r in map(json.loads, open(os.path.join(out, "task.jsonl")))}
    comps = PRESETS["factcheck"]["completions"]
    rows = [json.loads(x) for x in open(answers_path)]
    for split in ("heldout_topics", "generated"):
        part = [r for r in rows if r["id"] in task and task[r["id"]]["split"] == split]
        if not part:
            continue
        correct = np.array([parse_task_prediction(r["answer"], comps) == int(task[r["id"]]["label"]) for r in part])
        verified = np.array([bool(r.get("verified")) for r in part])
        table[split] = {
            "statements": len(part),
            "no_reject": {"task_accuracy": round(float(correct.mean()), 4), "admitted_fraction": 1.0},
            "p_lower": {"task_accuracy": round(float(correct[verified].mean()), 4) if verified.any() else None,
                        "admitted": int(verified.sum()), "admitted_fraction": round(float(verified.mean()), 4)},
            "statuses": {k: int(sum(r.get("status") == k for r in part))
                         for k in sorted({str(r.get("status")) for r in part})},
        }
    return table


def verification_task_table(path: str) -> dict:
    """{dataset: {estimator: {accuracy, admitted, n, calibrated}}} at the estimator's alpha', from an evaluate report."""
    rep = json.load(open(path))
    out = {}
    for name, ds in rep["datasets"].items():
        out[name] = {}
        for est, r in ds["reports"].items():
            m = r["marginal"]
            out[name][est] = {"accuracy": m.get("accuracy"), "admitted": m.get("n_admitted"), "n": ds["n"],
                              "index_conditionally_calibrated": est in ds["calibrated"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--only", nargs="+", choices=STAGES, default=None)
    ap.add_argument("--wrap", default="", help="prefix of model-loading commands, one string (e.g. a slot holder: "
                                              "'/work/wt/realslot nice -n 5')")
    args = ap.parse_args(argv)
    cfg = load_recipe(args.config)
    out = os.path.join(ROOT, cfg["output"]) if not os.path.isabs(cfg["output"]) else cfg["output"]
    os.makedirs(out, exist_ok=True)
    import shlex

    runner = Runner(out, shlex.split(args.wrap))
    commands = stage_commands(cfg, out)
    for stage in args.only or STAGES:
        if stage == "table":
            table = verified_generation_table(out) if os.path.isdir(os.path.join(out, "verifier")) else {}
            if os.path.isdir(os.path.join(out, "verifier_forced")):
                table["paper_encoding_verifier"] = verified_generation_table(out, "verifier_forced")
            network = network_table(out)
            if network is not None:
                table["network"] = network
            for name in ("evaluate", "evaluate_forced"):
                if os.path.exists(os.path.join(out, f"{name}.json")):
                    table[f"verification_task/{name}"] = verification_task_table(os.path.join(out, f"{name}.json"))
            with open(os.path.join(out, "table.json"), "w") as f:
                json.dump(table, f, indent=1)
            print(json.dumps(table, indent=1))
            continue
        if stage == "network_rows":
            if not os.path.exists(os.path.join(out, "network_rows.jsonl")):
                write_network_rows(cfg, out)
            continue
        done_path, cmd, heavy = commands[stage]
        done = {"answers": lambda: answers_done(out, source=answer_source(cfg)),
                "network_answers": lambda: answers_done(out, "network_answers.jsonl", "network_prompts.jsonl"),
                "network": lambda: network_finished(out, cfg.get("network_epochs", 1)),
                "forced_embed": lambda: answers_done(out, "forced_emb.jsonl", "forced.jsonl")}.get(
            stage, lambda: os.path.exists(done_path))()
        if done:
            print(f"[{stage}] done: {done_path}", file=sys.stderr)
            continue
        if stage == "generate":
            write_generate_prompts(cfg, out)
        if stage == "network_answers":
            write_network_prompts(out)
        if stage == "forced_rows":
            write_forced_tasks(cfg, out)
        if stage == "answers" and cfg.get("answer_splits"):
            write_answer_tasks(cfg, out)
        runner.run(stage, cmd, heavy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
