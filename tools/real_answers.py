"""Decode the model's own greedy answer to each task statement and keep its verifier features.

One row per task row ``{id, label, document[, split]}``: the prompt is the preset's
instruction in the model's chat template (as ``sdm-mlx make-verification-data --model``
and ``sdm-mlx generate --prompt-template`` build it), the answer is the model's greedy
answer (batched decoding, stopped when the JSON answer closes, as ``generate`` stops),
and the row's ``embedding`` is the verifier input pooled from the hidden states of that
very decoding (DESIGN #21, :func:`sdm_mlx.network.generation.greedy_generate`): the
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
from sdm_mlx.network.generation import first_json_object, greedy_generate, parse_task_prediction
from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS


class BaseHeads:
    """The model's own head as the decoding rule of :func:`greedy_generate` (plain greedy argmax)."""

    def __init__(self, model):
        self.model = model

    def hidden_states(self, token_ids_batch, cache=None):
        return _embed.hidden_states(self.model, token_ids_batch, cache=cache)

    def next_tokens(self, h):
        import mlx.core as mx

        return mx.argmax(_embed.logits_from_hidden(self.model, h), axis=-1)


class SharedPrefixCache:
    """One layer's KV cache of a batch laid out ``[shared prefix (P) | left pad_i | row i's own tokens | generated]``.

    The prefix's keys/values are computed once (batch 1) and tiled; RoPE positions are per row (``offset``), so a
    row's own tokens sit at positions P, P+1, ... whatever its padding; the mask hides the padding slots.  The
    model is causal, so every row sees exactly what a plain forward of its whole prompt computes.
    """

    def __init__(self, keys, values, pads: list[int]):
        import mlx.core as mx

        self.P = int(keys.shape[2])
        self.keys = mx.repeat(keys, len(pads), axis=0)
        self.values = mx.repeat(values, len(pads), axis=0)
        self.pads = mx.array(np.array(pads, dtype=np.int32))
        self.offset = mx.array(np.array([self.P - p for p in pads], dtype=np.int32))

    def update_and_fetch(self, keys, values):
        import mlx.core as mx

        self.keys = mx.concatenate([self.keys, keys], axis=2)
        self.values = mx.concatenate([self.values, values], axis=2)
        self.offset = self.offset + keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N: int, window_size=None, return_array: bool = False):
        import mlx.core as mx

        T0 = self.keys.shape[2]
        j = mx.arange(T0 + N)[None, None, None, :]
        i = mx.arange(N)[None, None, :, None]
        pad = (j >= self.P) & (j < self.P + self.pads[:, None, None, None])
        return (j <= T0 + i) & ~pad


