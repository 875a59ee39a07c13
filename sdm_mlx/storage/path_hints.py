"""What a path given as a model holds, and what the user probably meant: the hint of a wrong-kind model path.

A first hour mixes up the directories ``sdm-mlx`` writes: the mlx-lm LLM (``runs/tiny/model``), the SDM
estimator (``train --output``, a network's ``verifier/``), the SDM network (``network-train``'s ``network/``),
the run directories of ``demo`` and ``network-train`` that hold them, a data file, or a typo.  :func:`path_kind`
says which one a path is (by its marker files only: nothing is loaded), and :func:`wrong_kind_hint` turns that
into the sentence an error appends: what the path is, and which path or option was probably meant.

The three things a model option can want (``wanted``): ``"estimator"`` (``predict/evaluate/... --model``,
``--verifier``), ``"network"`` (``--head``) and ``"llm"`` (``embed/generate/serve -m``).
"""

from __future__ import annotations

import difflib
import json
import os

#: path kinds (:func:`path_kind`) in words
KIND_WORDS = {
    "estimator": "an SDM estimator (a model directory written by sdm-mlx train)",
    "checkpoint": "the checkpoint of an interrupted sdm-mlx train",
    "network": "an SDM network (the network/ directory network-train writes)",
    "llm": "an mlx-lm LLM directory",
    "demo-run": "a demo run directory",
    "network-train-run": "a network-train run directory",
    "data": "a data file",
    "file": "a file, not a directory",
    "directory": "a directory without a model's files",
    "missing": "missing",
}

#: what each kind of model option takes, in words
WANTED_WORDS = {
    "estimator": "an SDM estimator directory (written by sdm-mlx train --output, or a network's verifier/)",
    "network": "an SDM network directory (network-train's OUTPUT/network)",
    "llm": "an mlx-lm model directory (config.json, *.safetensors, tokenizer files) or a hub id",
}


def _json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def path_kind(path) -> str:
    """One of :data:`KIND_WORDS`' keys for ``path``, from its marker files alone."""
    path = os.path.expanduser(os.fspath(path))
    if not os.path.lexists(path):
        return "missing"
    if not os.path.isdir(path):
        return "data" if path.lower().endswith((".jsonl", ".json", ".csv", ".tsv", ".txt")) else "file"
    manifest = _json(os.path.join(path, "manifest.json"))
    if manifest.get("format") == "sdm_mlx":
        return "checkpoint" if manifest.get("kind") == "sdm_train_checkpoint" else "estimator"
    if _json(os.path.join(path, "network_config.json")).get("format") == "sdm_mlx_network":
        return "network"
    run = _json(os.path.join(path, ".sdm_mlx_run.json")).get("kind")
    if run in ("demo", "network-train"):
        return f"{run}-run"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "llm"
    return "directory"


#: the sub-directory of a run directory (or a tiny-model build) that holds each wanted kind
_INSIDE = {
    ("demo-run", "estimator"): "model",
    ("network-train-run", "estimator"): "verifier",
    ("network-train-run", "network"): "network",
    ("network", "estimator"): "verifier",
}


def _children_of_kind(path: str, wanted: str) -> list[str]:
    """Sub-directories of ``path`` (and of its sub-directories) that are of the ``wanted`` kind, nearest first."""
    found = []
    try:
        names = sorted(n for n in os.listdir(path) if not n.startswith("."))
    except OSError:
        return found
    for name in names:
        child = os.path.join(path, name)
        if os.path.isdir(child):
            kind = path_kind(child)
            if kind == wanted:
                found.append(child)
            elif (kind, wanted) in _INSIDE and path_kind(os.path.join(child, _INSIDE[kind, wanted])) == wanted:
                found.append(os.path.join(child, _INSIDE[kind, wanted]))
    return found[:3]


def _close_names(path: str) -> list[str]:
    """Paths spelled close to a missing ``path``: its first missing component replaced by a sibling with a close
    name (existing full paths first)."""
    path = os.path.normpath(os.path.expanduser(path))
    parts = [p for p in path.split(os.sep) if p]
    parent = os.sep if os.path.isabs(path) else "."
    for i, part in enumerate(parts):
        here = os.path.join(parent, part)
        if os.path.lexists(here):
            parent = here
            continue
        try:
            names = [n for n in os.listdir(parent) if not n.startswith(".")]
        except OSError:
            return []
        close = [os.path.normpath(os.path.join(parent, name, *parts[i + 1:]))
                 for name in difflib.get_close_matches(part, names, n=3, cutoff=0.6)]
        return sorted(close, key=lambda c: not os.path.exists(c))[:2]
    return []


def wrong_kind_hint(path, wanted: str) -> str:
    """A sentence for an error about ``path`` given where ``wanted`` is needed: what it is and what was probably
    meant (``""`` when ``path`` is of the wanted kind, or nothing useful can be said)."""
    shown = os.fspath(path)
    kind = path_kind(shown)
    if kind == wanted:
        return ""
    if kind == "missing":
        close = _close_names(shown)
        return f"did you mean {' or '.join(close)}?" if close else ""
    inside = _INSIDE.get((kind, wanted))
    if inside and path_kind(os.path.join(shown, inside)) == wanted:
        return f"it is {KIND_WORDS[kind]}; did you mean {os.path.join(shown, inside)}?"
    if kind == "checkpoint":
        return (f"it is {KIND_WORDS[kind]}: run the same train command again to finish it, then use its --output "
                f"({shown[:-len('.partial')] if shown.endswith('.partial') else 'the path without .partial'})")
    if kind in ("directory", "demo-run", "network-train-run"):
        children = _children_of_kind(shown, wanted)
        if children:
            return f"it is {KIND_WORDS[kind]}; did you mean {' or '.join(children)}?"
    where = {("estimator", "network"): "pass it as --verifier (with -m MODEL) instead of --head",
             ("estimator", "llm"): "pass it as --verifier; -m/--model takes the LLM",
             ("network", "llm"): "pass it as --head (the network names its base model)",
             ("llm", "network"): "pass it as -m/--model (with --verifier DIR), or train a network on it with "
                                 "sdm-mlx network-train",
             ("llm", "estimator"): "an LLM goes to -m/--model of embed, generate or serve; this option takes "
                                   + WANTED_WORDS["estimator"],
             ("network", "estimator"): "its verification layer is its verifier/ directory"}.get((kind, wanted))
    if where:
        return f"it is {KIND_WORDS[kind]}: {where}"
    if kind == "directory" and wanted == "llm":
        return ""  # the error already names the missing files
    return f"it is {KIND_WORDS[kind]}; this option takes {WANTED_WORDS[wanted]}"
