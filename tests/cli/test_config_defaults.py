"""Each estimator default lives in exactly one place (EstimatorConfig): the Python API, the `train`
parser, a YAML config and the dataclass agree; `-c/--config` YAML is type-checked per key."""

import dataclasses
import subprocess
import sys

import pytest

from sdm_mlx.cli import build_parser, load_yaml_config
from sdm_mlx.commands._common import estimator_config, paper_base
from sdm_mlx.commands.train import SETTINGS
from sdm_mlx.estimator.config import ESTIMATOR_DEFAULTS, EstimatorConfig
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
        (3, 32, "exact", "none", False, None)  # YAML normalize: false is the older spelling of "none"


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
    from sdm_mlx.network.config import NetworkConfig

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


@pytest.mark.parametrize("verb, flags", [("predict", ["--model", "--input"]), ("recalibrate", ["--model"]),
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
    assert values == {"stratified": False, "index_backend": "hnsw", "normalize": "none"}
    cfg.write_text("unstratified: 1\n")
    with pytest.raises(ValueError, match="key 'unstratified': expected true or false"):
        load_yaml_config(str(cfg), train_parser, SETTINGS)


# --------------------------------------------------------------------------- generation settings

GEN_VERBS = ("generate", "chat", "serve", "mcp")


@pytest.mark.parametrize("verb", GEN_VERBS)
def test_generation_defaults_cli_yaml_and_dataclass_agree(verb, tmp_path):
    from sdm_mlx.commands._common import SETTINGS as GEN_SETTINGS
    from sdm_mlx.commands._common import generation_config
    from sdm_mlx.verified.config import GenerationConfig

    want = GenerationConfig(model="M", verifier="V")
    parser, subparsers = build_parser()
    assert generation_config(parser.parse_args([verb, "-m", "M", "--verifier", "V"])) == want
    cfg = tmp_path / "g.yaml"
    cfg.write_text("model: M\nverifier: V\n")
    sub = subparsers[verb][0]
    sub.set_defaults(**load_yaml_config(str(cfg), sub, GEN_SETTINGS))
    assert generation_config(parser.parse_args([verb])) == want
    text = " ".join(sub.format_help().split())
    assert "(default: None)" not in text and "(default: False)" not in text
    if verb != "mcp":
        assert f"(default: {GenerationConfig().max_attempts})" in text


def test_generation_old_spellings_and_yaml_reach_the_config(tmp_path):
    from sdm_mlx.commands._common import SETTINGS as GEN_SETTINGS
    from sdm_mlx.commands._common import generation_config

    parser, subparsers = build_parser()
    for flags in (["--ignore-chat-template"], ["--no-chat-template"]):
        got = generation_config(parser.parse_args(["generate", "-m", "M", "--verifier", "V", *flags]))
        assert got.use_chat_template is False
    got = generation_config(parser.parse_args(["serve", "--head", "H", "--allow-non-json", "--system-prompt", "S",
                                               "--on-reject", "reask", "--max-attempts", "2", "--max-tokens", "9"]))
    assert (got.require_json, got.system, got.on_reject, got.max_attempts, got.max_tokens) == \
        (False, "S", "reask", 2, 9)
    cfg = tmp_path / "old.yaml"
    cfg.write_text("head: H\nallow-non-json: true\nignore-chat-template: true\nmax-attempts: 4\n")
    sub = subparsers["chat"][0]
    sub.set_defaults(**load_yaml_config(str(cfg), sub, GEN_SETTINGS))
    got = generation_config(parser.parse_args(["chat", "--max-attempts", "5"]))
    assert (got.head, got.require_json, got.use_chat_template, got.max_attempts) == ("H", False, False, 5)


@pytest.mark.parametrize("argv, needle", [
    (["--max-attempts", "0"], "--max-attempts must be >= 1"),
    (["--prompt-template", "no slot"], "--prompt-template must contain a {document} slot"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
])
def test_generation_bad_settings_name_the_option(argv, needle, tmp_path):
    res = _cli("generate", "-m", "M", "--verifier", "V", "-p", "hi", *argv, cwd=tmp_path)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr


@pytest.mark.filterwarnings("ignore")  # the random verifier admits nothing: not what is tested here
def test_generator_api_takes_its_defaults_from_generation_config(tiny_phi3_path):
    """The Python API object: no setting has a default of its own in VerifiedGenerator; built with no
    settings it resolves to GenerationConfig's defaults and the built-in templating defaults."""
    import inspect

    import numpy as np

    from sdm_mlx.llm import embed as E
    from sdm_mlx.verified.config import BUILTIN, GenerationConfig
    from sdm_mlx.llm.model import model_dims
    from sdm_mlx.verified import REASK_TEMPLATE, VerifiedGenerator

    params = inspect.signature(VerifiedGenerator).parameters
    shared = set(params) & set(GenerationConfig.__dataclass_fields__)
    assert shared == {"model", "verifier"}  # there: already loaded objects (the paths are model_path, verifier_path)
    assert all(params[n].default is None for n in shared)  # every setting comes via **settings / config
    model, tok = E.load_model(tiny_phi3_path)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2 * model_dims(model)[1])).astype(np.float32)
    y = np.arange(60) % 2
    verifier = SDMEstimator(iterations=1, epochs=1, exemplar_dim=4, rescaler_max_epochs=2, seed=0).fit(X, y)
    gen = VerifiedGenerator(model=model, tokenizer=tok, verifier=verifier)
    cfg = GenerationConfig()
    assert gen.config == cfg
    s = gen.settings
    assert (s.on_reject, s.max_attempts, s.reask_fallback, gen.prompts.reask_template) == \
        (cfg.on_reject, cfg.max_attempts, cfg.reask_fallback, REASK_TEMPLATE)
    assert (s.max_tokens, s.delimiter, s.max_length, s.use_chat_template, s.system) == \
        (BUILTIN["max_new_tokens"], BUILTIN["delimiter"], BUILTIN["max_length"], BUILTIN["use_chat_template"],
         BUILTIN["system"])
    assert gen.verifier.n_exemplars == cfg.n_exemplars and gen.verifier.require_json == cfg.require_json
    again = VerifiedGenerator.from_config(GenerationConfig(on_reject="reask", max_tokens=7), model=model,
                                          tokenizer=tok, verifier=verifier)
    assert (again.settings.on_reject, again.settings.max_tokens) == ("reask", 7)
    with pytest.raises(TypeError):
        VerifiedGenerator(model=model, tokenizer=tok, verifier=verifier, max_token=7)  # a misspelt setting
