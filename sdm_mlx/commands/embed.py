"""``sdm-mlx embed``: add LLM hidden-state features (``embedding``) to JSONL rows.

Each input row (``id`` required; ``label`` and every other field are kept) gets
``embedding = concat(mean of final-norm hidden states over the kept positions,
the hidden state at the chosen position)`` — see :mod:`sdm_mlx.llm.embed` for the
positions.  The text is the chat-templated ``--document-field`` (with
``--system`` and ``--prompt-template``), or an already templated
``--prompt-field``; ``--completion-field`` appends the assistant completion
(force-decoding).  The output is appended to and re-running skips ids already
present, so an interrupted run resumes where it stopped.  ``OUTPUT.features.json``
records how the features were made (model, position, delimiter, max length,
pooling and, for ``--pooling non-shared``, the shared token prefix of the whole
input) so that verification at generation time pools the same way.  Every written row also carries
``embedding_source: "llm-hidden-states"``, by which ``sdm-mlx train`` picks the per-dimension
input normalisation of LLM features (DESIGN #2) when ``--normalize`` is not given.
"""

from __future__ import annotations


from ..errors import CLIError, InputError
from ..llm.pooling import DEFAULT_FEATURE_PARTS
from ..storage.datasets import LLM_FEATURES, pending_rows
from ..storage.files import dumps
from ..storage.datasets import read_objects as read_jsonl


HELP = "add LLM hidden-state features (mean ⊕ state at the delimiter/last position) to JSONL rows"


#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("model", "input", "output")


def add_arguments(p) -> None:
    p.add_argument("-m", "--model", help="mlx-lm model directory or Hugging Face id "
                                   "(e.g. mlx-community/Phi-3.5-mini-instruct-4bit)")
    p.add_argument("--input", help="input JSONL (id, [label], document, ...)")
    p.add_argument("--output", help="output JSONL (input rows + embedding); appended to / resumed")
    p.add_argument("--document-field", default="document", help="field holding the document text")
    p.add_argument("--prompt-field", default=None,
                   help="field holding an already chat-templated prompt "
                        "(overrides --document-field, --system, --prompt-template)")
    p.add_argument("--completion-field", default=None,
                   help="field holding the assistant completion to force-decode (e.g. completion)")
    p.add_argument("--system", "--system-prompt", dest="system", default=None,
                   help="system message for the chat template")
    p.add_argument("--prompt-template", default=None,
                   help="user message with a {document} slot, e.g. 'Classify ... REVIEW: {document}'")
    p.add_argument("--no-chat-template", "--ignore-chat-template", dest="no_chat_template", action="store_true",
                   help="use the raw text (base models without a chat template)")
    p.add_argument("--position", choices=["delimiter", "last"], default=None,
                   help="second half of the feature: state predicting the completion's last closing delimiter, "
                        "or the last token's state (default: delimiter with --completion-field, else last)")
    p.add_argument("--delimiter", default="}", help="closing delimiter character(s) searched in the completion")
    p.add_argument("--on-missing-delimiter", choices=["error", "last", "prompt"], default="error",
                   help="completion without the delimiter: fail, use the last token, "
                        "or pool the prompt positions only")
    p.add_argument("--pooling", choices=["all", "non-shared"], default="all",
                   help="mean half of the feature: over all kept positions (the paper's), or without the token "
                        "prefix every input row shares (document + completion positions; DESIGN #21)")
    p.add_argument("--feature-parts", default=",".join(DEFAULT_FEATURE_PARTS),
                   help="pooled parts of the states to concatenate, in the order max, mean, last: "
                        f"'{','.join(DEFAULT_FEATURE_PARTS)}' (DESIGN #21's default), 'last', 'mean,last', "
                        "'max,mean,last' (the author's current encoding); recorded in each row and in the model "
                        "sdm-mlx train makes of them")
    p.add_argument("--max-length", type=int, default=500, help="keep at most this many leading token positions")
    p.add_argument("--batch-size", type=int, default=8, help="documents per forward pass")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def format_row(row: dict, embedding) -> str:
    """The row with ``embedding`` as JSON; floats written with 9 significant digits (exact for float32)."""
    import numpy as np

    if not np.all(np.isfinite(embedding)):
        raise InputError(f"non-finite hidden state for id {row.get('id')!r} (model numerics)")
    out = {k: v for k, v in row.items() if k != "embedding"}
    body = dumps(out)
    vec = "[" + ",".join(map("{:.9g}".format, embedding.tolist())) + "]"
    return body[:-1] + (", " if len(out) else "") + '"embedding": ' + vec + "}\n"


