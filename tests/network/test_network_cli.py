"""``sdm-mlx network-train`` smoke test with a tiny YAML recipe."""

import json
import os

import pytest
import yaml

from sdm_mlx.cli import main


def _recipe(tmp_path, model, **extra):
    from tiny_tasks import write_synthetic_sentiment

    cfg = {
        "model": model,
        "data": write_synthetic_sentiment(tmp_path / "task.jsonl", n=60, seed=1),
        "preset": "sentiment",
        "answers": "preset",  # the tiny random model's answers are noise: the paper's encoding
        "output-dir": str(tmp_path / "out"),
        "epochs": 1,
        "learning-rate": 0.01,
        "batch-size": 16,
        "max-new-tokens": 4,
        "generation-batch-size": 16,
        "embed-batch-size": 16,
        "alpha": 0.9,
        "verifier-iterations": 1,
        "verifier-epochs": 2,
        "verifier-exemplar-dim": 8,
        "verifier-rescaler-max-epochs": 5,
        "quiet": True,
        "require-admission": False,  # this 60-row verifier admits nothing; the smoke test runs the epochs anyway
        **extra,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_network_train_cli_smoke(tiny_phi3_path, tmp_path, capsys):
    recipe = _recipe(tmp_path, tiny_phi3_path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a 60-row pool is far too small for alpha = 0.9: the estimator may warn
        rc = main(["network-train", "--config", recipe])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["selected_epoch"] in (0, 1) and len(summary["epochs"]) == 1
    out = tmp_path / "out"
    assert (out / ".sdm_mlx_run.json").is_file()  # (and the hidden lock of the replaced resume/ state)
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == [
        "base_decodings.rank0.npz", "metrics.json", "network", "resume", "token_cache", "verification_rows.jsonl", "verifier"]
    assert sorted(os.listdir(out / "network")) == ["network_config.json", "positive_head.safetensors", "verifier"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["learning_rate"] == 0.01 and metrics["epochs"][0]["tokens"] > 0

    from sdm_mlx.network import load_network

    net = load_network(out / "network")
    assert net.verifier.input_dim_ == 2 * net.heads.hidden_size
    assert net.settings["completions"] == ['{"sentiment": "negative"}', '{"sentiment": "positive"}']
    for p in (out / "network" / "network_config.json", out / "metrics.json"):
        json.loads(p.read_text(), parse_constant=lambda c: pytest.fail(f"{p} holds {c}"))

    # the same command again: the run is finished, nothing to do; another setting needs --restart (or
    # --overwrite); files of the user's in the directory are kept
    (out / "notes.txt").write_text("mine")
    assert main(["network-train", "--config", recipe]) == 0
    assert "holds a finished run (1 of 1 epochs" in capsys.readouterr().err
    assert main(["network-train", "--config", recipe, "--batch-size", "8"]) == 2
    assert "--restart" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["network-train", "--config", recipe, "--restart"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert load_network(out / "network", load_verifier=False).config["base_model"] == str(tiny_phi3_path)


def test_network_train_stops_when_the_verifier_admits_nothing(tiny_phi3_path, tmp_path, capsys):
    """A verification layer that admits no calibration row would leave Alg. 4's count at 0: network-train stops
    before the epochs (exit 2) with the estimator's diagnosis; the verifier is kept for --verifier."""
    import warnings

    recipe = _recipe(tmp_path, tiny_phi3_path, **{"require-admission": True, "alpha": 0.99, "epochs": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["network-train", "--config", recipe]) == 2
    err = capsys.readouterr().err
    assert "the verification layer admits no calibration row at alpha' = 0.99" in err
    assert "stopped before the 3 epoch(s)" in err and "[no_valid_threshold]" in err and "Next step:" in err
    assert "--no-require-admission" in err
    out = tmp_path / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["stopped"] == "verifier_admits_nothing" and metrics["epochs"] == []
    assert metrics["verifier_diagnosis"]["can_admit"] is False
    assert not (out / "network").exists()  # no head was trained or saved
    from sdm_mlx import SDMEstimator

    assert SDMEstimator.load(out / "verifier").normalize == "per-dimension"  # DESIGN #2: LLM features

    # a verifier that can admit lets the epochs run: --verifier with the kept one at a lower alpha' is not needed
    # here; --no-require-admission runs them with the same verifier
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(["network-train", "--config", recipe, "--overwrite", "--no-require-admission"])
    assert rc == 0
    assert len(json.loads((out / "metrics.json").read_text())["epochs"]) == 3


def test_answer_form_helpers():
    from sdm_mlx.network.training_data import answer_form, corrected_answer, corrected_rows, model_answer_rows

    fc = ['{"correctness": false}', '{"correctness": true}']
    fenced = '```json\n{\n  "correctness": false\n}\n```'
    assert [answer_form(t) for t in (fc[1], fenced, '{\n"correctness": true}', "I think so")] == \
        ["compact", "fenced", "other", "unparsable"]
    assert corrected_answer(fenced, fc[0], fc[1]) == '```json\n{\n  "correctness": true\n}\n```'
    assert corrected_answer('{"sentiment":"negative"}', '{"sentiment": "negative"}', '{"sentiment": "positive"}') \
        == '{"sentiment":"positive"}'
    assert corrected_answer("no json", fc[0], fc[1]) is None
    rows = [{"id": i, "prompt": "p", "task_label": t} for i, t in enumerate((1, 0, 1))]
    got = model_answer_rows(rows, [fenced, fenced, "maybe"], fc)
    assert [(r["label"], r["answer_label"], r["form"]) for r in got] == [(0, 0, "fenced"), (1, 0, "fenced"),
                                                                          (0, -1, "unparsable")]
    (fixed,) = corrected_rows(got, fc)  # the unparsable answer has nothing to correct
    assert fixed["id"] == 0 and fixed["label"] == 1 and fixed["completion"].count("true") == 1


def test_network_train_on_the_models_own_answers(tiny_phi3_path, tmp_path, capsys):
    """answers: model -- the verification rows are the model's greedy answers (completion = generated text, label =
    parsed answer right), their features those of the decoding; wrong answers corrected in the model's layout join
    the W_pos positives."""
    import warnings

    from tiny_tool import make_tiny_model_tool  # tests/helpers/

    tool = make_tiny_model_tool()
    built = tool.build(str(tmp_path / "tiny"), rows=80, quiet=True)  # answers in the task's JSON, right ~half the time
    recipe = _recipe(tmp_path, built["model"], answers="model", data=built["task"], **{"max-new-tokens": 12})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["network-train", "--config", recipe]) == 0
    out = tmp_path / "out"
    rows = [json.loads(x) for x in (out / "verification_rows.jsonl").read_text().splitlines()]
    task = {json.loads(x)["id"]: json.loads(x) for x in open(built["task"])}
    assert len(rows) == len(task) == 80
    from sdm_mlx.network.generation import parse_task_prediction

    comps = ['{"sentiment": "negative"}', '{"sentiment": "positive"}']
    for r in rows:
        assert r["answer_label"] == parse_task_prediction(r["completion"], comps)
        assert r["label"] == int(r["answer_label"] == task[r["id"]]["label"]) and r["task_label"] == task[r["id"]]["label"]
    metrics = json.loads((out / "metrics.json").read_text())
    ans = metrics["answers"]
    assert ans["mode"] == "model" and ans["rows"] == 80 and sum(ans["forms"].values()) == 80
    assert 0 < ans["correct"] < 80
    assert ans["correct"] == sum(r["label"] for r in rows)
    wrong_train = [r for r in rows if r["split"] == "train" and r["label"] == 0 and r["answer_label"] >= 0]
    assert ans["corrected_positives"] == len(wrong_train)
    assert metrics["train_positive_rows"] == sum(r["split"] == "train" and r["label"] == 1 for r in rows) + \
        len(wrong_train)


def test_network_train_cli_errors(tiny_phi3_path, tmp_path, capsys):
    assert main(["network-train", "--output-dir", str(tmp_path / "x")]) == 2
    assert "--model" in capsys.readouterr().err
    recipe = _recipe(tmp_path, tiny_phi3_path, **{"verification-data": str(tmp_path / "v.jsonl")})
    assert main(["network-train", "--config", recipe]) == 2
    assert "exactly one of --data" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nlearning_rat: 1\n")
    assert main(["network-train", "--config", str(bad)]) == 2
    assert "unknown key" in capsys.readouterr().err
    assert main(["network-train", "--config", _recipe(tmp_path, tiny_phi3_path), "--distributed-timeout", "0"]) == 2
    assert "distributed_timeout must be a number of seconds > 0, got 0" in capsys.readouterr().err
    recipe = _recipe(tmp_path, str(tmp_path / "no_such_model"))
    assert main(["network-train", "--config", recipe]) == 2
    assert "not found" in capsys.readouterr().err


def test_network_train_distributed_timeout_reaches_the_collectives(tiny_phi3_path, tmp_path, monkeypatch):
    """--distributed-timeout (YAML distributed_timeout) bounds every collective wait (docs/distributed.md)."""
    from sdm_mlx.runtime import distributed
    from sdm_mlx.network import trainer
    from sdm_mlx.network.config import NetworkConfig

    seen = {}

    def fake_train(config, dp=None):
        seen["dp"], seen["config"] = dp.timeout, config.distributed_timeout
        raise distributed.DistributedError("rank 0 of 2: all_sum failed: [ring] connection to a peer was lost")

    monkeypatch.setattr(trainer, "train_network", fake_train)
    assert main(["network-train", "--config", _recipe(tmp_path, tiny_phi3_path), "--distributed-timeout", "7.5"]) == 2
    assert seen == {"dp": 7.5, "config": 7.5}
    assert NetworkConfig().distributed_timeout == distributed.DEFAULT_TIMEOUT == 900.0


@pytest.mark.parametrize("name", ["tiny_sentiment", "phi35_sentiment", "phi35_factcheck", "phi35_universal"])
def test_recipes_have_only_known_keys(name):
    from sdm_mlx.cli import build_parser, load_yaml_config
    from sdm_mlx.commands.network_train import SETTINGS

    _, subparsers = build_parser()
    parser, _ = subparsers["network-train"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    values = load_yaml_config(os.path.join(root, "recipes", f"{name}.yaml"), parser, SETTINGS)
    assert values["model"] and values["output_dir"]
    if name == "phi35_universal":
        from sdm_mlx.network import NetworkConfig

        NetworkConfig(model="m", output_dir="o", tasks=values["tasks"]).validate()
