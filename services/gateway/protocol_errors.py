"""Validation errors of the request models that name the field at fault.

Cross-field errors are raised as ``PydanticCustomError(..., {"param": name})`` so that the error
handler (``errors.validation_to_gateway_error``) reports ``param``.
"""

from __future__ import annotations

from pydantic_core import PydanticCustomError


def param_error(param: str, message: str) -> PydanticCustomError:
    """A validation error that names the request field ``param`` (dotted path)."""
    return PydanticCustomError("invalid_param", message, {"param": param})


def unsupported(param: str, detail: str = "") -> PydanticCustomError:
    return param_error(param, f"'{param}' is not supported{': ' + detail if detail else ''}")
