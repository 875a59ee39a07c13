"""Each estimator default lives in exactly one place (EstimatorConfig): the Python API, the `train`
parser, a YAML config and the dataclass agree; `-c/--config` YAML is type-checked per key."""

import dataclasses
import subprocess
import sys

import pytest

from sdm_mlx.cli import build_parser, load_yaml_config
from sdm_mlx.commands.train import SETTINGS, estimator_config, paper_base
from sdm_mlx.defaults import ESTIMATOR_DEFAULTS, EstimatorConfig
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.settings import resolve

FIELDS = [f.name for f in dataclasses.fields(EstimatorConfig)]


def _train_parser():
    parser, subparsers = build_parser()
    return parser, subparsers["train"][0]


def test_api_cli_yaml_and_dataclass_defaults_agree(tmp_path):
    api = SDMEstimator().get_params()
    parser, train_parser = _train_parser()
    from_cli = estimator_config(parser.parse_args(["train", "--train", "x", "--output", "y"]))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    from_yaml = resolve(EstimatorConfig, {}, load_yaml_config(str(empty), train_parser, SETTINGS))
    for name in FIELDS:
        default = dataclasses.fields(EstimatorConfig)[FIELDS.index(name)].default
        assert api[name] == getattr(from_cli, name) == getattr(from_yaml, name) == ESTIMATOR_DEFAULTS[name] \
            == default, name
    assert set(FIELDS) <= set(api)  # every setting is an estimator parameter


def test_cli_and_yaml_reach_the_estimator_and_cli_wins(tmp_path):
    parser, train_parser = _train_parser()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("epochs: 7\nexemplar-dim: 32\nindex-backend: hnsw\nnormalize: false\nclass-names: [a, b]\n")
    values = load_yaml_config(str(cfg), train_parser, SETTINGS)
    assert values["class_names"] == ["a", "b"]
    train_parser.set_defaults(**values)
    args = parser.parse_args(["train", "--train", "x", "--output", "y", "--epochs", "3", "--unstratified",
                              "--index", "exact", "--patience", "0"])
    got = estimator_config(args, paper_base(args))
    assert (got.epochs, got.exemplar_dim, got.index_backend, got.normalize, got.stratified, got.patience) == \
        (3, 32, "exact", False, False, None)


def _cli(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "sdm_mlx", *argv], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("text, needle", [
    ("class-names: a b c\n", "key 'class-names': expected a list"),
    ("epochs: 1.5\n", "key 'epochs': expected an integer"),
    ("learning-rate: fast\n", "key 'learning-rate': expected a number"),
    ("index-backend: faiss\n", "'faiss' is not one of exact, hnsw"),
    ("paper: 1\n", "key 'paper': expected true or false"),
    ("epochz: 3\n", "unknown key(s)"),
])
def test_cli_yaml_type_errors_name_file_and_key(tmp_path, text, needle):
    (tmp_path / "bad.yaml").write_text(text)
    res = _cli("train", "-c", "bad.yaml", "--train", "x.jsonl", "--output", "m", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "bad.yaml" in res.stderr and needle in res.stderr


def test_help_shows_real_defaults_and_required():
    res = subprocess.run([sys.executable, "-m", "sdm_mlx", "train", "--help"], capture_output=True, text=True)
    flat = " ".join(res.stdout.split())
    assert res.returncode == 0 and "-c CONFIG, --config CONFIG" in flat
    assert "(default: None)" not in flat and "(default: False)" not in flat
    assert "(default: largest class count)" in flat and "(required)" in flat
    assert "--index-backend {exact,hnsw}, --index {exact,hnsw}" in flat and "--no-normalize" in flat


def test_network_train_options_come_from_network_config(tmp_path):
    from sdm_mlx.commands.network_train import network_config
    from sdm_mlx.network_config import NetworkConfig

    parser, subparsers = build_parser()
    common = ["network-train", "-m", "base", "--data", "d.jsonl", "--preset", "sentiment"]
    got = network_config(parser.parse_args(common + ["--output", "out", "--quiet"]))
    want = NetworkConfig(model="base", output_dir="out", data="d.jsonl", preset="sentiment")
    assert got == want  # every other field: the dataclass default
    old = network_config(parser.parse_args(common + ["--output-dir", "out", "--no-chat-template", "--no-compile",
                                                     "--system-prompt", ""]))
    assert (old.output_dir, old.use_chat_template, old.compile_step, old.system, old.verbose) == \
        ("out", False, False, None, True)
    cfg = tmp_path / "r.yaml"
    cfg.write_text("model: base\noutput: out\ntasks: [{name: s, data: d.jsonl, preset: sentiment}]\n"
                   "completions: yes-no\n")
    res = subprocess.run([sys.executable, "-m", "sdm_mlx", "network-train", "-c", str(cfg)], capture_output=True,
                         text=True)
    assert res.returncode == 2 and "key 'completions': expected a list" in res.stderr


@pytest.mark.parametrize("verb, flags", [
    ("generate", ["-m", "-p", "--max-tokens", "--system-prompt", "--ignore-chat-template", "--adapter-path",
                  "--system", "--no-chat-template", "--head"]),
    ("chat", ["-m", "--system-prompt", "--ignore-chat-template", "--adapter-path"]),
    ("serve", ["-m", "--max-tokens", "--system-prompt", "--ignore-chat-template", "--adapter-path"]),
    ("embed", ["-m", "--system-prompt", "--ignore-chat-template"]),
    ("make-verification-data", ["-m", "--system-prompt"]),
])
def test_mlx_lm_names_and_old_spellings_share_one_destination(verb, flags):
    parser, subparsers = build_parser()
    sub = subparsers[verb][0]
    dests = {s: a.dest for a in sub._actions for s in a.option_strings}
    assert all(f in dests for f in flags), [f for f in flags if f not in dests]
    pairs = [("--system-prompt", "--system"), ("--ignore-chat-template", "--no-chat-template"),
             ("--adapter-path", "--head"), ("-m", "--model"), ("-p", "--prompt")]
    for new, old in pairs:
        if new in flags:
            assert dests[new] == dests[old]
    text = " ".join(sub.format_help().split())
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("verb, flags", [("predict", ["--model", "--input"]), ("recalibrate", ["--model", "--alpha"]),
                                         ("train", ["--train", "--output"])])
def test_required_options_say_so_and_are_checked_from_one_declaration(verb, flags, tmp_path):
    text = subprocess.run([sys.executable, "-m", "sdm_mlx", verb, "--help"], capture_output=True, text=True).stdout
    assert text.count("(required)") == len(flags)
    helps = {s: a.help for a in build_parser()[1][verb][0]._actions for s in a.option_strings}
    assert all(helps[flag].endswith("(required)") for flag in flags)
    res = _cli(verb, cwd=tmp_path)
    assert res.returncode == 2 and f"missing required option(s): {', '.join(flags)}" in res.stderr


def test_yaml_keeps_the_old_negative_spellings(tmp_path):
    parser, train_parser = _train_parser()
    cfg = tmp_path / "old.yaml"
    cfg.write_text("unstratified: true\nindex: hnsw\nno-normalize: true\n")
    values = load_yaml_config(str(cfg), train_parser, SETTINGS)
    assert values == {"stratified": False, "index_backend": "hnsw", "normalize": False}
    cfg.write_text("unstratified: 1\n")
    with pytest.raises(ValueError, match="key 'unstratified': expected true or false"):
        load_yaml_config(str(cfg), train_parser, SETTINGS)
