"""SDM network end to end on a tiny local Phi-3: Alg. 4 raises the admitted calibration count, the
selection rule holds, and the saved network reloads onto a fresh base model with identical outputs."""

import json
import os

import numpy as np
import pytest

from tiny_tool import make_tiny_model_tool  # tests/helpers/

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    return make_tiny_model_tool()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny network trained once; every calibration count of the run is recorded (:class:`_Counts`)."""
    from sdm_mlx.llm.embed import load_model
    from sdm_mlx.network import NetworkConfig, train_network

    tmp = tmp_path_factory.mktemp("network_e2e")
    built = _tool().build(str(tmp / "tiny"), rows=1000, quiet=True)
    cfg = NetworkConfig(
        model=built["model"], data=built["task"], output_dir=str(tmp / "out"), preset="sentiment", epochs=2,
        answers="preset",
        learning_rate=1e-2, batch_size=50, max_new_tokens=12, generation_batch_size=64, embed_batch_size=32,
        alpha=0.8, verifier_iterations=3, verifier_epochs=50, verifier_exemplar_dim=64,
        verifier_learning_rate=3e-3, verifier_rescaler_max_epochs=50, verbose=False,
    )
    model, tok = load_model(built["model"])
    import warnings

    counts = _Counts()
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
        warnings.simplefilter("ignore")
        mp.setattr("sdm_mlx.network.rank_work.count_verified", counts.recording)
        result = train_network(cfg, model, tok)
    result.counts = counts.calls
    return cfg, result


class _Counts:
    """Wraps the trainer's ``count_verified``: for every calibration count (the base head's, then one per epoch) the
    rows in the order they were decoded, the decoding settings, W_pos at that moment and the result."""

    def __init__(self):
        from sdm_mlx.network import rank_work

        self.real, self.calls = rank_work.count_verified, []

    def recording(self, heads, tokenizer, verifier, rows, completions, **kwargs):
        result = self.real(heads, tokenizer, verifier, rows, completions, **kwargs)
        self.calls.append({"rows": list(rows), "completions": completions, "kwargs": dict(kwargs),
                           "weight": heads.weight_numpy().copy(), "result": result})
        return result


def _decisions(counted: dict) -> dict:
    """What a calibration count decided (its parts), without its wall time, example text, or how many of its
    decodings were given or replayed rather than decoded (a reloaded network decodes them all)."""
    return {k: v for k, v in counted.items() if k not in ("seconds", "example", "given", "replayed")}


def test_training_raises_the_admitted_count_with_the_strict_selection_rule(run):
    cfg, res = run
    counts = [e["count"] for e in res.history]
    best, selected = res.initial_count, 0
    for e, c in enumerate(counts, 1):
        if c > best:
            best, selected = c, e
    assert (res.selected_epoch, res.best_count) == (selected, best)
    assert res.best_count > res.initial_count, (res.initial_count, counts)
    metrics = json.loads(open(res.metrics_path).read())
    assert metrics["selected_epoch"] == res.selected_epoch and metrics["initial"]["count"] == res.initial_count
    for e in metrics["epochs"]:
        for key in ("loss", "nll", "reg", "reg_rescaled", "beta_first", "beta_last", "count", "seconds",
                    "tokens_per_s", "epoch_seconds"):
            assert key in e and np.isfinite(e[key]), key
        assert e["beta_first"] == 0.0 and 0.09 < e["beta_last"] < 0.1
    assert metrics["epochs"][-1]["nll"] < metrics["epochs"][0]["nll"] + 1e-9 or len(metrics["epochs"]) == 1


def assert_reloads_as_saved(net, kept: dict) -> None:
    """``net`` (a reloaded network) holds the W_pos the trainer kept and, decoding the calibration rows exactly as
    the trainer did, makes the decisions the trainer counted when it kept that head.

    The recount runs in the trainer's process and thread setting, over the same rows in the same order, in batches of
    the same size, so it performs the same float operations as the trainer's count: any difference comes from the
    reload.  (A recount in another row order, e.g. the order of verification_rows.jsonl, groups other prompts into
    each decoding batch; the batched products then round differently (~1e-6 in the verifier features), which can move
    a calibration row across an admission boundary: 245 against 246 on an AVX2 CPU with 2 OpenBLAS threads.)
    """
    from sdm_mlx.network.generation import DecodeSettings
    from sdm_mlx.network.selection import count_verified

    np.testing.assert_array_equal(np.array(net.heads.pos.weight), kept["weight"])  # a stored copy: exact
    s, kw = net.settings, kept["kwargs"]["settings"]
    assert (s["max_new_tokens"], s["delimiter"], s["max_length"], s["completions"]) == \
        (kw.max_new_tokens, kw.delimiter, kw.max_length, kept["completions"])
    again = count_verified(net.heads, net.tokenizer, net.verifier, kept["rows"], s["completions"],
                           settings=DecodeSettings(max_new_tokens=s["max_new_tokens"], delimiter=s["delimiter"],
                                                   max_length=s["max_length"], batch_size=kw.batch_size))
    assert _decisions(again) == _decisions(kept["result"])


def test_saved_network_reloads_with_identical_outputs(run):
    from sdm_mlx.network import load_network

    cfg, res = run
    kept = res.counts[res.selected_epoch]  # count 0: the base head's, count e: after epoch e
    assert len(res.counts) == cfg.epochs + 1 and kept["result"]["count"] == res.best_count
    net = load_network(res.network_path)  # fresh mlx_lm.load of the stored base model + the verifier
    assert net.config["training"]["epoch"] == res.selected_epoch
    assert net.config["training"]["calibration_count"] == res.best_count
    assert_reloads_as_saved(net, kept)


def test_the_reload_check_fails_when_the_head_is_lost_or_changed(run):
    """The check above can fail: a reload that keeps the base head (the trained W_pos lost) decides other
    calibration rows, and a single changed weight is caught by the exact comparison with the kept copy."""
    import mlx.core as mx

    from sdm_mlx.network import load_network
    from sdm_mlx.network.heads import SDMHeads

    cfg, res = run
    kept = res.counts[res.selected_epoch]
    assert res.selected_epoch >= 1  # a trained head, not the base head, was kept
    net = load_network(res.network_path)
    w = np.array(net.heads.pos.weight)
    w[3, 5] += 1e-3
    net.heads.pos.weight = mx.array(w)
    with pytest.raises(AssertionError):
        assert_reloads_as_saved(net, kept)
    net.heads = SDMHeads(net.heads.model)  # W_pos = the base model's head again
    lost = dict(kept, weight=np.array(net.heads.pos.weight))  # past the weight check, to the decisions
    with pytest.raises(AssertionError):
        assert_reloads_as_saved(net, lost)


def test_finished_training_is_recorded_in_the_network(run):
    from sdm_mlx.network.artifact import read_network_config, training_status

    cfg, res = run
    t = read_network_config(res.network_path)["training"]
    assert t["finished"] is True and t["epochs_completed"] == t["epochs_planned"] == cfg.epochs
    assert t["epoch"] == res.selected_epoch and training_status({"training": t}) is None
    assert json.loads(open(res.metrics_path).read())["finished"] is True


def test_interrupted_network_train_says_it_holds_the_base_head(run, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the first epoch of a re-run: the trained head was replaced by the base head (the epoch-0
    fallback), and both the artifact and the message say so; loading it warns."""
    import dataclasses
    import shutil
    import warnings

    from sdm_mlx.llm.embed import load_model
    from sdm_mlx.network import load_network, train_network
    from sdm_mlx.network.artifact import read_network_config
    from sdm_mlx.network.trainer import SDMNetworkTrainer

    cfg, res = run
    out = tmp_path / "out"
    shutil.copytree(cfg.output_dir, out)
    cfg2 = dataclasses.replace(cfg, output_dir=str(out), verifier=res.verifier_path, epochs=3, overwrite=True)

    def interrupt(self, epoch, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(SDMNetworkTrainer, "run_epoch", interrupt)
    model, tok = load_model(cfg.model)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(KeyboardInterrupt):
            train_network(cfg2, model, tok)
    err = capsys.readouterr().err
    assert "interrupted during epoch 1/3" in err and "untrained base head" in err and "finished=false" in err
    t = read_network_config(out / "network")["training"]
    assert (t["finished"], t["epoch"], t["epochs_completed"], t["epochs_planned"]) == (False, 0, 0, 3)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["finished"] is False and metrics["interrupted_during_epoch"] == 1
    with pytest.warns(RuntimeWarning, match="did not finish .*0 of 3 epochs.*untrained base head"):
        load_network(out / "network", model, tok, load_verifier=False)


def test_reused_verifier_embeds_one_row_only(run, tmp_path, monkeypatch):
    """--verifier: the rows' features are not recomputed (one row checks the width); same split, same count."""
    import dataclasses
    import warnings

    from sdm_mlx.llm.embed import load_model
    from sdm_mlx.network import train_network
    from sdm_mlx.network.trainer import SDMNetworkTrainer

    cfg, res = run
    sizes = []
    real = SDMNetworkTrainer.features_of

    def counted(self, rows, desc, *args):
        sizes.append(len(rows))
        return real(self, rows, desc, *args)

    monkeypatch.setattr(SDMNetworkTrainer, "features_of", counted)
    cfg2 = dataclasses.replace(cfg, output_dir=str(tmp_path / "out"), verifier=res.verifier_path, epochs=0)
    model, tok = load_model(cfg.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res2 = train_network(cfg2, model, tok)
    assert sizes == [1]
    assert res2.initial_count == res.initial_count
    rows = [json.loads(x) for x in open(os.path.join(cfg2.output_dir, "verification_rows.jsonl"))]
    first = [json.loads(x) for x in open(os.path.join(cfg.output_dir, "verification_rows.jsonl"))]
    assert [r["split"] for r in rows] == [r["split"] for r in first]
