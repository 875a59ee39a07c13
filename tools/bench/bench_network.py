"""Benchmark the SDM-network training step and the tiny recipe; extrapolate to Phi-3.5-mini.

    python tools/bench/bench_network.py [--sizes tiny phi35] [--batch 50] [--steps 5] [--compile both|on|off]
                                  [--no-tiny-run] [--mac-tflops 4 --mac-gbs 200 --prefill-tok-s 1000
                                  --decode-tok-s 250] [--json out.json]

(1) **Head step** — the compiled W_pos update (``sdm_mlx.network.trainer.make_train_step``: z_ref and
    z_pos over a batch of cached hidden states, the 2|V| SDM log-softmax twice, the mask, the L2
    regulariser, backward to W_pos, Adam) for a model with |V| x D =

      tiny    616 x 64        (the tests' tiny Phi-3)
      mid     8192 x 1024
      phi35   32064 x 3072    (Phi-3.5-mini-instruct: W_pos = 98.5M float32 parameters)

    using an mlx-lm Phi-3 model with no transformer layers (the trunk is irrelevant to the step: its
    hidden states are cached) and a random head, 4-bit quantised with ``--quantize 4`` as in
    ``mlx-community/Phi-3.5-mini-instruct-4bit`` (W_pos is its float32 dequantisation).  Reported:
    ms/step, µs/token, tokens/s, GFLOP/s of the three head matmuls (6·B·|V|·D flops/step), MLX
    peak memory (``mx.get_peak_memory``) and the process's max RSS.
(2) **Tiny recipe** (unless ``--no-tiny-run``): ``tools/builders/make_tiny_model.py`` + the settings of
    ``recipes/tiny_sentiment.yaml``, end to end, with the time of each phase.
(3) **Phi-3.5 estimate** for the paper's sentiment / factcheck experiments (formula printed with the
    table): the head step by a roofline (flops / F + bytes / BW, with F and BW of the target Mac as
    stated assumptions; the bytes and flops per step are exact for this implementation, and the step
    is also *measured here* at the real size), and generation / feature passes from stated per-token
    Phi-3.5 throughputs on the Mac.  Nothing in (3) is measured on a Mac.

Prints a table and the JSON (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools", "builders"))  # make_tiny_model.py (tools/README.md)

import sdm_mlx  # noqa: E402,F401  (before mlx: loads OpenBLAS on Linux; MLX's bundled BLAS is ~100x slower)
import mlx.core as mx  # noqa: E402
from sdm_mlx.runtime.blas import describe_blas  # noqa: E402

SIZES = {"tiny": (616, 64), "mid": (8192, 1024), "phi35": (32064, 3072), "qwen15": (151936, 1536)}

# Sizes of the paper's experiments used by the estimate.
PHI35 = {
    "vocab": 32064, "hidden": 3072, "params_4bit_gb": 2.2, "params_bf16_gb": 7.6, "layers": 32, "kv_heads": 32,
}
TASKS = {
    # pooled verification rows; ~half are training rows, half of those y = 1; tokens per
    # completion up to and incl. the closing delimiter (Phi-3 tokenizer); typical chat prompt length in tokens
    # (IMDb reviews average ~230 words; fact-check statements ~10 words) and generated tokens per answer.
    "sentiment": {"pooled": 18000, "completion_tokens": 8, "prompt_tokens": 350, "new_tokens": 9},
    "factcheck": {"pooled": 6085, "completion_tokens": 7, "prompt_tokens": 70, "new_tokens": 8},
}


def _rss_mb() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1024.0 if sys.platform != "darwin" else r / (1024.0 * 1024.0)


def _head_only_model(vocab: int, hidden: int, quantize: int | None, seed: int = 0):
    """An mlx-lm Phi-3 model with 0 transformer layers (embedding + final norm + untied lm_head)."""
    import mlx.nn as nn
    from mlx_lm.models import phi3

    args = phi3.ModelArgs(model_type="phi3", hidden_size=hidden, num_hidden_layers=0, intermediate_size=4 * hidden,
                          num_attention_heads=max(1, hidden // 64), rms_norm_eps=1e-5, vocab_size=vocab)
    mx.random.seed(seed)
    model = phi3.Model(args)
    # a head with realistic logit scale: rows ~ N(0, 1/D) so that |z| ~ O(1) for unit-RMS hidden states
    model.lm_head.weight = mx.random.normal((vocab, hidden)) * (1.0 / math.sqrt(hidden))
    if quantize:
        nn.quantize(model, group_size=64, bits=quantize)
    mx.eval(model.parameters())
    return model


def bench_head_step(vocab: int, hidden: int, batch: int, steps: int, quantize: int | None,
                    compile_step: bool = True, reference_head: str = "model", host: bool = False) -> dict:
    """One size's W_pos step: MLX's (compiled or eager) or, with ``host``, the host step (:mod:`sdm_mlx.network.host_step`)."""
    from sdm_mlx.network.heads import SDMHeads
    from sdm_mlx.network.host_step import HostTrainStep
    from sdm_mlx.network.trainer import make_optimizer, make_train_step

    model = _head_only_model(vocab, hidden, quantize)
    heads = SDMHeads(model, reference_head=reference_head)
    opt = make_optimizer(1e-5)
    if host:
        step = HostTrainStep(heads, opt)
        step.begin()
    else:
        step = make_train_step(heads, opt, compile=compile_step)
    rng = np.random.default_rng(0)
    n_tok = batch * (steps + 2)
    H = mx.array(rng.normal(size=(n_tok, hidden)).astype(np.float32))
    T = mx.array(rng.integers(vocab, 2 * vocab, size=n_tok).astype(np.int32))
    q = mx.array(rng.uniform(1, 30, size=n_tok).astype(np.float32))
    d = mx.array(rng.uniform(0.3, 1, size=n_tok).astype(np.float32))
    mx.eval(H, T, q, d)
    Hn, Tn, qn, dn = (np.array(a) for a in (H, T, q, d))
    mx.reset_peak_memory()
    times = []
    for b in range(steps + 2):
        sl = slice(b * batch, (b + 1) * batch)
        t0 = time.perf_counter()
        if host:
            step(Hn[sl], Tn[sl], qn[sl], dn[sl], 0.05)
        else:
            out = step(H[sl], T[sl], q[sl], d[sl], mx.array(0.05, dtype=mx.float32))
            mx.eval(out, heads.state, opt.state)
        times.append(time.perf_counter() - t0)
    if host:
        step.end()
    t = float(np.median(times[2:]))  # the first two include compilation and Adam-state allocation
    flops = 6.0 * batch * vocab * hidden
    return {
        "vocab": vocab, "hidden": hidden, "w_pos_params": vocab * hidden, "batch": batch,
        "compiled": compile_step and not host, "step": "host" if host else ("compiled" if compile_step else "eager"),
        "reference_head": reference_head,
        "quantized_ref_head_bits": quantize, "first_step_s": times[0], "step_ms": 1000 * t,
        "us_per_token": 1e6 * t / batch, "tokens_per_s": batch / t, "gflops": flops / t / 1e9,
        "mlx_peak_memory_mb": mx.get_peak_memory() / 2**20, "max_rss_mb": _rss_mb(),
    }


def tiny_recipe_run(workdir: str) -> dict:
    import warnings

    import make_tiny_model

    from sdm_mlx.network.trainer import NetworkConfig, train_network
    from sdm_mlx.settings import yaml_values

    t0 = time.perf_counter()
    built = make_tiny_model.build(os.path.join(workdir, "tiny"), quiet=True)
    t_build = time.perf_counter() - t0
    recipe = yaml_values(os.path.join(ROOT, "recipes", "tiny_sentiment.yaml"), [NetworkConfig], extra_keys=("quiet",))
    recipe.update(model=built["model"], data=built["task"], output_dir=os.path.join(workdir, "out"), verbose=False)
    recipe.pop("quiet", None)
    cfg = NetworkConfig(**recipe)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = train_network(cfg)
    total = time.perf_counter() - t0
    with open(res.metrics_path, encoding="utf-8") as f:
        m = json.load(f)
    ep = m["epochs"]
    gen_docs = m["calibration_rows"] + m["train_positive_rows"]
    gen_s = sum(e["qd_seconds"] + e["calibration"]["seconds"] for e in ep)
    return {
        "build_seconds": t_build, "total_seconds": total, "epochs": len(ep), "tokens_per_epoch": m["tokens"],
        "train_tokens_per_s": float(np.mean([e["tokens_per_s"] for e in ep])),
        "step_ms": float(np.mean([e["step_ms"] for e in ep])),
        "generation_docs_per_s": gen_docs * len(ep) / gen_s if gen_s > 0 else float("nan"),
        "initial_count": res.initial_count, "best_count": res.best_count, "selected_epoch": res.selected_epoch,
        "calibration_rows": m["calibration_rows"], "setup_seconds": total - sum(e["epoch_seconds"] for e in ep)
        - m["initial"]["seconds"], "mlx_peak_memory_mb": mx.get_peak_memory() / 2**20, "max_rss_mb": _rss_mb(),
    }


def machine_rates(n_gemm: int = 2048, stream_mb: int = 512) -> dict:
    """This box's float32 GEMM rate (``mx.matmul``, n x n, best of 3) and memory bandwidth (NumPy float32 copy of
    ``stream_mb`` MB, read + write, best of 3), measured now (the machine may be shared)."""
    a = mx.random.normal((n_gemm, n_gemm))
    mx.eval(a)
    mx.eval(a @ a)
    t_gemm = min(_timed(lambda: mx.eval(a @ a)) for _ in range(3))
    src = np.ones(stream_mb * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t_copy = min(_timed(lambda: np.copyto(dst, src)) for _ in range(3))
    return {"gemm_gflops": 2 * n_gemm**3 / t_gemm / 1e9, "stream_gbs": 2 * src.nbytes / t_copy / 1e9,
            "load_average": os.getloadavg()[0]}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def head_step_roofline(vocab: int, hidden: int, batch: int, tflops: float, gbs: float, ref_bytes: float = 0.5625):
    """Seconds per step from flops / F + bytes / BW (see FORMULA); ``ref_bytes`` per weight of the frozen head."""
    p = vocab * hidden
    flops = 6.0 * batch * p  # z_ref, z_pos forward + dW backward (h has no gradient)
    # W_pos read (forward) 4 + dW write 4 + Adam: read W, g, m, v (16) write W, m, v (12) + ref head read
    nbytes = (4 + 4 + 16 + 12 + ref_bytes) * p
    return flops / (tflops * 1e12) + nbytes / (gbs * 1e9), flops, nbytes


def phi35_estimate(us_per_token: float, prefill_tok_s: float, decode_tok_s: float, batch: int = 50,
                   epochs: int = 5) -> dict:
    """Time and memory of the paper's two experiments with Phi-3.5-mini (see FORMULA)."""
    V, D = PHI35["vocab"], PHI35["hidden"]
    out = {}
    for name, t in TASKS.items():
        n_tr = t["pooled"] // 2
        n_ca = t["pooled"] - n_tr
        n_pos = n_tr // 2
        n_tok = n_pos * t["completion_tokens"]
        head_s = n_tok * us_per_token * 1e-6
        gen_docs = n_pos + n_ca  # per epoch: q, d over the y=1 training prompts + the calibration count
        gen_s = gen_docs * (t["prompt_tokens"] / prefill_tok_s + t["new_tokens"] / decode_tok_s)
        once_s = (t["pooled"] + n_pos) * (t["prompt_tokens"] + t["completion_tokens"]) / prefill_tok_s
        per_epoch = head_s + gen_s
        fixed_gb = {
            "w_pos_fp32": V * D * 4 / 1e9, "grad_fp32": V * D * 4 / 1e9, "adam_moments_fp32": 2 * V * D * 4 / 1e9,
            "token_cache_fp32": n_tok * D * 4 / 1e9,
            "kv_cache_gen_batch8": 8 * (t["prompt_tokens"] + t["new_tokens"]) * PHI35["layers"] * 2 * D * 2 / 1e9,
            "step_activations": 8 * batch * 2 * V * 4 / 1e9,
        }
        extra = sum(fixed_gb.values())
        out[name] = {
            "train_rows": n_tr, "calibration_rows": n_ca, "y1_train_docs": n_pos, "tokens_per_epoch": n_tok,
            "head_training_s_per_epoch": head_s, "generation_s_per_epoch": gen_s,
            "features_and_cache_s_once": once_s, "per_epoch_s": per_epoch,
            "total_s_excl_verifier_fit": once_s + gen_s + epochs * per_epoch,
            "memory_gb": {k: round(v, 3) for k, v in fixed_gb.items()},
            "memory_total_gb_4bit": round(PHI35["params_4bit_gb"] + extra, 2),
            "memory_total_gb_bf16": round(PHI35["params_bf16_gb"] + extra, 2),
        }
    return out


