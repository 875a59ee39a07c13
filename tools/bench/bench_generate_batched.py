"""Benchmark: batched decoding (one engine, continuous batching, prompt-prefix cache) vs the code before it.

    python tools/bench/bench_generate.py --batched --old-src DIR [--model DIR] [--factcheck] [--prompts 64]
                                   [--tokens 32] [--batch 16] [--old-batch 8] [--repeats 2] [--json out.json]

``DIR`` holds an older ``sdm_mlx`` package (e.g. ``git archive 052b975 sdm_mlx | tar -x -C DIR``); each
measurement runs in its own subprocess, with ``PYTHONPATH=DIR`` for the old code and the installed
package for the new, old and new alternated ``--repeats`` times (ratios within one run; the load
average is recorded before each).  Two workloads over the same ``--prompts`` chat prompts:

* ``generate`` — what ``sdm-mlx generate --input`` does: verified generation of every prompt
  (decoding up to the closing ``}``, at most ``--tokens``, then verification with a synthetic
  ``SDMEstimator`` of the model's feature width, ``on_reject=return``).  Old: one prompt after another
  (``VerifiedGenerator.generate``); new: ``VerifiedGenerator.generate_many`` (``--batch`` rows).
* ``alg4`` — Alg. 4's per-epoch decoding: ``network.generation.greedy_generate`` (joint neg+pos with a
  positive head = float32 copy of the LM head, verifier features on) with ``batch_size=--batch``;
  old: left-padded static batches, new: the engine.

Reported: rows/s and generated tokens/s of each, the new/old ratio of rows/s, and whether old and new
decoded the same tokens.  Model load time is excluded (timed from the first prompt).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(spec: dict) -> dict:
    """One measurement in this process (``spec``: workload, model, prompts, tokens, batch, support)."""
    if os.environ.get("BENCH_OLD_SRC"):  # the older tree only: no fallback into this checkout's editable install
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                            and "editable" not in type(f).__module__]
    import sdm_mlx

    sys.path.insert(0, str(HERE))
    from bench_generate import E, make_prompts, make_verifier  # E: this tree's embed module, or an older tree's

    try:  # as the batch commands (network-train, generate --input) do; older trees have no such switch
        from sdm_mlx.runtime.allocator import keep_freed_buffers_after_load
    except ImportError:
        pass
    else:
        keep_freed_buffers_after_load()
    model, tok = E.load_model(spec["model"])
    prompts = make_prompts(tok, spec["prompts"], spec["factcheck"])
    from sdm_mlx.llm.model import model_dims
    from sdm_mlx.network.heads import SDMHeads

    width = 2 * model_dims(model)[1]
    out = {"code": str(Path(sdm_mlx.__file__).parent), "load_average": os.getloadavg()}
    if spec["workload"] == "alg4":
        from sdm_mlx.network.generation import DecodeSettings, greedy_generate

        heads = SDMHeads(model, reference_head="float32")
        t0 = time.perf_counter()
        gens = greedy_generate(heads, tok, prompts, DecodeSettings(max_new_tokens=spec["tokens"],
                                                                   batch_size=spec["batch"]), features=True)
        out["seconds"] = time.perf_counter() - t0
        out["tokens"] = [g.token_ids for g in gens]
    else:
        from sdm_mlx.verified import VerifiedGenerator

        kw = {"max_batch": spec["batch"]} if hasattr(VerifiedGenerator, "generate_many") else {}
        gen = VerifiedGenerator(model=model, tokenizer=tok, verifier=make_verifier(width, spec["support"]),
                                system="", prompt_template="{document}", use_chat_template=False,
                                max_tokens=spec["tokens"], on_reject="return", **kw)
        t0 = time.perf_counter()
        if hasattr(gen, "generate_many"):
            results = gen.generate_many(prompts)
        else:
            results = [gen.generate(p) for p in prompts]
        out["seconds"] = time.perf_counter() - t0
        out["tokens"] = [r.attempts[-1].token_ids for r in results]
    out["rows_per_s"] = len(prompts) / out["seconds"]
    out["tokens_per_s"] = sum(len(t) for t in out["tokens"]) / out["seconds"]
    return out


def _run(spec: dict, old_src: str | None, prefix: list) -> dict:
    env = dict(os.environ)
    if old_src:
        env["PYTHONPATH"] = os.path.abspath(old_src) + os.pathsep + env.get("PYTHONPATH", "")
        env["BENCH_OLD_SRC"] = os.path.abspath(old_src)
    cmd = prefix + [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"worker failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def compare(args, model: str) -> dict:
    """Old vs new, alternated, for both workloads; the best run of each."""
    prefix = args.slot.split() if args.slot else []
    report = {"model": model, "prompts": args.prompts, "tokens": args.tokens, "batch": args.batch,
              "old_batch": args.old_batch or args.batch,
              "factcheck": args.factcheck, "repeats": args.repeats, "old_src": args.old_src, "workloads": {}}
    for workload in args.workloads.split(","):
        spec = {"workload": workload, "model": model, "prompts": args.prompts, "tokens": args.tokens,
                "batch": args.batch, "support": args.support, "factcheck": args.factcheck}
        runs = {"old": [], "new": []}
        old_spec = dict(spec, batch=args.old_batch or args.batch)  # e.g. each version's own default
        for rep in range(args.repeats):
            for name, src in (("old", args.old_src), ("new", None)):
                runs[name].append(_run(old_spec if name == "old" else spec, src, prefix))
                r = runs[name][-1]
                print(f"  {workload} {name} repeat {rep + 1}: {r['rows_per_s']:.3f} rows/s, "
                      f"{r['tokens_per_s']:.1f} tokens/s (load {r['load_average'][0]:.2f})", flush=True)
        best = {k: max(v, key=lambda r: r["rows_per_s"]) for k, v in runs.items()}
        same = sum(a == b for a, b in zip(best["old"]["tokens"], best["new"]["tokens"]))
        report["workloads"][workload] = {
            "old": {k: v for k, v in best["old"].items() if k != "tokens"},
            "new": {k: v for k, v in best["new"].items() if k != "tokens"},
            "ratio_rows_per_s": best["new"]["rows_per_s"] / best["old"]["rows_per_s"],
            "same_tokens": f"{same}/{len(best['new']['tokens'])}",
            "all_runs": {k: [{x: y for x, y in r.items() if x != "tokens"} for r in v] for k, v in runs.items()},
        }
    return report


def print_table(r: dict) -> None:
    print(f"\n{r['model']}: {r['prompts']} prompts, <= {r['tokens']} tokens, batch {r['batch']} "
          f"(old: {r.get('old_batch', r['batch'])})")
    print(f"{'workload':<10}{'old rows/s':>12}{'new rows/s':>12}{'ratio':>8}{'old tok/s':>11}{'new tok/s':>11}"
          f"{'same tokens':>13}")
    for w, x in r["workloads"].items():
        print(f"{w:<10}{x['old']['rows_per_s']:>12.3f}{x['new']['rows_per_s']:>12.3f}{x['ratio_rows_per_s']:>8.2f}"
              f"{x['old']['tokens_per_s']:>11.1f}{x['new']['tokens_per_s']:>11.1f}{x['same_tokens']:>13}")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    print(json.dumps(worker(json.loads(sys.argv[2]))))
