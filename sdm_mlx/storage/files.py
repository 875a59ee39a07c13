"""The one place where sdm_mlx writes outputs and reads JSONL (the JSON text: :mod:`.strict_json`).

* :func:`atomic_write` — every output file.  A regular file (or a path that does not exist
  yet) is written to a hidden temporary file in the same directory, fsynced and renamed over
  the target (mode 0644); a symlink is written through to its target (the link stays); a
  character device, FIFO, socket, ``/dev/stdout``, ``/dev/fd/N`` (process substitution) or
  ``-`` (standard output) is streamed directly.  Errors name the user's path, never a
  temporary one.
* :func:`strict` / :func:`dumps` — strict RFC 8259 JSON: no ``NaN``/``Infinity`` (non-finite
  floats become ``null``; producers whose ``null`` carries meaning add a ``<key>_reason`` field
  with :func:`put_float`, and readers map it back with :func:`get_float`); NumPy scalars and
  arrays are converted.  They live in :mod:`sdm_mlx.storage.strict_json` and are re-exported here.
* :func:`iter_jsonl` — the JSONL reader: ``-`` is standard input, a UTF-8 byte-order mark is
  accepted, errors name the file and line.
* :func:`refuse_same_files` / :func:`refuse_inputs_inside` — an output that is an input is
  refused before anything is read.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
from contextlib import contextmanager

from ..errors import InputError, InputNotFoundError, OutputError
from .strict_json import (  # noqa: F401  (re-exported: callers find the strict JSON in sdm_mlx.storage.files)
    dumps,
    finite_or_none,
    get_float,
    loads_strict,
    put_float,
    strict,
)

STDIO = "-"
FILE_MODE = 0o644
DIR_MODE = 0o755
#: names of already open descriptors: always streamed, even when they point at a regular file
_STREAM_PREFIXES = ("/dev/fd/", "/dev/stdout", "/dev/stderr", "/proc/self/fd/")


# --------------------------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------------------------
def is_stream(path) -> bool:
    """True for ``-`` and for paths that must be streamed rather than replaced (devices, FIFOs,
    sockets, ``/dev/stdout``, ``/dev/fd/N``)."""
    path = os.fspath(path)
    if path == STDIO or path.startswith(_STREAM_PREFIXES):
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def fsync_dir(path: str) -> None:
    """fsync a directory (makes a rename durable); best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_temporaries(target: str) -> None:
    """Delete the temporaries (``.<name>.<pid>.*.sdm-tmp``, files or directories) that earlier writes of
    ``target`` left when their process died (e.g. ``kill -9``); those of live processes are kept."""
    parent, base = os.path.split(os.path.abspath(target))
    prefix = f".{base}."
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".sdm-tmp")):
            continue
        pid = name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            p = os.path.join(parent, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except OSError:
                    pass


def describe_os_error(e: OSError, path=None) -> str:
    """``"<path>: <reason>"`` for an OSError (``path`` replaces the error's own file name)."""
    reason = e.strerror or str(e)
    where = os.fspath(path) if path is not None else e.filename
    return f"{where}: {reason}" if where is not None else reason


def make_dirs(path) -> None:
    """``os.makedirs`` whose new directories are 0755 whatever the umask (existing ones are left alone)."""
    missing, p = [], os.path.abspath(os.fspath(path))
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue
        os.chmod(d, DIR_MODE)


def make_parent(path) -> None:
    """Create the parent directory of ``path`` (0755) if it is missing."""
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise OutputError(f"cannot write {path}: {parent} is not a directory")
    if not os.path.isdir(parent):
        try:
            make_dirs(parent)
        except OSError as e:
            raise OutputError(f"cannot create the directory for {path}: {describe_os_error(e, parent)}") from None


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------
#: the fix named when standard output cannot take what a command prints there
STDOUT_FIX = "give it a destination: >FILE, or >/dev/null to discard what is printed there"


def stdout_problem() -> str | None:
    """Why nothing written to standard output could be read (None: it can be written).

    A process started with stdout closed (``1>&-``; Python then sets ``sys.stdout`` to None) or open for
    reading only (``1</dev/null``) gets a message naming the fix, instead of a crash on ``None.write`` or a
    success that printed nothing."""
    out = sys.stdout
    if out is None:
        return f"standard output is closed (started with 1>&-); {STDOUT_FIX}"
    try:
        fd = out.fileno()
    except (OSError, ValueError, AttributeError):  # not a file (captured by a caller): writable
        return None
    try:
        import fcntl

        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except (ImportError, OSError):
        return None
    if mode == os.O_RDONLY:
        return f"standard output is open for reading only (started with 1<FILE); {STDOUT_FIX}"
    return None


def _stdout(binary: bool):
    """``sys.stdout`` (its ``buffer`` when ``binary``), or an :class:`OutputError` when it cannot be written."""
    problem = stdout_problem()
    if problem is not None:
        raise OutputError(f"cannot write '-': {problem}")
    return sys.stdout.buffer if binary else sys.stdout


@contextmanager
def atomic_write(path, binary: bool = False):
    """``with atomic_write(path) as f: f.write(...)`` — see the module docstring for what happens."""
    path = os.fspath(path)
    try:
        if path == STDIO:
            out = _stdout(binary)
            yield out
            out.flush()
        elif is_stream(path):
            with open(path, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
                yield f
        else:
            with _replace_file(path, binary) as f:
                yield f
    except BrokenPipeError:
        if path == STDIO:
            raise  # the reader of stdout went away (``| head``): the CLI ends quietly, as Unix tools do
        raise OutputError(f"cannot write {path}: the reader of this pipe or FIFO went away") from None
    except OSError as e:
        raise OutputError(f"cannot write {describe_os_error(e, path)}") from None


@contextmanager
def _replace_file(path: str, binary: bool):
    target = os.path.realpath(path)  # a symlink is written through, at its target's location
    if os.path.isdir(target):
        raise OutputError(f"cannot write {path}: it is a directory")
    make_parent(target)
    parent, base = os.path.split(target)
    remove_stale_temporaries(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.{os.getpid()}.", suffix=".sdm-tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(parent)


def write_text(path, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def write_json(path, obj, indent: int = 1) -> None:
    """One strict JSON document (see :func:`dumps`) to ``path`` via :func:`atomic_write`."""
    write_text(path, dumps(obj, indent=indent) + "\n")


def write_jsonl(path, rows) -> int:
    """Rows (dicts) as strict JSONL to ``path`` via :func:`atomic_write`; returns the row count."""
    n = 0
    with atomic_write(path) as f:
        for row in rows:
            f.write(dumps(row) + "\n")
            n += 1
    return n


@contextmanager
def open_append(path):
    """An append-mode text handle for resumable JSONL outputs (devices and FIFOs are opened, never replaced)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise OutputError(f"cannot write {path}: it is a directory")
    try:
        if path == STDIO:
            out = _stdout(False)
            yield out
            out.flush()
            return
        if not is_stream(path):
            make_parent(path)
        with open(path, "a", encoding="utf-8") as f:
            yield f
    except BrokenPipeError:
        if path == STDIO:
            raise  # the reader of stdout went away: the CLI ends quietly
        raise OutputError(f"cannot write {path}: the reader of this pipe or FIFO went away") from None
    except OSError as e:
        raise OutputError(f"cannot write {describe_os_error(e, path)}") from None


# --------------------------------------------------------------------------------------------
# reading JSONL
# --------------------------------------------------------------------------------------------
def _open_input(path):
    path = os.fspath(path)
    if path == STDIO:
        return sys.stdin, False
    if os.path.isdir(path):
        raise InputError(f"input {path} is a directory, expected a JSONL file")
    if not os.path.exists(path):
        raise InputNotFoundError(f"input file not found: {path}")
    try:
        return open(path, encoding="utf-8-sig"), True
    except OSError as e:
        raise InputError(f"cannot read {describe_os_error(e, path)}") from None


def malformed_json_message(source: str, line_no: int, line: str, e: json.JSONDecodeError) -> str:
    """What is wrong with a line that is not JSON: CSV/TSV text (a header or comma-separated values), or a
    truncated / malformed JSON line."""
    text = line.strip()
    if not text.startswith(("{", "[", '"')) and ("," in text or "\t" in text):
        return (f"{source}:{line_no}: not JSON ({e.msg}): JSONL is expected, one JSON object per line such as "
                '{"id": "r1", "label": 0, "embedding": [0.1, 0.2]}; this looks like CSV (comma- or tab-separated '
                "values): write one object per row, the features as a list under 'embedding' or 'attributes' "
                "(sdm_mlx.storage.datasets.Dataset.to_jsonl does this; docs/cli.md)")
    return f"{source}:{line_no}: malformed JSON ({e.msg}); is the file truncated?"


def iter_jsonl(path_or_lines, source: str | None = None):
    """Yield (line_number, parsed value) for the non-blank lines of a JSONL file, ``-`` (stdin) or an
    iterable of lines.  A UTF-8 BOM at the start is skipped; malformed JSON or bad UTF-8 raises
    :class:`InputError` naming the source and line."""
    if isinstance(path_or_lines, (str, os.PathLike)):
        source = source or ("<stdin>" if os.fspath(path_or_lines) == STDIO else os.fspath(path_or_lines))
        fh, close = _open_input(path_or_lines)
    else:
        fh, close = path_or_lines, False
        source = source or "<lines>"
    line_no = 0
    try:
        for line_no, line in enumerate(fh, start=1):
            if line_no == 1 and line.startswith("\ufeff"):
                line = line[1:]
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(malformed_json_message(source, line_no, line, e)) from None
    except UnicodeDecodeError as e:
        raise InputError(f"{source}:{line_no + 1}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise InputError(f"cannot read {describe_os_error(e, source)}") from None
    finally:
        if close:
            fh.close()


# --------------------------------------------------------------------------------------------
# guards
# --------------------------------------------------------------------------------------------
def _flag_paths(pairs) -> list[tuple[str, str]]:
    out = []
    for flag, value in pairs:
        values = value if isinstance(value, (list, tuple)) else [value]
        out += [(flag, os.fspath(v)) for v in values if v not in (None, "", STDIO)]
    return out


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def refuse_same_files(outputs, inputs) -> None:
    """Raise :class:`OutputError` if an output file is the same file as an input (or as another output),
    or lies inside an input directory (e.g. a ``--model``).

    ``outputs``/``inputs``: ``[(flag, path or list of paths), ...]``; ``None``/``-`` are skipped;
    device outputs (``/dev/null``...) are streams and may repeat."""
    outs = [(f, p) for f, p in _flag_paths(outputs) if not is_stream(p)]
    ins = _flag_paths(inputs)
    for i, (oflag, out) in enumerate(outs):
        for iflag, inp in ins:
            if os.path.isdir(inp) and _inside(out, inp):
                raise OutputError(f"{oflag} {out} is inside the {iflag} directory {inp}; refusing to write into an "
                                  "input (choose another output path)")
            if _same(out, inp):
                raise OutputError(f"{oflag} {out} is the same file as {iflag} {inp}; refusing to overwrite an input "
                                  "(choose another output path)")
        for oflag2, out2 in outs[i + 1:]:
            if _same(out, out2):
                raise OutputError(f"{oflag} and {oflag2} are the same file ({out}); choose two different paths")


def _inside(child: str, parent: str) -> bool:
    child, parent = os.path.realpath(child), os.path.realpath(parent)
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def refuse_inputs_inside(flag: str, directory, inputs) -> None:
    """Raise :class:`OutputError` if the output ``directory`` is the working directory (or one of its
    parents) or holds an input file or directory."""
    if directory in (None, ""):
        return
    directory = os.fspath(directory)
    if _inside(os.getcwd(), directory):
        raise OutputError(f"{flag} {directory} is the working directory or one of its parents; "
                          "give a new directory for the output")
    for iflag, inp in _flag_paths(inputs):
        if _inside(inp, directory):
            raise OutputError(f"{flag} {directory} contains the input {iflag} {inp}; refusing to write over "
                              "an input (choose another output directory)")
