"""Benchmark: does ``sdm-mlx serve``'s memory stay flat under a long bounded load?

    python tools/bench/bench_serve_soak.py [--size tiny] [--seconds 300] [--clients 16] [--max-words N]
                                     [--server sdm|mlx_lm] [--json soak.json]

Builds the same random Phi-3-architecture model and verifier as ``tools/bench/bench_serve.py``, starts
``sdm-mlx serve`` with its default bounds (prompt cache ``--prompt-cache-bytes``, verdict store
``--max-verdicts``), and keeps ``--clients`` clients busy for ``--seconds``: every request has its own
review text (so the prompt cache keeps admitting, and evicting once full: with ``serve``'s default
bound of 256 MiB that takes a tiny model's ~4,000 prompts; ``--prompt-cache-bytes`` lowers it), a quarter of them stream, and the
policies rotate over ``return``, ``abstain`` and ``reask`` (2 attempts).  The server's resident set
(``VmRSS``) is sampled every ``--every`` seconds.  Reported: the samples, the peak (``VmHWM``), the
requests and errors, the growth over the second half of the run (MiB and % of its start) — the
stores fill in the first minute or two, so a flat server shows ≈ 0 there — and the median RSS of each quarter
of the run (single readings swing by ±10 MiB; the medians of the second and the last quarter are the steadier
comparison).

``--max-words N`` gives each review a random 1..N words (default: 2, as in the earlier runs), so that prompt
lengths, and so the shapes the model computes, vary as in real traffic: whatever is kept per shape (compiled
traces, see ``sdm_mlx/runtime/compiled.py``) shows up here.  ``--server mlx_lm`` runs ``mlx_lm.server`` on the
same model under the same load (its own ``--prompt-cache-bytes``, no ``sdm`` policies): the baseline of the
Python and MLX runtime that a flat server is judged against.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import sdm_mlx  # noqa: F401  (before mlx: loads OpenBLAS on Linux)
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests" / "helpers"))  # server_process.py

from bench_common import SIZES, write_report  # noqa: E402
from bench_serve import WORDS, build, chat, free_port, peak_rss_mb, post, start_mlx_lm, status_mb  # noqa: E402
from sdm_mlx.runtime.blas import describe_blas  # noqa: E402
from server_process import ServerProcess, sdm_mlx  # noqa: E402

POLICIES = ({"on_reject": "return"}, {"on_reject": "abstain"}, {"on_reject": "reask", "max_attempts": 2})


def rss_mb(pid: int) -> float | None:
    """Current resident set size of a live process (Linux ``VmRSS``), in MiB."""
    return status_mb(pid, "VmRSS")


def quarter_values(samples: list, seconds: float) -> list:
    """The RSS readings of each quarter of the run (the final reading, taken after the clients stopped, counts
    in the last quarter)."""
    out = []
    for q in range(4):
        lo, hi = q * seconds / 4, (q + 1) * seconds / 4
        out.append([s["rss_mb"] for s in samples if s["rss_mb"] is not None and (lo <= s["t_s"] < hi or
                                                                                 (q == 3 and s["t_s"] >= hi))])
    return out


def quarter_medians(samples: list, seconds: float) -> list:
    """The median RSS of the samples in each quarter of the run (None for a quarter without samples).  Two
    readings 10 s apart differ by up to ±10 MiB, so the end points of a half mislead; medians over 75 s of a
    5-minute run do not."""
    return [float(np.median(v)) if v else None for v in quarter_values(samples, seconds)]


def quarter_ranges(samples: list, seconds: float) -> list:
    """``[lowest, highest]`` RSS of each quarter (None without samples).  A server that gives its heap's free
    pages back (``malloc_trim``) swings between the two as a batch's buffers are faulted in and given back: on a
    larger model the readings can be bimodal, and a median then jumps between the modes while the lowest
    (what is kept) and the highest (the working peak) hold."""
    return [[min(v), max(v)] if v else None for v in quarter_values(samples, seconds)]


def soak(port: int, pid: int, *, seconds: float, clients: int, tokens: int, every: float,
         mlx_lm_model: str | None = None, max_words: int = 2) -> dict:
    """``mlx_lm_model``: the server is ``mlx_lm.server``, which loads the model a request names (and has no
    ``sdm`` policies)."""
    stop = time.perf_counter() + seconds
    counter = itertools.count()
    done, errors, lock = [0], [], threading.Lock()
    rng = np.random.default_rng(0)
    words = list(WORDS)

    def worker(c: int):
        while time.perf_counter() < stop:
            k = next(counter)
            n = 2 if max_words <= 2 else int(rng.integers(1, max_words + 1))
            text = f"Review {k}: the film is {' and '.join(rng.choice(words, n, replace=n > 2))}. Sentiment as JSON?"
            stream = k % 4 == 0
            body = chat(text, tokens, stream=stream, **({"model": mlx_lm_model} if mlx_lm_model
                                                        else {"sdm": POLICIES[k % len(POLICIES)]}))
            try:
                post(port, "/v1/chat/completions", body, stream=stream, timeout=120)
                with lock:
                    done[0] += 1
            except Exception as e:  # reported, never silently dropped
                with lock:
                    errors.append(repr(e)[:200])

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    samples = []
    while time.perf_counter() < stop:
        samples.append({"t_s": round(time.perf_counter() - t0, 1), "rss_mb": rss_mb(pid), "requests": done[0]})
        time.sleep(every)
    for t in threads:
        t.join(timeout=180)
    samples.append({"t_s": round(time.perf_counter() - t0, 1), "rss_mb": rss_mb(pid), "requests": done[0]})
    half = [s for s in samples if s["t_s"] >= seconds / 2 and s["rss_mb"] is not None]
    grow = half[-1]["rss_mb"] - half[0]["rss_mb"] if len(half) >= 2 else None
    quarters = quarter_medians(samples, seconds)
    ranges = quarter_ranges(samples, seconds)
    return {"samples": samples, "requests": done[0], "errors": len(errors), "error_samples": errors[:3],
            "requests_per_s": done[0] / (time.perf_counter() - t0),
            "second_half_growth_mb": grow,
            "rss_quarter_medians_mb": quarters,
            "rss_quarter_ranges_mb": ranges,
            "growth_second_to_last_quarter_mb": (quarters[3] - quarters[1]
                                                 if None not in (quarters[1], quarters[3]) else None),
            "second_half_growth_pct": 100 * grow / half[0]["rss_mb"] if grow is not None else None,
            "peak_rss_mb": peak_rss_mb(pid)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens per request")
    ap.add_argument("--support", type=int, default=1000, help="support rows of the verifier")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between RSS samples")
    ap.add_argument("--prompt-cache-bytes", type=int, default=None,
                    help="the server's prompt-cache bound (default: serve's); a small one fills within the first "
                         "minute, so the rest of the run shows whether anything else grows")
    ap.add_argument("--max-words", type=int, default=2,
                    help="words in each review: 2 (as in earlier runs), or a random 1..N, so that prompt lengths "
                         "(and so the shapes the model sees) vary as in real traffic")
    ap.add_argument("--server", choices=("sdm", "mlx_lm"), default="sdm",
                    help="soak `sdm-mlx serve` (verified), or `mlx_lm.server` on the same model and load, as the "
                         "baseline a flat server is judged against")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    report = {"server": args.server, "max_words": args.max_words, "size": args.size, "seconds": args.seconds,
              "clients": args.clients, "tokens": args.tokens, "prompt_cache_bytes": args.prompt_cache_bytes,
              "blas": describe_blas(), "cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        model_path, verifier = build(tmp, args.size, args.support)
        if args.server == "mlx_lm":
            port, options = free_port(), (["--prompt-cache-bytes", args.prompt_cache_bytes]
                                          if args.prompt_cache_bytes is not None else [])
            report["mlx_lm_options"] = options
            proc = start_mlx_lm(model_path, port, options=options)
            pid, model = proc.pid, model_path  # mlx_lm.server loads the model a request names

            def stop() -> int:
                proc.terminate()
                return proc.wait(timeout=30)
        else:
            srv = ServerProcess(sdm_mlx("serve", "--model", model_path, "--verifier", verifier, "--port", 0, "--quiet",
                                        "--system", "", "--prompt-template", "{document}", "--served-model-name",
                                        "bench", *(["--prompt-cache-bytes", args.prompt_cache_bytes]
                                                   if args.prompt_cache_bytes is not None else [])), timeout=300)
            port, pid, model, stop = srv.port, srv.proc.pid, None, srv.stop
        try:
            post(port, "/v1/chat/completions", chat("warm-up", args.tokens, **({"model": model} if model else {})))
            report.update(soak(port, pid, seconds=args.seconds, clients=args.clients, tokens=args.tokens,
                               every=args.every, mlx_lm_model=model, max_words=args.max_words))
            report["load_average_after"] = os.getloadavg()
        finally:
            report["server_exit_code"] = stop()
    for s in report["samples"]:
        print(f"{s['t_s']:>7.1f} s  RSS {s['rss_mb']:>7.1f} MiB  {s['requests']:>6} requests")
    medians = " / ".join("-" if m is None else f"{m:.1f}" for m in report["rss_quarter_medians_mb"])
    ranges = " / ".join("-" if r is None else f"{r[0]:.0f}-{r[1]:.0f}" for r in report["rss_quarter_ranges_mb"])
    print(f"{report['requests']} requests ({report['requests_per_s']:.1f}/s), {report['errors']} errors; peak RSS "
          f"{report['peak_rss_mb']:.0f} MiB; second half growth {report['second_half_growth_mb']:+.1f} MiB "
          f"({report['second_half_growth_pct']:+.1f} %); median RSS by quarter {medians} MiB "
          f"(lowest-highest {ranges}); "
          f"load average {report['load_average_before'][0]:.1f} -> "
          f"{report['load_average_after'][0]:.1f}")
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