FORMULA = """Extrapolation (per experiment; E epochs, B tokens per step, P = |V| x D = 98.5M for Phi-3.5-mini):
  head step  t_step = 6*B*P / F  +  36.6*P bytes / BW       (F: fp32 matmul FLOP/s, BW: memory bandwidth;
             flops: z_ref, z_pos, dW; bytes: W_pos read, dW write, Adam read W,g,m,v + write W,m,v, 4-bit ref head)
  c_tok      = t_step / B                                   (measured here at the real size; roofline for the Mac)
  N_tok      = (#y=1 training docs) x (completion tokens up to the delimiter)
  head       = N_tok x c_tok                                per epoch
  gen        = (#y=1 training docs + #calibration docs) x (L_prompt / prefill_tok_s + L_new / decode_tok_s)
  once       = (all rows + y=1 training rows) x L_doc / prefill_tok_s          (verifier features, token cache)
  total      = once + verifier fit + gen (initial bar) + E x (head + gen)
  memory     = model weights + 4 x P x 4 B (W_pos, grad, Adam m, v) + N_tok x D x 4 B + KV cache + activations"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "phi35"], choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per size (after 2 warm-up steps)")
    ap.add_argument("--quantize", type=int, default=4, help="bits of the frozen reference head (0: float32)")
    ap.add_argument("--reference-head", nargs="+", default=["model"], choices=["model", "float32"],
                    help="how z_ref is computed in the timed step (see sdm_mlx.network.heads.REFERENCE_HEADS)")
    ap.add_argument("--no-tiny-run", action="store_true", help="skip the end-to-end tiny recipe")
    ap.add_argument("--compile", choices=["both", "on", "off", "all", "host"], default="both",
                    help="time the compiled and/or eager MLX step; 'host': the host step; 'all': the three")
    ap.add_argument("--mac-tflops", type=float, default=4.0,
                    help="assumed achieved fp32 matmul TFLOP/s of the target Mac GPU (M2 Max class: ~13.6 nominal)")
    ap.add_argument("--mac-gbs", type=float, default=200.0,
                    help="assumed achieved memory bandwidth GB/s of the target Mac (M2 Max class: 400 nominal)")
    ap.add_argument("--prefill-tok-s", type=float, default=1000.0,
                    help="assumed Phi-3.5-mini-4bit prompt-processing rate on the target Mac (tokens/s)")
    ap.add_argument("--decode-tok-s", type=float, default=250.0,
                    help="assumed Phi-3.5-mini-4bit greedy decoding rate, summed over a batch of 8 sequences (tokens/s)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    report = {"machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                          "mlx": mx.__version__, "device": str(mx.default_device()), "blas": describe_blas()}}
    heads = []
    modes = {"both": [True, False], "on": [True], "off": [False], "host": ["host"],
             "all": ["host", True, False]}[args.compile]
    for name in args.sizes:
        V, D = SIZES[name]
        for ref in args.reference_head:
            for comp in modes:
                steps = args.steps if V * D < 10**8 else min(args.steps, 3)
                r = bench_head_step(V, D, args.batch, steps, args.quantize or None, compile_step=comp is True,
                                    reference_head=ref, host=comp == "host")
                r["size"] = name
                heads.append(r)
                print(f"head step {name} ref={ref} compile={comp}: {r['step_ms']:.1f} ms/step", file=sys.stderr,
                      flush=True)
    rates = machine_rates()
    report["machine_rates"] = rates
    for h in heads:  # float32 reference head (4 B/weight) unless quantised
        ref_bytes = 4.0 if not h["quantized_ref_head_bits"] else 0.5625
        t_roof, _, _ = head_step_roofline(h["vocab"], h["hidden"], h["batch"], rates["gemm_gflops"] / 1000,
                                          rates["stream_gbs"], ref_bytes)
        h["roofline_here_ms"] = 1000 * t_roof
        h["fraction_of_roofline"] = t_roof * 1000 / h["step_ms"]
        print(f"head step {h['size']}: roofline here {1000 * t_roof:.0f} ms (GEMM {rates['gemm_gflops']:.0f} GFLOP/s, "
              f"stream {rates['stream_gbs']:.1f} GB/s): {h['fraction_of_roofline']:.0%} of it", file=sys.stderr)
    report["head_step"] = heads
    if not args.no_tiny_run:
        with tempfile.TemporaryDirectory() as tmp:
            report["tiny_recipe"] = tiny_recipe_run(tmp)
    full = [h for h in heads if h["size"] == "phi35"]
    c_here = min(h["us_per_token"] for h in full) if full else float("nan")
    t_mac, flops, nbytes = head_step_roofline(32064, 3072, args.batch, args.mac_tflops, args.mac_gbs)
    c_mac = 1e6 * t_mac / args.batch
    report["phi35_estimate"] = {
        "assumptions": {"mac_tflops": args.mac_tflops, "mac_gbs": args.mac_gbs, "prefill_tok_s": args.prefill_tok_s,
                        "decode_tok_s_batch8": args.decode_tok_s, "batch": args.batch, "epochs": 5,
                        "tasks": TASKS},
        "formula": FORMULA,
        "head_step_flops": flops, "head_step_bytes": nbytes,
        "mac_step_ms": 1000 * t_mac, "mac_us_per_token": c_mac, "measured_here_us_per_token": c_here,
        "mac": phi35_estimate(c_mac, args.prefill_tok_s, args.decode_tok_s, args.batch),
    }
    print(f"\nmachine: {report['machine']}")
    print(f"\n{'size':6} {'|V|':>6} {'D':>5} {'B':>3} {'ref':>7} {'compiled':>8} {'ms/step':>9} {'us/tok':>9} {'tok/s':>8} "
          f"{'GFLOP/s':>8} {'peak MB':>8} {'RSS MB':>8}")
    for h in heads:
        print(f"{h['size']:6} {h['vocab']:>6} {h['hidden']:>5} {h['batch']:>3} {h['reference_head']:>7} "
              f"{h['step']:>8} "
              f"{h['step_ms']:>9.2f} {h['us_per_token']:>9.1f} {h['tokens_per_s']:>8.1f} {h['gflops']:>8.1f} "
              f"{h['mlx_peak_memory_mb']:>8.0f} {h['max_rss_mb']:>8.0f}")
    if "tiny_recipe" in report:
        t = report["tiny_recipe"]
        print(f"\ntiny recipe: {t['total_seconds']:.1f}s total ({t['epochs']} epochs, {t['tokens_per_epoch']} tokens/epoch, "
              f"{t['train_tokens_per_s']:.0f} train tok/s, {t['step_ms']:.2f} ms/step, "
              f"{t['generation_docs_per_s']:.0f} generated docs/s), count {t['initial_count']} -> {t['best_count']} "
              f"(epoch {t['selected_epoch']}), MLX peak {t['mlx_peak_memory_mb']:.0f} MB, max RSS {t['max_rss_mb']:.0f} MB")
    print("\n" + FORMULA)
    est = report["phi35_estimate"]
    print(f"\nPhi-3.5-mini head step: {flops / 1e9:.1f} GFLOP and {nbytes / 1e9:.2f} GB per step of {args.batch} tokens; "
          f"measured here {c_here:.0f} us/token; Mac roofline ({args.mac_tflops} TFLOP/s, {args.mac_gbs} GB/s) "
          f"{1000 * t_mac:.1f} ms/step = {c_mac:.0f} us/token")
    print(f"Mac estimate (assumed prefill {args.prefill_tok_s:.0f} tok/s, decode {args.decode_tok_s:.0f} tok/s over batch 8):")
    for name in TASKS:
        e = est["mac"][name]
        print(f"  {name:9} tokens/epoch {e['tokens_per_epoch']:>6}  head {e['head_training_s_per_epoch'] / 60:5.1f} min/epoch  "
              f"generation {e['generation_s_per_epoch'] / 60:6.1f} min/epoch  once {e['features_and_cache_s_once'] / 60:5.1f} min  "
              f"total (5 epochs, excl. verifier fit) {e['total_s_excl_verifier_fit'] / 3600:5.2f} h  memory "
              f"{e['memory_total_gb_4bit']} GB (4-bit) / {e['memory_total_gb_bf16']} GB (bf16)")
    from sdm_mlx.storage.files import dumps, write_text

    text = dumps(report, indent=1)
    if args.json:
        write_text(args.json, text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