def _texts(args, rows, tokenizer, path, foreign=None):
    """(documents, completion_spans) for the rows.

    ``foreign``: a list collecting the ids of ``--prompt-field`` prompts that do
    not end with the model's chat template tail (built for another chat template).
    """
    from ..llm.embed import chat_text, prompt_tail

    docs, spans = [], []
    suffix = prompt_tail(tokenizer) if args.prompt_field and not args.no_chat_template else None
    for lineno, row in rows:
        if args.prompt_field:
            prompt = row.get(args.prompt_field)
            field = args.prompt_field
        else:
            field = args.document_field
            doc = row.get(field)
            prompt = None if not isinstance(doc, str) else chat_text(
                tokenizer, doc, system=args.system, prompt_template=args.prompt_template,
                use_chat_template=not args.no_chat_template,
            )
        if not isinstance(prompt, str):
            raise InputError(f"{path}: line {lineno}: missing or non-string field {field!r}")
        if suffix and foreign is not None and not prompt.endswith(suffix):
            foreign.append(row["id"])
        completion = ""
        if args.completion_field:
            completion = row.get(args.completion_field)
            if not isinstance(completion, str):
                raise InputError(f"{path}: line {lineno}: missing or non-string field {args.completion_field!r}")
        docs.append(prompt + completion)
        spans.append((len(prompt), None))
    return docs, spans


def _position(args) -> str:
    """The pooled position, after checking the options that go with it."""
    if args.max_length < 1 or args.batch_size < 1:
        raise CLIError("--max-length and --batch-size must be >= 1")
    position = args.position or ("delimiter" if args.completion_field else "last")
    if position == "delimiter" and not args.completion_field:
        raise CLIError("--position delimiter needs --completion-field (the delimiter is searched in the completion)")
    if args.prompt_template is not None and "{document}" not in args.prompt_template:
        raise CLIError("--prompt-template must contain a {document} slot")
    return position


def _feature_parts(args) -> list:
    """--feature-parts as a list in FEATURE_PARTS order, checked before the model loads."""
    from ..llm.pooling import check_feature_parts

    try:
        return list(check_feature_parts(args.feature_parts))
    except InputError as e:
        raise CLIError(f"--feature-parts: {e}") from None


def _embed_rows(args, todo: list, model, tokenizer, spec: dict, bar, *, out) -> dict:
    """Append the embedded rows of ``todo`` to ``out``, chunk by chunk; counts of truncated / missing rows."""
    from ..llm.embed import DocumentError, document_features

    chunk = args.batch_size * 32
    stats = {"truncated": 0, "missing": 0, "width": None, "truncated_ids": [], "foreign": []}
    for c0 in range(0, len(todo), chunk):
        part = todo[c0 : c0 + chunk]
        docs, spans = _texts(args, part, tokenizer, args.input, stats["foreign"])
        try:
            feats = document_features(
                model, tokenizer, docs, spans, position=spec["position"], delimiter=args.delimiter,
                max_length=args.max_length, batch_size=args.batch_size, on_missing=args.on_missing_delimiter,
                pooling=args.pooling, shared_prefix=spec["shared_prefix_ids"], progress=bar.update,
                parts=spec["feature_parts"],
            )
        except DocumentError as e:
            lineno, row = part[e.index]
            raise InputError(f"{args.input}: line {lineno} (id {row['id']!r}): {e.reason}") from None
        stats["width"] = feats.embeddings.shape[1]
        recorded = {"embedding_source": LLM_FEATURES, "feature_parts": spec["feature_parts"]}
        out.write("".join(format_row({**r, **recorded}, e)
                          for (_, r), e in zip(part, feats.embeddings)))
        out.flush()
        stats["truncated"] += int(feats.truncated.sum())
        stats["missing"] += int(feats.missing_delimiter.sum())
        stats["truncated_ids"] += [part[k][1]["id"]
                                   for k in feats.truncated.nonzero()[0][: 5 - len(stats["truncated_ids"])]]
    return stats


