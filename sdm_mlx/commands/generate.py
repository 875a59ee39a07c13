"""``sdm-mlx generate``: verified generation for one prompt (``--prompt``; ``--prompt -`` reads it from standard
input, as mlx_lm.generate) or a JSONL batch (``--input``/``--output``).

Each prompt (the user message, placed in ``--prompt-template``'s ``{document}``
slot and chat-templated with ``--system``) is decoded — greedily by default,
or sampled with mlx-lm's ``--temp``/``--top-p``/``--top-k``/``--min-p``/``--seed`` —
over the joint neg+pos distribution with ``--head``, plain otherwise — up to the
closing ``}`` of the JSON answer (or EOS / ``--max-tokens``), verified with the
verification layer (``--verifier``), and ``--on-reject`` decides what happens
to a rejected answer: ``abstain`` (a clear "not verified" text), ``reask``
(re-prompt with the previous answer for a re-check, up to ``--max-attempts``)
or ``return`` (the answer flagged unverified).  Results: one JSON object per
prompt (schema: :mod:`sdm_mlx.verified`) on stdout (``--prompt``) or appended to
``--output`` (``--input``; rerunning skips ids already written, and a partially
written last line left by an interrupted run is removed).  ``--input`` rows are
decoded together in one continuous batch of ``--max-batch`` rows (the shared
prompt prefix prefilled once) and written in input order.  Streamed tokens and
progress go to stderr.
"""

from __future__ import annotations

import sys
import time

from ..errors import CLIError, InputError, require_options
from ..verified.config import add_sampling_arguments, sampling_params
from ._common import (SETTINGS, add_generation_arguments, add_stream_arguments, build_generator, say_to_stderr,
                      verdict_line)

HELP = "verified generation: decoding (joint neg+pos with --head), SDM verification, abstain/re-ask/return"

__all__ = ["HELP", "SETTINGS", "add_arguments", "run", "verdict_line"]


def add_arguments(p) -> None:
    add_generation_arguments(p)
    add_sampling_arguments(p)
    add_stream_arguments(p)
    p.add_argument("--max-batch", type=int, default=16, help="--input rows decoded at once (continuous batching)")
    p.add_argument("-p", "--prompt", default=None,
                   help="one prompt (the user message / {document}); result on stdout; '-' reads it from standard "
                        "input (as mlx_lm.generate)")
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


def _one(gen, args, say) -> None:
    """``--prompt``: one result object on stdout, the streamed answer and verdicts on stderr."""
    from ..storage.files import dumps

    stream = (args.stream is not False) and not args.quiet
    on_text, on_start = _stderr_stream(stream)

    def on_attempt(att):
        if stream:
            sys.stderr.write(" " + verdict_line(att) + "\n")
            sys.stderr.flush()

    result = gen.generate(args.prompt, on_text=on_text, on_attempt_start=on_start, on_attempt=on_attempt,
                          sampling=sampling_params(args))
    sys.stdout.write(dumps(result.to_dict()) + "\n")
    sys.stdout.flush()
    say(f"{result.status} ({result.reason or 'admitted'}) after {len(result.attempts)} attempt(s)")


def _batch(gen, todo: list, args, say) -> None:
    """``--input``: every pending row decoded in one continuous batch; results appended to ``--output`` in
    input order (a finished row waits for the rows before it), a line of progress per row."""
    from ..storage.files import dumps, open_append

    counts, tokens, t0 = {}, 0, time.perf_counter()
    ready: dict = {}
    written = [0]
    with open_append(args.output) as out:
        def on_result(i: int, result) -> None:
            nonlocal tokens
            ready[i] = result
            counts[result.status] = counts.get(result.status, 0) + 1
            tokens += result.tokens
            say(f"[{sum(counts.values())}/{len(todo)}] id={result.id!r}: {result.status}"
                f"{'' if result.verified else ' (' + str(result.reason) + ')'}, {len(result.attempts)} attempt(s), "
                f"{result.tokens} tokens, {result.seconds:.2f}s")
            while written[0] in ready:
                out.write(dumps(ready.pop(written[0]).to_dict()) + "\n")
                out.flush()
                written[0] += 1

        gen.generate_many([row[args.document_field] for _, row in todo], [row["id"] for _, row in todo],
                          on_result=on_result, sampling=sampling_params(args))
    seconds = time.perf_counter() - t0
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    rate = f", {tokens / seconds:.1f} tokens/s incl. verification" if seconds > 0 else ""
    say(f"wrote {len(todo)} result(s) to {args.output}: {summary}{rate}")


def run(args) -> int:
    from ..storage.files import refuse_same_files

    if (args.prompt is None) == (args.input is None):
        raise CLIError("give exactly one of --prompt and --input")
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
        if not args.prompt.strip():
            raise CLIError("--prompt -: standard input held no prompt")
    if args.input is not None:
        require_options(args, "output")
        refuse_same_files([("--output", args.output)], [("--input", args.input)])
    elif not args.prompt.strip():
        raise CLIError("--prompt is empty")
    say = say_to_stderr("sdm-mlx generate", args.quiet)
    if args.input is not None:  # batch work: sdm_mlx.runtime.allocator
        from ..runtime.allocator import keep_freed_buffers_after_load

        keep_freed_buffers_after_load()
    todo = _pending(args, say) if args.input is not None else []
    if args.input is not None and not todo:
        say("nothing to do")
        return 0
    sampling_params(args)  # bad sampling flags: exit 2 before the model loads
    if args.max_batch < 1:
        raise CLIError("--max-batch must be >= 1")
    gen = build_generator(args, max_batch=args.max_batch)
    if args.prompt is not None:
        _one(gen, args, say)
    else:
        _batch(gen, todo, args, say)
    return 0
