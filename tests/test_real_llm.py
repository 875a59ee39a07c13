"""The LLM path on a real instruction-tuned model: Qwen2.5-Coder-1.5B-Instruct (float32, mlx-lm).

Tier ``real_llm``, not in the default run.  Fetch the model once (~1.1 GB
download, ~7.1 GB on disk), then run the tier::

    python tools/fetch_test_llm.py            # -> ~/.cache/sdm_mlx/test_llm/qwen2.5-coder-1.5b-instruct-float32
    python -m pytest -m real_llm              # 1.5-7 min on a shared 2-core CPU, ~7.5 GB RAM per model load

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

from sdm_mlx import embed as E
from sdm_mlx.data import load_factcheck
from sdm_mlx.verification_data import PAPER_SYSTEM, PRESETS

pytestmark = pytest.mark.real_llm

ROOT = Path(__file__).resolve().parents[1]
#: Batch invariance measured on this model (float32, OpenBLAS, batch 1 vs 8, 16 factcheck rows):
#: max |Δ| 2.0e-5 with max |x| 34, i.e. 7e-7 relative, relative L2 1.0e-6.  Asserted with ~100x margin.
BATCH_RTOL = 1e-4
QWEN_VOCAB = 151936


def model_dir() -> Path:
    env = os.environ.get("SDM_MLX_TEST_LLM")
    if env:
        return Path(env).expanduser()
    sys.path.insert(0, str(ROOT / "tools"))
    from fetch_test_llm import default_cache, default_output

    return default_output(default_cache(), "float32")


@pytest.fixture(scope="module")
def model_path() -> str:
    path = model_dir()
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        pytest.skip(f"real test LLM not found at {path}: run `python tools/fetch_test_llm.py` "
                    "(or set SDM_MLX_TEST_LLM to an mlx-lm model directory)")
    return str(path)


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
