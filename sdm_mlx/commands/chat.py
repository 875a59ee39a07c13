"""``sdm-mlx chat``: interactive verified generation — one prompt per stdin line, until EOF.

Each non-empty line is a prompt (the user message / ``{document}``; single-turn:
the verification unit is one prompt and its JSON answer).  The answer of every
attempt is streamed to stdout as it is generated, followed by its verdict; if
the final result is an abstention, the not-verified text follows (with
``--no-stream`` only the final, policy-filtered text and verdict are printed).
Sampling flags as ``generate`` (``--temp``, ``--top-p``, ``--top-k``, ``--min-p``, ``--seed``).
``--json`` prints one result object per prompt instead (schema:
:mod:`sdm_mlx.verified`); ``--output`` also appends them to a JSONL file.
Works non-interactively (``sdm-mlx chat ... < prompts.txt``).  The options are
those of ``sdm-mlx generate``.
"""

from __future__ import annotations

import sys

from ..verified.config import add_sampling_arguments, sampling_params
from ._common import SETTINGS, add_generation_arguments, add_stream_arguments, build_generator, verdict_line

HELP = "interactive verified generation: prompts from stdin, streamed answers with their verdicts"


__all__ = ["HELP", "SETTINGS", "add_arguments", "run"]


def add_arguments(p) -> None:
    add_generation_arguments(p)
    add_sampling_arguments(p)
    add_stream_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON result per prompt instead of text")
    p.add_argument("--output", default=None, help="also append the JSON results to this JSONL file")


def run(args) -> int:
    sampling = sampling_params(args)  # bad sampling flags: exit 2 before the model loads
    gen = build_generator(args)
    interactive = sys.stdin.isatty()
    stream = args.stream is not False and not args.json
    from contextlib import nullcontext

    from ..storage.files import dumps, open_append

    out_ctx = open_append(args.output) if args.output else nullcontext()
    say = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"sdm-mlx chat: {gen.decoding} decoding, on reject: {gen.settings.on_reject}"
        + (f" (max {gen.settings.max_attempts} attempts)" if gen.settings.on_reject == "reask" else "")
        + ("; one prompt per line, Ctrl-D to quit" if interactive else ""))
    w = sys.stdout.write

    def on_text(seg):
        w(seg)
        sys.stdout.flush()

    def on_start(k):
        w("assistant: " if k == 1 else f"re-ask {k}/{gen.settings.max_attempts}: ")

    def on_attempt(att):
        w("\n  " + verdict_line(att) + "\n")
        sys.stdout.flush()

    turn = 0
    with out_ctx as out:
        while True:
            if interactive:
                sys.stderr.write("> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
            if not line:
                break
            prompt = line.rstrip("\r\n")
            if not prompt.strip():
                continue
            turn += 1
            if stream:
                result = gen.generate(prompt, id=turn, on_text=on_text, on_attempt_start=on_start,
                                      on_attempt=on_attempt, sampling=sampling)
                if result.status == "abstained":
                    w(result.text + "\n")
                elif result.status == "unverified":
                    w(f"UNVERIFIED ({result.reason}): the answer above is returned without verification\n")
            else:
                result = gen.generate(prompt, id=turn, sampling=sampling)
                if args.json:
                    w(dumps(result.to_dict()) + "\n")
                else:
                    w(result.text + "\n  " + verdict_line(result.attempts[-1]) + "\n")
            sys.stdout.flush()
            if out is not None:
                out.write(dumps(result.to_dict()) + "\n")
                out.flush()
    if interactive:
        sys.stderr.write("\n")
    return 0
