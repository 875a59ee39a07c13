"""ModelSources: the settings validated once, the model reference and the verifier directory in one value."""

import os

import pytest

from sdm_mlx.errors import InputError
from sdm_mlx.verified.config import GenerationConfig
from sdm_mlx.verified.sources import ModelSources


def test_paths_without_a_head_are_taken_as_given():
    s = ModelSources.resolve(GenerationConfig(model="some/model", verifier="ver"))
    assert (s.model, s.verifier, s.head_config, s.head_settings) == ("some/model", "ver", None, None)
    assert s.names() == ("model", ["some/model"]) and s.names("served")[0] == "served"


def test_missing_sources_and_bad_settings_are_refused_once_at_resolve():
    s = ModelSources.resolve(GenerationConfig())
    with pytest.raises(InputError):
        s.require_model()
    with pytest.raises(InputError):
        s.require_verifier()
    with pytest.raises(InputError):
        ModelSources.resolve(GenerationConfig(on_reject="ignore"))


def test_the_head_fills_model_and_verifier():
    s = ModelSources(GenerationConfig(head="h"), {"base_model": "/m", "verifier": "verifier", "settings": {"x": 1}})
    assert (s.model, s.verifier, s.head_settings) == ("/m", os.path.join(os.path.abspath("h"), "verifier"), {"x": 1})
