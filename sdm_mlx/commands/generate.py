"""``sdm-mlx generate``: verified generation for one prompt (``--prompt``) or a JSONL batch (``--input``/``--output``).

Each prompt (the user message, placed in ``--prompt-template``'s ``{document}``
slot and chat-templated with ``--system``) is decoded greedily — over the joint
neg+pos distribution with ``--head``, plain mlx-lm greedy otherwise — up to the
closing ``}`` of the JSON answer (or EOS / ``--max-tokens``), verified with the
verification layer (``--verifier``), and ``--on-reject`` decides what happens
to a rejected answer: ``abstain`` (a clear "not verified" text), ``reask``
(re-prompt with the previous answer for a re-check, up to ``--max-attempts``)
or ``return`` (the answer flagged unverified).  Results: one JSON object per
prompt (schema: :mod:`sdm_mlx.verified`) on stdout (``--prompt``) or appended to
``--output`` (``--input``; rerunning skips ids already written, and a partially
written last line left by an interrupted run is removed).  Streamed tokens and
progress go to stderr.
"""

from __future__ import annotations

import sys

from ..errors import CLIError, InputError, require_options
from ._common import (SETTINGS, add_generation_arguments, add_sampling_arguments, add_stream_arguments,
                      build_generator, sampling_options, say_to_stderr, verdict_line)

HELP = "verified generation: greedy decoding (joint neg+pos with --head), SDM verification, abstain/re-ask/return"

__all__ = ["HELP", "SETTINGS", "add_arguments", "run", "verdict_line"]


def add_arguments(p) -> None:
    add_generation_arguments(p)
    add_sampling_arguments(p)
    add_stream_arguments(p)
    p.add_argument("-p", "--prompt", default=None, help="one prompt (the user message / {document}); result on stdout")
    p.add_argument("--input", default=None, help="JSONL prompts: {id, <document-field>, ...} per line")
    p.add_argument("--output", default=None, help="JSONL results for --input (appended; resumable)")
    p.add_argument("--document-field", default="document", help="field of --input rows holding the prompt")


def _stderr_stream(enabled: bool):
    if not enabled:
        return None, None

    def on_text(seg):
        sys.stderr.write(seg)
        sys.stderr.flush()

    def on_start(k):
        sys.stderr.write(f"attempt {k}: ")
        sys.stderr.flush()

    return on_text, on_start


def _pending(args, say) -> list:
    """The ``(line, row)`` pairs of ``--input`` not yet in ``--output`` (rows checked for the document field)."""
    from ..storage.datasets import pending_rows
    from ..storage.datasets import read_objects as read_jsonl

    rows = read_jsonl(args.input, unique_ids=True)
    for lineno, row in rows:
        doc = row.get(args.document_field)
        if not isinstance(doc, str) or not doc:
            raise InputError(f"{args.input}: line {lineno}: missing, empty or non-string field "
                             f"{args.document_field!r} (set --document-field)")
    return pending_rows(rows, args.output, lambda row: "verified" in row and "attempts" in row, say)


def _one(gen, args, say, options: dict) -> None:
    """``--prompt``: one result object on stdout, the streamed answer and verdicts on stderr."""
    from ..storage.files import dumps

    stream = (args.stream is not False) and not args.quiet
    on_text, on_start = _stderr_stream(stream)

    def on_attempt(att):
        if stream:
            sys.stderr.write(" " + verdict_line(att) + "\n")
            sys.stderr.flush()

    result = gen.generate(args.prompt, on_text=on_text, on_attempt_start=on_start, on_attempt=on_attempt, **options)
    sys.stdout.write(dumps(result.to_dict()) + "\n")
    sys.stdout.flush()
    say(f"{result.status} ({result.reason or 'admitted'}) after {len(result.attempts)} attempt(s)")


def _batch(gen, todo: list, args, say, options: dict) -> None:
    """``--input``: one result per pending row appended to ``--output``, a line of progress per row."""
    from ..storage.files import dumps, open_append

    stream = bool(args.stream) and not args.quiet
    on_text, on_start = _stderr_stream(stream)
    on_attempt = (lambda a: sys.stderr.write(" " + verdict_line(a) + "\n")) if stream else None
    counts, tokens, seconds = {}, 0, 0.0
    with open_append(args.output) as out:
        for i, (_, row) in enumerate(todo, 1):
            if stream:
                sys.stderr.write(f"[{i}/{len(todo)}] id={row['id']!r}\n")
            result = gen.generate(row[args.document_field], id=row["id"], on_text=on_text,
                                  on_attempt_start=on_start, on_attempt=on_attempt, **options)
            out.write(dumps(result.to_dict()) + "\n")
            out.flush()
            counts[result.status] = counts.get(result.status, 0) + 1
            tokens += result.tokens
            seconds += result.seconds
            if not stream:
                say(f"[{i}/{len(todo)}] id={row['id']!r}: {result.status}"
                    f"{'' if result.verified else ' (' + str(result.reason) + ')'}, {len(result.attempts)} attempt(s), "
                    f"{result.tokens} tokens, {result.seconds:.2f}s")
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    rate = f", {tokens / seconds:.1f} tokens/s incl. verification" if seconds > 0 else ""
    say(f"wrote {len(todo)} result(s) to {args.output}: {summary}{rate}")


def run(args) -> int:
    from ..storage.files import refuse_same_files

    if (args.prompt is None) == (args.input is None):
        raise CLIError("give exactly one of --prompt and --input")
    if args.input is not None:
        require_options(args, "output")
        refuse_same_files([("--output", args.output)], [("--input", args.input)])
    elif not args.prompt.strip():
        raise CLIError("--prompt is empty")
    say = say_to_stderr("sdm-mlx generate", args.quiet)
    todo = _pending(args, say) if args.input is not None else []
    if args.input is not None and not todo:
        say("nothing to do")
        return 0
    gen = build_generator(args)
    options = sampling_options(args, gen)
    if args.prompt is not None:
        _one(gen, args, say, options)
    else:
        _batch(gen, todo, args, say, options)
    return 0
