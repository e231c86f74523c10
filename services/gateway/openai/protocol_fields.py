"""Request field types bounded by ``pdserve.sampling.bounds`` (the table ``Scheduler.add_request``
checks too), shared by the OpenAI and the native request models, and their named-field errors.

Cross-field errors are raised as ``PydanticCustomError(..., {"param": name})`` so that the error
handler can report ``param``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from pdserve.sampling.bounds import (
    FLOAT32_MAX,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    BoundError,
    check_stop_strings,
)


class RequestModel(BaseModel):
    """Base of every request body model: JSON types are strict, as OpenAI's API checks them
    (``"max_tokens": "5"`` or ``true`` is a 400 naming the field, not a coerced 5 or 1; an integer
    field takes no ``5.0``, a boolean no ``1`` or ``"true"``); a float field still takes an integer.

    Raises:
        pydantic.ValidationError: on validation (the gateway answers it with a 400).
    """

    model_config = ConfigDict(strict=True)


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]  # and <= the vocabulary: RequestManager checks it
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
PositiveFloat32 = Annotated[float, Field(gt=0.0, le=FLOAT32_MAX)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
# OpenAI's logit_bias: token id (a JSON object key, so a string of digits: parsed) -> bias in [-100, 100]
LogitBiasKey = Annotated[int, Field(strict=False, ge=0, le=INT32_MAX)]
LogitBias = Annotated[
    dict[LogitBiasKey, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    Field(max_length=MAX_LOGIT_BIAS_ENTRIES),
]


def param_error(param: str, message: str) -> PydanticCustomError:
    """A validation error that names the request field ``param`` (dotted path)."""
    return PydanticCustomError("invalid_param", message, {"param": param})


def unsupported(param: str, detail: str = "") -> PydanticCustomError:
    """A named-field error for a known field whose value this server cannot honour."""
    return param_error(param, f"'{param}' is not supported{': ' + detail if detail else ''}")


def check_stop(stop: str | list[str] | None, param: str) -> str | list[str] | None:
    """``stop`` unchanged, or a named-field error past the stop strings' total size (the count and
    each string's length are bounded by the field's type)."""
    try:
        check_stop_strings([stop] if isinstance(stop, str) else stop or [])
    except BoundError as e:
        raise param_error(param, str(e)) from None
    return stop
