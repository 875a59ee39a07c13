"""The exceptions sdm_mlx raises for problems the user can fix.

Every user-facing error derives from :class:`SDMError` (a ``ValueError``, so existing
``except ValueError`` code keeps working).  The CLI prints them as
``sdm-mlx <verb>: error: <message>`` with exit code 2 and no traceback; the message
always names the file, line, id or option at fault.
"""

from __future__ import annotations


class SDMError(ValueError):
    """Base class of every error caused by user input, paths or artifacts."""


class InputError(SDMError):
    """An input file (or standard input) that cannot be read or does not validate."""


class InputTypeError(InputError, TypeError):
    """Input of a type that cannot be used at all (e.g. features that are not numbers); also a ``TypeError``."""


class OutputError(SDMError):
    """An output path that must not or cannot be written (an input, a foreign directory, no permission...)."""


class ArtifactError(SDMError):
    """A missing, corrupt, tampered or incompatible artifact."""


class InputNotFoundError(InputError, FileNotFoundError):
    """An input path that does not exist (also a ``FileNotFoundError`` for callers that catch that)."""


class ModelNotFoundError(InputNotFoundError):
    """An LLM ``--model`` that is neither an existing directory nor a reachable hub id (see
    :mod:`sdm_mlx.llm.model_path`)."""


class NotFittedError(SDMError, AttributeError):
    """An estimator used before ``fit`` / ``load``: a ``ValueError`` and an ``AttributeError``, exactly the bases
    of scikit-learn's ``NotFittedError``.

    scikit-learn is not a runtime dependency (importing it would cost every CLI call a second or more), so
    this class cannot derive from scikit-learn's.  What is raised is :func:`not_fitted_error`'s: when
    scikit-learn is imported in the process (as it is wherever ``except sklearn.exceptions.NotFittedError``
    can be written), an instance of a subclass of BOTH this class and ``sklearn.exceptions.NotFittedError``,
    so either ``except`` catches it; otherwise an instance of this class.
    """


_SKLEARN_NOT_FITTED: list = []  #: the subclass that also derives from scikit-learn's, made on first use


def not_fitted_error(message: str) -> NotFittedError:
    """A :class:`NotFittedError`, also a ``sklearn.exceptions.NotFittedError`` when scikit-learn is imported."""
    import sys

    if "sklearn" not in sys.modules:
        return NotFittedError(message)
    if not _SKLEARN_NOT_FITTED:
        from sklearn.exceptions import NotFittedError as SklearnNotFittedError

        _SKLEARN_NOT_FITTED.append(type("NotFittedError", (NotFittedError, SklearnNotFittedError),
                                        {"__module__": __name__, "__doc__": NotFittedError.__doc__}))
    return _SKLEARN_NOT_FITTED[0](message)


class CLIError(SDMError):
    """A command-line usage error (a missing or inconsistent option): printed as
    ``sdm-mlx <verb>: error: ...`` with exit code 2."""


def require_options(args, *names: str) -> None:
    """Raise :class:`CLIError` naming every option in ``names`` that is missing from ``args`` (given
    neither on the command line nor in ``--config``)."""
    missing = [n for n in names if getattr(args, n, None) in (None, "", [])]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        raise CLIError(f"missing required option(s): {flags} (on the command line or in --config)")


class DataConversionWarning(UserWarning):
    """Input that was converted to the expected form (e.g. a column-vector y flattened to 1-D)."""


class NothingAdmittedWarning(UserWarning):
    """A selective score over rows of which nothing was admitted: the score (0.0) compares nothing, so a search
    whose every fold gives it chose its "best" parameters arbitrarily (:func:`sdm_mlx.evaluation.selective.selective_score`)."""