def shared_prefix(model, prompt_ids: list) -> dict:
    """The token prefix all prompts share: its ids, per-layer keys/values and the sum of its final-norm states."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    first = prompt_ids[0]
    P = min(len(r) for r in prompt_ids) - 1  # every row keeps at least one own token
    for r in prompt_ids[1:]:
        P = next((k for k in range(P) if r[k] != first[k]), P)
    cache = make_prompt_cache(model)
    h = _embed.hidden_states(model, [first[:P]], cache=cache)[0]
    kv = [(c.keys[..., :P, :], c.values[..., :P, :]) for c in cache]
    mx.eval(h, *[a for pair in kv for a in pair])
    return {"ids": first[:P], "kv": kv, "state_sum": h.sum(axis=0)}


def decode_shared(model, tokenizer, prefix: dict, prompt_ids: list, max_tokens: int, eos: set) -> list:
    """Greedy decoding of prompts that start with ``prefix``; ``(tokens, embedding, n_kept)`` per prompt, the
    embedding pooled as :func:`sdm_mlx.network.generation.greedy_generate` pools it (DESIGN #21)."""
    import mlx.core as mx

    from sdm_mlx.network.generation import is_closed

    P = len(prefix["ids"])
    own = [r[P:] for r in prompt_ids]
    W = max(len(r) for r in own)
    pads = [W - len(r) for r in own]
    cache = [SharedPrefixCache(k, v, pads) for k, v in prefix["kv"]]
    h = _embed.hidden_states(model, mx.array(np.array([[0] * p + r for p, r in zip(pads, own)], dtype=np.int32)),
                             cache=cache)
    B, last, tokens, done, steps = len(own), h[:, -1, :], [[] for _ in own], [False] * len(own), []
    for step in range(max_tokens):
        nxt = mx.argmax(_embed.logits_from_hidden(model, last), axis=-1).tolist()
        for i in range(B):
            if done[i]:
                continue
            if nxt[i] in eos:
                done[i] = True
                continue
            tokens[i].append(int(nxt[i]))
            done[i] = is_closed(tokenizer.decode(tokens[i])) or len(tokens[i]) >= max_tokens
        if all(done):
            break
        feed = mx.array(np.array([[t[-1] if t else 0] for t in tokens], dtype=np.int32))
        hs = _embed.hidden_states(model, feed, cache=cache)
        steps.append(hs[:, 0, :])
        last = hs[:, -1, :]
        mx.eval(last, steps[-1])
    step_h = mx.stack(steps, axis=1) if steps else None
    out = []
    for i in range(B):
        n, _ = _embed.generated_n_kept(tokenizer, len(prompt_ids[i]), tokens[i], on_missing="prompt")
        rows = h[i, pads[i]:]
        if n > P + len(own[i]):
            rows = mx.concatenate([rows, step_h[i, : n - P - len(own[i])]], axis=0)
        rows = rows[: n - P]
        feat = mx.concatenate([(prefix["state_sum"] + rows.sum(axis=0)) / float(n), rows[-1]])
        out.append((tokens[i], np.array(feat, dtype=np.float32), n))
    return out


def forced_shared(model, tokenizer, prefix: dict, prompts: list, completions: list) -> np.ndarray:
    """Features of force-decoded ``prompt + completion`` (as ``sdm-mlx embed --prompt-field --completion-field``
    computes them: mean over the positions before the completion's last delimiter token ⊕ the state predicting
    it), with the shared prompt prefix computed once; rows sorted by length are fed in one padded block."""
    import mlx.core as mx

    P = len(prefix["ids"])
    ids, ns = [], []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        toks = _embed.encode(tokenizer, p + c)
        j = _embed.delimiter_token_index_in_text(tokenizer, p + c, toks, (len(p), None), _embed.DEFAULT_DELIMITER)
        if j is None or toks[:P] != prefix["ids"]:
            raise SystemExit(f"row {i}: no closing delimiter in the completion, or not the shared prompt prefix")
        ids.append(toks[P:j])
        ns.append(j)
    W = max(len(r) for r in ids)
    pads = [W - len(r) for r in ids]
    cache = [SharedPrefixCache(k, v, pads) for k, v in prefix["kv"]]
    h = _embed.hidden_states(model, mx.array(np.array([[0] * q + r for q, r in zip(pads, ids)], dtype=np.int32)),
                             cache=cache)
    feats = [mx.concatenate([(prefix["state_sum"] + h[i, pads[i]:].sum(axis=0)) / float(n), h[i, -1]])
             for i, n in enumerate(ns)]
    out = mx.stack(feats)
    mx.eval(out)
    return np.array(out, dtype=np.float32)


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


def decode_rows(model, tokenizer, rows, args, completions, template, prefix=None):
    """One chunk: output rows with the answer, its parse and the decode-time features (``prefix``: decode with
    the shared prompt prefix computed once, :func:`decode_shared`, in batches sorted by length)."""
    prompts = [_embed.chat_text(tokenizer, r["document"], system=args.system, prompt_template=template) for r in rows]
    if prefix is None:
        outs = greedy_generate(BaseHeads(model), tokenizer, prompts, max_new_tokens=args.max_tokens,
                               batch_size=args.batch_size, features=True)
        outs = [(o.token_ids, o.embedding, o.n_kept, len(o.prompt_ids)) for o in outs]
    else:
        ids = [_embed.encode(tokenizer, p) for p in prompts]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        outs = [None] * len(ids)
        eos = _embed.eos_token_ids(tokenizer)
        for b0 in range(0, len(order), args.batch_size):
            idx = order[b0: b0 + args.batch_size]
            for i, (toks, feat, n) in zip(idx, decode_shared(model, tokenizer, prefix, [ids[i] for i in idx],
                                                             args.max_tokens, eos)):
                outs[i] = (toks, feat, n, len(ids[i]))
    result = []
    for r, (toks, feat, n, n_prompt) in zip(rows, outs):
        text = tokenizer.decode(toks)
        pred = parse_task_prediction(text, completions)
        result.append({
            "id": r["id"], "split": r.get("split"), "task_label": int(r["label"]), "answer_label": int(pred),
            "form": answer_form(text), "label": int(pred == int(r["label"])), "text": text,
            "n_kept": int(n), "prompt_tokens": n_prompt, "generated_tokens": len(toks),
            "embedding_source": "llm-hidden-states", "embedding": [float(x) for x in feat],
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


def check_rows(model, tokenizer, rows, have, args, preset, prefix) -> None:
    """Re-decode the first ``args.check`` finished rows with the shared prefix; stop unless texts are equal and
    the features agree to 1e-4 of their largest magnitude."""
    stored = {}
    with open(args.output, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            stored[r["id"]] = r
            if len(stored) >= args.check:
                break
    again = decode_rows(model, tokenizer, [r for r in rows if r["id"] in stored], args, preset["completions"],
                        preset["prompt_template"], prefix)
    worst, same = 0.0, 0
    for r in again:
        old = stored[r["id"]]
        a, b = np.array(r["embedding"]), np.array(old["embedding"])
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
        same += r["text"] == old["text"] and r["n_kept"] == old["n_kept"]
    print(f"check: {same}/{len(again)} same answers and positions; max |d| / max |x| = {worst:.2e}",
          file=sys.stderr, flush=True)
    if same != len(again) or worst > 1e-4:
        raise SystemExit("shared-prefix decoding disagrees with the full prefill: use --no-shared-prefix")


def run_forced(args) -> int:
    """``--forced``: embed verification rows (id, prompt, completion, ...) with the shared prefix; resumable."""
    rows = read_rows(args.input)[: args.limit]
    have = done_ids(args.output)
    todo = [r for r in rows if r["id"] not in have]
    print(f"{len(have)} rows already in {args.output}; {len(todo)} to embed", file=sys.stderr, flush=True)
    if not todo:
        return 0
    model, tokenizer = _embed.load_model(args.model)
    prefix = shared_prefix(model, [_embed.encode(tokenizer, r["prompt"]) for r in rows])
    todo.sort(key=lambda r: -len(r["prompt"] + r["completion"]))
    t0 = time.time()
    with open(args.output, "a", encoding="utf-8") as f:
        for b0 in range(0, len(todo), args.batch_size):
            part = todo[b0: b0 + args.batch_size]
            feats = forced_shared(model, tokenizer, prefix, [r["prompt"] for r in part],
                                  [r["completion"] for r in part])
            for r, e in zip(part, feats):
                f.write(json.dumps({**r, "embedding_source": "llm-hidden-states",
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
    ap.add_argument("--no-shared-prefix", action="store_true",
                    help="prefill every prompt in full (greedy_generate) instead of the shared prefix once")
    ap.add_argument("--check", type=int, default=0,
                    help="first re-decode this many rows already in --output and compare texts and features")
    ap.add_argument("--forced", action="store_true",
                    help="instead: --input holds verification rows (id, prompt, completion); write their force-decoded "
                         "features (sdm-mlx embed's) computed with the shared prompt prefix")
    args = ap.parse_args(argv)
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
    prefix = None
    if not args.no_shared_prefix:
        prompts = [_embed.chat_text(tokenizer, r["document"], system=args.system,
                                    prompt_template=preset["prompt_template"]) for r in rows]
        prefix = shared_prefix(model, [_embed.encode(tokenizer, p) for p in prompts])
        np.savez(args.output + ".prefix.npz", P=len(prefix["ids"]),
                 state_sum=np.array(prefix["state_sum"], dtype=np.float64))
        print(f"shared prefix: {len(prefix['ids'])} tokens, computed once", file=sys.stderr, flush=True)
        if args.check:
            check_rows(model, tokenizer, rows, have, args, preset, prefix)
    step = args.batch_size  # one batch per flush: a stopped run loses at most one batch
    t0, n_done, n_tok = time.time(), 0, 0
    with open(args.output, "a", encoding="utf-8") as f:
        for b0 in range(0, len(todo), step):
            out = decode_rows(model, tokenizer, todo[b0: b0 + step], args, preset["completions"],
                              preset["prompt_template"], prefix)
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
