"""The base of every typed setting: a config section, and a variant's own settings (an advantage
estimator's, ``turnforge.algos.estimators``), which the config schema (``turnforge.config``) holds.

An unknown key is an error, and so are inf and nan in a float field and a boolean in a number
field (pydantic's lax mode would read YAML's true/false as 1/0).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError


def _is_number(annotation: Any) -> bool:
    """An int or float field, optional or not."""
    kinds = get_args(annotation) or (annotation,)
    return bool not in kinds and any(kind in (int, float) for kind in kinds)


def _learning_rate(value: float) -> float:
    if not (math.isfinite(value) and 0 < value <= 1):
        raise PydanticCustomError("learning_rate", "a learning rate must be a finite number in (0, 1]")
    return value


#: Every learning rate of the config: finite, positive, at most 1 (1e9 or .inf is a typo, not a setting);
#: inf and nan reach ``_learning_rate`` too, so that every bad rate gets the same message.
LearningRate = Annotated[float, Field(allow_inf_nan=True), AfterValidator(_learning_rate)]


class Section(BaseModel):
    """A config section: an unknown key is an error, and so are inf and nan in a float field
    and a boolean in a number field (pydantic's lax mode would read YAML's true/false as 1/0)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and _is_number(annotation):
            raise PydanticCustomError("bool_number", "a boolean where a number is expected")
        return value
