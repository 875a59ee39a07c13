"""Benchmark: ``sdm-mlx serve`` (verified generation over HTTP) vs ``mlx_lm.server`` on the same model.

    python tools/bench/bench_serve.py [--size small] [--clients 1,4,16] [--requests 8] [--tokens 32] [--support 1000]
                                [--model DIR] [--no-bare] [--json out.json]

Without ``--model`` a random Phi-3-architecture model is built with
``tools/builders/tiny_models.py`` (``--size``: ``tiny`` hidden 64 / 2 layers, ``small``
hidden 512 / 4 layers, ``medium`` hidden 1024 / 8 layers; the vocabulary is
the tokenizer's own, a few hundred tokens); the
verification layer is an ``SDMEstimator`` fitted (tiny settings) on
``--support`` synthetic rows of the model's feature width (its size is what
matters for timing; see tools/bench/bench_generate.py).  Both servers run as
subprocesses on loopback and get the same chat requests (a shared system
message and instruction, then a distinct review; greedy,
``max_tokens=--tokens``; ours with no template of its own and
``on_reject=return`` so every request is one generation + one verification).
Ours stops at the answer's closing brace (the verification unit), after 11-32
tokens on these random models.  mlx-lm cannot stop there: it matches a stop string
as the token ids the string encodes to, and these models write the brace inside
other tokens (``"}``).  So the answers are length-matched: each prompt is first
sent to our server once, and ``mlx_lm.server`` then gets, for that prompt,
``max_tokens`` = the number of tokens our answer had.  Both decode greedily with
the same model, so both generate the same tokens and the latencies compare like
for like (``--mlx-lm-full-length``: every mlx_lm answer runs to ``--tokens``, the
setting of the tables before 2026-11-27's last section in docs/serving.md).
Both servers keep their prompt caches (mlx_lm's ``LRUPromptCache``, our
``PrefixCache``).  Reported, for each number of concurrent clients of
``--clients`` (each sending ``--requests`` non-streaming requests back to back; at each number of clients the
servers run back to back, in an order alternating between the ``--repeats`` repeats;
the best run of each kept):

* requests/s and completion tokens/s, latency mean / p50 / p95, and the ratio
  sdm-mlx / mlx_lm of mean latency (the verification overhead, end to end);
* time to first token of a streamed request (median over the prompts):
  ``mlx_lm``; ``sdm return`` (tokens streamed live, verdict in the last chunk);
  ``sdm return, no prompt cache`` (a second server with ``--prompt-cache-bytes 0``);
  ``sdm abstain`` (only verified text is released, so the first token arrives
  after generation + verification);
* peak RSS of each server process (``VmHWM``) and the load average before and after;
* paired ratios: within each repeat, sdm / mlx_lm of requests/s, p50 and p95 (the two servers ran one
  after the other), and their medians over the repeats.

Prints a table, writes JSON with ``--json`` and names the BLAS MLX used.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import subprocess
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
from bench_generate import make_verifier  # noqa: E402
from sdm_mlx.runtime.blas import describe_blas  # noqa: E402
from server_process import ServerProcess, sdm_mlx  # noqa: E402

OPENBLAS_DEFAULT_WAIT = "OpenBLAS default (28)"  # OPENBLAS_THREAD_TIMEOUT unset
WORDS = "warm funny dull wooden long moving sharp lovely boring awful great weak".split()


def prompts(n: int) -> list:
    rng = np.random.default_rng(0)
    return [f"Review {i}: the film is {' and '.join(rng.choice(WORDS, 2, replace=False))}. Sentiment as JSON?"
            for i in range(n)]


def post(port: int, path: str, body: dict, stream: bool = False, timeout: float = 600):
    """``(seconds to first body byte after the headers, total seconds, parsed JSON or SSE lines)``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{path}: HTTP {r.status}: {r.read()[:300]!r}")
    if not stream:
        data = json.loads(r.read())
        conn.close()
        return None, time.perf_counter() - t0, data
    first, lines = None, []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if first is None and obj.get("choices") and obj["choices"][0].get("delta", {}).get("content"):
            first = time.perf_counter() - t0
        lines.append(obj)
    conn.close()
    return first, time.perf_counter() - t0, lines


SYSTEM = "You are a helpful AI assistant that classifies movie reviews."
INSTRUCTION = ('Classify the sentiment of the following movie review. Respond using the following JSON: '
               '{"sentiment": str}. REVIEW: ')


