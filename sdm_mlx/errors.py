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


class NotFittedError(SDMError, AttributeError):
    """An estimator used before ``fit`` / ``load`` (also an ``AttributeError``, as scikit-learn's is)."""


class DataConversionWarning(UserWarning):
    """Input that was converted to the expected form (e.g. a column-vector y flattened to 1-D)."""
