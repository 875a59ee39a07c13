"""Decode the model's own greedy answer to each task statement and keep its verifier features.

One row per task row ``{id, label, document[, split]}``: the prompt is the preset's
instruction in the model's chat template (as ``sdm-mlx make-verification-data --model``
and ``sdm-mlx generate --prompt-template`` build it), the answer is the model's greedy
answer (batched decoding, stopped when the JSON answer closes, as ``generate`` stops),
and the row's ``embedding`` is the verifier input pooled from the hidden states of that
very decoding (DESIGN #21, the batched engine :class:`sdm_mlx.decoding.DecodeEngine`): the
features ``generate`` computes for the same prompt at generation time.

Output rows: ``id, split, task_label, answer_label (-1 = unparsable), form (compact |
fenced | other | unparsable), label = 1 iff answer_label == task_label, text, n_kept,
prompt_tokens, embedding`` -- a training file for ``sdm-mlx train`` whose label is "the
model's answer is correct". Resumable: rows already in ``--output`` are skipped, every
batch is appended and flushed.

    python tools/real_answers.py --model "$MODEL" --input runs/real/task.jsonl --output runs/real/answers.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from sdm_mlx.llm import embed as _embed
from sdm_mlx.decoding import DecodeEngine, DecodeRequest, PrefixCache
from sdm_mlx.network.generation import first_json_object, parse_task_prediction
from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS


def answer_form(text: str) -> str:
    """``compact`` (one-line JSON), ``fenced`` (a ```json block), ``other`` (JSON in another layout) or ``unparsable``."""
    if first_json_object(text) is None:
        return "unparsable"
    stripped = text.strip()
    if stripped.startswith("```"):
        return "fenced"
    if stripped.startswith("{") and "\n" not in stripped:
        return "compact"
    return "other"


def done_ids(path: str) -> set:
    """Ids already written to ``path`` (a trailing partial line, from a killed run, is cut off)."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    return {json.loads(line)["id"] for line in data.splitlines() if line.strip()}


def read_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def decode_rows(engine, tokenizer, rows, args, completions, template):
    """One chunk: output rows with the answer, its parse and the decode-time features.  ``engine`` is the
    package's batched decoder (:class:`sdm_mlx.decoding.DecodeEngine`, plain greedy, the shared prompt prefix
    prefilled once by its prefix cache): the tokens and features ``sdm-mlx generate`` computes."""
    prompts = [_embed.chat_text(tokenizer, r["document"], system=args.system, prompt_template=template) for r in rows]
    ids = [_embed.encode(tokenizer, p) for p in prompts]
    decs = engine.run([DecodeRequest(i, args.max_tokens, features=True, feature_parts=args.feature_parts) for i in ids])
    result = []
    for r, i, dec in zip(rows, ids, decs):
        text = tokenizer.decode(dec.token_ids)
        pred = parse_task_prediction(text, completions)
        result.append({
            "id": r["id"], "split": r.get("split"), "task_label": int(r["label"]), "answer_label": int(pred),
            "form": answer_form(text), "label": int(pred == int(r["label"])), "text": text,
            "n_kept": int(dec.feature_info["n_kept"]), "prompt_tokens": len(i), "generated_tokens": len(dec.token_ids),
            "embedding_source": "llm-hidden-states", "feature_parts": list(args.feature_parts),
            "embedding": [float(x) for x in np.asarray(dec.features).ravel()],
        })
    return result


def shared_prefix_stats(model, tokenizer, prompts) -> dict:
    """Length P of the token prefix every prompt shares and the sum of its final-norm states (float64 [D]).

    The model is causal, so the states of those P positions are the same in every row: the mean over the
    non-shared positions (document + completion) of a row pooled over n positions is
    ``(n * mean_all - state_sum) / (n - P)``.
    """
    ids = [_embed.encode(tokenizer, p) for p in prompts]
    first = ids[0]
    P = min(len(r) for r in ids)
    for r in ids[1:]:
        P = next((k for k in range(P) if r[k] != first[k]), P)
    h = np.array(_embed.hidden_states(model, [first[:P]])[0], dtype=np.float64)
    return {"P": P, "state_sum": h.sum(axis=0), "prefix_text": tokenizer.decode(first[:P])}


def write_prefix_stats(args, rows, preset) -> None:
    tokenizer = _embed.load_tokenizer(args.model)
    prompts = [_embed.chat_text(tokenizer, r["document"], system=args.system, prompt_template=preset["prompt_template"])
               for r in rows]
    model, tokenizer = _embed.load_model(args.model)
    st = shared_prefix_stats(model, tokenizer, prompts)
    np.savez(args.prefix_stats, P=st["P"], state_sum=st["state_sum"])
    print(f"shared prefix: {st['P']} tokens ({st['prefix_text']!r}) -> {args.prefix_stats}", file=sys.stderr)


#: ``--forced`` writes (and can resume) after every chunk of this many batches
FORCED_BATCHES_PER_CHUNK = 16


def run_forced(args) -> int:
    """``--forced``: embed verification rows (id, prompt, completion, ...) with the shared prefix; resumable."""
    rows = read_rows(args.input)[: args.limit]
    have = done_ids(args.output)
    todo = [r for r in rows if r["id"] not in have]
    print(f"{len(have)} rows already in {args.output}; {len(todo)} to embed", file=sys.stderr, flush=True)
    if not todo:
        return 0
    model, tokenizer = _embed.load_model(args.model, head=False)
    seqs = [_embed.encode(tokenizer, r["prompt"] + r["completion"]) for r in rows]
    shared = seqs[0][: _embed.common_prefix_length(seqs)]  # the whole file's: rows do not depend on the batch
    todo.sort(key=lambda r: -len(r["prompt"] + r["completion"]))
    t0 = time.time()
    with open(args.output, "a", encoding="utf-8") as f:
        chunk = args.batch_size * FORCED_BATCHES_PER_CHUNK  # the shared prefix runs once per chunk, not per batch
        for b0 in range(0, len(todo), chunk):
            part = todo[b0: b0 + chunk]
            feats = _embed.prompt_completion_features(model, tokenizer, [r["prompt"] for r in part],
                                                      [r["completion"] for r in part], batch_size=args.batch_size,
                                                      shared_prefix=shared, parts=args.feature_parts).embeddings
            for r, e in zip(part, feats):
                f.write(json.dumps({**r, "embedding_source": "llm-hidden-states", "feature_parts": list(args.feature_parts),
                                    "embedding": [float(x) for x in e]}) + "\n")
            f.flush()
            print(f"{b0 + len(part)}/{len(todo)} rows, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", required=True)
    ap.add_argument("--input", required=True, help="task JSONL: id, label, document[, split]")
    ap.add_argument("--output", required=True)
    ap.add_argument("--preset", default="factcheck", choices=sorted(PRESETS))
    ap.add_argument("--system", default=PAPER_SYSTEM)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None, help="decode at most this many rows of --input")
    ap.add_argument("--prefix-stats", help="instead: write the shared prompt prefix's length and state sum (.npz)")
    ap.add_argument("--forced", action="store_true",
                    help="instead: --input holds verification rows (id, prompt, completion); write their force-decoded "
                         "features (sdm-mlx embed's: the shared prompt prefix run once)")
    ap.add_argument("--feature-parts", default="mean,last",
                    help="pooled parts of the features, concatenated in the order max, mean, last (DESIGN #21); "
                         "'max,mean,last' keeps all three, so either encoding can be sliced out later")
    args = ap.parse_args(argv)
    args.feature_parts = _embed.check_feature_parts(args.feature_parts)
    if args.forced:
        return run_forced(args)
    preset = PRESETS[args.preset]
    rows = read_rows(args.input)[: args.limit]
    if args.prefix_stats:
        write_prefix_stats(args, rows, preset)
        return 0
    have = done_ids(args.output)
    todo = [r for r in rows if r["id"] not in have]
    print(f"{len(have)} rows already in {args.output}; {len(todo)} to decode", file=sys.stderr, flush=True)
    if not todo:
        return 0
    model, tokenizer = _embed.load_model(args.model)
    prompts = [_embed.chat_text(tokenizer, r["document"], system=args.system,
                                prompt_template=preset["prompt_template"]) for r in rows]
    st = shared_prefix_stats(model, tokenizer, prompts)  # for tools/real_probe.py's non-shared pooling
    np.savez(args.output + ".prefix.npz", P=st["P"], state_sum=st["state_sum"])
    engine = DecodeEngine(model, tokenizer, max_batch=args.batch_size, prefix_cache=PrefixCache())
    step = args.batch_size  # one batch per flush: a stopped run loses at most one batch
    t0, n_done, n_tok = time.time(), 0, 0
    with open(args.output, "a", encoding="utf-8") as f:
        for b0 in range(0, len(todo), step):
            out = decode_rows(engine, tokenizer, todo[b0: b0 + step], args, preset["completions"],
                              preset["prompt_template"])
            for row in out:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
            n_done += len(out)
            n_tok += sum(r["prompt_tokens"] + r["generated_tokens"] for r in out)
            dt = time.time() - t0
            forms = {k: sum(r["form"] == k for r in out) for k in ("compact", "fenced", "other", "unparsable")}
            print(f"{n_done}/{len(todo)} rows, {dt:.0f} s, {n_done / dt:.3f} rows/s, {n_tok / dt:.1f} tok/s; "
                  f"last chunk forms {forms}, correct {np.mean([r['label'] for r in out]):.2f}",
                  file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
