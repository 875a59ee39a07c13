"""``sdm-mlx <verb>``: the command-line entry point.

Each verb lives in ``sdm_mlx/commands/<verb>.py`` and exposes ``HELP`` (one
line), ``add_arguments(parser)`` and ``run(args) -> int``.  Command modules keep
heavy imports (mlx, mlx-lm) inside ``run`` so ``--help`` stays fast.

Every verb accepts ``-c/--config file.yaml``: its keys are the verb's option names
(hyphens or underscores); precedence is CLI > YAML > defaults, unknown keys
are rejected and values are type-checked (errors name the file and key).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import os
import sys

from . import __version__
from .errors import CLIError, SDMError
from .errors import require_options as require

#: verb -> module name under sdm_mlx.commands, in the order shown by --help.
VERBS = {
    "train": "train",
    "predict": "predict",
    "recalibrate": "recalibrate",
    "add-support": "add_support",
    "inspect": "inspect",
    "evaluate": "evaluate",
    "demo": "demo",
    "embed": "embed",
    "make-verification-data": "make_verification_data",
    "api-features": "api_features",
    "network-train": "network_train",
    "generate": "generate",
    "chat": "chat",
    "serve": "serve",
    "mcp": "mcp",
    "pipeline": "pipeline",
}


__all__ = ["CLIError", "VERBS", "build_parser", "load_yaml_config", "main", "require", "user_message"]


def user_message(e: BaseException) -> str:
    """The one-line message for a user error (an OSError names its path and reason, never a traceback)."""
    if isinstance(e, OSError) and not isinstance(e, SDMError):
        from .storage.files import describe_os_error

        if e.errno in (errno.ENOSPC, errno.EROFS, errno.EFBIG, errno.EDQUOT):
            return f"cannot write {describe_os_error(e)}"
        return f"cannot read or write {describe_os_error(e)}"
    return str(e)


def stdout_closed() -> bool:
    """True if the reader of stdout went away (a pipe closed by ``head``); stdout is then pointed at
    /dev/null so that the interpreter's final flush does not report the broken pipe again."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        closed = any(event & select.POLLERR for _, event in poller.poll(0))  # a pipe without a reader
    except (OSError, ValueError, AttributeError):  # no real stdout (captured): not a closed pipe
        return False
    if closed:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return closed


def check_stdout() -> None:
    """Refuse to run, before any work, when standard output cannot be written (closed with ``1>&-``, or open for
    reading only): every verb prints its results, summary, log or protocol there, and a verb that printed into
    nothing must not report success (:func:`sdm_mlx.storage.files.stdout_problem`)."""
    from .storage.files import stdout_problem

    problem = stdout_problem()
    if problem is not None:
        raise CLIError(problem)


def _settings_classes(mod) -> tuple:
    """The settings dataclasses whose fields are ``mod``'s options (``SETTINGS`` of a command module)."""
    return tuple(getattr(mod, "SETTINGS", ()))


def _check_plain_option(action: argparse.Action, value, where: str):
    """A YAML value for an option not generated from a settings class, checked against its argparse action."""
    from .settings import SettingsError

    if value is None:
        return None
    if action.nargs == 0:  # store_true / store_false / BooleanOptionalAction
        if not isinstance(value, bool):
            raise SettingsError(f"{where}: expected true or false, got {value!r}")
        return value
    if action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1):
        if not isinstance(value, list):
            raise SettingsError(f"{where}: expected a list (YAML [a, b] or one '- item' per line), got {value!r}")
        return [_check_plain_option(_Scalar(action), v, f"{where}[{i}]") for i, v in enumerate(value)]
    if action.type is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise SettingsError(f"{where}: expected an integer, got {value!r}")
    if action.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingsError(f"{where}: expected a number, got {value!r}")
        value = float(value)
    if action.choices and value not in action.choices:
        raise SettingsError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


class _Scalar:
    """The item view of a list option's action (type and choices, one value)."""

    def __init__(self, action):
        self.nargs, self.type, self.choices = None, action.type, action.choices


