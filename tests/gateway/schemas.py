"""JSON Schemas the structured-output tests ask the real model for, each with a prompt.

Strings carry a ``maxLength`` or an ``enum``/``pattern`` and integers bounds, so a 135M model's
greedy output ends well inside the token budget; together they cover nested objects, arrays,
enums, required and optional fields, bounded numbers and ``additionalProperties: false``.
"""

from __future__ import annotations

from typing import Any


def obj(properties: dict[str, Any], required: list[str] | None = None, closed: bool = True) -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    schema["required"] = list(properties) if required is None else required
    if closed:
        schema["additionalProperties"] = False
    return schema


def text(n: int = 20) -> dict:
    return {"type": "string", "maxLength": n}


def integer(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


COLOR = {"type": "string", "enum": ["red", "green", "blue"]}

SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person.", obj({"name": text(), "age": integer(0, 120)})),
    ("Describe a city.", obj({"city": text(), "country": text(), "population": integer(0, 40_000_000)})),
    ("Pick a color.", obj({"color": COLOR})),
    ("Is water wet?", obj({"answer": {"type": "boolean"}})),
    ("Give a temperature.", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    (
        "List three fruits.",
        obj({"fruits": {"type": "array", "items": text(12), "minItems": 3, "maxItems": 3}}),
    ),
    ("Rate a movie.", obj({"title": text(), "stars": integer(1, 5)})),
    ("Describe a book.", obj({"title": text(), "author": obj({"first": text(12), "last": text(12)})})),
    ("A point in 2D.", obj({"x": integer(-100, 100), "y": integer(-100, 100)})),
    (
        "A user account.",
        obj({"username": {"type": "string", "pattern": "^[a-z]{3,10}$"}, "admin": {"type": "boolean"}}),
    ),
    (
        "A shopping item.",
        obj(
            {"item": text(), "qty": integer(1, 9), "price": {"type": "number", "minimum": 0, "maximum": 100}}
        ),
    ),
    ("A weekday.", obj({"day": {"type": "string", "enum": ["mon", "tue", "wed", "thu", "fri"]}})),
    (
        "Two numbers.",
        obj({"values": {"type": "array", "items": integer(0, 9), "minItems": 2, "maxItems": 2}}),
    ),
    ("A pet.", obj({"name": text(12), "species": {"enum": ["cat", "dog", "fish"]}, "age": integer(0, 30)})),
    ("A date.", obj({"year": integer(1900, 2100), "month": integer(1, 12), "day": integer(1, 31)})),
    (
        "A nested address.",
        obj({"address": obj({"street": text(), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    ),
    ("An optional nickname.", obj({"name": text(12), "nickname": text(12)}, required=["name"])),
    (
        "A team of two.",
        obj(
            {
                "members": {
                    "type": "array",
                    "items": obj({"name": text(10), "role": COLOR}),
                    "minItems": 2,
                    "maxItems": 2,
                }
            }
        ),
    ),
    ("A yes or no with a reason.", obj({"ok": {"type": "boolean"}, "reason": text(30)})),
    ("A score card.", obj({"home": integer(0, 20), "away": integer(0, 20), "final": {"type": "boolean"}})),
    ("A product tag.", obj({"tags": {"type": "array", "items": COLOR, "minItems": 1, "maxItems": 3}})),
    (
        "A recipe.",
        obj({"dish": text(), "steps": {"type": "array", "items": text(15), "minItems": 1, "maxItems": 2}}),
    ),
    ("Any object with a name.", obj({"name": text(15)}, closed=False)),
]
