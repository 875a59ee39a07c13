"""The LLM path on a real instruction-tuned model: Qwen2.5-Coder-1.5B-Instruct (float32, mlx-lm).

Tier ``real_llm``, not in the default run.  Fetch the model once (~1.1 GB
download, ~7.1 GB on disk), then run the tier::

    python tools/fetch_test_llm.py            # -> ~/.cache/sdm_mlx/test_llm/qwen2.5-coder-1.5b-instruct-float32
    python -m pytest -m real_llm -n 0         # ~10-20 min on a shared 2-core CPU, ~7.5-13 GB RAM per model load

``SDM_MLX_TEST_LLM`` points to another model directory (default: the fetch
tool's output directory, under ``$SDM_MLX_TEST_LLM_CACHE`` if set).  Every test
is skipped, with the fetch command as the reason, when the directory is absent.
Only the tokenizer is loaded in this process; the model itself is loaded by the
CLI subprocesses, one at a time, so peak memory stays at one model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from real_llm_lab import BATCH_RTOL, model_dir  # noqa: F401  (tests/helpers/; the model_path fixture: conftest.py)

from sdm_mlx.llm import embed as E
from sdm_mlx.storage.datasets import load_factcheck
from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS

pytestmark = pytest.mark.real_llm

ROOT = Path(__file__).resolve().parents[1]
#: Batch invariance measured on this model (float32, OpenBLAS, batch 1 vs 8, 16 factcheck rows):
#: max |Δ| 2.0e-5 with max |x| 34, i.e. 7e-7 relative, relative L2 1.0e-6.  Asserted with ~100x margin.
QWEN_VOCAB = 151936


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return E.load_tokenizer(model_path)


def cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "sdm_mlx", *map(str, args)], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"sdm-mlx {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def factcheck_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` topic statements, half true and half false (seeded)."""
    ds = load_factcheck()
    rng = np.random.default_rng(seed)
    idx = np.concatenate([rng.choice(np.flatnonzero(ds.y == c), n // 2, replace=False) for c in (0, 1)])
    return [{"id": ds.ids[i], "label": int(ds.y[i]), "document": ds.documents[i]} for i in idx]


@pytest.fixture(scope="module")
def verification(model_path, tmp_path_factory):
    """``make-verification-data --model`` on 6 factcheck statements: (task rows, verification rows, output path)."""
    tmp = tmp_path_factory.mktemp("real_llm")
    rows = factcheck_rows(6)
    task = tmp / "task.jsonl"
    task.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp / "ver.jsonl"
    proc = cli("make-verification-data", "--input", task, "--output", out, "--preset", "factcheck",
               "--model", model_path)
    assert "wrote 6 rows (3 label 1, 3 constructed negatives" in proc.stderr
    return rows, read_jsonl(out), out


# ----------------------------------------------------------------------------- the converted model


def test_tokenizer_and_head_match_qwen(model_path, tokenizer):
    """Ids come from the tokenizer: Qwen2's BPE, ChatML specials, no BOS; untied head of 151,936 rows."""
    assert E.encode(tokenizer, "Hello world") == [9707, 1879]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.bos_token is None
    config = json.loads((Path(model_path) / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["vocab_size"] == QWEN_VOCAB
    assert config["tie_word_embeddings"] is False
    # the tokenizer's vocabulary is smaller than the head: rows past it are padding the model never emits
    assert len(tokenizer.get_vocab()) < QWEN_VOCAB


# ----------------------------------------------------------------------------- make-verification-data


def test_make_verification_data_uses_the_real_chat_template(verification, tokenizer):
    rows, ver, _ = verification
    preset = PRESETS["factcheck"]
    assert [r["id"] for r in ver] == [r["id"] for r in rows]  # every statement exactly once, in order
    assert sorted(r["label"] for r in ver) == [0, 0, 0, 1, 1, 1]
    for src, r in zip(rows, ver):
        user = preset["prompt_template"].replace("{document}", src["document"])
        expected = tokenizer.apply_chat_template(
            [{"role": "system", "content": PAPER_SYSTEM}, {"role": "user", "content": user}],
            tokenize=False, add_generation_prompt=True)
        assert r["prompt"] == expected
        assert r["prompt"].startswith(f"<|im_start|>system\n{PAPER_SYSTEM}<|im_end|>\n<|im_start|>user\n")
        assert r["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
        shown = preset["completions"].index(r["completion"])
        assert r["task_label"] == src["label"] and (shown == src["label"]) == (r["label"] == 1)


# ----------------------------------------------------------------------------- the delimiter position


def test_delimiter_token_through_the_real_chat_template(verification, tokenizer):
    """The last "}" of the completion, not the braces of the instruction's JSON schema nor the template's tail."""
    _, ver, _ = verification
    brace = tokenizer.convert_tokens_to_ids("}")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r in ver:
        full = E.chat_text(tokenizer, r["document"], system=PAPER_SYSTEM,
                           prompt_template=PRESETS["factcheck"]["prompt_template"], completion=r["completion"])
        assert full.startswith(r["prompt"] + r["completion"])
        ids = E.encode(tokenizer, full)
        j = E.delimiter_token_index_in_text(tokenizer, full, ids, (len(r["prompt"]), len(r["prompt"]) + len(r["completion"])))
        # Qwen: ... '{"' 'correct' 'ness' '":' ' true' '}' '<|im_end|>' '\n'
        assert j == len(ids) - 3 and ids[j] == brace and ids[j + 1] == im_end
        assert tokenizer.decode(ids[j - 5 : j]) == r["completion"][:-1]
        # the instruction's '{"correctness": bool}' also closes a brace, inside the prompt: not the one chosen
        assert r["prompt"].count("}") == 1 and j >= len(E.encode(tokenizer, r["prompt"]))
        # the delimiter is the same token when the completion is force-decoded without the template's tail
        pc = r["prompt"] + r["completion"]
        ids_pc = E.encode(tokenizer, pc)
        assert ids_pc == ids[: j + 1]
        assert E.delimiter_token_index_in_text(tokenizer, pc, ids_pc, (len(r["prompt"]), None)) == j


# ----------------------------------------------------------------------------- sdm-mlx embed


@pytest.fixture(scope="module")
def embedded(verification, tmp_path_factory):
    """``sdm-mlx embed`` of the verification rows plus, per row, a copy whose completion stops before "}".

    Run twice through the CLI (batch 1 and batch 12, one model load each) with
    ``--on-missing-delimiter last``: a cut row's feature is the state at its last
    token, which must be the delimiter row's state predicting "}".
    """
    _, ver, _ = verification
    tmp = tmp_path_factory.mktemp("real_llm_embed")
    rows = ver + [dict(r, id=f"{r['id']}/cut", completion=r["completion"][:-1]) for r in ver]
    inp = tmp / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    outs = {}
    for bs in (1, 12):
        out = tmp / f"feats_b{bs}.jsonl"
        proc = cli("embed", "--model", model_dir(), "--input", inp, "--output", out, "--prompt-field", "prompt",
                   "--completion-field", "completion", "--on-missing-delimiter", "last", "--batch-size", bs)
        assert f"wrote {len(rows)} rows with 3072-dim embeddings" in proc.stderr
        assert f"{len(ver)} completion(s) without the delimiter '}}' (handled with --on-missing-delimiter last)" in proc.stderr
        assert "warning" not in proc.stderr  # the prompts match Qwen's chat template (no foreign-template warning)
        got = {r["id"]: np.asarray(r["embedding"], dtype=np.float64) for r in read_jsonl(out)}
        outs[bs] = np.stack([got[r["id"]] for r in rows])
    return ver, outs


def _rel(a, b):
    return np.abs(a - b).max(axis=1) / np.abs(a).max(axis=1)


def test_embed_batch_invariance_on_real_text(embedded):
    ver, outs = embedded
    a, b = outs[1], outs[12]
    assert a.shape == (2 * len(ver), 2 * 1536) and np.isfinite(a).all()
    rel = _rel(a, b)
    assert rel.max() < BATCH_RTOL, f"batch 1 vs 12: max relative difference {rel.max():.2e}"
    # and the features are not trivially equal across documents
    assert np.abs(a[0] - a[1]).max() > 100 * np.abs(a - b).max()


def test_embed_uses_the_state_predicting_the_delimiter(embedded):
    """Second half = h_{j-1} (the ' true'/' false' state), mean over h_0..h_{j-1}: equal to the cut rows' last-token features."""
    ver, outs = embedded
    n = len(ver)
    for feats in outs.values():
        rel = _rel(feats[:n], feats[n:])
        assert rel.max() < BATCH_RTOL, f"delimiter features vs last-token features of the cut text: {rel.max():.2e}"


# ----------------------------------------------------------------------------- network-train, generate, chat, serve
#
# One tiny SDM network is trained on the real model (24 statements, 1 epoch, 24 new tokens; ~10 min for these five
# tests on the shared 2-core CPU), then every verified-generation path runs against it through the CLI.  These tests check the paths,
# not the verifier's quality: on 24 rows a verifier of factual correctness learns nothing (docs/performance.md), so
# its rows are built to be separable.  Label 1: the statement's correct answer in both forms this model writes on
# its own (a fenced, pretty-printed JSON block, or the preset's compact JSON; which one depends on the statement);
# label 0: an answer in another format.  The model's own answers then lie next to label-1 rows.  Two copies force the outcomes: the run's verifier (alpha' = 0.51) admits them, and a
# `recalibrate --alpha 0.99` copy (which would need >= 100 calibration rows per class) rejects everything.

QWEN_COMPLETIONS = ['```json\n{\n  "correctness": false\n}\n```', '```json\n{\n  "correctness": true\n}\n```']
OTHER_FORMAT = '{"answer": "I cannot check this document"}'
OOD_PROMPT = "Write a haiku about the sea."


@pytest.fixture(scope="module")
def network(model_path, tokenizer, tmp_path_factory):
    """``sdm-mlx network-train --verification-data`` on 24 statements; a namespace of paths and the rows."""
    import types

    tmp = tmp_path_factory.mktemp("real_llm_network")
    template = PRESETS["factcheck"]["prompt_template"]
    rows = []
    for k, r in enumerate(factcheck_rows(24, seed=3)):
        prompt = E.chat_text(tokenizer, r["document"], system=PAPER_SYSTEM, prompt_template=template)
        row = {"document": r["document"], "prompt": prompt, "task_label": r["label"]}
        if k % 2:  # half of each task label (factcheck_rows lists the false ones first)
            rows.append({**row, "id": r["id"], "completion": OTHER_FORMAT, "label": 0})
            continue
        for form, answers in (("fenced", QWEN_COMPLETIONS), ("compact", PRESETS["factcheck"]["completions"])):
            rows.append({**row, "id": f"{r['id']}/{form}", "completion": answers[r["label"]], "label": 1})
    data = tmp / "verification.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp / "net"
    cli("network-train", "--model", model_path, "--verification-data", data, "--output", out,
        "--preset", "factcheck", "--completions", *QWEN_COMPLETIONS, "--epochs", 1, "--max-new-tokens", 24,
        "--generation-batch-size", 12, "--embed-batch-size", 8, "--batch-size", 50, "--learning-rate", 1e-5,
        "--no-compile", "--alpha", 0.51, "--verifier-iterations", 1, "--verifier-epochs", 30,
        "--verifier-exemplar-dim", 16, "--verifier-learning-rate", 3e-3, "--verifier-batch-size", 8,
        "--no-require-admission", "--quiet")  # 36 rows: the paths below are exercised even if nothing is admitted
    rows = read_jsonl(out / "verification_rows.jsonl")
    strict = tmp / "verifier_strict"
    cli("recalibrate", "--model", out / "verifier", "--alpha", 0.99, "--output", strict)
    return types.SimpleNamespace(dir=out, head=out / "network", lenient=out / "verifier", strict=strict, rows=rows,
                                 metrics=json.loads((out / "metrics.json").read_text()), tmp=tmp)


def test_network_train_runs_and_records_alg4(network):
    m = network.metrics
    assert m["finished"] is True and m["vocab_size"] == QWEN_VOCAB and m["hidden_size"] == 1536
    assert m["train_rows"] + m["calibration_rows"] == 36 and m["tokens"] > 0
    (e,) = m["epochs"]
    assert np.isfinite(e["loss"]) and e["beta_first"] == 0.0 and e["count"] >= 0
    cal = m["initial"]
    assert cal["documents"] == m["calibration_rows"] and 0 <= cal["count"] <= cal["task_correct"] <= cal["documents"]
    assert {r["split"] for r in network.rows} == {"train", "calibration"}
    assert {r["completion"] for r in network.rows if r["label"] == 1} <= {*QWEN_COMPLETIONS,
                                                                          *PRESETS["factcheck"]["completions"]}


@pytest.fixture(scope="module")
def lenient_results(network):
    """``generate --input`` over the support prompts with the lenient verifier, answers returned either way."""
    support = list({r["document"]: r for r in network.rows if r["split"] == "train" and r["label"] == 1}.values())
    inp, out = network.tmp / "support_prompts.jsonl", network.tmp / "lenient.jsonl"
    inp.write_text("".join(json.dumps({"id": r["id"], "document": r["document"]}) + "\n" for r in support))
    cli("generate", "--head", network.head, "--verifier", network.lenient, "--input", inp, "--output", out,
        "--on-reject", "return", "--quiet")
    return support, read_jsonl(out)


def _lands_on_support(r) -> bool:
    """The answer's features are a support row's (squared distance ~0 in exemplar space, as force-decoded)."""
    return r["attempts"][0]["verifier"]["d0"] < 1e-4


def test_generate_answer_lands_on_its_support_row(lenient_results):
    """The model's own answer to a support prompt has the features of that support row (decode-time features =
    force-decoded ones): q >= 1, d0 ~ 0, prediction 1, nearest exemplar label 1.  It is returned either way.

    Admission itself ("continue") cannot be forced at this size: with 18 calibration rows the lower bound
    rejects even an exact support match (measured: p_lower 0.76, q 12, d0 3e-12, below_threshold_psi)."""
    support, results = lenient_results
    assert [r["id"] for r in results] == [r["id"] for r in support]
    for r in results:
        assert r["decoding"] == "joint" and r["n_attempts"] == 1 and r["text"] == r["answer"]
        assert r["parsed"] is not None and set(r["parsed"]) == {"correctness"}
        if r["status"] == "verified":
            assert r["stopped"] == "verified" and r["attempts"][0]["verifier"]["admitted"] and 0 < r["p_lower"] <= 1
        else:
            assert r["status"] == "unverified" and r["reason"] and not r["verified"]
    hits = [r for r in results if _lands_on_support(r)]
    assert hits, [(r["answer"], r["attempts"][0]["verifier"]["d0"]) for r in results]
    for r in hits:
        v = r["attempts"][0]["verifier"]
        assert v["q"] >= 1 and v["prediction"] == 1 and v["n_kept"] == v["delimiter_index"] and not v["missing_delimiter"]
        assert r["exemplars"][0]["label"] == 1 and r["exemplars"][0]["squared_distance"] < 1e-4


def test_generate_reask_then_abstain(network, lenient_results):
    """Re-ask: every attempt is rejected by the strict verifier; two attempts, then the abstain fallback."""
    _, results = lenient_results
    doc = next(r for r in network.rows if r["id"] == results[0]["id"])["document"]
    proc = cli("generate", "--head", network.head, "--verifier", network.strict, "--prompt", doc,
               "--on-reject", "reask", "--max-attempts", 2, "--no-stream", "--quiet")
    r = json.loads(proc.stdout)
    assert r["on_reject"] == "reask" and r["n_attempts"] == 2 and r["stopped"] in ("max_attempts", "repeated_prompt")
    assert r["status"] == "abstained" and not r["verified"] and r["text"].startswith("NOT VERIFIED")
    a1, a2 = r["attempts"]
    assert a1["reask_message"] is None and a2["reask_message"] and a2["prompt_tokens"] > a1["prompt_tokens"]
    assert not a1["verified"] and not a2["verified"] and a1["reason"] and a2["reason"]


def test_chat_abstains_on_an_out_of_distribution_prompt(network, lenient_results):
    """Abstain (chat, the default policy): a haiku request is no factcheck answer; the log keeps the evidence."""
    _, results = lenient_results
    log = network.tmp / "chat.jsonl"
    argv = ["chat", "--head", network.head, "--verifier", network.strict, "--prompt-template", "{document}",
            "--max-tokens", 24, "--output", log, "--quiet"]
    proc = subprocess.run([sys.executable, "-m", "sdm_mlx", *map(str, argv)],
                          input=f"{OOD_PROMPT}\n", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NOT VERIFIED" in proc.stdout and "[rejected:" in proc.stdout
    (row,) = read_jsonl(log)
    assert row["status"] == "abstained" and row["on_reject"] == "abstain" and row["n_attempts"] == 1
    assert row["reason"] and not row["attempts"][0]["verified"] and row["answer"]


def test_serve_chat_completion_carries_the_verdict(network, lenient_results):
    """``sdm-mlx serve``: one /v1/chat/completions request (policy return): the same answer and verdict as generate."""
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    import http.client

    from server_process import ServerProcess

    _, results = lenient_results
    g = next(r for r in results if _lands_on_support(r))
    doc = next(r for r in network.rows if r["id"] == g["id"])["document"]
    srv = ServerProcess([sys.executable, "-m", "sdm_mlx", "serve", "--head", str(network.head), "--verifier",
                         str(network.lenient), "--port", "0", "--quiet", "--served-model-name", "qwen"], timeout=600)

    def request(method, path, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=600)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp, json.loads(resp.read())
        finally:
            conn.close()

    try:
        resp, data = request("POST", "/v1/chat/completions", {"model": "qwen", "sdm": {"on_reject": "return"},
                                                              "messages": [{"role": "user", "content": doc}]})
        assert resp.status == 200, data
        choice = data["choices"][0]
        ver = choice["verification"]
        assert choice["message"]["content"] == g["answer"] and choice["finish_reason"] == "stop"
        assert ver["status"] == g["status"] and ver["verified"] == g["verified"] and ver["n_attempts"] == 1
        assert resp.getheader("X-SDM-Verified") == ("true" if g["verified"] else "false")
        assert ver["prediction"] == 1 and ver["p_lower"] == pytest.approx(g["p_lower"], rel=1e-4, abs=1e-6)
        assert data["usage"]["completion_tokens"] == g["attempts"][0]["tokens"] > 0
        _, ex = request("GET", f"/v1/verdicts/{ver['verdict_id']}")
        assert ex["verifier"]["q"] == g["attempts"][0]["verifier"]["q"] and ex["verifier"]["d0"] < 1e-4
    finally:
        assert srv.stop() == 0, "".join(srv.lines)


def test_shared_prefix_features_equal_a_full_forward_of_each_row(verification, model_path):
    """The chat template, system message and instruction (~42 tokens) every factcheck verification prompt shares run
    once; the features equal each row's own full forward pass within 1e-4 relative (mean and state halves)."""
    _, ver, _ = verification
    model, tok = E.load_model(model_path)
    prompts, completions = [r["prompt"] for r in ver], [r["completion"] for r in ver]
    feats = E.prompt_completion_features(model, tok, prompts, completions, batch_size=4)
    seqs = [E.encode(tok, p + c)[: int(n)] for p, c, n in zip(prompts, completions, feats.n_kept)]
    shared = E.common_prefix_length(seqs)
    assert shared >= 30 and shared < int(feats.n_kept.min())
    ref = np.stack([np.array(E.pool_states(E.hidden_states(model, [s]), [len(s)]))[0] for s in seqs])
    rel = _rel(ref, feats.embeddings)
    assert rel.max() < BATCH_RTOL, f"shared-prefix vs full forward: max relative difference {rel.max():.2e}"
    ns = E.prompt_completion_features(model, tok, prompts, completions, pooling="non-shared", batch_size=4)
    assert (ns.pooled_from == shared).all()
    D = ref.shape[1] // 2
    ref_ns = np.stack([np.concatenate([np.array(E.hidden_states(model, [s]))[0][shared:].mean(0), r[D:]])
                       for s, r in zip(seqs, ref)])
    assert _rel(ref_ns, ns.embeddings).max() < BATCH_RTOL


# ------------------------------------------------------------------ verified generation that verifies ("continue")
#: A verified-generation run directory of ``sdm-mlx pipeline`` (its primary verifier in ``verifiers/``, trained on
#: the model's own answers to pooled statements; ``verdicts.jsonl``'s stage ``base``: that verifier's verdicts on the
#: held-out answers, the ones ``sdm-mlx generate`` gives).  Default: the arithmetic recipe's output
#: (``recipes/qwen15_arithmetic_verified_cpu.yaml``, the task whose verifier admits on this model; the factcheck
#: recipe's verifier admits nothing, docs/verified-generation-real.md).
VERIFIED_RUN_ENV = "SDM_MLX_TEST_VERIFIED_RUN"
VERIFIED_RUN_DEFAULT = "runs/qwen15_arithmetic_verified"


@pytest.fixture(scope="module")
def verified_run(model_path):
    """The pipeline's run directory (its factcheck-prompt tasks: factcheck, arithmetic), or a skip naming the command
    that makes it."""
    import types

    path = Path(os.environ.get(VERIFIED_RUN_ENV, ROOT / VERIFIED_RUN_DEFAULT)).expanduser()
    if not (path / "table.json").is_file() or not (path / "verdicts.jsonl").is_file():
        pytest.skip(f"no verified-generation run at {path}: run `sdm-mlx pipeline -c "
                    f"recipes/qwen15_arithmetic_verified_cpu.yaml` (or set {VERIFIED_RUN_ENV} to its output directory)")
    table = json.loads((path / "table.json").read_text(encoding="utf-8"))
    names = [t for t, spec in table["tasks"].items() if spec["preset"] in ("factcheck", "arithmetic")]
    tasks = {r["id"]: r for t in names for r in read_jsonl(path / "data" / f"{t}_heldout.jsonl")}
    checked = [r for r in read_jsonl(path / "verdicts.jsonl")
               if r["stage"] == "base" and r["task"] in names and r["split"] == "heldout"]
    return types.SimpleNamespace(dir=path, verifier=path / "verifiers" / table["primary"], checked=checked,
                                 tasks=tasks, admitted=[r for r in checked if r["verified"]],
                                 heldout=list(tasks.values()))


def _generate(model_path, run, rows, tmp):
    """``sdm-mlx generate --input`` (default policy: abstain) with the run's verifier and templating."""
    inp, out = tmp / "prompts.jsonl", tmp / "results.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cli("generate", "--model", model_path, "--verifier", run.verifier, "--system", PAPER_SYSTEM,
        "--prompt-template", PRESETS["factcheck"]["prompt_template"], "--max-tokens", 32, "--input", inp,
        "--output", out, "--quiet")
    return {r["id"]: r for r in read_jsonl(out)}


def test_generate_admits_a_verified_answer_and_abstains_out_of_distribution(model_path, verified_run,
                                                                           tmp_path_factory):
    """Continue on the real model: a held-out factcheck answer is ADMITTED by p-hat_lower at the trained alpha'
    (0.95, never recalibrated down) from the verifier's own statistics, and its text is served; a haiku request
    is abstained on.  The statements are held-out ones the pipeline's verdicts admitted."""
    from sdm_mlx import SDMEstimator

    est = SDMEstimator.load(verified_run.verifier)
    assert est.alpha >= 0.95 and est.normalize == "per-dimension"
    assert verified_run.admitted, (
        f"the pipeline's verifier admitted none of the {len(verified_run.checked)} held-out answers of its "
        f"verdicts (admission diagnosis: {est.admission_.get('next_step') if est.admission_ else None}); "
        "docs/verified-generation-real.md says why")
    rows = [{"id": r["id"], "document": verified_run.tasks[r["id"]]["document"]} for r in verified_run.admitted[:2]]
    by_id = _generate(model_path, verified_run, rows + [{"id": "ood", "document": OOD_PROMPT}],
                      tmp_path_factory.mktemp("real_llm_admit"))
    continued = [by_id[r["id"]] for r in rows if by_id[r["id"]]["status"] == "verified"]
    assert continued, [(by_id[r["id"]]["status"], by_id[r["id"]].get("reason")) for r in rows]
    for r in continued:
        v = r["attempts"][0]["verifier"]
        assert r["verified"] and r["stopped"] == "verified" and r["text"] == r["answer"] and r["n_attempts"] == 1
        assert v["admitted"] and v["prediction"] == 1 and r["p_lower"] >= est.alpha - 1e-9
        assert r["parsed"] is not None and set(r["parsed"]) == {"correctness"}
        assert verified_run.tasks[r["id"]]["split"] == "heldout"  # a held-out statement
    ood = by_id["ood"]
    assert ood["status"] == "abstained" and not ood["verified"] and ood["text"].startswith("NOT VERIFIED")
    assert ood["reason"]


def test_served_verdict_equals_generate_on_a_heldout_statement(model_path, verified_run, tmp_path_factory):
    """``sdm-mlx serve`` with the pipeline's verifier and templating: a held-out statement's chat completion
    carries the same answer, status, p-hat_lower and X-SDM-Verified as ``generate``'s verdict on it."""
    sys.path.insert(0, str(ROOT / "tests"))
    import http.client

    from server_process import ServerProcess

    first = (verified_run.admitted or verified_run.heldout)[0]
    doc = verified_run.tasks[first["id"]]["document"]
    g = _generate(model_path, verified_run, [{"id": first["id"], "document": doc}],
                  tmp_path_factory.mktemp("real_llm_serve"))[first["id"]]
    srv = ServerProcess([sys.executable, "-m", "sdm_mlx", "serve", "--model", model_path, "--verifier",
                         str(verified_run.verifier), "--system", PAPER_SYSTEM, "--prompt-template",
                         PRESETS["factcheck"]["prompt_template"], "--max-tokens", "32", "--port", "0", "--quiet",
                         "--served-model-name", "qwen"], timeout=900)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=900)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"model": "qwen", "messages": [{"role": "user", "content": doc}], "sdm": {"on_reject": "return"}}),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        conn.close()
        assert resp.status == 200, data
        choice = data["choices"][0]
        ver = choice["verification"]
        assert choice["message"]["content"] == g["answer"]
        assert ver["verified"] == g["verified"] and ver["prediction"] == g["attempts"][0]["verifier"]["prediction"]
        assert ver["status"] == ("verified" if g["verified"] else "unverified")  # served with on_reject=return
        assert resp.getheader("X-SDM-Verified") == ("true" if g["verified"] else "false")
        assert ver["p_lower"] == pytest.approx(g["p_lower"], rel=1e-4, abs=1e-6)
    finally:
        assert srv.stop() == 0, "".join(srv.lines)


#: Texts of other sources than the committed verifier's rows: reviews of a book and a restaurant, two film
#: reviews, and the first film review with its words scrambled (docs/verified-generation-real.md, "New texts").
NEW_TEXTS = [
    {"id": "book-1", "document": "The novel drags through its middle third, and the ending feels unearned."},
    {"id": "food-1", "document": "Best ramen I have had in years: rich broth, perfect noodles, friendly staff."},
    {"id": "film-1", "document": "A tender, beautifully acted film that stays with you long after the credits."},
    {"id": "film-2", "document": "Dull, lifeless and far too long."},
    {"id": "scr-1", "document": "credits after the long beautifully film with tender a stays you acted that"},
]
NEW_TEXT_LABELS = {"book-1": "negative", "food-1": "positive", "film-1": "positive", "film-2": "negative",
                   "scr-1": "positive"}


def test_the_committed_universal_verifier_judges_new_texts_through_generate(model_path, tmp_path):
    """``sdm-mlx generate --verifier docs/results/universal_qwen15_cpu/verifier`` with the Sentiment task's prompt:
    the committed verifier of the headline run pools the `last` state it records and judges the model's answers to
    texts it has never seen.  Measured 2026-11-29: the book, restaurant and short film reviews verified (p̂_lower
    0.976–0.992), the long film review below the robust min q~, the scrambled one below the model's min q~ (p̂_lower
    0.77): the assertions keep that margin, not the exact verdicts."""
    src = tmp_path / "new.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in NEW_TEXTS))
    out = tmp_path / "out.jsonl"
    cli("generate", "--model", model_path, "--verifier", ROOT / "docs/results/universal_qwen15_cpu/verifier",
        "--system", PAPER_SYSTEM, "--prompt-template", PRESETS["sentiment"]["prompt_template"], "--max-tokens", 32,
        "--input", src, "--output", out, "--on-reject", "return", "--quiet")
    rows = {r["id"]: r for r in read_jsonl(out)}
    assert sorted(rows) == sorted(NEW_TEXT_LABELS)
    for i, r in rows.items():
        assert isinstance(r["verified"], bool) and (r["reason"] is None) == r["verified"], r
        if r["verified"]:
            assert r["parsed"] == {"sentiment": NEW_TEXT_LABELS[i]} and r["p_lower"] >= 0.95, r
    assert sum(rows[i]["verified"] for i in ("book-1", "food-1", "film-1", "film-2")) >= 2
    assert not rows["scr-1"]["verified"]
