"""The decoding engine on a Llama-architecture model with and without its batched prefill and prompt cache.

mlx-lm's Llama (and Mistral) models define ``make_cache``; when it makes only plain ``KVCache`` objects the engine
prefills new requests in batch passes and reuses the shared prompt prefix (``batch_plan.plain_kv_caches``).
This times ``DecodeEngine.run`` over requests that share a long system message, alternating that path
("cache") with the path such models took before (each prompt prefilled alone, no prompt cache: "alone"), and
checks that both give the same tokens.

    python tools/bench/bench_prompt_cache.py [--model DIR] [--requests 48] [--rounds 3] [--json out.json]

Without ``--model``: a random Llama (hidden 512, 8 layers) built by ``tools/builders/tiny_models.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from bench_common import write_report

SMALL_LLAMA = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
               "num_key_value_heads": 8}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="an mlx-lm model directory (default: a random small Llama)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import sdm_mlx
    from mlx_lm import load

    from sdm_mlx.decoding import DecodeEngine, DecodeRequest, SamplingParams
    from sdm_mlx.decoding.batch_plan import plain_kv_caches
    from sdm_mlx.llm import embed as E
    from sdm_mlx.runtime.blas import describe_blas

    if args.model:
        model, tok = load(args.model)
        label = args.model
    else:
        from tiny_models import make_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            model, tok = load(str(make_tiny_model(tmp, "llama", overrides=SMALL_LLAMA)))
        label = "random llama (hidden 512, 8 layers)"
    if not plain_kv_caches(model):
        print(f"{label}: its make_cache makes other cache types; nothing to compare", file=sys.stderr)
        return 2
    system = "You are a careful film critic who answers in one short JSON object. " * 12
    prompts = [E.encode(tok, E.chat_text(tok, f"review {i}: the film was {'warm' if i % 2 else 'dull'}, {i} minutes",
                                         system=system)) for i in range(args.requests)]

    def run(path: str):
        engine = DecodeEngine(model, tok, max_batch=args.max_batch)
        if path == "alone":
            engine.batchable, engine.prefix_cache = False, None
        reqs = [DecodeRequest(p, args.max_tokens, SamplingParams(), features=True, stop_at_delimiter=False)
                for p in prompts]
        t = time.perf_counter()
        out = engine.run(reqs)
        return time.perf_counter() - t, [d.token_ids for d in out]

    times: dict = {"alone": [], "cache": []}
    tokens: dict = {}
    for _ in range(args.rounds):
        for path in ("alone", "cache"):
            dt, toks = run(path)
            times[path].append(dt)
            tokens[path] = toks
            print(f"{path:5s} {dt:7.2f} s for {len(prompts)} requests", file=sys.stderr, flush=True)
    report = {"model": label, "code": os.path.dirname(sdm_mlx.__file__), "blas": describe_blas(),
              "load_average": os.getloadavg(), "requests": len(prompts), "prompt_tokens": len(prompts[0]),
              "max_tokens": args.max_tokens, "seconds": times,
              "speedup_best": min(times["alone"]) / min(times["cache"]),
              "same_tokens": tokens["alone"] == tokens["cache"]}
    print(f"{label}: {len(prompts)} requests of {len(prompts[0])} prompt tokens: alone {min(times['alone']):.2f} s, "
          f"with the prompt cache {min(times['cache']):.2f} s ({report['speedup_best']:.1f}x); "
          f"same tokens: {report['same_tokens']}")
    if args.json:
        write_report(args.json, report)
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
