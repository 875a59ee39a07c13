"""Settings as dataclasses: each default and its help text live in one field; CLI flags and YAML keys
are generated from them.

A component declares its settings once (:class:`sdm_mlx.estimator.config.EstimatorConfig`,
:class:`sdm_mlx.network.config.NetworkConfig`, :class:`sdm_mlx.verified.config.GenerationConfig`)::

    @dataclass(frozen=True)
    class EstimatorConfig:
        alpha: float = option(0.95, "target conditional accuracy α'")

:func:`add_arguments` turns the fields into argparse options (``--learning-rate``; booleans get
``--x/--no-x``; lists take several values; ``choices``, short flags and old spellings come from the
field's metadata), showing the real default in ``--help``.  :func:`resolve` merges the three
sources with the precedence CLI > YAML > defaults and type-checks YAML values, naming the file and
key of a bad one.  Nothing here imports MLX, so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from .errors import SDMError

_META = "sdm_mlx"


@dataclasses.dataclass(frozen=True)
class OptionDetails:
    """The CLI details of a settings field (the keywords of :func:`option`).

    ``none_means`` explains a ``None`` default in ``--help`` ("largest class count"); ``aliases``
    are older flag spellings kept working; ``required`` fields have no usable default (``None``
    until given); ``cli=False`` keeps a field out of the command line (API/YAML only); ``flag`` replaces
    the flag made from the field name (``output_dir`` shown as ``--output``; the field name stays an alias);
    ``booleans = (value for false, value for true)`` keeps YAML's older true/false spelling of a field that
    became a choice (``normalize: false`` → ``"none"``).

    Eleven parameters, on purpose: like :func:`dataclasses.field` and ``argparse.add_argument`` it declares one
    setting, and each keyword is an independent, optional detail of that declaration (a group of them would only
    add a second name to spell at every field).
    """

    choices: Any = None
    short: str | None = None
    aliases: tuple = ()
    none_means: str = ""
    metavar: str | None = None
    required: bool = False
    cli: bool = True
    flag: str | None = None
    booleans: tuple | None = None


def option(default: Any, help: str, **details) -> Any:
    """A dataclass field carrying its default, help text and CLI details (``details``: the fields of
    :class:`OptionDetails`; an unknown one is a ``TypeError``)."""
    d = OptionDetails(**details)
    meta = {_META: dict(help=help, **{f.name: getattr(d, f.name) for f in dataclasses.fields(OptionDetails)})}
    meta[_META]["aliases"] = tuple(d.aliases)
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    """``exemplar_dim`` → ``--exemplar-dim``."""
    return "--" + name.replace("_", "-")


def _meta(f: dataclasses.Field) -> dict:
    return f.metadata.get(_META, {})


def field_flags(f: dataclasses.Field) -> list[str]:
    """The long flags of field ``f``: its primary flag first, then the field-name flag and old spellings."""
    meta = _meta(f)
    names = [meta["flag"]] if meta.get("flag") else []
    return names + [n for n in [flag_name(f.name), *meta.get("aliases", ())] if n not in names]


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def defaults(cls) -> dict:
    """{field name: default} of a settings dataclass."""
    return {f.name: default_of(f) for f in dataclasses.fields(cls)}


def _unwrap_optional(tp) -> tuple[Any, bool]:
    """(inner type, allows None) of ``X | None`` / ``Optional[X]``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else tp), len(args) < len(typing.get_args(tp))
    return tp, False


