"""``sdm-mlx make-verification-data``: the universal verification encoding of a labelled task JSONL.

See :mod:`sdm_mlx.llm.verification_data`.  Example (the paper's sentiment task)::

    sdm-mlx make-verification-data --input reviews.jsonl --output ver.jsonl --preset sentiment
    sdm-mlx embed --model mlx-community/Phi-3.5-mini-instruct-4bit --input ver.jsonl \\
        --output ver_feats.jsonl --prompt-field prompt --completion-field completion
"""

from __future__ import annotations

import os
import sys

from ..errors import CLIError

HELP = ("build verification rows (prompt, completion, label 1 = correct / 0 = constructed negative) "
        "from a task JSONL")


#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("input", "output")


def add_arguments(p) -> None:
    p.add_argument("--input", help="task JSONL with id, label (task label 0..C-1), document")
    p.add_argument("--output", help="output JSONL")
    p.add_argument("--completions", nargs="+", default=None,
                   help="one completion per task label, in label order (or one YAML/JSON file holding that list); "
                        "default: the --preset's")
    p.add_argument("--preset", choices=["factcheck", "sentiment"], default=None,
                   help="the paper's completions and instruction; factcheck is used when neither "
                        "--completions nor --preset is given")
    p.add_argument("--prompt-template", default=None, help="user message with a {document} slot (default: the preset's)")
    p.add_argument("--system", "--system-prompt", dest="system", default="You are a helpful AI assistant.",
                   help="system message ('' for none)")
    p.add_argument("-m", "--model", default=None,
                   help="model directory or hub id whose tokenizer's chat template builds the prompt "
                        "(default: the Phi-3.5-mini-instruct chat format, no model needed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the negative assignment")


def _completions(args) -> list[str]:
    comps = args.completions
    if isinstance(comps, str):
        comps = [comps]
    if comps and len(comps) == 1 and comps[0].endswith((".yaml", ".yml", ".json")):
        path = comps[0]
        if not os.path.exists(path):
            raise FileNotFoundError(f"completions file not found: {path}")
        import yaml

        with open(path, encoding="utf-8") as f:
            comps = yaml.safe_load(f)
        if not isinstance(comps, list) or not all(isinstance(c, str) for c in comps):
            raise CLIError(f"{path} must hold a list of completion strings (one per task label)")
    return list(comps)


def run(args) -> int:
    from ..storage.datasets import read_objects as read_jsonl
    from ..storage.files import refuse_same_files, write_jsonl
    from ..llm.verification_data import PRESETS, make_verification_rows, phi3_chat_prompt

    refuse_same_files([("--output", args.output)], [("--input", args.input)])

    if args.completions:
        completions = _completions(args)
        preset = PRESETS[args.preset] if args.preset else None
    else:
        preset = PRESETS[args.preset or "factcheck"]
        completions = preset["completions"]
    template = args.prompt_template or (preset["prompt_template"] if preset else None)
    if template is None:
        raise CLIError("--prompt-template is needed with custom --completions (the instruction they answer), "
                       "e.g. 'Classify ... Respond using the following JSON: {\"label\": str}. TEXT: {document}'")
    if "{document}" not in template:
        raise CLIError("--prompt-template must contain a {document} slot")
    if len(completions) < 2:
        raise CLIError("--completions needs one completion per task label (at least 2)")
    system = args.system or None

    if args.model:
        from ..llm.embed import chat_text, load_tokenizer

        tokenizer = load_tokenizer(args.model)

        def prompt_fn(doc):
            return chat_text(tokenizer, doc, system=system, prompt_template=template)
    else:
        def prompt_fn(doc):
            return phi3_chat_prompt(template.replace("{document}", doc), system)

    numbered = read_jsonl(args.input)
    rows = [r for _, r in numbered]
    out = make_verification_rows(
        rows, completions, prompt_fn, seed=args.seed,
        where=lambda i: f"{args.input}: line {numbered[i][0]}",
    )
    write_jsonl(args.output, out)
    n_neg = sum(1 for r in out if r["label"] == 0)
    if not args.model:
        print("sdm-mlx make-verification-data: no --model: the prompts use the Phi-3.5-mini-instruct chat format "
              "(<|user|> ... <|end|>); pass --model <dir or hub id> for another model's chat template",
              flush=True, file=sys.stderr)
    print(f"sdm-mlx make-verification-data: wrote {len(out)} rows ({len(out) - n_neg} label 1, "
          f"{n_neg} constructed negatives with label 0) to {args.output}", flush=True, file=sys.stderr)
    return 0
