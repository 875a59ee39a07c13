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

import argparse
import sys

from ..errors import CLIError, require_options
from ._common import add_model_arguments, add_policy_arguments

HELP = "verified generation: greedy decoding (joint neg+pos with --head), SDM verification, abstain/re-ask/return"


def add_common_arguments(p) -> None:
    """Options shared by ``generate`` and ``chat``."""
    add_model_arguments(p)
    add_policy_arguments(p)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="stream tokens (default: on for a single prompt / chat, off for --input batches)")
    p.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def build_generator(args):
    """A :class:`~sdm_mlx.verified.VerifiedGenerator` from parsed options (CLIError on inconsistent ones)."""
    if not args.model and not args.head:
        raise CLIError("missing required option(s): --model (or --head naming its base model)")
    if not args.verifier and not args.head:
        raise CLIError("missing required option(s): --verifier (or --head holding one)")
    if args.prompt_template is not None and "{document}" not in args.prompt_template:
        raise CLIError("--prompt-template must contain a {document} slot")
    if args.max_attempts < 1:
        raise CLIError("--max-attempts must be >= 1")
    for name in ("max_tokens", "max_length"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1")
    from ..verified import REASK_TEMPLATE, VerifiedGenerator

    gen = VerifiedGenerator(
        args.model, args.verifier, args.head, on_reject=args.on_reject, max_attempts=args.max_attempts,
        reask_fallback=args.reask_fallback, system=args.system, prompt_template=args.prompt_template,
        use_chat_template=False if args.no_chat_template else None, max_tokens=args.max_tokens,
        delimiter=args.delimiter, max_length=args.max_length, n_exemplars=args.n_exemplars,
        require_json=not args.allow_non_json, reask_template=args.reask_template or REASK_TEMPLATE,
    )
    return gen


def verdict_line(att) -> str:
    """A short human-readable verdict for one attempt."""
    p = "n/a" if att.p_lower is None else f"{att.p_lower:.3f}"
    if att.verified:
        return f"[verified: p_lower={p}, {att.tokens} tokens, {att.seconds:.2f}s]"
    return f"[rejected: {att.reason}, p_lower={p}, {att.tokens} tokens, {att.seconds:.2f}s]"


def add_arguments(p) -> None:
    add_common_arguments(p)
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


def run(args) -> int:
    from ..data import pending_rows
    from ..data import read_objects as read_jsonl
    from ..io import dumps, open_append, refuse_same_files

    if (args.prompt is None) == (args.input is None):
        raise CLIError("give exactly one of --prompt and --input")
    if args.input is not None:
        require_options(args, "output")
        refuse_same_files([("--output", args.output)], [("--input", args.input)])
    elif not args.prompt.strip():
        raise CLIError("--prompt is empty")
    quiet = args.quiet

    def say(msg):
        if not quiet:
            print(f"sdm-mlx generate: {msg}", file=sys.stderr, flush=True)

    todo = []
    if args.input is not None:
        rows = read_jsonl(args.input, unique_ids=True)
        for lineno, row in rows:
            doc = row.get(args.document_field)
            if not isinstance(doc, str) or not doc:
                raise ValueError(f"{args.input}: line {lineno}: missing, empty or non-string field "
                                 f"{args.document_field!r} (set --document-field)")
        todo = pending_rows(rows, args.output, lambda row: "verified" in row and "attempts" in row, say)
        if not todo:
            say("nothing to do")
            return 0

    gen = build_generator(args)
    if args.prompt is not None:
        stream = (args.stream is not False) and not quiet
        on_text, on_start = _stderr_stream(stream)

        def on_attempt(att):
            if stream:
                sys.stderr.write(" " + verdict_line(att) + "\n")
                sys.stderr.flush()

        result = gen.generate(args.prompt, on_text=on_text, on_attempt_start=on_start, on_attempt=on_attempt)
        sys.stdout.write(dumps(result.to_dict()) + "\n")
        sys.stdout.flush()
        say(f"{result.status} ({result.reason or 'admitted'}) after {len(result.attempts)} attempt(s)")
        return 0

    stream = bool(args.stream) and not quiet
    on_text, on_start = _stderr_stream(stream)
    counts, tokens, seconds = {}, 0, 0.0
    with open_append(args.output) as out:
        for i, (_, row) in enumerate(todo, 1):
            if stream:
                sys.stderr.write(f"[{i}/{len(todo)}] id={row['id']!r}\n")
            result = gen.generate(row[args.document_field], id=row["id"], on_text=on_text,
                                  on_attempt_start=on_start,
                                  on_attempt=(lambda a: sys.stderr.write(" " + verdict_line(a) + "\n")) if stream
                                  else None)
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
    return 0
