"""``sdm-mlx <verb>``: the command-line entry point.

Each verb lives in ``sdm_mlx/commands/<verb>.py`` and exposes ``HELP`` (one
line), ``add_arguments(parser)`` and ``run(args) -> int``.  Command modules keep
heavy imports (mlx, mlx-lm) inside ``run`` so ``--help`` stays fast.

Every verb accepts ``--config file.yaml``: its keys are the verb's option names
(hyphens or underscores); precedence is CLI > YAML > defaults and unknown keys
are rejected.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

from . import __version__
from .errors import SDMError

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
}


class CLIError(SDMError):
    """A user-facing error: printed as ``sdm-mlx <verb>: error: ...`` with exit code 2."""


def require(args: argparse.Namespace, *names: str) -> None:
    """Fail with a clear message if any option (given on the CLI or in YAML) is missing."""
    missing = [n for n in names if getattr(args, n, None) in (None, "", [])]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        raise CLIError(f"missing required option(s): {flags} (on the command line or in --config)")


def user_message(e: BaseException) -> str:
    """The one-line message for a user error (an OSError names its path and reason, never a traceback)."""
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    if isinstance(e, OSError) and not isinstance(e, SDMError):
        from .io import describe_os_error

        if e.errno == errno.ENOSPC:
            return f"no space left on the device ({describe_os_error(e)})"
        return describe_os_error(e)
    return str(e)


def _load_yaml_config(path: str, parser: argparse.ArgumentParser) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise CLIError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"cannot read the config file {path}: {getattr(e, 'strerror', None) or e}") from None
    except yaml.YAMLError as e:
        raise CLIError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CLIError(f"config file {path} must hold a mapping of option names to values")
    known = {a.dest for a in parser._actions if a.dest not in ("help", "config")}
    out, unknown = {}, []
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in known:
            unknown.append(str(key))
        else:
            out[dest] = value
    if unknown:
        raise CLIError(
            f"unknown key(s) in {path}: {', '.join(sorted(unknown))}; "
            f"known: {', '.join(sorted(k.replace('_', '-') for k in known))}"
        )
    return out


def _available_verbs() -> dict:
    mods = {}
    for verb, name in VERBS.items():
        try:
            mods[verb] = importlib.import_module(f"sdm_mlx.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"sdm_mlx.commands.{name}":
                raise
    return mods


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
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        p.add_argument("--config", default=None, help="YAML file of option values (CLI > YAML > defaults)")
        mod.add_arguments(p)
        subparsers[verb] = (p, mod)
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import warnings

    warnings.formatwarning = lambda message, category, *a, **k: f"sdm-mlx: warning: {message}\n"
    parser, subparsers = build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help(sys.stderr)
        return 2
    sub_parser, mod = subparsers[args.verb]
    try:
        if args.config:
            sub_parser.set_defaults(**_load_yaml_config(args.config, sub_parser))
            args = parser.parse_args(argv)
        from .blas import maybe_warn_slow_blas

        maybe_warn_slow_blas()
        rc = mod.run(args)
    except CLIError as e:
        print(f"sdm-mlx {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError, KeyError) as e:  # SDMError (a ValueError) and the OSErrors of user paths
        if os.environ.get("SDM_MLX_DEBUG"):
            raise
        print(f"sdm-mlx {args.verb}: error: {user_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sdm-mlx {args.verb}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
