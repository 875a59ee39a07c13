"""The scikit-learn parameter protocol of :class:`~sdm_mlx.estimator.sdm_estimator.SDMEstimator` (``get_params``,
``set_params``, ``clone``, ``repr``, the classifier tags), as scikit-learn's ``BaseEstimator`` gives it: a base class
that reads the parameters from the explicit ``__init__`` signature of the class it is mixed into."""

from __future__ import annotations

import inspect

import numpy as np

from ..errors import InputError


class ParamsMixin:
    """The parameters of an estimator whose ``__init__`` stores each keyword as given (scikit-learn's protocol)."""

    @classmethod
    def _get_param_names(cls) -> list[str]:
        """The ``__init__`` parameters, in signature order (what get_params / clone / save use)."""
        return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]

    def get_params(self, deep: bool = True) -> dict:
        """``{parameter: value}`` as given to ``__init__`` / ``set_params`` (no nested estimators: ``deep`` is moot)."""
        return {name: getattr(self, name) for name in self._get_param_names()}

    def set_params(self, **params) -> "ParamsMixin":
        """Set parameters by name (validated at the next ``fit``); returns self."""
        valid = self._get_param_names()
        for name, value in params.items():
            if name not in valid:
                raise InputError(f"invalid parameter {name!r} for SDMEstimator; valid parameters: {valid}")
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        defaults = type(self)().get_params()
        changed = [f"{k}={v!r}" for k, v in self.get_params().items() if not _same(v, defaults[k])]
        return f"SDMEstimator({', '.join(changed)})"

    def __sklearn_tags__(self):
        """scikit-learn ≥ 1.6 tags: a classifier (only called by scikit-learn, which is then installed)."""
        from sklearn.utils import ClassifierTags, Tags, TargetTags

        return Tags(estimator_type="classifier", target_tags=TargetTags(required=True),
                    classifier_tags=ClassifierTags(poor_score=True))

    _estimator_type = "classifier"


def _same(a, b) -> bool:
    """Equal parameter values for ``__repr__`` (arrays and lists compared by value)."""
    try:
        return bool(np.all(a == b)) and type(a) is type(b)
    except Exception:
        return False