def field_types(cls) -> dict:
    """{field name: (base type, allows None, item type or None for lists)}."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp, optional = _unwrap_optional(hints[f.name])
        item = None
        if typing.get_origin(tp) in (list, tuple) or tp in (list, tuple):
            args = typing.get_args(tp)
            item, tp = (args[0] if args else None), list
        out[f.name] = (tp, optional, item)
    return out


def _help_text(f: dataclasses.Field, value: Any) -> str:
    meta = _meta(f)
    text = meta.get("help", "")
    if meta.get("required"):
        return f"{text} (required)"
    if value is None:
        return f"{text} (default: {meta['none_means']})" if meta.get("none_means") else text
    if isinstance(value, bool):
        return text
    if isinstance(value, (list, tuple)):
        value = " ".join(map(str, value)) if value else "none"
    return f"{text} (default: {value})"


def add_arguments(parser, cls, *, title: str | None = None, exclude=(), only=None, defaults_from: dict | None = None):
    """Add one option per CLI field of ``cls`` to ``parser`` (in a group when ``title`` is given).

    Options default to ``argparse.SUPPRESS`` so that :func:`resolve` can tell a value typed on the
    command line from one left out; ``--help`` shows the dataclass default (or ``defaults_from``).
    """
    target = parser.add_argument_group(title) if title else parser
    types_ = field_types(cls)
    shown = defaults(cls) | (defaults_from or {})
    for f in dataclasses.fields(cls):
        meta = _meta(f)
        if not meta.get("cli", True) or f.name in exclude or (only is not None and f.name not in only):
            continue
        tp, _optional, item = types_[f.name]
        names = ([meta["short"]] if meta.get("short") else []) + field_flags(f)
        kw: dict = dict(dest=f.name, default=argparse.SUPPRESS, help=_help_text(f, shown[f.name]))
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
            if shown[f.name] is not None:  # None: _help_text shows none_means
                kw["help"] += f" (default: {'on' if shown[f.name] else 'off'})"
        elif tp is list:
            kw.update(nargs="+", type=_scalar_parser(item or str))
        else:
            kw["type"] = _scalar_parser(tp)
        if meta.get("choices"):
            kw["choices"] = meta["choices"]
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        target.add_argument(*names, **kw)
    return target


def _scalar_parser(tp):
    if tp in (int, float, str):
        return tp
    return str


class SettingsError(SDMError):
    """A setting of the wrong type or an unknown key (names the YAML file and key)."""


def _check_scalar(value, tp, where: str):
    if tp is bool:
        if not isinstance(value, bool):
            raise SettingsError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingsError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingsError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SettingsError(f"{where}: expected a string, got {value!r}")
        return value
    return value  # dict / Any: taken as given


def check_value(cls, name: str, value, where: str):
    """``value`` checked (and for floats, converted) against the type of field ``name`` of ``cls``."""
    tp, optional, item = field_types(cls)[name]
    if value is None:
        if optional:
            return None
        raise SettingsError(f"{where}: a value is required")
    if tp is list:
        if not isinstance(value, list):
            raise SettingsError(f"{where}: expected a list (YAML [a, b] or one '- item' per line), got {value!r}")
        return [_check_scalar(v, item, f"{where}[{i}]") if item else v for i, v in enumerate(value)]
    meta = _meta({f.name: f for f in dataclasses.fields(cls)}[name])
    if meta.get("booleans") and isinstance(value, bool):
        value = meta["booleans"][int(value)]
    value = _check_scalar(value, tp, where)
    choices = meta.get("choices")
    if choices and value not in choices:
        raise SettingsError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
    return value


def yaml_values(path: str, classes, extra_keys=()) -> dict:
    """{field name: value} from a YAML mapping whose keys are option names (hyphens or underscores).

    Every key must name a field of one of ``classes`` (or be in ``extra_keys``); values are
    type-checked against that field.  Errors name the file and the key.
    """
    import yaml

    try:
        with open(path, encoding="utf-8-sig") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise SettingsError(f"config file not found: {path}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise SettingsError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of option names to values")
    owner = {f.name: cls for cls in classes for f in dataclasses.fields(cls)}
    spelled = {flag[2:].replace("-", "_"): f.name for cls in classes for f in dataclasses.fields(cls)
               for flag in field_flags(f)}  # YAML may use any long flag name of a field
    out, unknown = {}, []
    for key, value in data.items():
        name = spelled.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name in owner:
            out[name] = check_value(owner[name], name, value, f"{path}: key {key!r}")
        elif name in extra_keys:
            out[name] = value
        else:
            unknown.append(str(key))
    if unknown:
        known = sorted({n.replace("_", "-") for n in owner} | {k.replace("_", "-") for k in extra_keys})
        raise SettingsError(f"unknown key(s) in {path}: {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    return out


def resolve(cls, cli: argparse.Namespace | dict, yaml: dict | None = None, **overrides):
    """An instance of ``cls`` from defaults < ``yaml`` < ``cli`` < ``overrides`` (only ``cls``'s fields)."""
    names = {f.name for f in dataclasses.fields(cls)}
    given = vars(cli) if isinstance(cli, argparse.Namespace) else dict(cli)
    values = {}
    for source in (yaml or {}, given, overrides):
        values.update({k: v for k, v in source.items() if k in names})
    missing = [field_flags(f)[0] for f in dataclasses.fields(cls)
               if _meta(f).get("required") and values.get(f.name, default_of(f)) in (None, "", [])]
    if missing:
        raise SettingsError(f"missing required option(s): {', '.join(missing)} (on the command line or in --config)")
    return cls(**values)