def chat(prompt: str, tokens: int, **extra) -> dict:
    return {"model": "bench", "messages": [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": INSTRUCTION + prompt}],
            "max_tokens": tokens, "temperature": 0.0, **extra}


def status_mb(pid: int, field: str) -> float | None:
    """A memory field of a live process's ``/proc/PID/status`` (``VmHWM``: peak RSS, ``VmRSS``: current), in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def peak_rss_mb(pid: int) -> float | None:
    """Peak resident set size of a live process (Linux ``VmHWM``), in MiB."""
    return status_mb(pid, "VmHWM")


def load_run(port: int, texts: list, tokens: int, clients: int, per_client: int, extra: dict,
             lengths: dict | None = None) -> dict:
    """``clients`` threads each sending ``per_client`` non-streaming requests back to back (``lengths``: a
    prompt's ``max_tokens`` instead of ``tokens``)."""
    lat, ntok, gen_s, ver_s, errors = [], [], [], [], []
    lock = threading.Lock()

    def worker(c: int):
        for k in range(per_client):
            text = texts[(c * per_client + k) % len(texts)]
            body = chat(text, tokens if lengths is None else lengths[text], **extra)
            try:
                _, dt, data = post(port, "/v1/chat/completions", body)
            except Exception as e:  # reported, never silently dropped
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                lat.append(dt)
                ntok.append(data["usage"]["completion_tokens"])
                for a in data["choices"][0].get("verification", {}).get("attempts", []):
                    gen_s.append(a["generation_seconds"])
                    ver_s.append(a["verification_seconds"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if not lat:
        raise RuntimeError(f"every request failed: {errors[:3]}")
    lat = np.array(lat)
    return {"clients": clients, "requests": len(lat), "errors": len(errors), "error_samples": errors[:3],
            "wall_s": wall, "requests_per_s": len(lat) / wall,
            "tokens_per_s": float(sum(ntok)) / wall, "completion_tokens": int(sum(ntok)),
            "latency_mean_s": float(lat.mean()), "latency_p50_s": float(np.median(lat)),
            "latency_p95_s": float(np.quantile(lat, 0.95)),
            "server_generation_s": float(np.mean(gen_s)) if gen_s else None,
            "server_verification_s": float(np.mean(ver_s)) if ver_s else None}


def ttft(port: int, texts: list, tokens: int, extra: dict) -> float:
    firsts = [post(port, "/v1/chat/completions", chat(t, tokens, stream=True, **extra), stream=True)[0]
              for t in texts]
    return float(np.median([f for f in firsts if f is not None]))


def start_mlx_lm(model_path: str, port: int, openblas_default_wait: bool = False, options=()) -> subprocess.Popen:
    """``mlx_lm.server`` with the same BLAS as ours (on Linux: OpenBLAS preloaded, see sdm_mlx/runtime/blas.py);
    ``openblas_default_wait``: without our ``OPENBLAS_THREAD_TIMEOUT`` (OpenBLAS's own busy-wait, as
    ``LD_PRELOAD`` alone gives it)."""
    from sdm_mlx.runtime.blas import find_openblas

    env = dict(os.environ)
    if openblas_default_wait:
        env.pop("OPENBLAS_THREAD_TIMEOUT", None)
    if sys.platform.startswith("linux") and find_openblas():
        env["LD_PRELOAD"] = find_openblas()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", model_path, "--port", str(port),
                             "--log-level", "WARNING", *map(str, options)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise TimeoutError("mlx_lm.server did not start")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(tmp: str, size: str, support: int, model: str | None = None) -> tuple[str, str]:
    """``(model directory, verifier directory)``: ``model`` (e.g. the real test LLM) or a random ``size`` one."""
    from tiny_models import make_tiny_model

    if model is None:
        # the tokenizer's own vocabulary: a padded vocab_size lets greedy decoding pick ids the tokenizer cannot
        # detokenize, which mlx_lm.server's streaming detokenizer does not survive
        overrides = {k: v for k, v in (SIZES[size] or {}).items() if k != "vocab_size"} or None
        model = make_tiny_model(tmp, "phi3", overrides=overrides)
    width = 2 * json.loads(Path(model, "config.json").read_text())["hidden_size"]
    verifier = os.path.join(tmp, "verifier")
    make_verifier(width, support).save(verifier)
    return model, verifier


def best(runs: list) -> list:
    """Per number of clients, the run with the highest throughput (the least disturbed by other load)."""
    out = {}
    for run in runs:
        c = run["clients"]
        if c not in out or run["requests_per_s"] > out[c]["requests_per_s"]:
            out[c] = run
    return [out[c] for c in sorted(out)]


def paired_ratios(ours: list, theirs: list) -> dict:
    """Per number of clients, sdm / mlx_lm of requests/s, p50 and p95 within each repeat (the two servers ran
    one after the other), and their medians: on a noisy machine steadier than the ratio of the best runs."""
    out: dict = {}
    for a, b in zip(ours, theirs):
        row = out.setdefault(str(a["clients"]), {"requests_per_s": [], "latency_p50_s": [], "latency_p95_s": []})
        for key, values in row.items():
            values.append(a[key] / b[key])
    return {c: {key: {"each": [round(v, 3) for v in values], "median": float(np.median(values))}
                for key, values in row.items()} for c, row in out.items()}


def our_lengths(port: int, texts: list, tokens: int) -> dict:
    """Each prompt's answer length on our server (one request after another): mlx_lm's ``max_tokens`` for it."""
    out = {}
    for text in dict.fromkeys(texts):
        out[text] = max(1, post(port, "/v1/chat/completions", chat(text, tokens))[2]["usage"]["completion_tokens"])
    return out


def measure(servers: dict, texts: list, args) -> dict:
    """``--repeats`` times: at each number of clients, a load run of each server, back to back (the order
    alternating between repeats), then the time to first token; keeps every run and the best of each."""
    runs = {name: [] for name in servers}
    clients = [int(c) for c in args.clients.split(",")]
    firsts = {key: [] for name, (_, _, modes) in servers.items() for key in modes}
    few = texts[: args.ttft_prompts]
    for name, (port, extra, _) in servers.items():  # warm-up (compilation, allocation)
        post(port, "/v1/chat/completions", chat(texts[0], args.tokens, **extra))
    lengths = {"mlx_lm": None if args.mlx_lm_full_length else our_lengths(servers["sdm"][0], texts, args.tokens)}
    loaded = [(name, port, extra) for name, (port, extra, _) in servers.items() if not name.endswith("_nocache")]
    for rep in range(args.repeats):
        for c in clients:  # the servers one after the other at each number of clients, first one then the other
            for name, port, extra in (loaded if rep % 2 == 0 else loaded[::-1]):
                runs[name].append(load_run(port, texts, args.tokens, c, args.requests, extra, lengths.get(name)))
        for name, (port, extra, modes) in servers.items():
            for key, mode in modes.items():
                firsts[key].append(ttft(port, few, args.tokens, {**extra, **mode}))
        print(f"  repeat {rep + 1}/{args.repeats} done", flush=True)
    out = {name: {"load": best(r), "all_runs": r} for name, r in runs.items() if r}
    out["paired_ratios"] = paired_ratios(runs["sdm"], runs["mlx_lm"])
    out["ttft_s"] = {key: min(v) for key, v in firsts.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--clients", default="1,4,16", help="comma-separated numbers of concurrent clients")
    ap.add_argument("--requests", type=int, default=8, help="requests per client")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens per request")
    ap.add_argument("--support", type=int, default=1000, help="support rows of the verifier")
    ap.add_argument("--ttft-prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2, help="alternating repeats; the best run of each is kept")
    ap.add_argument("--model", default=None,
                    help="an mlx-lm model directory to serve instead of a random --size one (e.g. the real test LLM)")
    ap.add_argument("--no-bare", action="store_true",
                    help="skip the second sdm server without a prompt cache (its time to first token): one model "
                         "fewer in memory, for large models")
    ap.add_argument("--mlx-lm-openblas-default-wait", action="store_true",
                    help="start mlx_lm.server without OPENBLAS_THREAD_TIMEOUT (OpenBLAS's default busy-wait after "
                         "each product; sdm_mlx sets 4 when it loads OpenBLAS, see sdm_mlx/runtime/blas.py)")
    ap.add_argument("--mlx-lm-full-length", action="store_true",
                    help="let every mlx_lm answer run to --tokens instead of matching each prompt's length to our "
                         "answer's (ours stop at the closing brace)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    texts = prompts(max(int(c) for c in args.clients.split(",")) * args.requests)
    report = {"size": args.size if args.model is None else os.path.basename(os.path.normpath(args.model)),
              "tokens": args.tokens, "requests_per_client": args.requests,
              "support": args.support, "repeats": args.repeats, "blas": describe_blas(),
              "mlx_lm_lengths": "--tokens" if args.mlx_lm_full_length else "matched to ours per prompt",
              "openblas_thread_timeout": {
                  "sdm": os.environ.get("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_DEFAULT_WAIT),
                  "mlx_lm": (OPENBLAS_DEFAULT_WAIT if args.mlx_lm_openblas_default_wait else
                             os.environ.get("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_DEFAULT_WAIT))},
              "machine": platform.platform(), "cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        model_path, verifier = build(tmp, args.size, args.support, args.model)
        port = free_port()
        proc = start_mlx_lm(model_path, port, args.mlx_lm_openblas_default_wait)
        srv = bare = None
        argv = sdm_mlx("serve", "--model", model_path, "--verifier", verifier, "--port", 0, "--quiet", "--system",
                       "", "--prompt-template", "{document}", "--served-model-name", "bench", "--on-reject", "return")
        try:
            srv = ServerProcess(argv, timeout=300)
            bare = None if args.no_bare else ServerProcess(argv + ["--prompt-cache-bytes", "0"], timeout=300)
            servers = {  # name: (port, request fields, TTFT modes)
                "mlx_lm": (port, {"model": model_path}, {"mlx_lm": {}}),  # mlx_lm.server loads the named model
                "sdm": (srv.port, {}, {"sdm_return": {}, "sdm_abstain": {"sdm": {"on_reject": "abstain"}}}),
            }
            if bare is not None:
                servers["sdm_nocache"] = (bare.port, {}, {"sdm_return_no_prompt_cache": {}})
            report.update(measure(servers, texts, args))
            report["peak_rss_mb"] = {"mlx_lm": peak_rss_mb(proc.pid), "sdm": peak_rss_mb(srv.proc.pid)}
            report["load_average_after"] = os.getloadavg()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            report["sdm_exit_code"] = srv.stop() if srv is not None else None
            if bare is not None:
                bare.stop()
    print_table(report)
    if args.json:
        write_report(args.json, report)
    return 0


def print_table(r: dict) -> None:
    print(f"\nmodel: {r['size']}, {r['tokens']} max tokens, verifier support {r['support']} rows; "
          f"mlx_lm answer lengths: {r.get('mlx_lm_lengths')}; "
          f"BLAS: {r['blas']}; OPENBLAS_THREAD_TIMEOUT: {r.get('openblas_thread_timeout')}")
    print(f"{'server':<16}{'clients':>8}{'req/s':>9}{'tok/s':>9}{'mean s':>9}{'p50 s':>9}{'p95 s':>9}{'errors':>8}")
    for key, name in (("mlx_lm", "mlx_lm.server"), ("sdm", "sdm-mlx serve")):
        for row in r[key]["load"]:
            print(f"{name:<16}{row['clients']:>8}{row['requests_per_s']:>9.2f}{row['tokens_per_s']:>9.1f}"
                  f"{row['latency_mean_s']:>9.3f}{row['latency_p50_s']:>9.3f}{row['latency_p95_s']:>9.3f}"
                  f"{row['errors']:>8}")
    for a, b in zip(r["sdm"]["load"], r["mlx_lm"]["load"]):
        print(f"latency ratio sdm/mlx_lm at {a['clients']} client(s): {a['latency_mean_s'] / b['latency_mean_s']:.2f}; "
              f"throughput ratio (req/s): {a['requests_per_s'] / b['requests_per_s']:.2f}")
    for c, ratios in r.get("paired_ratios", {}).items():
        print(f"paired ratios sdm/mlx_lm at {c} client(s), median of {len(ratios['requests_per_s']['each'])} repeats: "
              + "; ".join(f"{key} {v['median']:.2f} ({', '.join(f'{x:.2f}' for x in v['each'])})"
                          for key, v in ratios.items()))
    for row in r["sdm"]["load"]:
        print(f"sdm-mlx serve, {row['clients']} client(s): per request {row['server_generation_s']:.3f} s generation "
              f"+ {row['server_verification_s']:.3f} s verification (inside the server)")
    t = r["ttft_s"]
    print(f"time to first token (median over prompts, best repeat): mlx_lm {t['mlx_lm'] * 1e3:.1f} ms; "
          f"sdm return (live) {t['sdm_return'] * 1e3:.1f} ms; without the prompt cache "
          f"{t.get('sdm_return_no_prompt_cache', float('nan')) * 1e3:.1f} ms; sdm abstain (verified before release) "
          f"{t['sdm_abstain'] * 1e3:.1f} ms")
    rss = r.get("peak_rss_mb", {})
    print(f"peak RSS: mlx_lm.server {rss.get('mlx_lm') or float('nan'):.0f} MiB, sdm-mlx serve "
          f"{rss.get('sdm') or float('nan'):.0f} MiB; load average before {r['load_average_before'][0]:.2f}, "
          f"after {r.get('load_average_after', [float('nan')])[0]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
