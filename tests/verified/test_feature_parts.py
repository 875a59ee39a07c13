"""A verification layer trained on another encoding of the states (``last``, ``max,mean,last``) verifies
generations pooled the same way: ``sdm-mlx embed --feature-parts`` records the parts in every row, ``sdm-mlx
train`` keeps them in the model (``feature_parts_``), and verified generation pools its decodings with them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from sdm_mlx.errors import InputError
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.llm import embed as E
from sdm_mlx.storage.datasets import parse_rows

pytestmark = pytest.mark.filterwarnings("ignore:the fitted model admits nothing:RuntimeWarning")


def _rows(n=40, parts=("mean", "last"), D=4, seed=0):
    rng = np.random.default_rng(seed)
    for i in range(n):
        y = i % 2
        yield i + 1, {"id": f"r{i}", "label": y, "feature_parts": list(parts),
                      "embedding": (rng.normal(size=len(parts) * D) + 2 * y).tolist()}


def test_rows_carry_their_parts_into_the_dataset_and_back():
    ds = parse_rows(_rows(parts=("last",)), "t.jsonl")
    assert ds.feature_parts == ("last",)
    assert ds.subset([0, 1]).feature_parts == ("last",)
    assert ds.to_dicts()[0]["feature_parts"] == ["last"]
    rows = list(_rows(4))
    rows[2][1]["feature_parts"] = ["max", "mean", "last"]
    with pytest.raises(InputError, match="t.jsonl:3: this row records feature_parts"):
        parse_rows(rows, "t.jsonl")
    rows = list(_rows(4))
    rows[0][1]["feature_parts"] = "mean,last"
    with pytest.raises(InputError, match="must be a list of part names"):
        parse_rows(rows, "t.jsonl")
    unrecorded = list(_rows(4))
    for _, r in unrecorded:
        del r["feature_parts"]
    assert parse_rows(unrecorded, "t.jsonl").feature_parts is None


def test_the_model_keeps_the_parts_through_save_and_load(tmp_path):
    ds = parse_rows(_rows(60, parts=("max", "last")), "t.jsonl")
    est = SDMEstimator(iterations=1, epochs=2, exemplar_dim=4, batch_size=8, rescaler_max_epochs=5, seed=0)
    with pytest.raises(InputError, match="feature parts must be distinct names"):
        est.fit(ds.X, ds.y, feature_parts=("mean", "first"))
    est.fit(ds.X, ds.y, feature_parts=ds.feature_parts)
    assert est.feature_parts_ == ("max", "last")
    est.save(tmp_path / "m")
    assert SDMEstimator.load(tmp_path / "m").feature_parts_ == ("max", "last")
    plain = SDMEstimator(iterations=1, epochs=2, exemplar_dim=4, batch_size=8, rescaler_max_epochs=5, seed=0)
    plain.fit(ds.X, ds.y)
    plain.save(tmp_path / "plain")
    assert SDMEstimator.load(tmp_path / "plain").feature_parts_ is None


def _cli(*args, cwd):
    res = subprocess.run([sys.executable, "-m", "sdm_mlx", *args], capture_output=True, text=True, cwd=cwd,
                         timeout=300)
    return res


def test_embed_train_generate_with_last_alone(setup, tmp_path):
    """The whole path through the CLI: embed --feature-parts last, train, then a VerifiedGenerator whose
    decoding-time features have the layer's width and equal its own feature pass."""
    from sdm_mlx.verified import VerifiedGenerator
    from verified_lab import SYSTEM, TEMPLATE

    model, tok = E.load_model(setup.model_path)
    rows = []
    for i, ((doc, _), out) in enumerate(zip(setup.docs, setup.outs)):
        prompt = E.chat_text(tok, doc, system=SYSTEM, prompt_template=TEMPLATE)
        rows.append({"id": f"own-{i}", "label": 1, "prompt": prompt, "completion": out.text})
        rows.append({"id": f"wrong-{i}", "label": 0, "prompt": prompt, "completion": '{"sentiment": "maybe"}'})
    inp = tmp_path / "rows.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = _cli("embed", "--model", setup.model_path, "--input", str(inp), "--output", str(tmp_path / "x.jsonl"),
               "--prompt-field", "prompt", "--completion-field", "completion", "--feature-parts", "first",
               cwd=tmp_path)
    assert bad.returncode == 2 and "--feature-parts" in bad.stderr and "Traceback" not in bad.stderr
    res = _cli("embed", "--model", setup.model_path, "--input", str(inp), "--output", str(tmp_path / "emb.jsonl"),
               "--prompt-field", "prompt", "--completion-field", "completion", "--feature-parts", "last",
               "--on-missing-delimiter", "last", "--quiet", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    first = json.loads((tmp_path / "emb.jsonl").read_text().splitlines()[0])
    hidden = E.trunk(model).norm.weight.shape[0]
    assert first["feature_parts"] == ["last"] and len(first["embedding"]) == hidden
    res = _cli("train", "--train", str(tmp_path / "emb.jsonl"), "--output", str(tmp_path / "verifier"),
               "--iterations", "1", "--epochs", "3", "--exemplar-dim", "8", "--quiet", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert SDMEstimator.load(tmp_path / "verifier").feature_parts_ == ("last",)

    gen = VerifiedGenerator(setup.model_path, str(tmp_path / "verifier"), head_path=setup.head_dir)
    assert gen.verifier.feature_parts == ("last",)
    r = gen.generate(setup.verified_doc)  # a 2 x hidden decoding feature would fail the layer's width check
    att = r.attempts[0]
    assert att.verdict.verifier["n_kept"] > 0
    # the decoding-time features the generator asks for equal the layer's own feature pass (float rounding apart)
    from sdm_mlx.decoding import DecodeRequest

    prompt_ids = E.encode(gen.tokenizer, gen.prompt_text(setup.verified_doc))
    dec = gen.engine.run([DecodeRequest(prompt_ids, 24, features=True, feature_parts=gen.verifier.feature_parts)])[0]
    X, _ = gen.verifier.features(prompt_ids, dec.token_ids)
    assert X.shape == dec.features.shape == (1, hidden)
    np.testing.assert_allclose(dec.features, X, atol=1e-5, rtol=1e-5)


def test_a_layer_without_recorded_parts_is_read_as_mean_last(setup, tmp_path):
    from sdm_mlx.verified import VerifiedGenerator

    gen = VerifiedGenerator(setup.model_path, setup.verifier_dir, head_path=setup.head_dir)
    assert gen.verifier.feature_parts == ("mean", "last")


def test_an_unrecorded_layer_reads_as_mean_last_whatever_the_default(monkeypatch):
    """A layer saved before the parts were recorded was trained on concat(mean, last): changing DESIGN #21's default
    must not change how it is read."""
    from types import SimpleNamespace

    from sdm_mlx.llm import pooling

    monkeypatch.setattr(pooling, "DEFAULT_FEATURE_PARTS", ("last",))
    assert pooling.verifier_parts(SimpleNamespace()) == ("mean", "last")
    assert pooling.verifier_parts(SimpleNamespace(feature_parts_=None)) == ("mean", "last")
    assert pooling.verifier_parts(SimpleNamespace(feature_parts_=("last",))) == ("last",)
