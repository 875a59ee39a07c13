"""Settings dataclasses → CLI options and YAML keys (sdm_mlx.settings)."""

import argparse
from dataclasses import dataclass

import pytest

from sdm_mlx.settings import SettingsError, add_arguments, defaults, option, resolve, yaml_values


@dataclass(frozen=True)
class Demo:
    exemplar_dim: int = option(1000, "M: exemplar vector width")
    learning_rate: float = option(1e-4, "Adam learning rate")
    k: int | None = option(None, "neighbours scanned for q", none_means="largest class count")
    normalize: bool = option(True, "scalar input normalisation")
    class_names: list[str] | None = option(None, "display names of the classes")
    index: str = option("exact", "support index backend", choices=("exact", "hnsw"))
    model: str | None = option(None, "model directory", short="-m", aliases=("--model-dir",), required=True)


def _parser():
    p = argparse.ArgumentParser(prog="x")
    add_arguments(p, Demo)
    return p


def test_help_shows_real_defaults_and_required():
    text = " ".join(_parser().format_help().split())
    assert "(default: 1000)" in text and "(default: 0.0001)" in text
    assert "(default: largest class count)" in text and "(default: None)" not in text
    assert "(required)" in text and "--no-normalize" in text and "(default: on)" in text


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("exemplar-dim: 64\nlearning_rate: 0.001\nclass-names: [a, b, c]\nmodel: m\n")
    args = _parser().parse_args(["--exemplar-dim", "32", "-m", "cli_model", "--no-normalize"])
    got = resolve(Demo, args, yaml_values(str(cfg), [Demo]))
    assert got == Demo(exemplar_dim=32, learning_rate=0.001, k=None, normalize=False, class_names=["a", "b", "c"],
                       index="exact", model="cli_model")
    assert resolve(Demo, {}, {"model": "x"}).exemplar_dim == defaults(Demo)["exemplar_dim"] == 1000


def test_old_spelling_and_lists_from_the_cli():
    args = _parser().parse_args(["--model-dir", "d", "--class-names", "neg", "pos"])
    assert resolve(Demo, args).class_names == ["neg", "pos"] and resolve(Demo, args).model == "d"


@pytest.mark.parametrize("text, needle", [
    ("exemplar-dim: 1.5\n", "key 'exemplar-dim': expected an integer"),
    ("normalize: 'yes'\n", "key 'normalize': expected true or false"),
    ("class-names: a b c\n", "key 'class-names': expected a list"),
    ("index: faiss\n", "key 'index': 'faiss' is not one of exact, hnsw"),
    ("exemplar_dmi: 3\n", "unknown key(s)"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("a: [\n", "is not valid YAML"),
])
def test_yaml_errors_name_file_and_key(tmp_path, text, needle):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(SettingsError) as e:
        yaml_values(str(cfg), [Demo])
    assert needle in str(e.value) and str(cfg) in str(e.value)


def test_required_option_missing():
    with pytest.raises(SettingsError, match="missing required option.*--model"):
        resolve(Demo, _parser().parse_args([]))