def load_yaml_config(path: str, parser: argparse.ArgumentParser, classes=()) -> dict:
    """{dest: value} of a verb's YAML config: fields of ``classes`` are type-checked by
    :func:`sdm_mlx.settings.yaml_values`, the verb's other options against their argparse actions.
    Errors name the file and the key."""
    from .settings import yaml_values

    fields = {f.name for cls in classes for f in dataclasses.fields(cls)}
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config") and a.dest not in fields}
    negated = {s[2:].replace("-", "_"): a.dest for a in parser._actions if a.dest in fields
               for s in a.option_strings  # old spellings such as "unstratified: true", "no-normalize: true"
               if isinstance(a, argparse._StoreFalseAction)
               or (isinstance(a, argparse.BooleanOptionalAction) and s.startswith("--no-"))}
    constants = {s[2:].replace("-", "_"): a for a in parser._actions if a.dest in fields  # "no-normalize: true"
                 for s in a.option_strings if isinstance(a, argparse._StoreConstAction)}
    values = yaml_values(path, classes, extra_keys=tuple(actions) + tuple(negated) + tuple(constants))
    for key, value in list(values.items()):
        where = f"{path}: key {key.replace('_', '-')!r}"
        if key in negated:
            del values[key]
            values[negated[key]] = not _check_plain_option(argparse.Action([], key, nargs=0), value, where)
        elif key in constants:
            del values[key]
            if _check_plain_option(argparse.Action([], key, nargs=0), value, where):
                values[constants[key].dest] = constants[key].const
        elif key in actions:
            values[key] = _check_plain_option(actions[key], value, where)
    return values


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a real default; never "(default: None)" or "(default: False)" (flags and unset options).  An option a
    verb cannot run without (its help ends with "(required)": :func:`_mark_required`, a settings field declared
    ``required``) is shown without brackets in the usage line, as argparse shows its own required options; it is
    not ``required`` to argparse itself, because ``-c/--config`` may give it instead."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)

    def _format_usage(self, usage, actions, groups, prefix):
        marked = [a for a in actions if is_required(a) and not a.required]
        for action in marked:
            action.required = True
        try:
            return super()._format_usage(usage, actions, groups, prefix)
        finally:
            for action in marked:
                action.required = False


def is_required(action: argparse.Action) -> bool:
    """True for an option the verb cannot run without (given on the command line or in ``--config``)."""
    return bool(action.option_strings) and (action.help or "").endswith("(required)")