def _report(args, stats: dict, n: int, position: str, tokenizer, say) -> None:
    """What was written, and the rows that were truncated, built for another template or lack the delimiter."""
    from ..runtime.callbacks import note

    say(f"wrote {n} rows with {stats['width']}-dim embeddings to {args.output}")
    if stats["truncated"]:
        shown = ", ".join(map(repr, stats["truncated_ids"]))
        say(f"{stats['truncated']} document(s) longer than --max-length {args.max_length}: their state at the last "
            f"kept position {args.max_length - 1} was used instead of the {position} position (e.g. ids {shown})")
    if stats["foreign"]:
        from ..llm.embed import prompt_tail

        foreign = stats["foreign"]
        note(f"sdm-mlx embed: warning: {len(foreign)} prompt(s) in field {args.prompt_field!r} do not end with this "
             f"model's chat template tail {prompt_tail(tokenizer)!r} (e.g. ids "
             f"{', '.join(map(repr, foreign[:5]))}): they were built for another chat template; rebuild them with "
             f"`make-verification-data --model {args.model}`")
    if stats["missing"]:
        say(f"{stats['missing']} completion(s) without the delimiter {args.delimiter!r} "
            f"(handled with --on-missing-delimiter {args.on_missing_delimiter})")


def spec_path(output: str) -> str:
    """Where ``embed`` records how the features in ``output`` were made."""
    return str(output) + ".features.json"


def _feature_spec(args, rows: list, tokenizer, position: str) -> dict:
    """How the features are made; written next to the output (checked against it when resuming)."""
    import json
    import os

    from ..llm.embed import DEFAULT_FEATURE_PARTS, common_prefix_length, encode
    from ..storage.files import write_json

    shared = None
    if args.pooling == "non-shared":  # over every input row, so that a resumed run pools the same way
        docs, _ = _texts(args, rows, tokenizer, args.input)
        seqs = [encode(tokenizer, d)[: args.max_length] for d in docs]
        shared = seqs[0][: common_prefix_length(seqs)]
    spec = {"model": args.model, "position": position, "delimiter": args.delimiter, "max_length": args.max_length,
            "on_missing_delimiter": args.on_missing_delimiter, "pooling": args.pooling, "shared_prefix_ids": shared,
            "shared_prefix_text": None if shared is None else tokenizer.decode(shared),
            "feature_parts": args.feature_parts}
    path = spec_path(args.output)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        keys = ("position", "delimiter", "max_length", "pooling", "shared_prefix_ids", "feature_parts")
        old.setdefault("feature_parts", list(DEFAULT_FEATURE_PARTS))  # written before the option: the default then
        changed = [k for k in keys if old.get(k) != spec[k]]
        if changed:
            raise InputError(f"{args.output} holds features made with other settings ({', '.join(changed)} differ "
                             f"from {os.path.basename(path)}): use another --output or the same options")
    write_json(path, spec)
    return spec


def run(args) -> int:
    from ..runtime.callbacks import cli_callback
    from ..storage.files import open_append, refuse_same_files

    position = _position(args)
    args.feature_parts = _feature_parts(args)
    refuse_same_files([("--output", args.output)], [("--input", args.input)])
    callback = cli_callback(args.quiet)

    def say(msg):
        callback.message(f"sdm-mlx embed: {msg}")

    rows = read_jsonl(args.input, unique_ids=True)
    todo = pending_rows(rows, args.output, lambda row: "embedding" in row, say)
    if not todo:
        say("nothing to do")
        return 0
    from ..llm.embed import load_model
    from ..runtime.allocator import keep_freed_buffers_after_load

    keep_freed_buffers_after_load()  # batch work: sdm_mlx.runtime.allocator
    model, tokenizer = load_model(args.model, head=False)  # features never use the LM head
    spec = _feature_spec(args, rows, tokenizer, position)
    with open_append(args.output) as out, callback.progress(len(todo), "embed", unit="doc") as bar:
        stats = _embed_rows(args, todo, model, tokenizer, spec, bar, out=out)
    _report(args, stats, len(todo), position, tokenizer, say)
    return 0