def _available_verbs() -> dict:
    mods = {}
    for verb, name in VERBS.items():
        try:
            mods[verb] = importlib.import_module(f"sdm_mlx.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"sdm_mlx.commands.{name}":
                raise
    return mods


def _mark_required(parser: argparse.ArgumentParser, names) -> None:
    """Append "(required)" to the help of the options a verb cannot run without (given on the CLI or in YAML)."""
    for action in parser._actions:
        if action.dest in names and action.help and "(required)" not in action.help:
            action.help += " (required)"


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(
        prog="sdm-mlx",
        description="SDM activations, calibration and verified generation in MLX.",
    )
    parser.add_argument("--version", action="version", version=f"sdm-mlx {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="<verb>")
    mods = _available_verbs()
    subparsers = {}
    for verb, mod in mods.items():
        p = sub.add_parser(
            verb,
            help=mod.HELP,
            description=mod.HELP,
            formatter_class=_HelpFormatter,
        )
        p.add_argument("-c", "--config", default=None,
                       help="YAML file of option values, keys = option names (CLI > YAML > defaults)")
        mod.add_arguments(p)
        _mark_required(p, getattr(mod, "REQUIRED", ()))
        subparsers[verb] = (p, mod)
    return parser, subparsers


def _closest_flags(flag: str, known: list) -> list:
    """The verb's flags closest to ``flag`` (difflib ratio ≥ 0.6): the best, and a second only as close (within
    0.05), so "--modle" suggests --model alone."""
    import difflib

    scored = sorted(((difflib.SequenceMatcher(None, flag, k).ratio(), k) for k in known), reverse=True)
    scored = [(r, k) for r, k in scored if r >= 0.6]
    return [k for r, k in scored[:2] if r >= scored[0][0] - 0.05]


def unknown_arguments_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """"unrecognized arguments: ..." with a "did you mean" for each unknown flag close to one of the verb's."""

    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    hints = []
    for extra in extras:
        flag = extra.split("=", 1)[0]
        if not flag.startswith("-") or flag in known:
            continue
        close = _closest_flags(flag, known)
        if close:
            hints.append(f"{flag}: did you mean {' or '.join(close)}?")
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")


def parse_verb_arguments(parser: argparse.ArgumentParser, subparsers: dict, argv: list[str]):
    """``parser.parse_args(argv)``, but unknown arguments are reported against the verb (its usage, its
    name, a "did you mean" for a close flag) instead of the top-level usage."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        verb_parser = subparsers[args.verb][0] if getattr(args, "verb", None) in subparsers else parser
        verb_parser.error(unknown_arguments_message(verb_parser, extras))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import warnings

    warnings.formatwarning = lambda message, category, *a, **k: f"sdm-mlx: warning: {message}\n"
    parser, subparsers = build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    args = parse_verb_arguments(parser, subparsers, argv)
    if args.verb is None:
        parser.print_help(sys.stderr)
        return 2
    sub_parser, mod = subparsers[args.verb]
    try:
        check_stdout()
        if args.config and not getattr(mod, "CONFIG_IS_RECIPE", False):  # pipeline: -c names its recipe
            sub_parser.set_defaults(**load_yaml_config(args.config, sub_parser, _settings_classes(mod)))
            args = parse_verb_arguments(parser, subparsers, argv)
        from .runtime.blas import maybe_warn_slow_blas

        maybe_warn_slow_blas()
        require(args, *getattr(mod, "REQUIRED", ()))
        from .runtime.distributed import install_sigterm_message, quiet_unless_primary

        install_sigterm_message()
        with quiet_unless_primary():  # under mlx.launch, rank 0 alone reports
            rc = mod.run(args)
    except CLIError as e:
        print(f"sdm-mlx {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError as e:
        if not stdout_closed():
            print(f"sdm-mlx {args.verb}: error: {user_message(e)}", file=sys.stderr)
            return 2
        return 0  # `sdm-mlx predict ... | head`: the reader has what it wanted; end quietly, as Unix tools do
    except (SDMError, OSError) as e:  # user errors: SDMError and the OSErrors of user paths
        if os.environ.get("SDM_MLX_DEBUG"):
            raise
        print(f"sdm-mlx {args.verb}: error: {user_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sdm-mlx {args.verb}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # not an SDMError: a defect in sdm_mlx (or a library under it), not the user's input
        if os.environ.get("SDM_MLX_DEBUG"):
            raise
        print(f"sdm-mlx {args.verb}: internal error (a bug in sdm_mlx, not a problem with your input): "
              f"{type(e).__name__}: {e}\n  Re-run with SDM_MLX_DEBUG=1 for the traceback, and please report it.",
              file=sys.stderr)
        return 1
    return int(rc or 0)


def run(argv: list[str] | None = None):
    """The process entry point (``sdm-mlx``, ``python -m sdm_mlx``): end the process with :func:`main`'s exit code.

    After a verb that ran a model thread (``serve``, ``mcp``: :class:`~sdm_mlx.serve.engine.ModelThread`, a daemon
    that lives until the process exits), the process ends with ``os._exit`` once the ``atexit`` functions ran and
    stdout and stderr are flushed, skipping the native teardown of MLX's threads and streams.  That teardown
    aborted a server that had already stopped cleanly ("terminate called without an active exception", exit -6,
    once in the test suite), as it does when such a thread ends (the module docstring of
    :mod:`sdm_mlx.serve.engine`).  Every other verb exits normally.
    """
    code = main(argv)
    engine = sys.modules.get("sdm_mlx.serve.engine")
    if engine is None or not engine.ModelThread.started:
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()  # what a normal exit runs first: logging's flush, temporary directories, ...
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()
